"""Tests of the state store (worker/state/store.py) and of the trainer's export_state / import_state,
with real torch and peft on a tiny random Qwen2.

They assert what a user of the shared trainer relies on when there are more jobs than device
slots: a job whose state went to host or nvme and came back trains on bit-for-bit as if it
had never left; the store evicts the job needed least soon; nvme copies are complete or
absent, and a corrupt one is refused; a full node says so in one line; prefetching from
another thread is safe; and the inventory and swap statistics add up to the copies moved.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import random_tiny_qwen2
from transformers import Qwen2Config

from plexctl.common.protocol import LoraSpec, TrainBatch, TrainHParams
from plexctl.common.state_policy import TIER_ORDER
from tests.test_trainer import assert_exactly_equal, make_batch, without_seconds
from worker.errors import CorruptCopyError, JobConfigError, TierFullError
from worker.state import dirs as copy_dir
from worker.state import files as copy_files
from worker.state import tiers as state_tiers
from worker.state.job_copy import PAGE_BYTES
from worker.state.store import HostBufferPool, StateStore
from worker.state.tiers import TIER_CLASSES
from worker.trainer import PARKED_ADAPTERS_MAX, TrainerEngine

VOCAB = 64
THREADS = 1  # two threads on a busy 2-core machine are ~30x slower for this tiny model
HP_KL = TrainHParams(lr=2e-3, kl_coef=0.05, weight_decay=0.01, clip_low=0.2, clip_high=0.28)
HP_SEQ = TrainHParams(lr=5e-3, loss_agg="seq-mean-token-mean", max_grad_norm=0.5)
JOBS: dict[str, tuple[LoraSpec, int, TrainHParams]] = {
    "j0": (LoraSpec(rank=8, alpha=16, dropout=0.05), 11, HP_KL),
    "j1": (LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]), 22, HP_SEQ),
    "j2": (LoraSpec(rank=2, dropout=0.1), 33, HP_SEQ),
    "j3": (LoraSpec(rank=4, alpha=8), 44, HP_SEQ),
    "j4": (LoraSpec(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], dropout=0.05), 55, HP_KL),
}
ALONE_STEPS = 3


# ---------------------------------------------------------------- fixtures and helpers


def tiny_qwen2(path: Path, **overrides: Any) -> str:
    return random_tiny_qwen2(path, vocab_size=VOCAB, **overrides)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny Qwen2 (hidden 128, 2 layers, 2 heads, vocab 64, float32) in HF format."""
    return tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def batch_for(job_id: str, step: int) -> TrainBatch:
    return make_batch(1000 * (list(JOBS).index(job_id) + 1) + step, rows=4)


def engine(model_dir: str) -> TrainerEngine:
    return TrainerEngine(model_dir, threads=THREADS)


def train(trainer: TrainerEngine, job_id: str, step: int) -> dict[str, float]:
    return trainer.train_step(job_id, batch_for(job_id, step), JOBS[job_id][2])


def job_state(trainer: TrainerEngine, job_id: str) -> dict[str, Any]:
    """Cloned adapter and optimizer state of a resident job."""
    optimizer = trainer.optimizer_state_dict(job_id)
    return {
        "adapter": {k: t.clone() for k, t in trainer.adapter_state_dict(job_id).items()},
        "optimizer": {
            "state": {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer["state"].items()},
            "param_groups": optimizer["param_groups"],
        },
    }


@pytest.fixture(scope="module")
def alone(model_dir: str) -> dict[str, list[dict[str, Any]]]:
    """Each job trained alone on its own engine: its state and metrics after each step."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for job_id, (lora, seed, _) in JOBS.items():
        trainer = engine(model_dir)
        trainer.ensure_job(job_id, lora, seed)
        runs[job_id] = []
        for step in range(ALONE_STEPS):
            metrics = without_seconds(train(trainer, job_id, step))
            runs[job_id].append({**job_state(trainer, job_id), "metrics": metrics})
    return runs


def assert_like_alone(trainer: TrainerEngine, job_id: str, expected: dict[str, Any]) -> None:
    got = job_state(trainer, job_id)
    assert_exactly_equal(expected["adapter"], got["adapter"], f"{job_id}/adapter")
    assert_exactly_equal(expected["optimizer"], got["optimizer"], f"{job_id}/optimizer")


def ensure(store: StateStore, job_id: str) -> dict[str, Any]:
    lora, seed, _ = JOBS.get(job_id, (LoraSpec(rank=2), 99, HP_SEQ))
    return store.ensure_resident(job_id, lora, seed)


def config_json(model_dir: str) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def fresh_copy_bytes(model_dir: str) -> int:
    """Bytes of an untrained job's copy (adapter, AdamW state, RNG) for ``ensure``'s default LoRA."""
    probe = engine(model_dir)
    probe.ensure_job("probe", LoraSpec(rank=2), seed=1)
    return probe.export_state("probe").nbytes


def nvme_files(store: StateStore, beside: tuple[str, ...] = ()) -> dict[str, str]:
    """Job -> the name of its nvme copy's file, checked against what is in ``nvme_dir``: one
    file per copy on nvme, of whole pages, plus the store's spare files and ``beside``, nothing else."""
    assert store.nvme_dir is not None
    with store._cond:
        records = {job: r.nvme for job, r in store._records.items() if r.tier == "nvme"}
        spares = [spare.path.name for spare in store._files.spares]
    assert all(copy is not None and copy.job_id == job for job, copy in records.items())
    files = {job: copy.path.name for job, copy in records.items()}
    assert sorted(os.listdir(store.nvme_dir)) == sorted([*files.values(), *spares, *beside])
    assert len(spares) <= copy_dir.KEEP_SPARES
    for job, copy in records.items():
        assert (store.nvme_dir / files[job]).stat().st_size == copy.file_bytes
        assert (
            copy.file_bytes % copy_files.DIRECT_ALIGN == 0 and copy.file_bytes - copy.nbytes < copy_files.DIRECT_ALIGN
        )
    return files


