"""What the engines serve, end to end: a job asks for a dtype or a LoRA rank its engines do not
serve and is refused at submit with the reason (exit 7, nothing queued); a bfloat16 cluster
(trainer and vLLM on CPU) runs a bfloat16 job to the end and publishes bf16 adapters; a worker
told to use a GPU where there is none stops `up` with one line (exit 11) and leaves nothing
running."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from conftest import Cluster

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny-arith.yaml")
REFUSED = 7
START_FAILED = 11


def safetensors_dtypes(path: Path) -> set[str]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_the_engines_say_what_they_serve(cluster) -> None:
    engines = cluster.status()["engines"]
    assert {(e["kind"], e["dtype"], e["device"]) for e in engines} == {
        ("rollout", "float32", "cpu"),
        ("trainer", "float32", "cpu"),
    }


@pytest.mark.parametrize(
    "override, reason",
    [
        ("model.dtype=bfloat16", "model.dtype 'bfloat16': the engines of .* serve float32"),
        ("lora.rank=32", "lora.rank 32: the rollout engines load adapters up to rank 16"),  # CPU's default
    ],
)
def test_a_job_its_engines_cannot_serve_is_refused_at_submit(cluster, override, reason) -> None:
    import re

    name = "refused-" + override.split("=")[0].replace(".", "-")
    proc = cluster.run("submit", TINY, "--name", name, "--set", override)
    assert proc.returncode == REFUSED, proc.stdout + proc.stderr
    assert re.search(reason, proc.stderr), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert name not in {j["name"] for j in cluster.status()["jobs"]}  # nothing queued


@pytest.fixture(scope="module")
def bf16_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("plexrl-bf16")).up(
        tiny_model, "--workers", "1", "--dtype", "bfloat16", "--max-loras", "2"
    )
    yield c
    c.run("down", timeout=120)


def test_a_bf16_job_runs_end_to_end_on_bf16_engines(bf16_cluster) -> None:
    c = bf16_cluster
    assert {e["dtype"] for e in c.status()["engines"]} == {"bfloat16"}
    job = c.run(
        "submit",
        TINY,
        "--name",
        "bf16",
        "-q",
        "--set",
        "model.dtype=bfloat16",
        "--set",
        "algo.steps=4",
        "--set",
        "algo.eval_every=0",
        "--set",
        "checkpoint.every=1000",
        check=True,
    ).stdout.strip()
    waited = c.run("wait", job, "--timeout", "600")
    assert waited.returncode == 0, c.run("logs", job).stdout[-3000:]
    rows = [json.loads(line) for line in (c.state_dir / "jobs" / job / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 4 and all(abs(r["train/loss"]) < float("inf") for r in steps)  # finite, every step
    adapters = sorted((c.state_dir / "jobs" / job / "adapters").glob("v*/adapter_model.safetensors"))
    assert adapters and safetensors_dtypes(adapters[-1]) == {"BF16"}  # published in the engines' dtype
    refused = c.run("submit", TINY, "--name", "fp32", "--set", "model.dtype=float32")
    assert refused.returncode == REFUSED and "serve bfloat16" in refused.stderr


def test_a_gpu_asked_where_there_is_none_stops_up_with_one_line(tiny_model: Path, tmp_path: Path) -> None:
    c = Cluster(tmp_path / "home")
    proc = c.run("up", "--local", "--model", str(tiny_model), "--workers", "1", "--device", "cuda", timeout=300)
    assert proc.returncode == START_FAILED, proc.stdout + proc.stderr
    assert "--device cuda" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert c.run("status").returncode == 3  # nothing left running: no daemon answers
