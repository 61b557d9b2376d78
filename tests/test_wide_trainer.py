"""A trainer engine of two ranks served as the worker serves it: ``worker.servers.GroupTrainers``
over a ``TrainerGroup`` whose ranks each hold a store and a server (``worker.main.attach_rank``).
Real processes, gloo, FSDP2 on CPU.

Every body reaches every rank, and a step's micro-batches split among them. Jobs trained on it
end as the same jobs on a one-rank engine to summation order (a job with LoRA dropout too: its
micro-batches draw their masks wherever they run), whether they swap through the store's tiers or
share passes, and bit for bit the same alone or shared at that width. Only rank 0 writes what a
task publishes. A full fine-tuning job's weights and moments are sharded over the ranks and train
as on one rank, and a rank that dies takes the worker down.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from plexctl.common import calls as C
from plexctl.common import cluster_config as K
from plexctl.common import protocol as P
from tests.test_nospace import fill, small_fs  # noqa: F401 - small_fs: a fixture
from tests.test_state_store import JOBS, batch_for, job_state, tiny_qwen2
from tests.test_trainer import assert_exactly_equal
from worker.errors import CheckpointError
from worker.main import attach_rank, trainer_store
from worker.servers import GroupTrainers, Trainers
from worker.trainer import TrainerEngine
from worker.trainer_group import TrainerGroup

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

EID = "w0/trainer"
CONFIG = msgspec.structs.replace(K.DEFAULTS, device_slots=2, host_mem="64MiB", nvme_bytes="256MiB")
STEPS = {"j0": 2, "j1": 2, "j3": 2}  # j0 has LoRA dropout; j1 and j3 can share a pass


class Recorder:
    """An outbox that keeps each task's result."""

    def __init__(self) -> None:
        self.results: dict[int, tuple[bool, Any, str]] = {}

    def result(self, task_id: int, ok: bool, value: Any = None, **kwargs: Any) -> None:
        self.results[task_id] = (ok, value, kwargs.get("error", ""))

    def inventory(self, info: Any) -> None:
        pass


def task(job_id: str, step: int, publish: Path | None = None) -> C.TrainStepTask:
    lora, seed, hp = JOBS[job_id]
    return C.TrainStepTask(C.TrainerContext(lora, seed), batch_for(job_id, step), hp, str(publish or ""))


def bodies(out: Path, shared: bool = True) -> list[P.TaskBody | P.TaskPassBody]:
    """The jobs' steps interleaved (two device slots for three jobs: steps swap), j1 and j3 in
    shared passes (``shared``; else each step alone), each job's last step publishing its adapter
    under ``out``."""
    sent: list[P.TaskBody | P.TaskPassBody] = []
    n = 0
    for step in range(max(STEPS.values())):
        n += 1
        last = step == STEPS["j0"] - 1
        sent.append(P.TaskBody(n, "j0", EID, task("j0", step, out / "j0" if last else None)))
        pair = []
        for job in ("j1", "j3"):
            n += 1
            pair.append(P.TaskBody(n, job, EID, task(job, step, out / job if last else None)))
        sent.extend([P.TaskPassBody(EID, pair)] if shared else pair)
    return sent


def serve_all(server: Any, sent: list[P.TaskBody | P.TaskPassBody]) -> Recorder:
    out = Recorder()
    for body in sent:
        server.serve(body, out)
    return out