def assert_only_spares_left(store: StateStore) -> None:
    """Every job dropped: nvme_dir holds only the store's spare files, deleted when it goes."""
    assert store.nvme_dir is not None
    assert nvme_files(store) == {}
    assert sorted(os.listdir(store.nvme_dir)) == sorted(spare.path.name for spare in store._files.spares)
    store._files.delete_spares()  # what its finalizer does when the store goes (or at exit)
    assert os.listdir(store.nvme_dir) == [] and store._files.spares == []


# ---------------------------------------------------------------- export / import on the trainer


def test_export_release_import_continues_bit_exactly(model_dir: str, alone: dict) -> None:
    trainer = engine(model_dir)
    trainer.ensure_job("j0", *JOBS["j0"][:2])
    metrics = [without_seconds(train(trainer, "j0", 0))]
    copy = trainer.export_state("j0")
    assert copy.nbytes == trainer.state_bytes("j0") + torch.get_rng_state().numel()
    trainer.release("j0")
    assert trainer.jobs() == []

    trainer.ensure_job("j1", *JOBS["j1"][:2])  # another job trains while j0 is away
    train(trainer, "j1", 0)
    kept = {name: t.clone() for name, t in copy.tensors.items()}
    trainer.import_state("j0", copy)
    with pytest.raises(JobConfigError, match="already resident"):
        trainer.import_state("j0", copy)
    metrics += [without_seconds(train(trainer, "j0", step)) for step in (1, 2)]

    assert_like_alone(trainer, "j0", alone["j0"][2])
    assert metrics == [run["metrics"] for run in alone["j0"]]
    assert_exactly_equal(kept, copy.tensors, "copy")  # training after import leaves the copy alone
    assert_exactly_equal(alone["j1"][0]["adapter"], job_state(trainer, "j1")["adapter"], "j1")


# ---------------------------------------------------------------- swaps through one tier


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_round_trips_through_a_tier_are_bit_exact(model_dir: str, alone: dict, tmp_path: Path, tier: str) -> None:
    trainer = engine(model_dir)
    host_bytes = 1 << 30 if tier == "host" else 0
    store = StateStore(trainer, device_slots=1, host_bytes=host_bytes, nvme_dir=tmp_path / "nvme", nvme_bytes=1 << 30)
    reports = []
    for step in range(ALONE_STEPS):
        reports.append(ensure(store, "j0"))
        train(trainer, "j0", step)
        reports.append(ensure(store, "idle"))  # a fresh job pushes j0 off the device
        assert store.where("j0") == tier and trainer.jobs() == ["idle"]
    idle_bytes = trainer.state_bytes("idle") + torch.get_rng_state().numel()
    ensure(store, "j0")
    assert_like_alone(trainer, "j0", alone["j0"][-1])

    j0_bytes = StateStore.job_bytes(JOBS["j0"][0], config_json(model_dir))
    swaps = store.inventory()["swaps"]
    assert swaps[f"device->{tier}"]["count"] == 3 + 3  # j0 three times, idle three times
    assert swaps[f"device->{tier}"]["bytes"] == 3 * j0_bytes + 3 * idle_bytes
    assert swaps[f"{tier}->device"]["count"] == 3 + 2
    assert swaps[f"{tier}->device"]["bytes"] == 3 * j0_bytes + 2 * idle_bytes
    assert sum(s["count"] for s in swaps.values()) == 11
    assert [r["swap_in"] for r in reports] == [None, None, tier, tier, tier, tier]
    assert all(r["evicted"] == (["idle"] if i % 2 == 0 else ["j0"]) for i, r in enumerate(reports) if i > 0)
    if tier == "nvme":
        files = nvme_files(store)  # idle's copy; j0's file is a spare since it came back
        assert list(files) == ["idle"] and [s.path.name for s in store._files.spares] != []
    store.drop("j0")
    store.drop("idle")
    assert trainer.jobs() == []
    assert_only_spares_left(store)


# ---------------------------------------------------------------- many jobs, few slots


def test_five_jobs_on_two_slots_train_like_alone(model_dir: str, alone: dict, tmp_path: Path) -> None:
    config = config_json(model_dir)
    sizes = {job_id: StateStore.job_bytes(lora, config) for job_id, (lora, _, _) in JOBS.items()}
    host_bytes = max(sizes.values()) + min(sizes.values())  # room for about two copies: the rest go to nvme
    nvme_dir = tmp_path / "nvme"
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=2, host_bytes=host_bytes, nvme_dir=nvme_dir, nvme_bytes=1 << 30)
    order = list(JOBS)
    reports = []
    for step in range(2):  # first round on LRU alone, second with the queue as the hint
        for i, job_id in enumerate(order):
            store.set_upcoming(order[i:] + order[:i] if step else [])
            reports.append(ensure(store, job_id))
            train(trainer, job_id, step)
            check_inventory(store, sizes, nvme_dir)
            assert trainer.attached_adapters <= 2 + PARKED_ADAPTERS_MAX  # released adapters are reused or deleted

    swaps = store.inventory()["swaps"]
    evicted = [job for r in reports for job in r["evicted"]]
    demoted = [job for r in reports for job in r["demoted"]]
    swapped_in = [(r["swap_in"], order[i % 5]) for i, r in enumerate(reports) if r["swap_in"]]
    assert swaps["device->host"]["count"] + swaps["device->nvme"]["count"] == len(evicted)
    assert swaps["device->host"]["bytes"] + swaps["device->nvme"]["bytes"] == sum(sizes[j] for j in evicted)
    assert swaps["host->nvme"]["count"] == len(demoted) > 0
    assert swaps["host->nvme"]["bytes"] == sum(sizes[j] for j in demoted)
    for source in ("host", "nvme"):
        jobs_in = [job for src, job in swapped_in if src == source]
        assert swaps[f"{source}->device"]["count"] == len(jobs_in) > 0
        assert swaps[f"{source}->device"]["bytes"] == sum(sizes[j] for j in jobs_in)
    assert sum(r["bytes"] for r in reports) == sum(s["bytes"] for s in swaps.values())

    for job_id in order:  # bring each back and compare with the same job trained alone
        ensure(store, job_id)
        assert_like_alone(trainer, job_id, alone[job_id][1])
    for job_id in order:
        store.drop(job_id)
    assert trainer.jobs() == []
    assert all(store.inventory()[tier]["jobs"] == [] for tier in ("device", "host", "nvme"))
    assert_only_spares_left(store)


