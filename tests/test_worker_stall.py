"""A stalled worker is suspect, not dead; a worker whose process is gone is lost at once.

A worker that misses its heartbeats (SIGSTOP here, as a long GC pause, a swap storm or a
file-system stall would stop it) gets no new calls while it is suspect and, when it heartbeats
again, goes on with its jobs and their state: no job rolls back, its calls in flight complete.
It is lost only when its process is gone (a local worker's exit; a Slurm worker's, told by its
node task) or after ``--worker-grace`` seconds of silence.

Three layers: the scheduler core (suspect engines start nothing new), the daemon's core
driven with the messages of workers and drivers at the times the test gives, and a real local cluster whose
trainer worker is stopped for longer than the old 3 s window, then killed.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path

import pytest
from conftest import Cluster

from daemon.core import WORKER_GRACE_S
from daemon.scheduler import Engine, Scheduler, Task
from plexctl.cli import views
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import faults  # noqa: E402 - bench/faults.py, found through the path set above

TINY = str(REPO / "configs" / "tiny-arith.yaml")


# ---------------------------------------------------------------- the scheduler core


def task(tid: int, job: str, kind: str = "rollout", method: str = "generate") -> Task:
    return Task(tid, job, kind, method, "m", 0.0)


def test_a_suspect_engine_starts_nothing_new_and_takes_tasks_again_once_back():
    s = Scheduler(policy="spread+backfill")
    for eid, kind in (("w0/rollout", "rollout"), ("w1/rollout", "rollout"), ("w2/trainer", "trainer")):
        s.engine_up(Engine(eid, eid.split("/")[0], kind, "m"))
    assert s.admit("a", "m", 0.0).ok
    home = s.home_of("a", "rollout")
    other = ({"w0/rollout", "w1/rollout"} - {home}).pop()
    s.submit(task(1, "a"))
    s.submit(task(2, "a", "trainer", "train_step"))
    assert {(p.task.task_id, p.engine_id) for p in s.tick(1.0)} == {(1, home), (2, "w2/trainer")}

    s.engine_suspect(home)
    s.engine_suspect("w2/trainer")
    s.done(1, 2.0, 1.0)  # a call in flight on a suspect engine completes
    s.done(2, 2.0, 1.0)
    s.submit(task(3, "a"))
    s.submit(task(4, "a", "trainer", "train_step"))
    placed = s.tick(2.0)
    assert [(p.task.task_id, p.engine_id) for p in placed] == [(3, other)]  # the rollout backfills elsewhere
    assert s.home_of("a", "rollout") == home and s.home_of("a", "trainer") == "w2/trainer"  # homes kept
    assert 4 in s.queue  # its state is on the suspect trainer: it waits there, on no other engine

    assert s.admit("b", "m", 2.0).reason.startswith("waiting for its engines: every trainer engine")
    s.engine_back("w2/trainer")
    assert [(p.task.task_id, p.engine_id) for p in s.tick(3.0)] == [(4, "w2/trainer")]
    assert s.admit("b", "m", 3.0).ok and s.home_of("b", "rollout") == other  # not the suspect one
    s.engine_back(home)
    s.done(3, 4.0, 1.0)
    s.submit(task(5, "a"))
    assert [(p.task.task_id, p.engine_id) for p in s.tick(4.0)] == [(5, home)]


# ---------------------------------------------------------------- the daemon, with an injected clock


def running_job(d, tiny_model: Path, name: str) -> str:
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", overrides=[f"model.path={tiny_model}"], name=name)
    job_id, _ = d.journal.submit(name, "alice", spec)
    d.chores()  # admitted: its driver is to start
    d.driver_started(job_id, 0)
    return job_id


def register(d, worker: str, model: Path, pid: int = 1) -> None:
    engines = [
        P.EngineDecl(f"{worker}/rollout", "rollout", str(model), 4),
        P.EngineDecl(f"{worker}/trainer", "trainer", str(model)),
    ]
    d.send(worker.encode(), P.Op.REGISTER, P.RegisterReq(worker, "node", pid, engines, True))


def train_step(d, job_id: str, msg_id: int) -> None:
    step = C.TrainStepReq(P.TrainBatch([], [], [], []))
    d.send(f"drv:{job_id}".encode(), P.Op.CALL, P.CallReq(job_id, step), msg_id)


def sent_tasks(d) -> list[int]:
    out = [body.task_id for _, op, body in d.sent if op == P.Op.TASK and body.method == "train_step"]
    d.sent.clear()
    return out


def events(d, job_id: str) -> list[str]:
    return [kind for _, kind, _ in d.journal.events(job_id)]


def engine_rows(d) -> dict[str, P.EngineInfo]:
    d.send(b"cli", P.Op.STATUS, P.StatusReq(), msg_id=9)
    rep = d.sent.pop()[2]
    return {e.engine_id: e for e in rep.engines}


def test_a_silent_worker_is_suspect_keeps_its_jobs_and_is_lost_only_past_the_grace(core, tiny_model):
    d = core
    register(d, "w1", tiny_model)
    job = running_job(d, tiny_model, "stalled")
    t0 = d.workers["w1"].last_seen
    train_step(d, job, 7)
    d.place(t0)
    (in_flight,) = sent_tasks(d)

    d.heartbeat(t0 + 3.5)  # three heartbeats missed: suspect, not lost
    assert d.workers["w1"].suspect_since == t0 + 3.5 and d.sched.engines["w1/trainer"].suspect
    rows = engine_rows(d)
    assert rows["w1/trainer"].suspect and rows["w1/rollout"].suspect
    assert views.ready_text(rows["w1/trainer"]).startswith("suspect (")
    assert "worker suspect" in events(d, job)
    d.send(b"w1", P.Op.RESULT, P.ResultBody(in_flight, True, C.TrainStepResult({"loss": 0.0}), seconds=0.1))
    assert any(op == P.Op.REPLY and to == f"drv:{job}".encode() for to, op, _ in d.sent)  # it completed
    d.sent.clear()
    train_step(d, job, 8)
    d.place(t0 + 4)
    assert sent_tasks(d) == []  # no new call for a suspect worker

    d.heartbeat(t0 + 35)  # a 30 s stall survives the default grace
    assert WORKER_GRACE_S > 30 and "w1" in d.workers and "w1/trainer" in d.sched.engines
    assert not d.jobs.runtimes[job].rolled_back
    d.send(b"w1", P.Op.HEARTBEAT, P.HeartbeatBody("w1"), msg_id=3)  # it came back
    assert d.workers["w1"].suspect_since is None and not d.sched.engines["w1/trainer"].suspect
    assert "worker back" in events(d, job) and not engine_rows(d)["w1/trainer"].suspect
    d.place()
    assert len(sent_tasks(d)) == 1  # the call held while it was suspect goes to it now
    assert not d.jobs.runtimes[job].rolled_back

    d.heartbeat(d.workers["w1"].last_seen + WORKER_GRACE_S + 1)  # silent past the grace: lost
    assert "w1" not in d.workers and "w1/trainer" not in d.sched.engines
    assert "worker w1 lost" in d.jobs.runtimes[job].rolled_back


def test_a_worker_whose_process_exited_is_lost_at_once(core, tiny_model):
    d = core
    register(d, "n1", tiny_model, pid=4242)
    job = running_job(d, tiny_model, "killed")
    train_step(d, job, 7)
    d.place()
    d.send(b"node-task", P.Op.WORKER_EXITED, P.WorkerExited("n1", 4243, -9), msg_id=2)  # another process
    assert "n1" in d.workers
    d.send(b"node-task", P.Op.WORKER_EXITED, P.WorkerExited("n1", 4242, -9), msg_id=3)  # its own: lost now
    assert "n1" not in d.workers and "worker n1 lost" in d.jobs.runtimes[job].rolled_back

    register(d, "w0", tiny_model)
    job2 = running_job(d, tiny_model, "local")
    train_step(d, job2, 9)
    d.place()
    now = d.workers["w0"].last_seen + 0.1  # well inside the heartbeats: its exit decides
    d.take(d.core.worker_process_exited("w0", 0, now))  # a local worker's process, seen by the server
    assert "w0" not in d.workers and "process exited" in d.jobs.runtimes[job2].rolled_back


def test_the_worker_grace_reaches_the_daemon_through_the_cluster_config(tmp_path, monkeypatch):
    from daemon.main import Daemon
    from plexctl.common import auth
    from plexctl.common.cluster_config import ClusterConfig, config_path, read_config, write_config

    monkeypatch.setenv("PLEXRL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(auth.KEYS_ENV, raising=False)  # the daemon sets it: put back after the test
    state = tmp_path / "state"
    write_config(config_path(state), ClusterConfig(worker_grace=45))  # what `up` writes
    d = Daemon(state, [], [], config=read_config(config_path(state)))
    try:
        assert d.core.settings.worker_grace == 45
    finally:
        d.shutdown()


# ---------------------------------------------------------------- a real local cluster


def kinds(c: Cluster, job: str) -> list[str]:
    with sqlite3.connect(c.state_dir / "journal.db") as db:
        return [k for (k,) in db.execute("select kind from events where job_id = ? order by id", (job,))]


def journal_step(c: Cluster, job: str) -> tuple[str, int]:
    """The job's state and step as the journal holds them now (no CLI call: read at once)."""
    with sqlite3.connect(c.state_dir / "journal.db") as db:
        state, step = db.execute("select state, step from jobs where job_id = ?", (job,)).fetchone()
    return state, step


