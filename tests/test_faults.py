"""Faults injected into a running local cluster (bench/faults.py): a worker killed with SIGKILL
is detected, started again and its calls run again; only jobs whose trainer state lived there
roll back to their checkpoint; a daemon killed with SIGKILL loses no job and repeats no step.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

import pytest
from conftest import Cluster

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import faults  # noqa: E402

TINY = str(REPO / "configs" / "tiny-arith.yaml")


@pytest.fixture(scope="module")
def fault_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("plexrl-faults")).up(tiny_model)
    yield c
    c.run("down", timeout=120)


def kinds(c: Cluster, job: str) -> list[str]:
    with sqlite3.connect(c.state_dir / "journal.db") as db:
        return [k for (k,) in db.execute("select kind from events where job_id = ? order by id", (job,))]


def steps(c: Cluster, job: str) -> list[int]:
    rows = [json.loads(line) for line in c.run("logs", job, "--metrics", check=True).stdout.splitlines()]
    return [r["step"] for r in rows if "reward_mean" in r]


def test_a_killed_rollout_worker_comes_back_and_jobs_go_on_untouched(fault_cluster):
    c = fault_cluster
    job = c.run("submit", TINY, "--name", "survivor", "-q", "--set", "algo.steps=40", "--set", "checkpoint.every=5",
                check=True).stdout.strip()
    c.wait_for(job, lambda j: j["step"] >= 5, timeout=300, what="5 steps")
    old = faults.kill(faults.worker_pid(c.state_dir, "w0"))
    assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    assert faults.worker_pid(c.state_dir, "w0") != old  # started again
    assert "rolled back" not in kinds(c, job) and c.job(job)["restarts"] == 0  # its state was not there
    assert steps(c, job) == list(range(1, 41))
    log = (c.state_dir / "daemon.log").read_text()
    assert "worker w0 lost" in log


def test_a_killed_trainer_worker_rolls_its_jobs_back_to_their_checkpoint(fault_cluster):
    c = fault_cluster
    job = c.run("submit", TINY, "--name", "rolled", "-q", "--set", "algo.steps=40", "--set", "checkpoint.every=5",
                check=True).stdout.strip()
    c.wait_for(job, lambda j: j["step"] >= 12, timeout=300, what="12 steps")
    t0 = time.monotonic()
    faults.kill(faults.worker_pid(c.state_dir, "w1"))
    while "rolled back" not in kinds(c, job):
        assert time.monotonic() - t0 < 3 * 1.0 + 5, "not detected within 3 heartbeat intervals (plus slack)"
        time.sleep(0.2)
    assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    log = c.run("logs", job, check=True).stdout
    resumed = [int(line.split("at step ")[1].split()[0]) for line in log.splitlines()
               if "resumed from checkpoint at step" in line]
    assert len(resumed) == 1 and resumed[0] % 5 == 0 and resumed[0] >= 10
    assert steps(c, job) == list(range(1, 41))  # steps past the checkpoint ran again, recorded once


def test_a_killed_daemon_loses_no_job_and_repeats_no_step(fault_cluster, tiny_model):
    c = fault_cluster
    jobs = [c.run("submit", TINY, "--name", f"k{i}", "-q", "--set", "algo.steps=30", "--set", "checkpoint.every=5",
                  "--set", f"seed={i}", check=True).stdout.strip() for i in range(2)]
    queued = c.run("submit", TINY, "--name", "k-queued", "-q", "--set", "algo.steps=10",
                   check=True).stdout.strip()
    c.wait_for(jobs[0], lambda j: j["step"] >= 8, timeout=300, what="8 steps")
    faults.kill(faults.daemon_pid(c.state_dir))
    time.sleep(3.0)  # its workers and drivers notice their parent is gone and exit
    c.up(tiny_model)
    for job in (*jobs, queued):
        assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    for job in jobs:
        assert "recovered" in kinds(c, job)
        assert steps(c, job) == list(range(1, 31))
    assert steps(c, queued) == list(range(1, 11))
