"""Many jobs on one rollout engine and one trainer engine: placement, swaps, unchanged learning.

The session cluster (conftest.py) runs ``spread+backfill`` with 2 device slots on the trainer
and 2 adapter slots in vLLM, so 4 concurrent jobs force state swaps and adapter reloads. A
second cluster in this module runs ``isolated``: there each job owns the engine pair while
it runs, so jobs queue, and a job's learning curve there is the curve it has alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Cluster

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny-arith.yaml")
SHARED_JOBS = 4
STEPS = 40  # enough turns on 2 device slots for every job's state to move; learning: test_e2e, and below
ALONE_STEPS = 20


def metrics(cluster: Cluster, job: str) -> list[dict]:
    out = cluster.run("logs", job, "--metrics", check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def isolated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    # small tiers: a job whose state fits none of them is refused at submit, with the numbers
    c = Cluster(tmp_path_factory.mktemp("plexrl-isolated")).up(
        tiny_model, "--policy", "isolated", "--host-mem", "512K", "--nvme-bytes", "768K"
    )
    yield c
    c.run("down", timeout=120)


@pytest.fixture(scope="module")
def shared_jobs(cluster) -> list[str]:
    """Four jobs at once on the session cluster; seed 7 is also run alone on the isolated cluster."""
    ids = []
    for i, seed in enumerate((7, 11, 12, 13)):
        proc = cluster.run(
            "submit",
            TINY,
            "--set",
            f"seed={seed}",
            "--set",
            f"algo.steps={STEPS}",
            "--set",
            "checkpoint.every=50",
            "--name",
            f"shared-{i}",
            "-q",
            check=True,
        )
        ids.append(proc.stdout.strip())
    return ids


def test_isolated_gives_each_job_its_own_engines(isolated, shared_jobs):
    a = isolated.run(
        "submit", TINY, "--set", "seed=7", "--set", f"algo.steps={ALONE_STEPS}", "--name", "alone", "-q", check=True
    ).stdout.strip()
    b = isolated.run(
        "submit", TINY, "--set", "seed=8", "--set", "algo.steps=5", "--name", "second", "-q", check=True
    ).stdout.strip()
    isolated.wait_for(a, lambda j: j["state"] == "running", timeout=120, what="first job running")
    second = isolated.job(b)
    assert second["state"] == "queued"
    assert "dedicated engines" in second["reason"]
    assert isolated.run("wait", a, b, "--timeout", "600").returncode == 0
    ja, jb = isolated.job(a), isolated.job(b)
    assert jb["started_at"] >= ja["ended_at"] - 1.0  # never both on the pair at once


def test_more_jobs_than_slots_all_finish_and_swap(cluster, shared_jobs):
    waited = cluster.run("wait", *shared_jobs, "--timeout", "1500", timeout=1600)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    swapped_jobs = 0
    for job in shared_jobs:
        info = cluster.job(job)
        assert info["state"] == "succeeded" and info["step"] == STEPS
        # what each learns shared is what it learns alone, to the bit (test_shared_learning_curve_equals_alone),
        # and alone the recipe learns (test_e2e): its evaluation was taken, at the start and the end
        assert info["eval_first"] is not None and info["eval_last"] is not None, info
        rows = [m for m in metrics(cluster, job) if "reward_mean" in m]
        assert len(rows) == STEPS
        if any(m.get("train/swap_bytes", 0) > 0 for m in rows):
            swapped_jobs += 1
    assert swapped_jobs >= 2  # 4 jobs, 2 device slots: state had to move
    trainer = next(e for e in cluster.status()["engines"] if e["kind"] == "trainer")
    swaps = trainer["swaps"]
    assert swaps["device->host"]["count"] > 0 and swaps["host->device"]["count"] > 0
    assert trainer["tiers"]["device"]["capacity"] == 2


def test_shared_learning_curve_equals_alone(isolated, cluster, shared_jobs):
    alone_job = next(j for j in isolated.status()["jobs"] if j["name"] == "alone")
    assert alone_job["state"] == "succeeded"
    keys = ("reward_mean", "train/loss", "train/grad_norm", "train/ratio_mean")
    alone = [[m[k] for k in keys] for m in metrics(isolated, alone_job["job_id"]) if "reward_mean" in m]
    shared = [[m[k] for k in keys] for m in metrics(cluster, shared_jobs[0]) if "reward_mean" in m][:ALONE_STEPS]
    # Same seed, same data order, per-sample sampling seeds, batch-invariant CPU kernels and a
    # trainer that is bit-exact per job (swaps included): sharing the engines changes nothing,
    # to the last bit, in the samples (rewards) and in each step's update (loss, gradient norm).
    assert len(alone) == ALONE_STEPS
    assert shared == alone


def test_a_job_whose_state_fits_no_tier_is_refused_at_submit_with_the_numbers(isolated):
    proc = isolated.run("submit", TINY, "--set", "lora.rank=16", "--name", "too-big", "-q")
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "state takes" in proc.stderr and "more than any trainer's largest tier holds (768.0 KiB)" in proc.stderr
    assert "too-big" not in {j["name"] for j in isolated.status()["jobs"]}  # nothing queued


def test_stale_rollouts_stay_within_max_staleness(cluster):
    job = cluster.run(
        "submit", TINY, "--set", "algo.max_staleness=1", "--set", "algo.steps=12", "--name", "stale", "-q", check=True
    ).stdout.strip()
    assert cluster.run("wait", job, "--timeout", "600").returncode == 0
    rows = [m for m in metrics(cluster, job) if "reward_mean" in m]
    staleness = [m["staleness"] for m in rows]
    assert len(rows) == 12 and max(staleness) == 1 and min(staleness) >= 0  # generation overlapped training