def at_step(c: Cluster, job: str, n: int, timeout: float = 300) -> None:
    """Return as soon as the journal shows step ``n``: a CLI poll lags by seconds on a loaded machine,
    long enough for a tiny job to finish the steps the test means to interrupt."""
    deadline = time.monotonic() + timeout
    while journal_step(c, job)[1] < n:
        assert time.monotonic() < deadline, f"{job} did not reach step {n}: {journal_step(c, job)}"
        time.sleep(0.05)


def steps(c: Cluster, job: str) -> list[int]:
    rows = [json.loads(line) for line in c.run("logs", job, "--metrics", check=True).stdout.splitlines()]
    return [r["step"] for r in rows if "reward_mean" in r]


@pytest.fixture
def short_grace_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Its own cluster, stopped before the next one starts: 2 cores hold one at a time."""
    c = Cluster(tmp_path_factory.mktemp("plexrl-grace"))
    c.up(tiny_model, "--worker-grace", "4")
    yield c
    c.run("down", timeout=120)


def test_a_stall_past_the_worker_grace_is_a_loss_and_the_worker_serves_again_once_back(short_grace_cluster):
    c = short_grace_cluster
    job = c.run(
        "submit",
        TINY,
        "--name",
        "past-grace",
        "-q",
        "--set",
        "algo.steps=12",
        "--set",
        "checkpoint.every=4",
        check=True,
    ).stdout.strip()
    at_step(c, job, 5)
    trainer = faults.worker_pid(c.state_dir, "w1")
    os.kill(trainer, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        while "rolled back" not in kinds(c, job):
            assert time.monotonic() - t0 < 4 + 5, "not lost within the worker grace (plus slack)"
            time.sleep(0.2)
    finally:
        os.kill(trainer, signal.SIGCONT)
    assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    assert faults.worker_pid(c.state_dir, "w1") == trainer  # the same process registered again and served
    assert "resumed from checkpoint at step" in c.run("logs", job, check=True).stdout
    assert steps(c, job) == list(range(1, 13))
    assert "worker w1 lost: no heartbeat for" in (c.state_dir / "daemon.log").read_text()


@pytest.fixture(scope="module")
def stall_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("plexrl-stall"))
    c.up(tiny_model)  # the default worker grace
    yield c
    c.run("down", timeout=120)


def test_a_trainer_stopped_for_longer_than_three_heartbeats_comes_back_and_its_job_goes_on(stall_cluster):
    c = stall_cluster
    job = c.run(
        "submit", TINY, "--name", "stalled", "-q", "--set", "algo.steps=24", "--set", "checkpoint.every=4", check=True
    ).stdout.strip()
    at_step(c, job, 4)
    assert "worker suspect" not in kinds(c, job)  # a busy worker heartbeats from its own thread
    trainer = faults.worker_pid(c.state_dir, "w1")
    os.kill(trainer, signal.SIGSTOP)
    try:
        assert journal_step(c, job)[1] < 12, "the job ran ahead of the stop: nothing left to interrupt"
        time.sleep(5.0)
        engines = {e["engine_id"]: e for e in c.status()["engines"]}
        assert engines["w1/trainer"]["suspect"] and not engines["w0/rollout"]["suspect"]
        stopped_at = c.job(job)["step"]
        time.sleep(4.0)  # 9 s in all: three times the old window
        assert c.job(job)["state"] == "running"
    finally:
        os.kill(trainer, signal.SIGCONT)
    assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    assert faults.worker_pid(c.state_dir, "w1") == trainer  # the same process went on
    events = kinds(c, job)
    assert "worker suspect" in events and "worker back" in events
    assert not {"rolled back", "restarting", "recovered"} & set(events) and c.job(job)["restarts"] == 0
    assert "resumed from checkpoint" not in c.run("logs", job, check=True).stdout
    assert steps(c, job) == list(range(1, 25)) and stopped_at < 24  # not rolled back: every step once
    assert not any(e["suspect"] for e in c.status()["engines"])


def test_a_killed_trainer_is_still_lost_at_once(stall_cluster):
    c = stall_cluster
    job = c.run(
        "submit", TINY, "--name", "killed", "-q", "--set", "algo.steps=20", "--set", "checkpoint.every=4", check=True
    ).stdout.strip()
    at_step(c, job, 5)
    t0 = time.monotonic()
    faults.kill(faults.worker_pid(c.state_dir, "w1"))
    assert journal_step(c, job)[1] < 12, "the job ran ahead of the kill: nothing left to lose"
    while "rolled back" not in kinds(c, job):
        # at once: well inside the 60 s grace a silent worker gets (each look here is a CLI call)
        assert time.monotonic() - t0 < WORKER_GRACE_S / 3, "a dead worker waited for the grace"
        time.sleep(0.2)
    assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    assert steps(c, job) == list(range(1, 21))
    assert "worker w1 lost: process exited" in (c.state_dir / "daemon.log").read_text()
