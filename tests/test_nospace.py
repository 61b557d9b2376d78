"""A full disk, on a real small filesystem: a tmpfs of a few MiB mounted for each test (root only).

What a user checks when the node-local disk (the state store's nvme tier) or the shared
filesystem (checkpoints) fills up: the error is one line that says so and where; no temp
directory is left behind; the store falls back to host memory (within its spill allowance)
and tries the disk again later, and every job's state still comes back bit-exact; a
checkpoint that does not fit leaves the previous one intact and restorable; a periodic
checkpoint that does not fit does not end the job. (A corrupt checkpoint is rejected with
the file named: ``test_trainer.test_corrupt_checkpoint_is_rejected``.)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import random_tiny_qwen2
from test_state_store import job_state, nvme_files
from test_trainer import assert_exactly_equal, make_batch

from plexctl.common.protocol import LoraSpec, TrainHParams
from plexctl.rl import CallFailed, DrainCheckpointFailed, Job, JobDrained
from plexctl.spec_files import load_spec
from worker.errors import CheckpointError, NoSpaceError, TierFullError
from worker.state.store import NVME_FULL_RETRY_S, StateStore
from worker.trainer import TrainerEngine

REPO = Path(__file__).resolve().parents[1]
LORA = LoraSpec(rank=8)
HP = TrainHParams(lr=2e-3)
SEEDS = {"a": 1, "b": 2, "c": 3, "d": 4}


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return random_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), vocab_size=64)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[str, int], Path]]:
    """``small_fs(name, size)`` mounts a tmpfs of ``size`` bytes at tmp_path/name; unmounted after."""
    mounted: list[Path] = []

    def mount(name: str, size: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("a full filesystem is a small tmpfs here, and mounting one needs root")
        path = tmp_path / name
        path.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs at {path}: {proc.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=False, capture_output=True)


def fill(fs: Path, leave: int) -> Path:
    """Fill ``fs`` with a file until about ``leave`` bytes are free (page-rounded); return the file."""
    filler = fs / "filler"
    with open(filler, "wb") as f:
        f.write(bytes(max(0, shutil.disk_usage(fs).free - leave)))
    return filler


def config_json(model_dir: str) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def trained(trainer: TrainerEngine, job_id: str, steps: int = 1) -> dict[str, Any]:
    """Train the resident job ``steps`` steps; return a clone of its adapter and optimizer state."""
    for step in range(steps):
        trainer.train_step(job_id, make_batch(100 * SEEDS.get(job_id, 9) + step, rows=4), HP)
    return job_state(trainer, job_id)


class Clock:
    """The store's injected clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def temp_entries(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if ".tmp-" in name or ".old-" in name)


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The state store's warnings (its own and its tiers')."""
    return [
        r.getMessage() for r in caplog.records if r.name.startswith("worker.state.") and r.levelno == logging.WARNING
    ]


# ---------------------------------------------------------------- the state store's nvme tier


def test_full_nvme_disk_keeps_copies_in_host_memory_then_tries_again(
    model_dir: str, small_fs: Callable[[str, int], Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="worker.state")
    one = StateStore.job_bytes(LORA, config_json(model_dir))  # a trained job's copy
    nvme = small_fs("nvme", 4 << 20)
    filler = fill(nvme, leave=one + one // 2)  # room for one copy on disk, while the store believes in 1 GiB
    clock = Clock()
    trainer = TrainerEngine(model_dir, threads=1)
    store = StateStore(
        trainer,
        device_slots=1,
        host_bytes=0,
        host_spill_bytes=one + one // 2,
        nvme_dir=nvme,
        nvme_bytes=1 << 30,
        clock=clock,
    )
    states: dict[str, dict[str, Any]] = {}

    def ensure(job_id: str) -> dict[str, Any]:
        return store.ensure_resident(job_id, LORA, SEEDS[job_id])

    ensure("a")
    states["a"] = trained(trainer, "a")
    ensure("b")  # a goes to nvme: it fits
    states["b"] = trained(trainer, "b")
    assert store.where("a") == "nvme" and store_warnings(caplog) == []

    report = ensure("c")  # b's copy does not fit on the disk: it stays in host memory
    assert report["evicted"] == ["b"] and store.where("b") == "host"
    nvme_info = store.inventory()["nvme"]
    assert (nvme_info["nospace"], nvme_info["full"], nvme_info["jobs"]) == (1, True, ["a"])
    assert nvme_info["used_bytes"] == one
    assert nvme_info["error"] == (
        f"no space left on device writing job 'b''s copy ({one} bytes) to {nvme}, "
        f"{shutil.disk_usage(nvme).free} bytes free"
    )
    assert store.inventory()["host"]["used_bytes"] == one  # over host_bytes (0), within the spill allowance
    (warning,) = store_warnings(caplog)
    assert "no space left on device" in warning and str(nvme) in warning and "\n" not in warning
    assert list(nvme_files(store, beside=("filler",))) == ["a"]  # b's file went, no spare kept on a full disk
    assert store._files.spares == []
    states["c"] = trained(trainer, "c")

    with pytest.raises(TierFullError) as error:  # c cannot leave: nvme is full, host's allowance spent
        ensure("d")
    message = str(error.value)
    assert "\n" not in message and f"no room for job 'c''s state ({one} bytes) off the device" in message
    assert "out of space (no space left on device" in message and str(nvme) in message
    assert trainer.jobs() == ["c"] and store.where("c") == "device" and store.where("d") is None
    assert store.inventory()["nvme"]["nospace"] == 1  # the store did not write into the disk it knows is full
    assert store.inventory()["in_flight"] == {} and list(nvme_files(store, beside=("filler",))) == ["a"]

    filler.unlink()  # space frees up; after the back-off the store tries the disk again
    clock.now += NVME_FULL_RETRY_S
    assert ensure("d")["evicted"] == ["c"] and store.where("c") == "nvme"
    assert (store.inventory()["nvme"]["full"], store.inventory()["nvme"]["nospace"]) == (False, 1)
    states["d"] = trained(trainer, "d")
    assert len(store_warnings(caplog)) == 1

    for job_id in "abcd":  # every job's state comes back exactly as it left
        ensure(job_id)
        assert_exactly_equal(states[job_id], job_state(trainer, job_id), job_id)
    for job_id in "abcd":
        store.drop(job_id)
    assert nvme_files(store) == {} and trainer.jobs() == []  # only spares left
    store._files.delete_spares()
    assert os.listdir(nvme) == []


def test_spare_files_go_when_the_disk_is_full(model_dir: str, small_fs: Callable[[str, int], Path]) -> None:
    """The file of a copy that left nvme is kept to be overwritten (a spare); when a write runs
    out of space, spares are deleted with the failed file, and while the tier is marked full a
    copy leaving nvme has its file deleted, not kept: what the store freed is free on disk."""
    big = LoraSpec(rank=32)
    nvme = small_fs("nvme", 8 << 20)
    trainer = TrainerEngine(model_dir, threads=1)
    one = StateStore.job_bytes(LORA, config_json(model_dir))
    store = StateStore(trainer, device_slots=2, host_bytes=0, host_spill_bytes=4 * one, nvme_dir=nvme)
    store.ensure_resident("a", LORA, SEEDS["a"])
    states = {"a": trained(trainer, "a")}
    store.ensure_resident("c", big, SEEDS["c"])
    states["c"] = trained(trainer, "c")
    store.set_upcoming(["e", "a"])
    store.ensure_resident("e", LORA, 5)  # c goes to nvme
    store.set_upcoming(["c", "a"])
    assert store.ensure_resident("c", big, SEEDS["c"])["evicted"] == ["e"]  # c's file becomes a spare
    (spare,) = store._files.spares
    assert store.where("e") == "nvme" and spare.path.exists() and spare.nbytes > 2 * one
    fill(nvme, leave=0)

    store.set_upcoming(["f", "c"])  # a leaves; the big spare is not for it: a new file, no space
    assert store.ensure_resident("f", LORA, 6)["evicted"] == ["a"] and store.where("a") == "host"
    assert store.inventory()["nvme"]["nospace"] == 1 and store._files.spares == [] and not spare.path.exists()
    assert list(nvme_files(store, beside=("filler",))) == ["e"]
    store.set_upcoming(["e", "c"])  # e leaves nvme while it is marked full: its file is deleted
    assert store.ensure_resident("e", LORA, 5)["swap_in"] == "nvme"
    assert store._files.spares == [] and nvme_files(store, beside=("filler",)) == {}
    store.set_upcoming(["a", "c"])  # a comes back from host memory exactly as it left
    assert store.ensure_resident("a", LORA, SEEDS["a"])["swap_in"] == "host"
    assert_exactly_equal(states["a"], job_state(trainer, "a"), "a")
    assert_exactly_equal(states["c"], job_state(trainer, "c"), "c")


def test_failed_demotion_keeps_host_copies_and_the_job_on_the_device(
    model_dir: str, small_fs: Callable[[str, int], Path]
) -> None:
    one = StateStore.job_bytes(LORA, config_json(model_dir))
    nvme = small_fs("nvme", 1 << 20)
    fill(nvme, leave=0)
    trainer = TrainerEngine(model_dir, threads=1)
    store = StateStore(trainer, device_slots=1, host_bytes=one, host_spill_bytes=0, nvme_dir=nvme)
    states = {}
    store.ensure_resident("a", LORA, SEEDS["a"])
    states["a"] = trained(trainer, "a")
    store.ensure_resident("b", LORA, SEEDS["b"])  # a to host (fits)
    states["b"] = trained(trainer, "b")

    with pytest.raises(TierFullError) as error:  # b needs a demoted to nvme: the disk is full
        store.ensure_resident("c", LORA, SEEDS["c"])
    assert "\n" not in str(error.value) and "no space left on device" in str(error.value)
    inventory = store.inventory()
    assert [store.where(j) for j in "abc"] == ["host", "device", None] and trainer.jobs() == ["b"]
    assert (inventory["host"]["used_bytes"], inventory["nvme"]["used_bytes"], inventory["in_flight"]) == (one, 0, {})
    assert inventory["nvme"]["nospace"] == 1 and os.listdir(nvme) == ["filler"]

    store.ensure_resident("a", LORA, SEEDS["a"])  # a and b trade places through host memory
    assert_exactly_equal(states["a"], job_state(trainer, "a"), "a")
    store.ensure_resident("b", LORA, SEEDS["b"])
    assert_exactly_equal(states["b"], job_state(trainer, "b"), "b")
    assert store.inventory()["nvme"]["nospace"] == 1 and os.listdir(nvme) == ["filler"]


def test_write_behind_into_a_full_disk_keeps_the_copy_in_host_memory(
    model_dir: str, small_fs: Callable[[str, int], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A copy left to the write-behind thread that does not fit on the disk stays in host
    memory (the eviction that made it had returned already), and comes back exactly."""
    caplog.set_level(logging.WARNING, logger="worker.state")
    one = StateStore.job_bytes(LORA, config_json(model_dir))
    nvme = small_fs("nvme", 1 << 20)
    fill(nvme, leave=0)
    trainer = TrainerEngine(model_dir, threads=1)
    store = StateStore(
        trainer, device_slots=1, host_bytes=0, host_spill_bytes=2 * one, nvme_dir=nvme, write_behind_bytes=4 * one
    )
    store.ensure_resident("a", LORA, SEEDS["a"])
    states = {"a": trained(trainer, "a")}
    assert store.ensure_resident("b", LORA, SEEDS["b"])["evicted"] == ["a"]  # a's write is left behind
    states["b"] = trained(trainer, "b")
    assert store.wait_written(timeout=60)
    assert store.where("a") == "host"  # the write ran out of space: the copy stayed in host memory
    inventory = store.inventory()
    assert inventory["nvme"]["nospace"] == 1 and inventory["in_flight"] == {} and os.listdir(nvme) == ["filler"]
    (warning,) = store_warnings(caplog)
    assert "no space left on device" in warning and "\n" not in warning

    store.ensure_resident("a", LORA, SEEDS["a"])  # b spills to host (nvme is marked full); a comes back
    assert store.where("b") == "host"
    assert_exactly_equal(states["a"], job_state(trainer, "a"), "a")
    store.ensure_resident("b", LORA, SEEDS["b"])
    assert_exactly_equal(states["b"], job_state(trainer, "b"), "b")