def published(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {job: load_file(str(out / job / "adapter_model.safetensors")) for job in STEPS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def group_of(
    model_dir: str, width: int, nvme: Path, timeout_s: float = 120.0, options: dict[str, Any] | None = None
) -> TrainerGroup:
    attach = functools.partial(attach_rank, config=CONFIG, nvme_dir=nvme, info={}, eid=EID)
    return TrainerGroup(model_dir, width, options or {"threads": 1}, timeout_s=timeout_s, attach=attach)


SPLIT = {"threads": 1, "micro_batch_rows": 1}  # four micro-batches a step: two on each of two ranks


def metrics_of(results: dict[int, tuple[bool, Any, str]]) -> dict[int, dict[str, float]]:
    return {
        task_id: {k: v for k, v in value.metrics.items() if not k.startswith("swap") and k != "seconds"}
        for task_id, (ok, value, error) in results.items()
        if (ok or pytest.fail(f"task {task_id}: {error}")) and hasattr(value, "metrics")
    }


def test_jobs_on_two_ranks_split_their_steps_and_end_as_on_one(model_dir: str, tmp_path: Path) -> None:
    """Served on 2 ranks, each step's micro-batches split among them (data parallel): the jobs
    end as on one rank, to summation order (the job with LoRA dropout too, its micro-batches'
    masks the same whichever rank runs them); on 2 ranks a job trained alone and in shared passes
    ends bit for bit the same; every rank holds the same adapter; only rank 0 writes."""
    alone = Trainers({EID: trainer_store(TrainerEngine(model_dir, **SPLIT), CONFIG, tmp_path / "n1", {})})
    want = metrics_of(serve_all(alone, bodies(tmp_path / "one")).results)
    with group_of(model_dir, 2, tmp_path / "n2", options=SPLIT) as group:
        got = metrics_of(serve_all(GroupTrainers(group, pytest.fail), bodies(tmp_path / "two")).results)
        assert group.base_bytes()[0] < sum(p.numel() * 4 for p in group.engine._base.parameters())
        digests = {job: set(group.adapter_digests(job)) for job in group.engine.jobs()}
    with group_of(model_dir, 2, tmp_path / "n3", options=SPLIT) as group:
        unshared = metrics_of(
            serve_all(GroupTrainers(group, pytest.fail), bodies(tmp_path / "unshared", shared=False)).results
        )
    assert sorted(got) == sorted(want)
    for task_id, metrics in want.items():
        assert got[task_id].keys() >= metrics.keys(), task_id
        for key, value in metrics.items():
            assert got[task_id][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (task_id, key)
    one, two, apart = (published(tmp_path / d) for d in ("one", "two", "unshared"))
    for task_id, metrics in got.items():  # a step's metrics on 2 ranks, shared or alone (their sums' order aside)
        for key, value in metrics.items():
            if key != "group":  # the pass's job count
                assert unshared[task_id][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (task_id, key)
    for job in STEPS:
        assert one[job].keys() == two[job].keys() == apart[job].keys()
        # the dropout job's smallest gradients are the ones summation order moves most (its grad_norm
        # agrees above: its masks are the same on 2 ranks), and AdamW's first steps are about +-lr whatever their size
        atol = 1e-5 if job == "j0" else 1e-6
        assert all(torch.allclose(one[job][k], two[job][k], rtol=1e-4, atol=atol) for k in one[job]), job
        assert all(torch.equal(two[job][k], apart[job][k]) for k in two[job]), job  # shared or alone: the same
    assert all(len(d) == 1 for d in digests.values()), digests  # every rank holds the same adapter
    assert sorted(os.listdir(tmp_path / "two")) == sorted(STEPS)  # written once, by rank 0


FULL_HP = JOBS["j1"][2]
FULL_STEPS = 3


def full_bodies(out: Path, checkpoint: Path | None = None) -> list[P.TaskBody | P.TaskPassBody]:
    """A full fine-tuning job ("F") interleaved with a LoRA job (j1): with one device slot their
    states swap out through host and NVMe and back at every step; F's last step publishes its
    weights under ``out``, then (``checkpoint``) F is checkpointed there."""
    sent: list[P.TaskBody | P.TaskPassBody] = []
    for step in range(FULL_STEPS):
        last = step == FULL_STEPS - 1
        publish = str(out / "F") if last else ""
        full = C.TrainStepTask(C.TrainerContext(None, 7), batch_for("j3", step), FULL_HP, publish)
        sent.append(P.TaskBody(2 * step + 1, "F", EID, full))
        sent.append(P.TaskBody(2 * step + 2, "j1", EID, task("j1", step)))
    if checkpoint is not None:
        keep = C.CheckpointTask(C.TrainerContext(None, 7), str(checkpoint), {"step": FULL_STEPS})
        sent.append(P.TaskBody(100, "F", EID, keep))
    return sent


def full_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "F" / "model.safetensors"))


ONE_SLOT = msgspec.structs.replace(CONFIG, device_slots=1)


def full_group(model_dir: str, width: int, nvme: Path, config: Any = ONE_SLOT) -> TrainerGroup:
    attach = functools.partial(attach_rank, config=config, nvme_dir=nvme, info={}, eid=EID)
    return TrainerGroup(model_dir, width, SPLIT, timeout_s=120.0, attach=attach)


def test_a_full_fine_tuning_job_shards_its_weights_and_trains_as_on_one_rank(model_dir: str, tmp_path: Path) -> None:
    """A full fine-tuning job on 2 and on 4 ranks, each holding its shard of every weight and of
    AdamW's moments (the lm_head whole), its step's micro-batches split among them, swapping out
    and back at every step beside a LoRA job: its losses are one rank's within 1e-5 (AdamW on whole
    weights carries the ranks' other summation order from step to step), its published weights within
    1e-5; on 2 ranks with room for both jobs (no swap) it ends bit for bit the same,
    so each rank's shards come back from host and NVMe exact. Its checkpoint, written at width 2,
    each rank writing its own shards, restores at widths 1 and 4 with the same weights and moments."""
    alone = Trainers({EID: trainer_store(TrainerEngine(model_dir, **SPLIT), ONE_SLOT, tmp_path / "n1", {})})
    want = metrics_of(serve_all(alone, full_bodies(tmp_path / "one", tmp_path / "ckpt1")).results)
    ckpt = tmp_path / "ckpt"
    with full_group(model_dir, 2, tmp_path / "n2") as group:
        got = metrics_of(serve_all(GroupTrainers(group, pytest.fail), full_bodies(tmp_path / "two", ckpt)).results)
        shards = group.rank_state_bytes("F")
    with full_group(model_dir, 2, tmp_path / "n3", config=CONFIG) as group:
        kept = metrics_of(serve_all(GroupTrainers(group, pytest.fail), full_bodies(tmp_path / "kept")).results)
    with full_group(model_dir, 4, tmp_path / "n4") as group:
        four = metrics_of(serve_all(GroupTrainers(group, pytest.fail), full_bodies(tmp_path / "four")).results)
        group.load_checkpoint("F", str(tmp_path / "ckpt1"), None, 7)  # one rank's files, cut to 4 ranks' shards
        group.save_checkpoint("F", str(tmp_path / "again1"), {"step": FULL_STEPS})
        group.load_checkpoint("F", str(ckpt), None, 7)
        group.save_checkpoint("F", str(tmp_path / "again"), {"step": FULL_STEPS})
    for other in (got, four):
        for task_id, metrics in want.items():
            for key in ("loss", "pg_loss", "tokens", "grad_norm"):
                assert other[task_id][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-8), (task_id, key)
    one, two, four_w = (full_weights(tmp_path / d) for d in ("one", "two", "four"))
    assert one.keys() == two.keys() == four_w.keys()
    for key in one:
        assert (one[key] - two[key]).abs().max() <= 1e-5, key
        assert (one[key] - four_w[key]).abs().max() <= 1e-5, key
    assert got == kept  # swapped out and back at every step, or never: the same
    assert all(torch.equal(two[key], t) for key, t in full_weights(tmp_path / "kept").items())
    restored = TrainerEngine(model_dir, **SPLIT)
    restored.load_checkpoint("F", str(ckpt), None, 7)
    assert max(shards) < restored.state_bytes("F")  # a rank holds its shards
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert (manifest["layout"], manifest["width"]) == ("sharded", 2)
    written = {n: r["bytes"] for n, r in manifest["files"].items() if n.endswith(".distcp")}
    assert sorted(written) == ["shards/__0_0.distcp", "shards/__1_0.distcp"]  # each rank wrote its own
    assert max(written.values()) < 0.8 * sum(written.values())  # its shards, not the whole state
    weights = restored.adapter_state_dict("F")
    assert weights.keys() == two.keys()
    assert all(torch.equal(weights[k].to(two[k].dtype), two[k]) for k in two)  # the published step's weights
    again = TrainerEngine(model_dir, **SPLIT)  # width 2 -> 4 -> saved by 4 ranks -> 1: the same bits
    again.load_checkpoint("F", str(tmp_path / "again"), None, 7)
    assert all(torch.equal(t, weights[k]) for k, t in again.adapter_state_dict("F").items())
    moments_at_two, moments_at_four = (e.slots.job("F").optimizer.state_dict()["state"] for e in (restored, again))
    assert moments_at_two.keys() == moments_at_four.keys() and moments_at_two
    for index, moments in moments_at_two.items():
        assert set(moments) == {"step", "exp_avg", "exp_avg_sq"}, index
        assert all(torch.equal(moments[n], moments_at_four[index][n]) for n in moments), index
    from_one, back = TrainerEngine(model_dir, **SPLIT), TrainerEngine(model_dir, **SPLIT)
    from_one.load_checkpoint("F", str(tmp_path / "ckpt1"), None, 7)
    back.load_checkpoint("F", str(tmp_path / "again1"), None, 7)  # 1 -> 4 -> saved by 4 ranks -> 1
    assert_exactly_equal(job_state(from_one, "F"), job_state(back, "F"), "restored at 4 ranks and saved")


def test_a_full_job_of_a_model_with_tied_embeddings_trains_on_two_ranks_as_on_one(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A model whose lm_head is its embedding: on 2 ranks the embedding is split and the head
    whole, so a full fine-tuning job's head reads its embedding gathered, and the head's gradient
    is summed over the ranks and folded into the embedding's shards. Its losses, gradient norms and
    published weights (the embedding, no lm_head of its own) are one rank's within 1e-5."""
    tied = tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-tied"), tie_word_embeddings=True)
    alone = Trainers({EID: trainer_store(TrainerEngine(tied, **SPLIT), ONE_SLOT, tmp_path / "n1", {})})
    want = metrics_of(serve_all(alone, full_bodies(tmp_path / "one")).results)
    with full_group(tied, 2, tmp_path / "n2") as group:
        got = metrics_of(serve_all(GroupTrainers(group, pytest.fail), full_bodies(tmp_path / "two")).results)
    for task_id, metrics in want.items():
        for key in ("loss", "pg_loss", "tokens", "grad_norm"):
            assert got[task_id][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-8), (task_id, key)
    one, two = full_weights(tmp_path / "one"), full_weights(tmp_path / "two")
    assert one.keys() == two.keys() and "lm_head.weight" not in one
    start = load_file(str(Path(tied) / "model.safetensors"))["model.embed_tokens.weight"]
    moved = (one["model.embed_tokens.weight"] - start).abs().max()
    assert moved > 1e-4  # the embedding trained, its head's gradient in it
    for key in one:
        assert (one[key] - two[key]).abs().max() <= 1e-5, key


def test_a_sharded_checkpoint_without_space_fails_its_task_and_the_engine_goes_on(
    model_dir: str,
    tmp_path: Path,
    small_fs: Any,  # noqa: F811 - the fixture imported above
) -> None:
    """A full fine-tuning job's checkpoint on 2 ranks, each writing its shards: on a filesystem too
    full for them the task fails in one line that says so, no temp dir is left, and the engine
    takes the next task (a checkpoint elsewhere, which restores on one rank). A shard changed on
    disk is refused by its sha256: on 2 ranks, which check the files together, the rank that
    found it fails the restore on both and the engine goes on; on one rank too."""
    fs = small_fs("shared", 4 << 20)
    context = C.TrainerContext(None, 7)
    good, bad = tmp_path / "good", tmp_path / "bad"
    with full_group(model_dir, 2, tmp_path / "n2") as group:
        server = GroupTrainers(group, pytest.fail)
        out = serve_all(server, full_bodies(tmp_path / "out")[:2])
        fill(fs, leave=50_000)
        server.serve(P.TaskBody(50, "F", EID, C.CheckpointTask(context, str(fs / "ckpt"), {"step": 1})), out)
        server.serve(P.TaskBody(51, "F", EID, C.CheckpointTask(context, str(good), {"step": 1})), out)
        shutil.copytree(good, bad)
        shard = bad / "shards" / "__0_0.distcp"  # the 4th file by name: rank 1 checks it
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
        server.serve(P.TaskBody(52, "F", EID, C.RestoreTask(context, str(bad))), out)
        server.serve(P.TaskBody(53, "F", EID, C.RestoreTask(context, str(good))), out)
    ok, _, error = out.results[50]
    assert not ok and "\n" not in error
    assert f"no space left on device writing checkpoint step 1 to {fs / 'ckpt'}" in error, error
    assert error.endswith("nothing was written") and sorted(os.listdir(fs)) == ["filler"]
    assert out.results[51][0], out.results[51]
    ok, _, error = out.results[52]
    assert not ok and "shards/__0_0.distcp does not match its sha256" in error, error
    assert out.results[53][0], out.results[53]
    assert TrainerEngine(model_dir, **SPLIT).load_checkpoint("F", str(good), None, 7) == {"step": 1}
    with pytest.raises(CheckpointError, match=r"shards/__0_0\.distcp does not match its sha256"):
        TrainerEngine(model_dir, **SPLIT).load_checkpoint("F", str(bad), None, 7)


def events(cluster: Any, job: str) -> list[tuple[str, str]]:
    """The job's journal events, kind and message, oldest first."""
    with sqlite3.connect(cluster.state_dir / "journal.db") as db:
        return list(db.execute("select kind, detail from events where job_id = ? order by id", (job,)))


def tinker_bodies(out: Path, lora: Any = None) -> list[P.TaskBody | P.TaskPassBody]:
    """Tinker's calls on a full fine-tuning job ("T", or a LoRA job of ``lora``): forward_backward
    of five data (five micro-batches of a row: on two ranks, three rounds, one a null pass), then
    optim_step (its call again, with clipping), twice, the last publishing its weights under ``out``."""
    from tests.test_trainer_tokens import make_data

    context = C.TrainerContext(lora, 9)
    sent: list[P.TaskBody | P.TaskPassBody] = []
    for step in range(2):
        call = C.LossCall(make_data(40 + step, count=5), "importance_sampling")
        sent.append(P.TaskBody(2 * step + 1, "T", EID, C.ForwardBackwardTask(context, call)))
        adam = C.AdamStep(learning_rate=1e-3, grad_clip_norm=0.5)
        publish = str(out / "F") if step == 1 else ""
        sent.append(P.TaskBody(2 * step + 2, "T", EID, C.OptimStepTask(context, [call], adam, publish)))
    return sent


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_tinker_calls_on_two_ranks_split_their_data_and_are_one_ranks(model_dir: str, tmp_path: Path, kind: str):
    """Tinker's forward_backward and optim_step split their micro-batches among 2 ranks, as a
    step does (``RankSplit``): each datum's log-probs and loss are the one rank's that computed
    it, gathered to all; the gradients summed over the ranks (a full job's shards in each
    backward). The losses, log-probs, gradient norms and weights are a one-rank engine's."""
    lora = None if kind == "full" else JOBS["j3"][0]
    alone = Trainers(
        {EID: trainer_store(TrainerEngine(model_dir, threads=1, micro_batch_rows=1), CONFIG, tmp_path / "n1", {})}
    )
    want = serve_all(alone, tinker_bodies(tmp_path / "one", lora)).results
    with group_of(model_dir, 2, tmp_path / "n2", options=SPLIT) as group:
        got = serve_all(GroupTrainers(group, pytest.fail), tinker_bodies(tmp_path / "two", lora)).results
    for task_id, (ok, value, error) in want.items():
        assert ok and got[task_id][0], (task_id, error, got[task_id][2])
        if isinstance(value, C.ForwardBackwardResult):
            assert got[task_id][1].loss == pytest.approx(value.loss, rel=1e-6)
            for mine, theirs in zip(got[task_id][1].logprobs, value.logprobs, strict=True):
                assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-6)
        else:
            for key in ("loss:sum", "grad_norm:mean", "data:sum"):
                assert got[task_id][1].metrics[key] == pytest.approx(value.metrics[key], rel=1e-6), key
    name = "model.safetensors" if lora is None else "adapter_model.safetensors"
    one, two = (load_file(str(tmp_path / run / "F" / name)) for run in ("one", "two"))
    assert one.keys() == two.keys() and all((one[k] - two[k]).abs().max() <= 1e-5 for k in one)


def test_a_rank_on_another_node_joins_through_the_rendezvous_file(model_dir: str, tmp_path: Path) -> None:
    """A trainer engine of 2 ranks whose rank 1 is started apart, as a Slurm allocation's other
    node starts it (``python -m worker.ranks``): it finds the group in the rendezvous file rank 0
    writes, keeps its store under its own scratch, and the jobs end bit for bit as on two ranks
    started together; when the group closes it waits for the next one, and SIGTERM ends it."""
    import subprocess
    import sys

    from plexctl.common.cluster_config import write_config

    config_file, rendezvous = tmp_path / "cluster.json", tmp_path / "groups" / "job-trainer0.json"
    write_config(config_file, CONFIG)
    host = subprocess.Popen(
        [sys.executable, "-m", "worker.ranks", "--rendezvous", str(rendezvous), "--ranks", "1"]
        + ["--cluster-config", str(config_file), "--scratch", str(tmp_path / "other-node")],
        cwd=REPO,
    )
    try:
        attach = functools.partial(attach_rank, config=CONFIG, nvme_dir=tmp_path / "n1", info={}, eid=EID)
        extra = {"info": {}, "eid": EID}
        with TrainerGroup(
            model_dir, 2, SPLIT, timeout_s=120.0, attach=attach, local_ranks=1, rendezvous=rendezvous, extra=extra
        ) as group:
            assert group.pids == []  # no rank started here but rank 0
            serve_all(GroupTrainers(group, pytest.fail), bodies(tmp_path / "apart"))
            assert len(set(group.adapter_digests("j1"))) == 1
        assert (tmp_path / "other-node" / "rank1").is_dir()  # rank 1's own NVMe tier, on its node
        with group_of(model_dir, 2, tmp_path / "n2", options=SPLIT) as group:
            serve_all(GroupTrainers(group, pytest.fail), bodies(tmp_path / "together"))
        apart, together = published(tmp_path / "apart"), published(tmp_path / "together")
        for job in STEPS:
            assert all(torch.equal(apart[job][k], together[job][k]) for k in apart[job]), job
        assert host.poll() is None  # waiting for the group's next forming
    finally:
        host.terminate()
        assert host.wait(30) == 0


def test_a_rank_that_dies_takes_the_worker_down(model_dir: str, tmp_path: Path) -> None:
    failures: list[str] = []
    group = group_of(model_dir, 2, tmp_path / "n", timeout_s=20.0)
    try:
        trainers = GroupTrainers(group, failures.append)
        serve_all(trainers, [P.TaskBody(1, "j1", EID, task("j1", 0))])
        os.kill(group.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        out = serve_all(trainers, [P.TaskBody(2, "j1", EID, task("j1", 1))])
        assert time.monotonic() - t0 < 60
        assert failures and "rank 1" in failures[0]
        assert 2 not in out.results  # no result: the engine's death is not the task's error
    finally:
        group.close()


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.journey
def test_up_with_a_trainer_of_two_ranks_runs_a_lora_job_and_a_full_one(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`plexctl up --local --trainer-width 2`, as a user types it: status shows the trainer engine
    with its two ranks; the tiny LoRA job and the tiny full fine-tuning job run on it side by
    side, each evaluated at its start and end (the full job's rollouts from its weights gathered
    from both ranks and published); rank 1 killed mid-run takes the engine down, it starts again
    whole, and both jobs roll back to their checkpoints and succeed with every step recorded once;
    a Tinker client's run, alive through it, is told at its next call that its state went back to
    its saved state and step, and goes on from there; a Tinker client's run on the engine started
    again saves its state and loads it back, optimizer included, to the same next step."""
    import tinker

    from bench import faults
    from tests.conftest import Cluster
    from tests.test_faults import kinds, steps

    monkeypatch.setenv("TINKER_TELEMETRY", "0")

    n_steps = 16  # the full job is killed at step 3: steps enough that it is still running then
    cluster = Cluster(tmp_path / "home", env={"TINKER_TELEMETRY": "0"}).up(
        tiny_model, "--trainer-width", "2", "--tinker-port", "0"
    )
    try:
        trainer = next(e for e in cluster.status()["engines"] if e["kind"] == "trainer")
        assert trainer["ranks"] == 2
        assert "cpu x2" in cluster.run("status", check=True).stdout
        known = {j["job_id"] for j in cluster.status()["jobs"]}
        service, run = tinker_client(cluster)
        [tinker_job] = {j["job_id"] for j in cluster.status()["jobs"]} - known
        data, adam = tinker_data(run), tinker.AdamParams(learning_rate=1e-3)
        for _ in range(2):
            run.forward_backward(data, "cross_entropy").result()
            run.optim_step(adam).result()
        saved = run.save_state("two").result().path
        at_save = run.forward(data, "cross_entropy").result().metrics["loss:sum"]
        run.forward_backward(data, "cross_entropy").result()
        run.optim_step(adam).result()  # step 3: lost with the engine
        every = ("--set", "checkpoint.every=2", "-q")
        lora = cluster.run(
            "submit", str(REPO / "configs" / "tiny-arith.yaml"), "--set", f"algo.steps={n_steps}", *every
        )
        full = cluster.run(
            "submit", str(REPO / "configs" / "tiny-arith-full.yaml"), "--set", f"algo.steps={n_steps}", *every
        )
        assert lora.returncode == 0 and full.returncode == 0, lora.stderr + full.stderr
        jobs = (lora.stdout.strip(), full.stdout.strip())
        cluster.wait_for(jobs[1], lambda j: j["step"] >= 3, timeout=600, what="3 steps")
        worker = faults.worker_pid(cluster.state_dir, trainer["worker_id"])
        [rank1] = faults.rank_pids(worker)
        faults.kill(rank1)
        for job in jobs:
            cluster.run("wait", job, "--timeout", "900", timeout=960)
        # the Tinker run's state went with the engine: its next call says so, and where it went back to
        told = rf"lost its trainer state.*{re.escape(saved)}, step 2: 1 optim_step\(s\) since then.*send them again"
        with pytest.raises(tinker.RequestFailedError, match=told):
            run.forward(data, "cross_entropy").result()
        assert run.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, rel=1e-6)
        with pytest.raises(tinker.RequestFailedError, match=told):
            run.optim_step(adam).result()  # not on nothing: the lost forward_backward was not sent again
        run.forward_backward(data, "cross_entropy").result()
        run.optim_step(adam).result()
        assert cluster.job(tinker_job)["restarts"] == 1 and cluster.job(tinker_job)["step"] == 3
        service.close("success").result()
        for job in jobs:
            done = cluster.job(job)
            assert done["state"] == "succeeded" and done["step"] == n_steps, (done["error"], events(cluster, job))
            assert 0.0 <= done["eval_first"] <= 1.0 and 0.0 <= done["eval_last"] <= 1.0, done
            assert steps(cluster, job) == list(
                range(1, n_steps + 1)
            )  # steps past the checkpoint ran again, recorded once
        assert "rolled back" in kinds(cluster, jobs[1])
        assert faults.worker_pid(cluster.state_dir, trainer["worker_id"]) != worker  # started again, whole
        tinker_state_round_trip(cluster)
    finally:
        cluster.run("down", timeout=120)


def tinker_client(cluster: Any, seed: int = 5) -> tuple[Any, Any]:
    """A Tinker service client of the cluster's owner and a rank-8 LoRA training client on it."""
    import tinker

    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    service = tinker.ServiceClient(base_url=url, api_key=(cluster.home / "tinker-api-key").read_text().strip())
    return service, service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=seed).result()


def tinker_data(run: Any) -> list[Any]:
    from tests.test_tinker_e2e import supervised_data

    return supervised_data(run.get_tokenizer(), 8)


def tinker_state_round_trip(cluster: Any) -> None:
    """A Tinker LoRA run on the cluster: a step, ``save_state``, two more steps, then
    ``load_state_with_optimizer``: the loss and the next step are those after the save."""
    import tinker

    from tests.test_tinker_e2e import supervised_data

    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        service = tinker.ServiceClient(base_url=url, api_key=(cluster.home / "tinker-api-key").read_text().strip())
        try:
            run = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=3).result()
            data = supervised_data(run.get_tokenizer(), 8)
            adam = tinker.AdamParams(learning_rate=1e-2)

            def step() -> float:
                run.forward_backward(data, "cross_entropy").result()
                run.optim_step(adam).result()
                return run.forward(data, "cross_entropy").result().metrics["loss:sum"]

            step()
            saved = run.save_state("wide").result().path
            at_save = run.forward(data, "cross_entropy").result().metrics["loss:sum"]
            after_save = step()
            step()
            run.load_state_with_optimizer(saved).result()
            assert run.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, rel=1e-6)
            assert step() == pytest.approx(after_save, rel=1e-6)
        finally:
            service.close("success").result()


def test_a_step_whose_micro_batches_do_not_divide_among_the_ranks_runs_null_passes(model_dir: str, tmp_path: Path):
    """Three micro-batches on two ranks: rank 1 runs a null pass in the second round (FSDP's
    collectives need as many passes on every rank), which adds nothing: the step is one rank's."""
    from tests.test_trainer import make_batch

    lora, seed, hp = JOBS["j1"]
    step = C.TrainStepTask(C.TrainerContext(lora, seed), make_batch(77, rows=3), hp, "")
    engine = TrainerEngine(model_dir, **SPLIT)
    alone = Trainers({EID: trainer_store(engine, CONFIG, tmp_path / "n1", {})})
    want = metrics_of(serve_all(alone, [P.TaskBody(1, "j1", EID, step)]).results)[1]
    one = engine.adapter_state_dict("j1")
    with group_of(model_dir, 2, tmp_path / "n2", options=SPLIT) as group:
        got = metrics_of(serve_all(GroupTrainers(group, pytest.fail), [P.TaskBody(1, "j1", EID, step)]).results)[1]
        two = group.engine.adapter_state_dict("j1")
        assert len(set(group.adapter_digests("j1"))) == 1
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6) and got["tokens"] == want["tokens"]
    assert all(torch.allclose(one[k], two[k], rtol=1e-4, atol=1e-6) for k in one)


