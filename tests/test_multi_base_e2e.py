"""Two base models and full fine-tuning on the same engines, through ``plexctl`` on real local clusters.

Both clusters serve tiny-arith (Qwen2-style) and tiny-llama (Llama-style, another size): each
worker hosts an engine of its kind per model. Three jobs: a LoRA job and a full fine-tuning job
on tiny-arith, a LoRA job on tiny-llama. The shared cluster runs them at once and keeps one
job's state on a trainer's device (``--device-slots 1``), so their states swap out and in as
they take turns and the tiny-arith rollout engine loads the full job's published weights in
place and puts the base back for the LoRA job. The isolated cluster runs each job alone. What
their user checks: per step, each job's rewards, losses, gradient norms and ratios are
bit-identical alone and shared; `status` says each job's model and what it trains, and each
engine's model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Cluster

REPO = Path(__file__).resolve().parents[1]
FULL = str(REPO / "configs" / "tiny-arith-full.yaml")
LORA = str(REPO / "configs" / "tiny-arith.yaml")
LLAMA = str(REPO / "configs" / "tiny-llama.yaml")
JOBS = {"full": (FULL, 7), "lora": (LORA, 11), "llama": (LLAMA, 5)}  # name: (spec, seed)
STEPS = 8  # enough turns that the two jobs of one trainer interleave, however the turns fall
KEYS = ("reward_mean", "train/loss", "train/grad_norm", "train/ratio_mean")


def rows(cluster: Cluster, job: str) -> list[dict]:
    out = cluster.run("logs", job, "--metrics", check=True).stdout
    return [m for m in map(json.loads, out.splitlines()) if "reward_mean" in m]


def submit_all(cluster: Cluster) -> dict[str, str]:
    ids = {}
    for name, (spec, seed) in JOBS.items():
        args = ["--set", f"seed={seed}", "--set", f"algo.steps={STEPS}", "--set", "checkpoint.every=3"]
        ids[name] = cluster.run("submit", spec, *args, "--name", name, "-q", check=True).stdout.strip()
    return ids


def up(tmp: Path, tiny_model: Path, llama_model: Path, *args: str) -> Cluster:
    return Cluster(tmp).up(tiny_model, "--model", str(llama_model), *args)


@pytest.fixture(scope="module")
def shared(tiny_model: Path, llama_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = up(tmp_path_factory.mktemp("plexrl-bases-shared"), tiny_model, llama_model, "--device-slots", "1")
    yield c
    c.run("down", timeout=120)


@pytest.fixture(scope="module")
def alone(tiny_model: Path, llama_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = up(tmp_path_factory.mktemp("plexrl-bases-alone"), tiny_model, llama_model, "--policy", "isolated")
    yield c
    c.run("down", timeout=120)


def test_jobs_on_two_bases_and_a_full_job_learn_identically_alone_and_shared(shared, alone, llama_model):
    on_shared = submit_all(shared)
    on_alone = {}
    for name, (spec, seed) in JOBS.items():  # one at a time: each job has the engines to itself
        args = ["--set", f"seed={seed}", "--set", f"algo.steps={STEPS}", "--set", "checkpoint.every=3"]
        on_alone[name] = alone.run("submit", spec, *args, "--name", name, "-q", check=True).stdout.strip()
        waited = alone.run("wait", on_alone[name], "--timeout", "600", timeout=700)
        assert waited.returncode == 0, waited.stdout + waited.stderr
    waited = shared.run("wait", *on_shared.values(), "--timeout", "900", timeout=1000)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    for name in JOBS:
        got, want = rows(shared, on_shared[name]), rows(alone, on_alone[name])
        assert len(want) == STEPS, name
        assert [[m[k] for k in KEYS] for m in got] == [[m[k] for k in KEYS] for m in want], name
    # the two tiny-arith jobs took turns on one device slot: a state moved in for one of them (which
    # one depends on how the turns fell: max_switches lets a job keep the trainer for up to 4 steps
    # in a row, and the full job's first step may come after the LoRA job's first four)
    turns = {name: rows(shared, on_shared[name]) for name in ("full", "lora")}
    assert any(m.get("train/swap_bytes", 0) > 0 for got in turns.values() for m in got), turns
    status = shared.status()
    jobs = {j["job_id"]: j for j in status["jobs"]}
    ran = [jobs[job] for job in on_shared.values()]
    assert max(j["started_at"] for j in ran) < min(j["ended_at"] for j in ran)  # all three at once
    assert jobs[on_shared["full"]]["trains"] == "all weights"
    assert jobs[on_shared["lora"]]["trains"] == "adapter"
    assert Path(jobs[on_shared["llama"]]["model"]).name == llama_model.name
    models = {Path(e["model"]).name for e in status["engines"]}
    assert models == {"tiny-arith", llama_model.name}
    text = shared.run("status", check=True).stdout
    assert "all weights" in text and "tiny-llama" in text
