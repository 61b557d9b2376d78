"""The daemon when things around it go wrong. A restarted daemon adopts the drivers and
workers that outlived its predecessor: an adopted job's calls wait until it is placed again,
and its trainer calls go to the trainer that holds its state (no other trainer has it), even
when another trainer is idle. A driver that gave up on its daemon is queued again; a job
whose driver cannot be started waits with the reason, and the daemon goes on.

The core's part on the daemon's core (``core`` fixture: real journal, no socket) driven with
the messages a driver and two workers send; the recovery of processes on a real daemon server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from conftest import SIMULATED_USERS

from daemon import procs
from daemon.core import StartDriver
from daemon.main import Daemon
from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]


def adopted_job(d, tiny_model: Path, name: str) -> str:
    """A job whose driver outlived the last daemon, adopted by this one (as recovery leaves it)."""
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", overrides=[f"model.path={tiny_model}"], name=name)
    job_id, _ = d.journal.submit(name, "alice", spec)
    d.journal.update(job_id, state="running")
    d.adopt(job_id)
    return job_id


def register(d, worker: str, model: Path, resident: dict[str, str]) -> None:
    engines = [
        P.EngineDecl(f"{worker}/rollout", "rollout", str(model), 4),
        P.EngineDecl(f"{worker}/trainer", "trainer", str(model)),
    ]
    d.send(worker.encode(), P.Op.REGISTER, P.RegisterReq(worker, "node", 1, engines, True, resident=resident))


def train_step(d, job_id: str, msg_id: int) -> None:
    step = C.TrainStepReq(P.TrainBatch([], [], [], []))
    d.send(f"drv:{job_id}".encode(), P.Op.CALL, P.CallReq(job_id, step), msg_id)


def tasks(d) -> list[tuple[str, str]]:
    out = [(body.job_id, body.engine_id) for _, op, body in d.sent if op == P.Op.TASK and body.method == "train_step"]
    d.sent.clear()
    return out


def test_an_adopted_jobs_calls_wait_for_it_and_go_to_the_trainer_holding_its_state(core, tiny_model):
    d = core
    a, b = adopted_job(d, tiny_model, "a"), adopted_job(d, tiny_model, "b")
    train_step(d, a, 7)  # sent again by a's driver before any worker is back
    d.place()
    assert tasks(d) == [] and a in d.jobs.held  # held, not placed by load on whatever comes first
    register(d, "w0", tiny_model, {})  # an empty trainer comes back first
    register(d, "w1", tiny_model, {a: "w1/trainer", b: "w1/trainer"})
    d.chores()
    d.place()
    assert tasks(d) == [(a, "w1/trainer")]
    train_step(d, b, 8)  # w1 is busy with a's step and w0 idle: b's state is on w1 only
    d.place()
    assert tasks(d) == []
    (task_id,) = [tid for tid, call in d.calls.items() if call.job_id == a]
    d.send(b"w1", P.Op.RESULT, P.ResultBody(task_id, True, C.TrainStepResult({"loss": 0.0}), seconds=0.1))
    d.place()
    assert tasks(d) == [(b, "w1/trainer")]


def test_a_driver_that_gave_up_on_its_daemon_is_requeued_not_left_interrupted(core, tiny_model):
    """A driver that lost its daemon for longer than the orphan grace stops with exit 75 (as a
    drained one does); the daemon that sees it exit is not draining, so the job is queued again
    and resumes from its checkpoint instead of waiting for an ``up`` that never comes."""
    d = core
    job = adopted_job(d, tiny_model, "gave-up")
    d.driver_exited(job, 75)
    assert job not in d.jobs.runtimes
    assert d.journal.job(job).state == "queued"
    assert d.journal.events(job)[-1][1] == "requeued"


def test_a_job_whose_driver_cannot_start_waits_with_the_reason_and_the_daemon_goes_on(core, tiny_model):
    d = core
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", overrides=[f"model.path={tiny_model}"], name="nodir")
    job, _ = d.journal.submit("nodir", "alice", spec)
    register(d, "w0", tiny_model, {})
    assert d.chores() == [StartDriver(job)]
    d.driver_not_started(job, "[Errno 28] No space left on device")  # as the server tells it
    assert d.journal.job(job).state == "queued" and job not in d.jobs.runtimes
    assert d.jobs.reasons[job] == "cannot start its driver: [Errno 28] No space left on device"
    now = time.time()
    assert d.chores(now) == []  # not at once: after a second, then 2, 4, 8
    assert d.chores(now + 1.1) == [StartDriver(job)]
    d.driver_started(job, 4242)
    assert d.journal.job(job).state == "running" and job not in d.jobs.reasons
    assert d.jobs.runtimes[job].pid == 4242 and d.journal.events(job)[-1][1:] == ("started", "driver pid 4242")


def test_a_driver_that_never_starts_fails_its_job_with_the_reason_after_a_bounded_backoff(core, tiny_model):
    from daemon.core import DRIVER_START_TRIES

    d = core
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", overrides=[f"model.path={tiny_model}"], name="never")
    job, _ = d.journal.submit("never", "alice", spec)
    register(d, "w0", tiny_model, {})
    now, starts = time.time(), 0
    for _ in range(200):  # as often as the server's loop would ask, over a minute
        now += 0.3
        if StartDriver(job) in d.chores(now):
            starts += 1
            d.driver_not_started(job, "the job's inputs cannot be staged", now)
    assert starts == DRIVER_START_TRIES
    info = d.journal.job(job)
    assert info.state == "failed" and "cannot be staged" in info.error and f"{starts} tries" in info.error


def test_a_driver_the_server_cannot_start_leaves_the_job_waiting(daemon, tiny_model):
    d = daemon
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", overrides=[f"model.path={tiny_model}"], name="nodir")
    job, _ = d.journal.submit("nodir", "alice", spec)
    d.core.handle(
        b"w0",
        auth.INTERNAL_USER,
        P.Op.REGISTER,
        P.Header(msg_id=1),
        P.RegisterReq(
            "w0",
            "node",
            1,
            [P.EngineDecl(f"w0/{k}", k, str(tiny_model), 4 if k == "rollout" else 1) for k in ("rollout", "trainer")],
            True,
        ),
        time.time(),
    )
    d.jobs_dir.joinpath(job).write_text("in the way")  # its directory cannot be made (as with a full disk)
    d._carry_out(d.core.chores(time.time()))
    assert d.journal.job(job).state == "queued" and job not in d.drivers
    assert d.core.jobs.reasons[job].startswith("cannot start its driver: ")
    d.jobs_dir.joinpath(job).unlink()
    d._carry_out(d.core.chores(time.time() + 1.1))  # the next pass, a second later, starts it
    try:
        assert d.journal.job(job).state == "running" and job not in d.core.jobs.reasons
    finally:
        d.drivers[job].kill()
        d.drivers[job].wait()


def running_job(d: Daemon, tiny_model: Path, name: str) -> str:
    """A job the journal of the server ``d`` has running (its driver is the test's to make)."""
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", overrides=[f"model.path={tiny_model}"], name=name)
    job_id, _ = d.journal.submit(name, "alice", spec)
    d.journal.update(job_id, state="running")
    return job_id


def test_recovery_keeps_a_cancel_asked_before_the_restart_and_judges_drivers_that_ended_meanwhile(
    daemon, tiny_model, tmp_path
):
    d = daemon
    done, cancelled = running_job(d, tiny_model, "done"), running_job(d, tiny_model, "asked")
    for job in (done, cancelled):
        d.jobs_dir.joinpath(job).mkdir(parents=True, exist_ok=True)
        d.journal.event(job, "started")
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # its driver ended while no daemon ran, and said how
    procs.record(d.jobs_dir / done / "driver.pid", finished, d._driver_argv(done, d.jobs_dir / done, "alice"))
    (d.jobs_dir / done / "driver.exit").write_text(json.dumps({"pid": finished.pid, "rc": 0}))  # as write_exit does
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    procs.record(
        d.jobs_dir / cancelled / "driver.pid", running, d._driver_argv(cancelled, d.jobs_dir / cancelled, "alice")
    )
    d.journal.event(cancelled, "cancel_requested")  # then the daemon died
    d.authenticator.stop()
    d.sock.close()
    d.core.close()
    again = Daemon(d.state_dir, [str(tiny_model)], [], trusted_users=SIMULATED_USERS)
    try:
        again.reap_drivers(time.time())
        assert again.journal.job(done).state == "succeeded"  # not run again from its checkpoint
        assert again.core.jobs.runtimes[cancelled].cancel_requested_at is not None
        call = P.CallReq(cancelled, C.TrainStepReq(P.TrainBatch([], [], [], [])))
        effects = again.core.handle(b"drv", auth.INTERNAL_USER, P.Op.CALL, P.Header(msg_id=3), call, time.time())
        (reply,) = [e.body for e in effects if e.op == P.Op.ERROR]
        assert reply.code == "cancelled"
    finally:
        running.kill()
        running.wait()
        again.authenticator.stop()
        again.sock.close()
        again.core.close()


def test_recovery_stops_a_driver_started_for_a_job_the_journal_still_has_queued(daemon, tiny_model):
    d = daemon
    job = running_job(d, tiny_model, "stray")
    d.journal.update(job, state="queued")  # the last daemon died between starting its driver and journaling it
    d.jobs_dir.joinpath(job).mkdir(parents=True)
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    procs.record(d.jobs_dir / job / "driver.pid", stray, d._driver_argv(job, d.jobs_dir / job, "alice"))
    d.authenticator.stop()
    d.sock.close()
    d.core.close()
    again = Daemon(d.state_dir, [str(tiny_model)], [], trusted_users=SIMULATED_USERS)
    try:
        assert stray.wait(10) == -9  # only one driver per job: the next one is started by this daemon
        assert again.journal.job(job).state == "queued"
    finally:
        stray.kill()
        again.authenticator.stop()
        again.sock.close()
        again.core.close()