def check_inventory(store: StateStore, sizes: dict[str, int], nvme_dir: Path) -> None:
    """Every job on exactly one tier, within capacity, with used bytes = the copies' bytes."""
    inventory = store.inventory()
    assert [tier.name for tier in store.tiers] == list(TIER_ORDER) == [name for name in inventory if name in TIER_ORDER]
    assert list(TIER_CLASSES) == list(TIER_ORDER)  # one class per entry of STATE_TIERS, in its order
    tiers = {tier: inventory[tier]["jobs"] for tier in ("device", "host", "nvme")}
    placed = [job for jobs in tiers.values() for job in jobs]
    assert len(placed) == len(set(placed)) and all(store.where(j) == t for t, jobs in tiers.items() for j in jobs)
    assert len(tiers["device"]) <= inventory["device"]["capacity"] and inventory["in_flight"] == {}
    for tier in ("host", "nvme"):  # every job here has trained: its copy is exactly job_bytes
        assert inventory[tier]["used_bytes"] == sum(sizes[j] for j in tiers[tier]) <= inventory[tier]["capacity"]
    assert sorted(nvme_files(store)) == tiers["nvme"]
    assert sum(s.nbytes for s in store._files.spares) + inventory["nvme"]["used_bytes"] <= inventory["nvme"]["capacity"]


# ---------------------------------------------------------------- eviction policy


def test_eviction_follows_upcoming_then_least_recently_used(model_dir: str, tmp_path: Path) -> None:
    trainer = engine(model_dir)
    one_copy = fresh_copy_bytes(model_dir)
    store = StateStore(trainer, device_slots=2, host_bytes=2 * one_copy, nvme_dir=tmp_path / "nvme")
    ensure(store, "a")
    ensure(store, "b")
    assert store.inventory()["host"]["used_bytes"] == 0

    store.set_upcoming(["a", "c"])  # b is not coming back soon
    assert ensure(store, "c")["evicted"] == ["b"]
    assert store.where("b") == "host" and store.inventory()["host"]["used_bytes"] == one_copy

    store.set_upcoming(["c", "b"])  # a is now the one not needed
    report = ensure(store, "b")
    assert (report["swap_in"], report["evicted"]) == ("host", ["a"])

    store.set_upcoming([])  # no hint: least recently used (c, made resident before b)
    assert ensure(store, "d")["evicted"] == ["c"]
    assert store.inventory()["host"]["jobs"] == ["a", "c"]  # host is full now

    store.set_upcoming(["d", "c", "e", "b", "a"])  # evict b; host keeps c (sooner) and demotes a
    report = ensure(store, "e")
    assert (report["evicted"], report["demoted"]) == (["b"], ["a"])
    assert [store.where(j) for j in "abcde"] == ["nvme", "host", "host", "device", "device"]

    store.set_upcoming(["e", "b", "c", "d"])  # d goes, and is needed after every host copy: to nvme
    report = ensure(store, "f")
    assert (report["evicted"], report["demoted"], store.where("d")) == (["d"], [], "nvme")
    swaps = store.inventory()["swaps"]
    assert (swaps["device->host"]["count"], swaps["device->nvme"]["count"], swaps["host->nvme"]["count"]) == (4, 1, 1)
    with pytest.raises(JobConfigError, match="rank"):  # a stored job keeps its LoRA shape
        store.ensure_resident("a", LoraSpec(rank=4), seed=99)
    assert store.where("a") == "nvme"


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "victim", ["flipped byte", "last byte flipped", "truncated file", "grown file", "missing file"]
)
def test_corrupt_nvme_copy_is_refused(model_dir: str, tmp_path: Path, victim: str) -> None:
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=0, nvme_dir=tmp_path / "nvme")
    ensure(store, "a")
    ensure(store, "b")
    (copy_file,) = (tmp_path / "nvme").iterdir()
    assert nvme_files(store) == {"a": copy_file.name}
    nbytes = store._records["a"].nvme.nbytes
    if victim == "missing file":
        copy_file.unlink()
    elif victim == "truncated file":
        os.truncate(copy_file, copy_file.stat().st_size - 1)
    elif victim == "grown file":
        with open(copy_file, "ab") as f:
            f.write(bytes(copy_files.DIRECT_ALIGN))
    else:
        data = bytearray(copy_file.read_bytes())
        data[nbytes // 2 if victim == "flipped byte" else nbytes - 1] ^= 0x01
        copy_file.write_bytes(bytes(data))

    with pytest.raises(CorruptCopyError) as error:
        ensure(store, "a")
    assert "\n" not in str(error.value) and "'a'" in str(error.value) and str(copy_file) in str(error.value)
    assert trainer.jobs() == ["b"] and store.where("a") == "nvme"  # not imported, b not evicted for it
    assert store.inventory()["in_flight"] == {}
    with pytest.raises(CorruptCopyError):  # still refused when asked again
        ensure(store, "a")
    assert trainer.jobs() == ["b"] and store.where("a") == "nvme"
    store.drop("a")
    assert os.listdir(tmp_path / "nvme") == [] and store._files.spares == []  # a corrupt copy's file is not kept


def test_tier_full_error_when_nothing_fits(model_dir: str, tmp_path: Path) -> None:
    trainer = engine(model_dir)
    no_nvme = StateStore(trainer, device_slots=1, host_bytes=1000)
    ensure(no_nvme, "a")
    with pytest.raises(TierFullError) as error:
        ensure(no_nvme, "b")
    message = str(error.value)
    assert "\n" not in message and "host 0/1000 bytes" in message and "nvme tier off" in message
    assert trainer.jobs() == ["a"] and no_nvme.where("a") == "device" and no_nvme.where("b") is None
    no_nvme.drop("a")

    small_nvme = StateStore(trainer, device_slots=1, host_bytes=0, nvme_dir=tmp_path / "nvme", nvme_bytes=4096)
    ensure(small_nvme, "a")
    with pytest.raises(TierFullError, match=r"nvme 0/4096 bytes used"):
        ensure(small_nvme, "b")
    assert trainer.jobs() == ["a"] and os.listdir(tmp_path / "nvme") == []


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_failed_release_leaves_the_job_on_the_device_and_the_store_serving(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str
) -> None:
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=1 << 30 if tier == "host" else 0, nvme_dir=tmp_path / "nvme")
    ensure(store, "a")
    failing = lambda job_id: (_ for _ in ()).throw(RuntimeError("release failed"))  # noqa: E731
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "release", failing)
        with pytest.raises(RuntimeError, match="release failed"):
            ensure(store, "b")  # a's eviction fails at its last step
    seen: dict[str, Any] = {}

    def after() -> None:  # on a thread: a store left waiting for a move that never lands hangs
        with monkeypatch.context() as patch:
            patch.setattr(trainer, "release", failing)
            with pytest.raises(RuntimeError, match="release failed"):
                store.drop("a")
        seen["where"], seen["inventory"] = store.where("a"), store.inventory()
        ensure(store, "b")
        store.drop("a")
        seen["done"] = True

    thread = threading.Thread(target=after, daemon=True)
    thread.start()
    thread.join(60)
    assert seen.get("done"), f"the store hangs after a failed release: {seen}"
    assert seen["where"] == "device" and not seen["inventory"]["in_flight"]
    assert seen["inventory"]["host"]["used_bytes"] == 0 and os.listdir(tmp_path / "nvme") == []
    assert trainer.jobs() == ["b"] and store.where("a") is None