# ---------------------------------------------------------------- checkpoints on a full filesystem


@pytest.mark.parametrize("layout", ["a directory per step", "one directory overwritten"])
def test_checkpoint_on_a_full_filesystem_says_so_and_keeps_the_last_good_one(
    model_dir: str, small_fs: Callable[[str, int], Path], layout: str
) -> None:
    fs = small_fs("shared", 2 << 20)
    per_step = layout == "a directory per step"
    good_dir = fs / "ckpt" / ("step-000001" if per_step else "latest")
    new_dir = fs / "ckpt" / ("step-000002" if per_step else "latest")
    trainer = TrainerEngine(model_dir, threads=1)
    trainer.ensure_job("A", LORA, seed=1)
    good = trained(trainer, "A")
    trainer.save_checkpoint("A", str(good_dir), {"step": 1})
    listing = sorted(os.listdir(fs / "ckpt"))
    trained(trainer, "A")  # the state moves on past the checkpoint
    fill(fs, leave=100_000)
    free = shutil.disk_usage(fs).free

    with pytest.raises(NoSpaceError) as error:
        trainer.save_checkpoint("A", str(new_dir), {"step": 2})
    message = str(error.value)
    assert isinstance(error.value, CheckpointError) and "\n" not in message
    assert message.startswith(f"no space left on device writing checkpoint step 2 to {new_dir} (needs ~0.")
    assert re.search(r"\(needs ~0\.\d MB, 0\.1 MB free\); ", message), message
    assert message.endswith("nothing was written" if per_step else "the previous one there is kept")
    assert sorted(os.listdir(fs / "ckpt")) == listing and temp_entries(fs / "ckpt") == []
    assert shutil.disk_usage(fs).free == free  # the partial files went with the temp dir

    with pytest.raises(NoSpaceError, match=r"^no space left on device writing adapter of job 'A' to "):
        trainer.save_adapter("A", str(fs / "adapters" / "v000002"))
    assert os.listdir(fs / "adapters") == []

    fresh = TrainerEngine(model_dir, threads=1)  # the last good checkpoint restores exactly
    assert fresh.load_checkpoint("A", str(good_dir), LORA, seed=1) == {"step": 1}
    assert_exactly_equal(good, job_state(fresh, "A"), "restored")


