"""The daemon when things around it go wrong. A restarted daemon adopts the drivers and
workers that outlived its predecessor: an adopted job's calls wait until it is placed again,
and its trainer calls go to the trainer that holds its state (no other trainer has it), even
when another trainer is idle. A driver that gave up on its daemon is queued again; a job
whose driver cannot be started waits with the reason, and the daemon goes on.

A real daemon object on a real socket and journal, driven through its message handlers with
the frames a driver and two workers send; what it sends back is recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from conftest import SIMULATED_USERS

from daemon import procs
from daemon.main import Daemon, JobRuntime
from plexctl import protocol as P
from plexctl.spec import load_spec, spec_to_wire

REPO = Path(__file__).resolve().parents[1]


def adopted_job(d: Daemon, tiny_model: Path, name: str) -> str:
    """A job whose driver outlived the last daemon (as ``_recover_jobs`` leaves it)."""
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", overrides=[f"model.path={tiny_model}"], name=name)
    job_id, _ = d.journal.submit(name, name, "alice", spec_to_wire(spec), spec.algo.steps, spec.priority)
    d.journal.update(job_id, state="running")
    d.runtimes[job_id] = JobRuntime(job_id, spec, d.jobs_dir / job_id, None, user="alice")
    d.adopting[job_id] = time.time() + 60
    return job_id


def register(d: Daemon, worker: str, model: Path, resident: dict[str, str]) -> None:
    engines = [
        P.EngineDecl(f"{worker}/rollout", "rollout", str(model), 4),
        P.EngineDecl(f"{worker}/trainer", "trainer", str(model)),
    ]
    d.on_register(
        worker.encode(), P.Header(msg_id=1), P.RegisterReq(worker, "node", 1, engines, True, resident=resident)
    )


def train_step(d: Daemon, job_id: str, msg_id: int) -> None:
    d.on_call(
        f"drv:{job_id}".encode(), P.Header(msg_id=msg_id), P.CallReq(job_id, "train_step", {"batch": {}, "hp": {}})
    )


def tasks(d: Daemon) -> list[tuple[str, str]]:
    out = [(body.job_id, body.engine_id) for _, op, body in d.sent if op == P.Op.TASK and body.method == "train_step"]
    d.sent.clear()
    return out


def test_an_adopted_jobs_calls_wait_for_it_and_go_to_the_trainer_holding_its_state(daemon, tiny_model):
    d = daemon
    a, b = adopted_job(d, tiny_model, "a"), adopted_job(d, tiny_model, "b")
    train_step(d, a, 7)  # sent again by a's driver before any worker is back
    d._place(time.time())
    assert tasks(d) == [] and a in d.held  # held, not placed by load on whatever comes first
    register(d, "w0", tiny_model, {})  # an empty trainer comes back first
    register(d, "w1", tiny_model, {a: "w1/trainer", b: "w1/trainer"})
    d._admit_adopted(time.time())
    d._place(time.time())
    assert tasks(d) == [(a, "w1/trainer")]
    train_step(d, b, 8)  # w1 is busy with a's step and w0 idle: b's state is on w1 only
    d._place(time.time())
    assert tasks(d) == []
    (task_id,) = [tid for tid, call in d.calls.items() if call.job_id == a]
    d.on_result(b"w1", P.Header(msg_id=2), P.ResultBody(task_id, True, {"loss": 0.0}, seconds=0.1))
    d._place(time.time())
    assert tasks(d) == [(b, "w1/trainer")]


def test_a_driver_that_gave_up_on_its_daemon_is_requeued_not_left_interrupted(daemon, tiny_model):
    """A driver that lost its daemon for longer than the orphan grace stops with exit 75 (as a
    drained one does); the daemon that sees it exit is not draining, so the job is queued again
    and resumes from its checkpoint instead of waiting for an ``up`` that never comes."""
    d = daemon
    job = adopted_job(d, tiny_model, "gave-up")
    d.runtimes[job].proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(75)"])
    d.runtimes[job].proc.wait(30)
    d._reap_drivers(time.time())
    assert job not in d.runtimes
    assert d.journal.job(job).state == "queued"
    assert d.journal.events(job)[-1][1] == "requeued"


def test_a_job_whose_driver_cannot_start_waits_with_the_reason_and_the_daemon_goes_on(daemon, tiny_model):
    d = daemon
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", overrides=[f"model.path={tiny_model}"], name="nodir")
    job, _ = d.journal.submit("nodir", "nodir", "alice", spec_to_wire(spec), spec.algo.steps, spec.priority)
    register(d, "w0", tiny_model, {})
    d.jobs_dir.joinpath(job).write_text("in the way")  # its directory cannot be made (as with a full disk)
    d._admit(time.time())
    assert d.journal.job(job).state == "queued" and job not in d.runtimes
    assert d.reasons[job].startswith("cannot start its driver: ")
    d.jobs_dir.joinpath(job).unlink()
    d._admit(time.time())  # the next pass starts it
    try:
        assert d.journal.job(job).state == "running" and job not in d.reasons
    finally:
        d.runtimes[job].proc.kill()
        d.runtimes[job].proc.wait()


def test_recovery_keeps_a_cancel_asked_before_the_restart_and_judges_drivers_that_ended_meanwhile(
    daemon, tiny_model, tmp_path
):
    d = daemon
    done, cancelled = adopted_job(d, tiny_model, "done"), adopted_job(d, tiny_model, "asked")
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
    d.journal.close()
    again = Daemon(d.state_dir, [str(tiny_model)], [], trusted_users=SIMULATED_USERS)
    again.sent = []
    again._send = lambda identity, op, body, in_reply_to=0: again.sent.append((identity, op, body))
    try:
        again._reap_drivers(time.time())
        assert again.journal.job(done).state == "succeeded"  # not run again from its checkpoint
        assert again.runtimes[cancelled].cancel_requested_at is not None
        again.on_call(b"drv", P.Header(msg_id=3), P.CallReq(cancelled, "train_step", {"batch": {}, "hp": {}}))
        (reply,) = [body for _, op, body in again.sent if op == P.Op.ERROR]
        assert reply.code == "cancelled"
    finally:
        running.kill()
        running.wait()
        again.authenticator.stop()
        again.sock.close()
        again.journal.close()


def test_recovery_stops_a_driver_started_for_a_job_the_journal_still_has_queued(daemon, tiny_model):
    d = daemon
    job = adopted_job(d, tiny_model, "stray")
    d.journal.update(job, state="queued")  # the last daemon died between starting its driver and journaling it
    del d.runtimes[job], d.adopting[job]
    d.jobs_dir.joinpath(job).mkdir(parents=True)
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    procs.record(d.jobs_dir / job / "driver.pid", stray, d._driver_argv(job, d.jobs_dir / job, "alice"))
    d.authenticator.stop()
    d.sock.close()
    d.journal.close()
    again = Daemon(d.state_dir, [str(tiny_model)], [], trusted_users=SIMULATED_USERS)
    try:
        assert stray.wait(10) == -9  # only one driver per job: the next one is started by this daemon
        assert again.journal.job(job).state == "queued"
    finally:
        stray.kill()
        again.authenticator.stop()
        again.sock.close()
        again.journal.close()