# ---------------------------------------------------------------- prefetch from another thread


def test_prefetch_from_another_thread_while_training(model_dir: str, alone: dict, tmp_path: Path) -> None:
    size = StateStore.job_bytes(JOBS["j3"][0], config_json(model_dir))
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=size, nvme_dir=tmp_path / "nvme")
    for job_id in ("j3", "j2"):
        ensure(store, job_id)
        train(trainer, job_id, 0)
    assert store.where("j3") == "host"
    store.set_upcoming(["j1", "j2"])  # j2's copy keeps host; j3, needed later, is demoted to nvme
    assert ensure(store, "j1")["demoted"] == ["j3"]
    assert [store.where(j) for j in ("j1", "j2", "j3")] == ["device", "host", "nvme"]
    assert store.prefetch("j3") is False  # host is full of a copy needed sooner

    store.set_upcoming(["j1", "j3"])  # now j2 is the one needed last
    outcome: list[Any] = []
    prefetcher = threading.Thread(target=lambda: outcome.append(store.prefetch("j3")))
    prefetcher.start()
    for step in range(2):  # the trainer thread keeps training j1 meanwhile
        ensure(store, "j1")
        train(trainer, "j1", step)
    prefetcher.join(timeout=30)
    assert outcome == [True]
    assert [store.where(j) for j in ("j1", "j2", "j3")] == ["device", "nvme", "host"]

    report = ensure(store, "j3")
    assert report["swap_in"] == "host"
    train(trainer, "j3", 1)
    assert_like_alone(trainer, "j3", alone["j3"][1])
    swaps = store.inventory()["swaps"]
    assert (swaps["nvme->host"]["count"], swaps["nvme->host"]["bytes"]) == (1, size)
    assert swaps["host->nvme"]["count"] == 2
    # where the seconds fell: the prefetch (and the demotion it made) ran off the trainer's
    # critical path, everything ensure_resident moved on it
    prefetched = swaps["nvme->host"]
    assert prefetched["critical_s"] == 0 and 0 <= prefetched["overlap_s"] <= prefetched["seconds"]
    for direction in ("device->host", "host->device"):
        assert swaps[direction]["critical_s"] == swaps[direction]["seconds"] and swaps[direction]["overlap_s"] == 0
    demoted = swaps["host->nvme"]
    assert 0 < demoted["critical_s"] < demoted["seconds"]  # one demotion by ensure_resident, one by the prefetch
    # the two background moves are logged with their wall-clock intervals, demotion first
    seen, moves = store.background_moves()
    assert seen == 2 and [(m.direction, m.job_id) for m in moves] == [("host->nvme", "j2"), ("nvme->host", "j3")]
    assert moves[0].start <= moves[0].end <= moves[1].start <= moves[1].end
    assert moves[1].end - moves[1].start == pytest.approx(prefetched["seconds"], abs=1e-6)  # wall clock digits
    assert store.background_moves(seen) == (2, [])  # nothing new since


def test_concurrent_prefetches_and_swaps_never_lose_state(model_dir: str, tmp_path: Path) -> None:
    """The daemon's pattern: while the trainer thread swaps in the next job, another thread
    prefetches the one after it. Whatever the interleaving, no state is lost or mixed up."""
    trainer = engine(model_dir)
    size = fresh_copy_bytes(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=2 * size, nvme_dir=tmp_path / "nvme")
    jobs = ["a", "b", "c", "d", "e"]
    created = {}
    for job_id in jobs:
        ensure(store, job_id)
        created[job_id] = {k: t.clone() for k, t in trainer.adapter_state_dict(job_id).items()}
    hints: queue.Queue[str | None] = queue.Queue()
    errors: list[BaseException] = []

    def prefetcher() -> None:
        while (job_id := hints.get()) is not None:
            try:
                store.prefetch(job_id)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
            finally:
                hints.task_done()

    thread = threading.Thread(target=prefetcher)
    thread.start()
    rng = random.Random(2)
    try:
        for _ in range(40):
            order = rng.sample(jobs, len(jobs))
            store.set_upcoming(order)
            hints.put(order[1])  # prefetched while order[0] is swapped in
            ensure(store, order[0])
            assert_exactly_equal(created[order[0]], trainer.adapter_state_dict(order[0]), order[0])
            hints.join()
    finally:
        hints.put(None)
        thread.join(timeout=30)
    assert errors == []
    inventory = store.inventory()
    assert inventory["swaps"]["nvme->host"]["count"] > 0, inventory["swaps"]  # the prefetches did move copies
    assert inventory["in_flight"] == {} and inventory["host"]["used_bytes"] <= 2 * size
    assert sorted(j for tier in ("device", "host", "nvme") for j in inventory[tier]["jobs"]) == jobs
    assert sorted(nvme_files(store)) == inventory["nvme"]["jobs"]  # one file per copy, spares, nothing else


