"""Faults injected into a running local cluster (bench/faults.py): a worker killed with SIGKILL
is detected, started again and its calls run again; only jobs whose trainer state lived there
roll back to their checkpoint; a daemon killed with SIGKILL is rejoined by the drivers and
workers that outlived it (jobs go on where they were), or, past the orphan grace, resumes every
job from its checkpoint; no job is lost and no step repeated.
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
ORPHAN_GRACE_S = 15


@pytest.fixture(scope="module")
def fault_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    # drivers and workers wait this long for a restarted daemon before they exit
    c = Cluster(tmp_path_factory.mktemp("plexrl-faults"), env={"PLEXRL_ORPHAN_GRACE_S": str(ORPHAN_GRACE_S)})
    c.up(tiny_model)
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
    job = c.run(
        "submit", TINY, "--name", "survivor", "-q", "--set", "algo.steps=40", "--set", "checkpoint.every=5", check=True
    ).stdout.strip()
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
    job = c.run(
        "submit", TINY, "--name", "rolled", "-q", "--set", "algo.steps=40", "--set", "checkpoint.every=5", check=True
    ).stdout.strip()
    c.wait_for(job, lambda j: j["step"] >= 12, timeout=300, what="12 steps")
    t0 = time.monotonic()
    faults.kill(faults.worker_pid(c.state_dir, "w1"))
    while "rolled back" not in kinds(c, job):
        assert time.monotonic() - t0 < 3 * 1.0 + 5, "not detected within 3 heartbeat intervals (plus slack)"
        time.sleep(0.2)
    assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    log = c.run("logs", job, check=True).stdout
    resumed = [
        int(line.split("at step ")[1].split()[0])
        for line in log.splitlines()
        if "resumed from checkpoint at step" in line
    ]
    assert len(resumed) == 1 and resumed[0] % 5 == 0 and resumed[0] >= 10
    assert steps(c, job) == list(range(1, 41))  # steps past the checkpoint ran again, recorded once


def test_a_killed_daemon_is_rejoined_by_its_drivers_and_workers(fault_cluster, tiny_model):
    """SIGKILL the daemon mid-run and start it again on the same state directory: the drivers
    and workers that outlived it reconnect, the jobs go on from where they were (not from a
    checkpoint), every step is applied and recorded once, the queued job runs."""
    c = fault_cluster
    jobs = [
        c.run(
            "submit",
            TINY,
            "--name",
            f"k{i}",
            "-q",
            "--set",
            "algo.steps=30",
            "--set",
            "checkpoint.every=5",
            "--set",
            f"seed={i}",
            check=True,
        ).stdout.strip()
        for i in range(2)
    ]
    queued = c.run("submit", TINY, "--name", "k-queued", "-q", "--set", "algo.steps=10", check=True).stdout.strip()
    c.wait_for(jobs[0], lambda j: j["step"] >= 8, timeout=300, what="8 steps")
    drivers = {job: faults.driver_pid(c.state_dir, job) for job in jobs}
    workers = {w: faults.worker_pid(c.state_dir, w) for w in ("w0", "w1")}
    faults.kill(faults.daemon_pid(c.state_dir))
    time.sleep(2.0)  # the daemon stays away for a while: calls in flight are lost with it
    c.up(tiny_model)
    assert {w: faults.worker_pid(c.state_dir, w) for w in workers} == workers  # engines never restarted
    for job in (*jobs, queued):
        assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    for job in jobs:
        assert "reattached" in kinds(c, job) and "recovered" not in kinds(c, job)
        assert faults.driver_pid(c.state_dir, job) == drivers[job]  # the same driver went on
        log = c.run("logs", job, check=True).stdout
        assert "reconnected to the daemon" in log and "resumed from checkpoint" not in log
        assert steps(c, job) == list(range(1, 31))
        info = c.job(job)
        assert info["state"] == "succeeded" and info["step"] == 30
    assert steps(c, queued) == list(range(1, 11))


def test_a_daemon_down_past_the_grace_resumes_jobs_from_their_checkpoint(fault_cluster, tiny_model):
    """When no daemon comes back within the orphan grace, drivers and workers exit; the next
    daemon starts fresh engines and resumes every job from its last checkpoint, steps once."""
    c = fault_cluster
    job = c.run(
        "submit", TINY, "--name", "g", "-q", "--set", "algo.steps=20", "--set", "checkpoint.every=5", check=True
    ).stdout.strip()
    c.wait_for(job, lambda j: j["step"] >= 7, timeout=300, what="7 steps")
    driver = faults.driver_pid(c.state_dir, job)
    faults.kill(faults.daemon_pid(c.state_dir))
    deadline = time.monotonic() + ORPHAN_GRACE_S + 20
    while _alive(driver) or _any_worker(c.state_dir):
        assert time.monotonic() < deadline, "drivers and workers did not exit after the grace"
        time.sleep(0.5)
    c.up(tiny_model)
    assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    assert "requeued" in kinds(c, job)  # its driver said it gave up on its daemon (driver.exit)
    assert "resumed from checkpoint at step" in c.run("logs", job, check=True).stdout
    assert steps(c, job) == list(range(1, 21))


def _alive(pid: int) -> bool:
    from plexctl.common.cluster import pid_alive

    return pid_alive(pid)


def _any_worker(state_dir: Path) -> bool:
    try:
        faults.worker_pid(state_dir, "w0")
        return True
    except LookupError:
        pass
    try:
        faults.worker_pid(state_dir, "w1")
        return True
    except LookupError:
        return False