class CheckpointingClient:
    """The job's service calls that ``end_step`` makes, in one process: the real trainer writes
    the checkpoint, and its failure comes back as the daemon returns it (``CallFailed`` with
    ``call_failed: checkpoint failed: <error type>: <message>``)."""

    def __init__(self, trainer: TrainerEngine, ckpt_dir: Path) -> None:
        self.trainer, self.ckpt_dir = trainer, ckpt_dir
        self.drain = ""
        self.reports: list[tuple[str, int, str]] = []

    def checkpoint(self, step: int, extra: dict[str, Any]) -> str:
        out = self.ckpt_dir / f"step-{step:06d}"
        try:
            self.trainer.save_checkpoint("job", str(out), extra)
        except Exception as exc:  # noqa: BLE001 - worded as worker.main and the daemon word it
            raise CallFailed(f"call_failed: checkpoint failed: {type(exc).__name__}: {exc}") from None
        return str(out)

    def report(self, event: str, step: int, metrics: dict[str, float], message: str = "") -> None:
        self.reports.append((event, step, message))


def test_a_periodic_checkpoint_without_space_does_not_end_the_job(
    model_dir: str, small_fs: Callable[[str, int], Path], tiny_model: Path, tmp_path: Path
) -> None:
    fs = small_fs("shared", 2 << 20)
    trainer = TrainerEngine(model_dir, threads=1)
    trainer.ensure_job("job", LORA, seed=1)
    client = CheckpointingClient(trainer, fs / "ckpt")
    lines: list[str] = []
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", ["checkpoint.every=2", "algo.steps=10"])
    job = Job(client, spec, tmp_path, log=lines.append)  # type: ignore[arg-type]
    try:
        job.end_step(1)
        job.end_step(2)
        good = job_state(trainer, "job")
        assert (job.checkpoint_step, os.listdir(fs / "ckpt")) == (2, ["step-000002"])
        trained(trainer, "job")
        filler = fill(fs, leave=50_000)

        job.end_step(4)  # no space: logged and noted, the job goes on
        line = lines[-1]
        assert line.startswith(f"no space left on device writing checkpoint step 4 to {fs / 'ckpt' / 'step-000004'} (")
        assert line.endswith(
            "; nothing was written; the last good checkpoint (step 2) is kept; "
            "training goes on, the next checkpoint tries again"
        )
        assert client.reports == [("note", 4, line)] and job.checkpoint_step == 2

        client.drain = "SIGTERM"  # the cluster stops and the drain checkpoint does not fit either
        with pytest.raises(DrainCheckpointFailed) as drained:
            job.end_step(5)
        assert isinstance(drained.value, JobDrained)
        assert str(drained.value).startswith("SIGTERM; no space left on device writing checkpoint step 5 to ")
        assert str(drained.value).endswith("the last good checkpoint (step 2) is kept; the job resumes from step 2")
        assert os.listdir(fs / "ckpt") == ["step-000002"] and temp_entries(fs / "ckpt") == []

        client.drain = ""
        filler.unlink()  # space again: the next periodic checkpoint is written
        job.end_step(6)
        assert (job.checkpoint_step, sorted(os.listdir(fs / "ckpt"))) == (6, ["step-000002", "step-000006"])

        trainer.release("job")  # any other failure still ends the job
        with pytest.raises(CallFailed, match="UnknownJobError"):
            job.end_step(8)
    finally:
        job.close()

    fresh = TrainerEngine(model_dir, threads=1)
    assert fresh.load_checkpoint("job", str(fs / "ckpt" / "step-000002"), LORA, seed=1)["step"] == 2
    assert_exactly_equal(good, job_state(fresh, "job"), "step 2")


def test_a_shard_write_that_fails_without_an_errno_on_a_full_filesystem_is_out_of_space(tmp_path: Path) -> None:
    """torch's zip writer reports a short write on a full disk as a position it did not reach, with
    no errno: while the filesystem has less room than the rank's shards, that failure is ENOSPC
    (which the checkpoint's caller names in one line); with room, it is the one-line error it was."""
    import errno

    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from worker import checkpoint_shards as shards
    from worker.errors import CheckpointError

    lost = CheckpointException(
        "save", {1: (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos"), None)}
    )
    huge = {"w": torch.empty(1 << 60, dtype=torch.uint8, device="meta")}  # more than any disk holds
    small = {"w": torch.empty(16, dtype=torch.uint8)}
    assert shards._short_of_space(tmp_path, huge) and not shards._short_of_space(tmp_path, small)
    full = shards._one_error(lost, "writing the shards", shards._short_of_space(tmp_path, huge))
    assert isinstance(full, OSError) and full.errno == errno.ENOSPC
    other = shards._one_error(lost, "writing the shards", shards._short_of_space(tmp_path, small))
    assert isinstance(other, CheckpointError) and "unexpected pos" in str(other) and "\n" not in str(other)