# ---------------------------------------------------------------- the copy format and its I/O


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_multi_chunk_copies_round_trip_and_reject_a_flipped_byte(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """Small chunks, so a tiny state spans many requests (in flight on the I/O threads, the
    last one padded for O_DIRECT); both with O_DIRECT (writes and reads) and buffered."""
    monkeypatch.setattr(copy_files, "IO_CHUNK_BYTES", 2 * copy_files.DIRECT_ALIGN)
    monkeypatch.setattr(copy_files, "READ_DIRECT", direct)
    if not direct:
        monkeypatch.setattr(copy_files, "_direct_io_works", lambda directory: False)
    trainer = engine(model_dir)
    trainer.ensure_job("j0", *JOBS["j0"][:2])
    train(trainer, "j0", 0)
    copy = trainer.export_state("j0")
    pool = HostBufferPool()
    written = copy_files.write_copy(tmp_path / "j0.bin", copy)
    assert len(written.sums) > 10 and written.nbytes == copy.nbytes
    assert (tmp_path / "j0.bin").stat().st_size == written.file_bytes
    back, buffer = copy_files.read_copy(written, pool)
    assert back.nbytes == copy.nbytes and back.param_groups == copy.param_groups and back.spec is copy.spec
    assert_exactly_equal(copy.tensors, back.tensors, "tensors")
    assert buffer.data_ptr() % copy_files.DIRECT_ALIGN == 0
    pool.give(buffer)

    tensors = tmp_path / "j0.bin"
    data = bytearray(tensors.read_bytes())
    data[5 * copy_files.IO_CHUNK_BYTES + 3] ^= 0x40
    tensors.write_bytes(bytes(data))
    with pytest.raises(CorruptCopyError, match="does not match its checksums"):
        copy_files.read_copy(written, pool)


def test_a_slow_read_request_holds_up_no_other(model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk serves requests out of order: the second chunk's request is held until every
    other chunk has been read (with a 30 s safety release). The read keeps the other requests
    going and checksums each chunk as it lands, then returns the verified copy; reading in
    order, a few requests ahead, it would stall behind the held one until the release."""
    monkeypatch.setattr(copy_files, "IO_CHUNK_BYTES", 2 * copy_files.DIRECT_ALIGN)
    trainer = engine(model_dir)
    trainer.ensure_job("j0", *JOBS["j0"][:2])
    train(trainer, "j0", 0)
    copy = trainer.export_state("j0")
    written = copy_files.write_copy(tmp_path / "j0.bin", copy)
    chunks = len(written.sums)
    assert chunks > 3 * copy_files.IO_DEPTH
    held, others_done, lock = 1, threading.Event(), threading.Lock()
    landed: list[int] = []
    read_into = copy_files._read_into

    def out_of_order(fd: int, buffers: list, offset: int, nbytes: int) -> None:
        chunk = offset // copy_files.IO_CHUNK_BYTES
        if chunk == held:
            released = others_done.wait(30)
            landed.append(-1 if not released else chunk)
        read_into(fd, buffers, offset, nbytes)
        with lock:
            if chunk != held:
                landed.append(chunk)
            if len(landed) == chunks - 1:
                others_done.set()

    monkeypatch.setattr(copy_files, "_read_into", out_of_order)
    back, buffer = copy_files.read_copy(written, HostBufferPool())
    assert -1 not in landed, "the read waited for the held request before asking for the others"
    assert landed[-1] == held and sorted(landed) == list(range(chunks))
    assert_exactly_equal(copy.tensors, back.tensors, "tensors")


def test_host_buffer_pool_reuses_buffers_of_a_fitting_size() -> None:
    pool = HostBufferPool(keep=2)
    kib = 1024
    big = pool.take(100 * kib)
    assert big.numel() >= 100 * kib and big.data_ptr() % copy_files.DIRECT_ALIGN == 0
    pool.give(big)
    assert pool.take(60 * kib) is big  # fits, and not more than twice the size asked for
    pool.give(big)
    small = pool.take(10 * kib)  # would waste the big one: a new buffer
    assert small is not big and (pool.allocated, pool.reused) == (2, 1)
    pool.give(small)
    pool.give(pool.take(300 * kib))
    assert pool.free_bytes() == big.numel() + 300 * kib  # keeps the two largest


def test_pooled_buffers_carry_copies_of_different_sizes_exactly(model_dir: str, tmp_path: Path) -> None:
    """Copies read from nvme land in pool buffers that earlier copies of other sizes used:
    every job still comes back exactly as it left, and the buffers are reused."""
    loras = {"r3": LoraSpec(rank=3), "r4": LoraSpec(rank=4), "r5": LoraSpec(rank=5)}
    trainer = engine(model_dir)
    size = max(StateStore.job_bytes(lora, config_json(model_dir)) for lora in loras.values())
    store = StateStore(trainer, device_slots=1, host_bytes=size, nvme_dir=tmp_path / "nvme")
    saved = {}
    for job_id, lora in loras.items():
        store.ensure_resident(job_id, lora, seed=7)
        trainer.train_step(job_id, make_batch(len(saved), rows=2), HP_SEQ)
        saved[job_id] = job_state(trainer, job_id)
    rng = random.Random(0)
    for i in range(12):
        on_nvme = store.inventory()["nvme"]["jobs"]
        first = on_nvme[0] if on_nvme and i % 3 else rng.choice(list(loras))
        order = [first, *rng.sample([j for j in loras if j != first], 2)]
        store.set_upcoming(order)
        store.prefetch(order[0])  # nvme -> host into a pool buffer, if it was on nvme
        store.ensure_resident(order[0], loras[order[0]], seed=7)
        assert_like_alone(trainer, order[0], saved[order[0]])
    assert store.inventory()["swaps"]["nvme->host"]["count"] > 0
    assert store._pool.reused > 0


def test_export_fills_one_given_buffer_and_import_reuses_a_released_one(model_dir: str) -> None:
    """A copy is one flat buffer that the caller's pool gives (every tensor a view into it), and
    on CPU a job imported after another was released lands in that job's parked device buffer."""
    trainer = engine(model_dir)
    pool = HostBufferPool()
    for job_id in ("j0", "j3"):
        trainer.ensure_job(job_id, *JOBS[job_id][:2])
        train(trainer, job_id, 0)
    saved = {job_id: job_state(trainer, job_id) for job_id in ("j0", "j3")}
    copies = {}
    for job_id in ("j0", "j3"):
        copies[job_id] = trainer.export_state(job_id, pool)
        memory = copies[job_id].memory
        start, end = memory.data_ptr(), memory.data_ptr() + memory.numel()
        assert all(start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end for t in copies[job_id].tensors.values())
        trainer.release(job_id)
    trainer.import_state("j0", copies["j0"])
    trainer.release("j0")  # j0's device buffer stays with its parked adapter
    trainer.import_state("j3", copies["j3"])  # same LoRA shape: same size, so it lands there
    trainer.import_state("j0", copies["j0"])
    assert trainer.slabs.reused >= 1
    for job_id in ("j0", "j3"):
        assert_like_alone(trainer, job_id, saved[job_id])
        pool.give(copies[job_id].memory)
    assert pool.allocated == 2


def test_a_copy_in_a_buffer_of_its_pages_or_a_larger_one_comes_back_exactly(model_dir: str) -> None:
    """On CPU a job's slot is whole pages, as a pool's buffer for it is, so a swap copies the one
    into the other as they are; a larger buffer from the pool takes the path through views."""
    trainer = engine(model_dir)
    trainer.ensure_job("j0", *JOBS["j0"][:2])
    train(trainer, "j0", 0)
    saved = job_state(trainer, "j0")
    slot = trainer._job("j0").slot
    assert slot.whole and slot.device.numel() % PAGE_BYTES == 0 and slot.device.numel() >= slot.spec.nbytes
    exact, larger = HostBufferPool(), HostBufferPool()
    larger.give(larger.take(slot.device.numel() + PAGE_BYTES))  # fits: at most twice the size
    for pool, numel in ((exact, slot.device.numel()), (larger, slot.device.numel() + PAGE_BYTES)):
        copy = trainer.export_state("j0", pool)
        assert copy.memory.numel() == numel
        trainer.release("j0")
        trainer.import_state("j0", copy)
        assert_like_alone(trainer, "j0", saved)
        pool.give(copy.memory)


def test_repeated_swaps_reuse_pooled_buffers(model_dir: str, tmp_path: Path) -> None:
    """Three jobs of one size on one device slot, host room for one copy: every round each job
    comes back from host or nvme and the one it evicts goes to host or nvme. After the first
    round no swap allocates a buffer (the store's host pool and the engine's parked slots serve
    them all), and every job still comes back exactly as it left."""
    lora = LoraSpec(rank=4, alpha=8)
    size = StateStore.job_bytes(lora, config_json(model_dir))
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=size, nvme_dir=tmp_path / "nvme")
    jobs = ["p", "q", "r"]
    saved = {}
    for i, job_id in enumerate(jobs):
        store.ensure_resident(job_id, lora, seed=i)
        trainer.train_step(job_id, make_batch(i, rows=2), HP_SEQ)
        saved[job_id] = job_state(trainer, job_id)

    def pools() -> dict[str, int]:
        counts = store.inventory()["swaps"]
        return {
            "host buffers made": store._pool.allocated,
            "device buffers made": trainer.slabs.allocated,
            "host buffers reused - copies made": store._pool.reused
            - sum(counts[d]["count"] for d in ("device->host", "device->nvme", "nvme->device")),
            "device buffers reused - imports": trainer.slabs.reused
            - sum(counts[d]["count"] for d in ("host->device", "nvme->device")),
        }

    for round_ in range(4):
        if round_ == 1:
            after_first = pools()
        for i, job_id in enumerate(jobs):
            store.set_upcoming(jobs[i:] + jobs[:i])
            store.ensure_resident(job_id, lora, seed=jobs.index(job_id))
            assert_like_alone(trainer, job_id, saved[job_id])
    swaps = store.inventory()["swaps"]
    assert all(swaps[d]["count"] >= 4 for d in ("device->host", "device->nvme", "host->device", "nvme->device"))
    assert pools() == after_first  # since: nothing made, every copy and import in a reused buffer
    for job_id in jobs:
        store.drop(job_id)


def test_a_copy_over_other_memory_is_written_through_bounce_buffers(model_dir: str, tmp_path: Path) -> None:
    """A copy whose tensors are not laid out as its file (no one buffer under them) is
    gathered chunk by chunk and reads back exactly."""
    trainer = engine(model_dir)
    trainer.ensure_job("j0", *JOBS["j0"][:2])
    train(trainer, "j0", 0)
    copy = trainer.export_state("j0")
    buffers = {name: buffer.clone() for name, buffer in copy.buffers.items()}
    tensors = {name: t.clone() for name, t in copy.tensors.items()}  # not views of the buffers: still a copy
    elsewhere = dataclasses.replace(copy, tensors=tensors, buffers=buffers, memory=None)
    assert copy_files._file_image(elsewhere, elsewhere.segments(), elsewhere.nbytes) is None
    written = copy_files.write_copy(tmp_path / "j0.bin", elsewhere)
    back, buffer = copy_files.read_copy(written, HostBufferPool())
    assert_exactly_equal(copy.tensors, back.tensors, "tensors")
    assert back.memory is buffer
    assert (tmp_path / "j0.bin").read_bytes()[written.nbytes :] == bytes(written.file_bytes - written.nbytes)


# ---------------------------------------------------------------- sizing


def test_job_bytes_matches_the_real_copy(model_dir: str, tmp_path: Path) -> None:
    gqa_dir = tiny_qwen2(tmp_path / "gqa", num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    cases = [
        (model_dir, JOBS["j0"][0]),
        (model_dir, JOBS["j1"][0]),
        (gqa_dir, LoraSpec(rank=4, alpha=8)),
        (gqa_dir, LoraSpec(rank=3, target_modules=["k_proj", "down_proj"])),
    ]
    for directory, lora in cases:
        trainer = engine(directory)
        trainer.ensure_job("x", lora, seed=1)
        trainer.train_step("x", make_batch(7, rows=2), TrainHParams())
        copy = trainer.export_state("x")
        assert StateStore.job_bytes(lora, config_json(directory)) == copy.nbytes, (directory, lora)
        assert StateStore.job_bytes(lora, Qwen2Config.from_pretrained(directory)) == copy.nbytes
    with pytest.raises(ValueError, match="lm_head"):
        StateStore.job_bytes(LoraSpec(target_modules=["lm_head"]), config_json(model_dir))


# ---------------------------------------------------------------- nvme files: reused, within the budget


def test_a_copy_leaving_nvme_leaves_its_file_for_the_next_copy_within_the_budget(
    model_dir: str, tmp_path: Path
) -> None:
    """Two jobs of one size trade places through nvme: after the first two writes, every copy
    is written over the file of the copy that left nvme last (same file, same inode: no file is
    made or deleted), and every job still comes back exactly. With a budget of two copies, the
    file of a copy that leaves is deleted instead (it would not fit beside the copies): nvme never
    holds more than ``nvme_bytes``."""
    lora = LoraSpec(rank=4, alpha=8)
    size = StateStore.job_bytes(lora, config_json(model_dir))
    for budget, kept in ((1 << 30, True), (2 * size + 1000, False)):  # a swap holds both on nvme a moment
        trainer = engine(model_dir)
        nvme_dir = tmp_path / f"nvme-{kept}"
        store = StateStore(trainer, device_slots=1, host_bytes=0, nvme_dir=nvme_dir, nvme_bytes=budget)
        saved = {}
        for i, job_id in enumerate("ab"):
            store.ensure_resident(job_id, lora, seed=i)
            trainer.train_step(job_id, make_batch(i, rows=2), HP_SEQ)
            saved[job_id] = job_state(trainer, job_id)
        inodes = set()
        for round_ in range(6):
            job_id = "ab"[round_ % 2]
            store.ensure_resident(job_id, lora, seed=round_ % 2)  # the other one goes to nvme
            assert_like_alone(trainer, job_id, saved[job_id])
            files = nvme_files(store)
            assert list(files) == ["ba"[round_ % 2]]
            inodes.add(os.stat(nvme_dir / files["ba"[round_ % 2]]).st_ino)
            spares = [spare.path.name for spare in store._files.spares]
            assert len(spares) == (1 if kept else 0)
            assert store.inventory()["nvme"]["used_bytes"] + sum(s.nbytes for s in store._files.spares) <= budget
        if kept:  # two files made in all, each overwritten since
            assert len(inodes) == 2 and next(store._files._serial) == 2
        for job_id in "ab":
            store.drop(job_id)
        assert_only_spares_left(store)


def test_a_new_store_deletes_the_copies_of_a_process_that_is_gone(model_dir: str, tmp_path: Path) -> None:
    """A crashed worker's nvme copies cannot be read by anyone: the next store on that directory
    deletes them; copies of a live process, copies written on another host (whose processes
    this one cannot see) and files that are not copies stay."""
    import subprocess
    import sys

    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    code = (
        "import os, sys; d = sys.argv[1]\n"
        "for i in range(3): open(os.path.join(d, f'copy-{os.getpid()}-0badc0de-{i}.bin'), 'wb').write(b'x' * 4096)"
    )
    subprocess.run([sys.executable, "-c", code, str(nvme_dir)], check=True)  # writes, then is gone
    assert len(list(nvme_dir.iterdir())) == 3
    gone_pid = int(next(nvme_dir.iterdir()).name.split("-")[1])
    live = nvme_dir / f"copy-{os.getpid()}-12345678-0.bin"
    live.write_bytes(b"y")
    elsewhere = nvme_dir / f"copy-{gone_pid}.{'0' * 8}-12345678-0.bin"  # another node's, on a shared directory
    elsewhere.write_bytes(b"z")
    other = nvme_dir / "notes.txt"
    other.write_text("not a copy")
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=0, nvme_dir=nvme_dir, nvme_bytes=1 << 30)
    assert sorted(p.name for p in nvme_dir.iterdir()) == sorted([live.name, other.name, elsewhere.name])
    lora = LoraSpec(rank=4, alpha=8)
    for i, job_id in enumerate("ab"):  # the store's own copies go there as before
        store.ensure_resident(job_id, lora, seed=i)
    assert store.where("a") == "nvme"
    assert [p for p in nvme_dir.iterdir() if p.name.startswith(f"copy-{os.getpid()}.{copy_dir.host_tag()}-")]


def test_write_behind_takes_nvme_writes_off_the_trainers_thread(model_dir: str, alone: dict, tmp_path: Path) -> None:
    """With a write-behind allowance, an eviction that sends copies to nvme returns once the
    victim is exported: the demotions, and a victim that goes straight to nvme, are written
    by the store's write-behind thread (host memory holds them meanwhile), never on the
    trainer's critical path; every state still comes back bit-exact."""
    size = StateStore.job_bytes(JOBS["j3"][0], config_json(model_dir))  # host holds j3, or j2, not j0
    trainer = engine(model_dir)
    store = StateStore(
        trainer, device_slots=1, host_bytes=size, nvme_dir=tmp_path / "nvme", write_behind_bytes=4 * size
    )
    for job_id in ("j3", "j2"):
        ensure(store, job_id)
        train(trainer, job_id, 0)
    assert store.where("j3") == "host"
    store.set_upcoming(["j0", "j2"])  # j2 goes to host, j3 (needed later) makes room for it
    report = ensure(store, "j0")
    assert report["evicted"] == ["j2"] and report["demoted"] == []  # j3's demotion was left behind
    assert store.wait_written(timeout=60)
    assert [store.where(j) for j in ("j0", "j2", "j3")] == ["device", "host", "nvme"]
    train(trainer, "j0", 0)

    store.set_upcoming(["j3", "j2"])  # j0 (too big for host) goes straight to nvme
    assert ensure(store, "j3")["swap_in"] == "nvme"
    assert store.wait_written(timeout=60)
    assert [store.where(j) for j in ("j0", "j2", "j3")] == ["nvme", "host", "device"]
    swaps = store.inventory()["swaps"]
    assert swaps["device->nvme"]["count"] == 0  # every eviction was an export to host ...
    assert swaps["host->nvme"]["count"] == 2 and swaps["host->nvme"]["critical_s"] == 0  # ... written behind
    assert [(m.direction, m.job_id) for m in store.background_moves()[1]] == [
        ("host->nvme", "j3"),
        ("host->nvme", "j0"),
    ]
    assert store.inventory()["host"]["used_bytes"] <= size  # back within the host tier once written

    for step, job_id in [(1, "j3"), (1, "j2"), (1, "j0"), (2, "j3"), (2, "j0"), (2, "j2")]:
        ensure(store, job_id)  # right after an eviction: a copy still being written is waited for
        train(trainer, job_id, step)
        assert_like_alone(trainer, job_id, alone[job_id][step])
    assert store.wait_written(timeout=60)
    for job_id in ("j0", "j2", "j3"):
        store.drop(job_id)
    assert_only_spares_left(store)


def test_a_job_needed_before_its_copy_is_written_takes_the_host_copy_back(
    model_dir: str, alone: dict, tmp_path: Path, monkeypatch
) -> None:
    """A job needed again while the write-behind thread still has its copy swaps in from host
    memory at once, without waiting for the write: whether that write is under way (it goes on,
    its file becomes a spare) or not begun (it is skipped). The job trains on bit-exactly, the
    writes that were not taken back land, and every host buffer goes back to the pool once."""
    trainer = engine(model_dir)
    size = StateStore.job_bytes(JOBS["j0"][0], config_json(model_dir))
    store = StateStore(trainer, device_slots=1, host_bytes=0, nvme_dir=tmp_path / "nvme", write_behind_bytes=8 * size)
    taken: list[torch.Tensor] = []
    given: list[torch.Tensor] = []
    pool_take, pool_give = store._pool.take, store._pool.give
    monkeypatch.setattr(store._pool, "take", lambda n: taken.append(pool_take(n)) or taken[-1])
    monkeypatch.setattr(store._pool, "give", lambda b: given.append(b) or pool_give(b))
    writing, release = threading.Event(), threading.Event()
    write_copy = state_tiers.write_copy
    written: list[str] = []

    def held_write(path: Path, state: Any, reuse: int | None = None) -> Any:
        written.append(path.name)
        writing.set()
        release.wait()
        return write_copy(path, state, reuse=reuse)

    monkeypatch.setattr(state_tiers, "write_copy", held_write)
    safety = threading.Timer(60, release.set)  # a store that waited for the write would hang without it
    safety.start()
    try:
        ensure(store, "j3")
        train(trainer, "j3", 0)
        ensure(store, "j2")  # j3's copy goes to the write-behind thread, whose write is held
        assert writing.wait(timeout=60) and store.where("j3") == "host"
        train(trainer, "j2", 0)
        report = ensure(store, "j3")  # j3 back mid-write; j2's copy queued behind it
        assert report["swap_in"] == "host" and report["evicted"] == ["j2"] and not release.is_set()
        train(trainer, "j3", 1)
        assert_like_alone(trainer, "j3", alone["j3"][1])
        report = ensure(store, "j2")  # j2 back before its write began; j3's copy queued again
        assert report["swap_in"] == "host" and not release.is_set()
        train(trainer, "j2", 1)
        assert_like_alone(trainer, "j2", alone["j2"][1])
    finally:
        release.set()
        safety.cancel()
    assert store.wait_written(timeout=60)
    assert store.where("j2") == "device" and store.where("j3") == "nvme"
    swaps = store.inventory()["swaps"]
    assert swaps["host->nvme"]["count"] == 1 and swaps["host->nvme"]["stalled_s"] == 0  # j3's last copy only
    assert [(m.direction, m.job_id) for m in store.background_moves()[1]] == [("host->nvme", "j3")]
    # j3's first write went on and its file became a spare, j2's was skipped, j3's last copy
    # overwrote that spare in place
    assert len(written) == 2 and written[0] == written[1] == nvme_files(store)["j3"] and store._files.spares == []
    assert ensure(store, "j3")["swap_in"] == "nvme"
    train(trainer, "j3", 2)
    assert_like_alone(trainer, "j3", alone["j3"][2])
    for job_id in ("j2", "j3"):
        store.drop(job_id)
    assert sorted(map(id, taken)) == sorted(map(id, given))  # each buffer back once per use
    assert_only_spares_left(store)


def test_write_behind_once_its_thread_takes_no_more_work_writes_on_the_callers(model_dir: str, tmp_path: Path) -> None:
    """When the write-behind thread takes no more work (the interpreter is exiting: its pool
    refuses new tasks), an eviction writes its copy itself and the copy is on nvme, intact."""
    size = fresh_copy_bytes(model_dir)
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=0, nvme_dir=tmp_path / "nvme", write_behind_bytes=4 * size)
    for job_id in ("j1", "j2"):
        ensure(store, job_id)
        train(trainer, job_id, 0)
    assert store.wait_written(timeout=60) and store.where("j1") == "nvme"
    before = job_state(trainer, "j2")
    store._writer.shutdown(wait=True)  # what interpreter exit does to every thread pool
    ensure(store, "j3")
    assert store.where("j2") == "nvme" and store.inventory()["nvme"]["used_bytes"] > 0
    assert store.wait_written(timeout=0)  # nothing left in flight
    swaps = store.inventory()["swaps"]
    assert swaps["host->nvme"]["count"] == 2 and swaps["device->nvme"]["count"] == 0
    ensure(store, "j2")
    assert_like_alone(trainer, "j2", before)


def test_write_behind_allowance_bounds_what_is_left_behind(model_dir: str, tmp_path: Path) -> None:
    """Copies beyond the allowance are written before ensure_resident returns, as without one."""
    size = fresh_copy_bytes(model_dir)
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=0, nvme_dir=tmp_path / "nvme", write_behind_bytes=size - 1)
    for job_id in ("a", "b", "c"):
        ensure(store, job_id)
    swaps = store.inventory()["swaps"]
    assert swaps["device->nvme"]["count"] == 2 and swaps["device->nvme"]["critical_s"] > 0
    assert swaps["host->nvme"]["count"] == 0 and store.background_moves() == (0, [])