LEARN_STEPS = {"tiny-arith.yaml": 100, "tiny-arith-full.yaml": 200}
LEARN_GAIN = 0.04  # evaluation reward, last over first (one run: LoRA +0.088, as at width 1; full +0.078)


def test_a_lora_job_and_a_full_one_learn_on_a_trainer_of_two_ranks(tiny_model: Path, tmp_path: Path) -> None:
    """`plexctl up --local --trainer-width 2` and the two example specs submitted side by side,
    as a user types them: both succeed, each one's evaluation reward rising by at least LEARN_GAIN
    over its run (the LoRA job's steps split among the ranks, the full job's weights sharded over them)."""
    from tests.conftest import Cluster

    cluster = Cluster(tmp_path / "home").up(tiny_model, "--trainer-width", "2")
    try:
        jobs = {
            spec: cluster.run(
                "submit",
                str(REPO / "configs" / spec),
                "--set",
                f"algo.steps={n}",
                "--set",
                "checkpoint.every=0",
                "-q",
                check=True,
            ).stdout.strip()
            for spec, n in LEARN_STEPS.items()
        }
        waited = cluster.run("wait", *jobs.values(), "--timeout", "900", timeout=960)
        assert waited.returncode == 0, waited.stdout + waited.stderr
        for spec, job in jobs.items():
            info = cluster.job(job)
            gain = info["eval_last"] - info["eval_first"]
            print(f"width 2, {spec}: eval reward {info['eval_first']:.3f} -> {info['eval_last']:.3f} ({gain:+.3f})")
            assert info["state"] == "succeeded" and info["step"] == LEARN_STEPS[spec], info
            assert gain >= LEARN_GAIN, (spec, info)
    finally:
        cluster.run("down", timeout=300)
