"""End to end through the CLI, the daemon, two workers, real vLLM (CPU) and real torch + peft.

One local cluster serves the whole module (see conftest.py). The learning job and the job
that gets cancelled run at the same time on the same engines.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from plexctl.common.client import Client
from plexctl.common.cluster import read_endpoint
from plexctl.common.spec import spec_to_wire
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny-arith.yaml")
# The margin configs/tiny-arith.yaml must clear; docs/benchmarks.md ("Learning check") gives the runs it
# comes from (seed 0 with vLLM 0.32 CPU: +0.040 and +0.055 for two trainers equal to 6e-7).
LEARN_MARGIN = 0.025


@pytest.fixture(scope="module")
def learning_job(cluster) -> str:
    proc = cluster.run("submit", TINY, "--name", "learn", "-q", check=True)
    return proc.stdout.strip()


def test_cancel_stops_at_a_call_boundary_and_keeps_the_checkpoint(cluster, learning_job):
    job = cluster.run(
        "submit",
        TINY,
        "--set",
        "algo.steps=100000",
        "--set",
        "checkpoint.every=5",
        "--name",
        "to-cancel",
        "-q",
        check=True,
    ).stdout.strip()
    info = cluster.wait_for(job, lambda j: j["step"] >= 7, timeout=300, what="7 steps")
    assert info["state"] == "running"
    assert cluster.run("cancel", job, check=True).returncode == 0
    waited = cluster.run("wait", job, "--timeout", "120")
    assert waited.returncode == 5, waited.stdout + waited.stderr  # 5: cancelled
    info = cluster.job(job)
    assert info["state"] == "cancelled"
    stopped_at = info["step"]
    time.sleep(2.0)
    assert cluster.job(job)["step"] == stopped_at  # nothing runs after the cancel

    job_dir = cluster.state_dir / "jobs" / info["job_id"]
    latest = json.loads((job_dir / "ckpt" / "latest.json").read_text())
    ckpt = Path(latest["dir"])
    assert latest["step"] % 5 == 0 and 5 <= latest["step"] <= stopped_at
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = manifest["files"]
    assert {"adapter_model.safetensors", "adapter_config.json", "extra.json"} <= set(files)
    for name, meta in files.items():  # the checkpoint is whole: every file matches its checksum
        assert hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == meta["sha256"]
    assert json.loads((ckpt / "extra.json").read_text())["step"] == latest["step"]
    assert not any(p.name.startswith(".") for p in (job_dir / "ckpt").iterdir()), "temp dirs left behind"
    assert "cancelled" in cluster.run("logs", job, check=True).stdout


def test_a_job_learns_end_to_end(cluster, learning_job):
    waited = cluster.run("wait", learning_job, "--timeout", "900", timeout=960)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    info = cluster.job(learning_job)
    assert info["state"] == "succeeded"
    assert info["step"] == 200 and info["policy_version"] >= 200
    gain = info["eval_last"] - info["eval_first"]
    print(
        f"eval reward {info['eval_first']:.3f} -> {info['eval_last']:.3f} (gain {gain:+.3f}), "
        f"{info['elapsed_s']:.0f} s, cold start {cluster.cold_start_s:.1f} s"
    )
    assert gain >= LEARN_MARGIN

    metrics = [
        json.loads(line) for line in cluster.run("logs", learning_job, "--metrics", check=True).stdout.splitlines()
    ]
    steps = [m for m in metrics if "reward_mean" in m]
    assert [m["step"] for m in steps] == list(range(1, 201))
    assert [m["step"] for m in metrics if "eval_reward" in m] == [0, 200]
    log = cluster.run("logs", learning_job, check=True).stdout
    assert "step 200/200" in log and log.rstrip().endswith("done")


def test_status_json_reports_jobs_and_engines(cluster, learning_job):
    rep = cluster.status()
    job = next(j for j in rep["jobs"] if j["job_id"] == learning_job)
    for key in (
        "state",
        "step",
        "steps",
        "reward",
        "eval_first",
        "eval_last",
        "policy_version",
        "engine",
        "user",
        "elapsed_s",
    ):
        assert key in job
    assert job["steps"] == 200 and job["name"] == "learn"
    kinds = sorted(e["kind"] for e in rep["engines"])
    assert kinds == ["rollout", "trainer"] and all(e["ready"] for e in rep["engines"])
    ran_on = cluster.wait_for(learning_job, lambda j: j["engine"], timeout=300, what="its first call")["engine"]
    assert "w0/rollout" in ran_on.split(",")  # the engines its calls ran on
    ids = cluster.run("ls", "-q", check=True).stdout.split()
    assert learning_job in ids


def test_bad_spec_is_refused_and_nothing_is_queued(cluster, tmp_path):
    before = cluster.run("ls", "-q", check=True).stdout.split()
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs" / "tiny-arith.yaml").read_text().replace("lr:", "lrr:"))
    proc = cluster.run("submit", str(bad))
    assert proc.returncode == 2
    assert "algo.lrr" in proc.stderr and "did you mean `lr`" in proc.stderr
    proc = cluster.run("submit", TINY, "--set", "algo.group_size=1")
    assert proc.returncode == 2 and "algo.group_size" in proc.stderr
    assert cluster.run("ls", "-q", check=True).stdout.split() == before


def test_submit_is_idempotent_and_unknown_models_are_refused(cluster):
    client = Client(read_endpoint(cluster.state_dir).address)
    spec = spec_to_wire(load_spec(TINY, ["algo.steps=1"], name="idem"))
    a = client.submit(spec, submit_id="same-id")
    b = client.submit(spec, submit_id="same-id")
    assert a.job_id == b.job_id and a.created and not b.created
    other = dict(spec, model={**spec["model"], "path": "/nonexistent/model"})
    proc_err = None
    try:
        client.submit(other, submit_id="other-id")
    except Exception as exc:  # noqa: BLE001
        proc_err = exc
    assert proc_err is not None and "not served by this cluster" in str(proc_err)
    assert cluster.run("wait", a.job_id, "--timeout", "300").returncode == 0


def test_unknown_job_and_unreachable_daemon_exit_codes(cluster, tmp_path):
    assert cluster.run("status", "nope").returncode == 4
    other = cluster.run("--state-dir", str(tmp_path / "none"), "status")
    assert other.returncode == 4 and "no cluster" in other.stderr


def test_down_drains_and_up_resumes_from_where_the_job_stopped(tiny_model, tmp_path):
    from conftest import Cluster

    c = Cluster(tmp_path / "home")
    assert c.run("up", "--local", "--model", str(tiny_model), timeout=900).returncode == 0
    try:
        job = c.run(
            "submit", TINY, "--set", "algo.steps=60", "--set", "checkpoint.every=10", "-q", check=True
        ).stdout.strip()
        c.wait_for(job, lambda j: j["step"] >= 25, timeout=300, what="25 steps")
        assert c.run("down", timeout=120).returncode == 0  # drains: the job checkpoints at its step's end
        assert c.run("status").returncode == 3  # the daemon is gone
        assert c.run("up", "--local", "--model", str(tiny_model), timeout=900).returncode == 0
        assert c.run("wait", job, "--timeout", "600").returncode == 0
        info = c.job(job)
        assert info["state"] == "succeeded" and info["step"] == 60 and info["restarts"] == 1
        log = c.run("logs", job, check=True).stdout
        resumed = [line for line in log.splitlines() if "resumed from checkpoint at step" in line]
        assert len(resumed) == 1
        at = int(resumed[0].split("at step ")[1].split()[0])
        assert at >= 25  # not the last periodic checkpoint (20): the drain's own, at the step it reached
        rows = [json.loads(line) for line in c.run("logs", job, "--metrics", check=True).stdout.splitlines()]
        assert [r["step"] for r in rows if "reward_mean" in r] == list(range(1, 61))  # none lost or repeated
    finally:
        c.run("down", timeout=120)


def test_a_multi_turn_tool_job_runs_through_the_daemon(cluster, tmp_path):
    from plexctl.envs import python_tool_tiny_dataset

    data = tmp_path / "tool.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in python_tool_tiny_dataset(64, seed=0)))
    job = cluster.run(
        "submit",
        TINY,
        "--name",
        "tool",
        "-q",
        "--set",
        f"data.path={data}",
        "--set",
        "data.eval_path=null",
        "--set",
        "env.name=python_tool",
        "--set",
        "env.max_turns=3",
        "--set",
        "env.max_total_tokens=48",
        "--set",
        "sampling.max_tokens=12",
        "--set",
        "algo.steps=3",
        "--set",
        "algo.prompts_per_step=4",
        "--set",
        "algo.group_size=4",
        check=True,
    ).stdout.strip()
    waited = cluster.run("wait", job, "--timeout", "600")
    assert waited.returncode == 0, waited.stdout + cluster.run("logs", job).stdout[-3000:]
    rows = [json.loads(line) for line in cluster.run("logs", job, "--metrics", check=True).stdout.splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # episode accounting reaches the job's metrics
        for key in ("env/turns_mean", "env/tool_calls", "env/malformed_calls", "env/tool_timeouts"):
            assert key in r, sorted(r)
        assert r["train/tokens"] > 0


def test_a_job_whose_reward_keeps_failing_stops_with_the_reason(cluster, tmp_path):
    (tmp_path / "broken_reward.py").write_text(
        "def score(completion, answer, sample):\n    raise ValueError('verifier down')\n"
    )
    job = cluster.run(
        "submit",
        TINY,
        "--name",
        "broken",
        "-q",
        "--set",
        "reward.name=null",
        "--set",
        "reward.fn=broken_reward:score",
        "--set",
        f"reward.path={tmp_path}",
        "--set",
        "reward.max_error_rate=0.5",
        "--set",
        "algo.steps=20",
        check=True,
    ).stdout.strip()
    waited = cluster.run("wait", job, "--timeout", "300")
    assert waited.returncode == 1  # failed
    info = cluster.job(job)
    assert info["state"] == "failed" and "max_error_rate" in info["error"] and info["step"] == 0


def _driver_pid(cluster, job: str) -> int:
    import sqlite3

    with sqlite3.connect(cluster.state_dir / "journal.db") as db:
        rows = db.execute(
            "select detail from events where job_id = ? and kind = 'started' order by id", (job,)
        ).fetchall()
    return int(rows[-1][0].split("driver pid ")[1])


def test_a_crashed_driver_restarts_from_its_checkpoint_then_fails_past_the_limit(cluster):
    import os
    import signal

    job = cluster.run(
        "submit",
        TINY,
        "--name",
        "crashy",
        "-q",
        "--set",
        "algo.steps=30",
        "--set",
        "checkpoint.every=5",
        "--set",
        "checkpoint.max_restarts=1",
        check=True,
    ).stdout.strip()
    cluster.wait_for(job, lambda j: j["step"] >= 8, timeout=300, what="8 steps")
    os.kill(_driver_pid(cluster, job), signal.SIGKILL)
    assert cluster.run("wait", job, "--timeout", "600").returncode == 0, cluster.run("logs", job).stdout[-2000:]
    log = cluster.run("logs", job, check=True).stdout
    resumed = [line for line in log.splitlines() if "resumed from checkpoint at step" in line]
    assert len(resumed) == 1 and int(resumed[0].split("at step ")[1].split()[0]) in (5, 10, 15)
    rows = [json.loads(line) for line in cluster.run("logs", job, "--metrics", check=True).stdout.splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == list(range(1, 31))  # steps past the checkpoint: once

    # past checkpoint.max_restarts the job fails, with the reason in status
    job = cluster.run(
        "submit",
        TINY,
        "--name",
        "crashy2",
        "-q",
        "--set",
        "algo.steps=10000",
        "--set",
        "checkpoint.max_restarts=0",
        check=True,
    ).stdout.strip()
    cluster.wait_for(job, lambda j: j["step"] >= 2, timeout=300, what="2 steps")
    os.kill(_driver_pid(cluster, job), signal.SIGKILL)
    assert cluster.run("wait", job, "--timeout", "120").returncode == 1
    info = cluster.job(job)
    assert info["state"] == "failed" and "driver crashed (killed by SIGKILL)" in info["error"]
