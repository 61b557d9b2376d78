"""A full fine-tuning job beside a LoRA job on one base, through ``plexctl`` on real local clusters.

The shared cluster keeps one job's state on the trainer's device (``--device-slots 1``), so the
two jobs' states swap out and in as they take turns, and the rollout engine loads the full
job's published weights in place and puts the base back for the LoRA job. The isolated cluster
runs the full job alone. What its user checks: per step, the rewards, losses, gradient norms
and ratios are bit-identical alone and shared; `status` says which job trains all weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Cluster

REPO = Path(__file__).resolve().parents[1]
FULL = str(REPO / "configs" / "tiny-arith-full.yaml")
LORA = str(REPO / "configs" / "tiny-arith.yaml")
STEPS = 6
KEYS = ("reward_mean", "train/loss", "train/grad_norm", "train/ratio_mean")


def rows(cluster: Cluster, job: str) -> list[dict]:
    out = cluster.run("logs", job, "--metrics", check=True).stdout
    return [m for m in map(json.loads, out.splitlines()) if "reward_mean" in m]


def submit(cluster: Cluster, spec: str, name: str, seed: int) -> str:
    args = ["--set", f"seed={seed}", "--set", f"algo.steps={STEPS}", "--set", "checkpoint.every=3"]
    return cluster.run("submit", spec, *args, "--name", name, "-q", check=True).stdout.strip()


@pytest.fixture(scope="module")
def shared(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("plexrl-full-shared")).up(tiny_model, "--device-slots", "1")
    yield c
    c.run("down", timeout=120)


@pytest.fixture(scope="module")
def alone(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("plexrl-full-alone")).up(tiny_model, "--policy", "isolated")
    yield c
    c.run("down", timeout=120)


def test_full_job_learns_identically_alone_and_shared_with_a_lora_job(shared, alone):
    full_shared = submit(shared, FULL, "full", seed=7)
    lora_shared = submit(shared, LORA, "lora", seed=11)
    full_alone = submit(alone, FULL, "full", seed=7)
    for cluster, jobs in ((shared, [full_shared, lora_shared]), (alone, [full_alone])):
        waited = cluster.run("wait", *jobs, "--timeout", "900", timeout=1000)
        assert waited.returncode == 0, waited.stdout + waited.stderr
    got, want = rows(shared, full_shared), rows(alone, full_alone)
    assert len(want) == STEPS
    assert [[m[k] for k in KEYS] for m in got] == [[m[k] for k in KEYS] for m in want]
    assert sum(m.get("train/swap_bytes", 0) > 0 for m in got) >= STEPS // 2  # its state moved while shared
    lora_rows = rows(shared, lora_shared)
    assert len(lora_rows) == STEPS and all(m["train/grad_norm"] > 0 for m in lora_rows)
    trains = {j["job_id"]: j["trains"] for j in shared.status()["jobs"]}
    assert trains == {full_shared: "all weights", lora_shared: "adapter"}
    assert "all weights" in shared.run("status", check=True).stdout
