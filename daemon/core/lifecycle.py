"""``JobLifecycle``: a job from admission to its end: admitted and its driver started (or
adopted after a daemon restart), cancelled, drained, rolled back, and its driver's exit judged:
succeeded, failed, restarted from its checkpoint, requeued or interrupted.

Invariants: a running job has a runtime from ``StartDriver`` (or adoption) until its driver's
exit is judged, and ``_end_job`` then frees its tasks, calls and engine state; while draining,
nothing is admitted. Each change of a job's state goes to the journal with an event saying why.
"""

from __future__ import annotations

import collections
import os
import signal
from pathlib import Path

from daemon import jail
from daemon.core.job_kinds import driver_for
from daemon.core.records import (
    ADOPT_TIMEOUT_S,
    DRIVER_START_TRIES,
    JobRuntime,
    StopDriver,
    _kept_adapter,
)
from daemon.core.tables import CallTable, JobTable, Settings, Turn, WorkerTable, log
from daemon.procs import DRIVER_EXIT_DRAINED, DRIVER_EXIT_FAILED
from daemon.scheduler import Scheduler
from plexctl.common import protocol as P
from plexctl.common.spec import JobSpec
from plexctl.common.state_size import full_state_bytes, job_state_bytes, model_config

LIMIT_EXITS = {  # a jailed driver ended by one of its limits (daemon.jail_boot): that job fails, no restart
    jail.CPU_LIMIT_EXIT: "its driver used up its CPU-time limit (plexctl share --limit cpu=SECONDS)",
    -signal.SIGXFSZ: "its driver wrote a file past its job-dir limit (killed by SIGXFSZ)",
}


def state_bytes(spec: JobSpec) -> int:
    """The bytes of a job's trainer state (adapter or weights, optimizer), 0 if unknown."""
    lora = spec.lora
    try:
        config = model_config(spec.model.path)
        if lora is None:  # full fine-tuning: float32 weights (the trainer's masters) and AdamW moments
            return full_state_bytes(config, "float32")
        return job_state_bytes(lora.rank, list(lora.target_modules), config)
    except (OSError, KeyError, ValueError):
        return 0  # unknown architecture: admit, the worker's store enforces its tiers


class JobLifecycle:
    """Jobs' admission, start, cancel, drain, roll back and end."""

    def __init__(
        self,
        settings: Settings,
        turn: Turn,
        jobs: JobTable,
        workers: WorkerTable,
        calls: CallTable,
        sched: Scheduler,
    ) -> None:
        self.settings, self.turn, self.jobs = settings, turn, jobs
        self.workers, self.calls, self.sched = workers, calls, sched

    def adopt(self, job_id: str, pid: int, now: float, alive: bool = True) -> None:
        """A job the journal has running whose driver (``pid``) outlived the last daemon: it goes
        on where it was once engines for it are back. ``alive`` False: its driver ended while no
        daemon ran; its exit is judged by ``driver_exited``."""
        jobs = self.jobs
        info = jobs.known(job_id)
        spec = jobs.journal.spec(job_id)
        job_dir = jobs.job_dir(job_id)
        rt = jobs.runtimes[job_id] = JobRuntime(
            job_id, spec, job_dir, pid, policy_version=info.policy_version, user=info.user, driver=driver_for(spec)
        )
        adapter_dir = job_dir.adapter(info.policy_version)
        if info.policy_version and adapter_dir.is_dir():
            rt.adapter = P.AdapterRef(job_id, info.policy_version, str(adapter_dir), full=spec.lora is None)
        asked = [kind for _, kind, _ in jobs.journal.events(job_id) if kind in ("started", "cancel_requested")]
        if asked and asked[-1] == "cancel_requested":  # asked before the last daemon went: still asked
            rt.cancel_requested_at = now
        if alive:
            jobs.adopting[job_id] = now + ADOPT_TIMEOUT_S
            jobs.journal.event(
                job_id, "reattached", f"driver pid {pid} outlived the daemon" if pid else "its external client goes on"
            )

    def requeue(self, job_id: str, was: str) -> None:
        """A job that was running or interrupted when the last daemon stopped, with no driver
        left: queued again, it resumes from its last checkpoint."""
        info = self.jobs.known(job_id)
        self.jobs.journal.update(job_id, state="queued", restarts=info.restarts + 1)
        self.jobs.journal.event(job_id, "recovered", f"was {was}")

    def driver_started(self, job_id: str, pid: int) -> None:
        rt = self.jobs.runtimes[job_id]
        rt.pid = pid
        self.jobs.start_failures.pop(job_id, None)
        self._running(job_id, f"driver pid {pid}")

    def _running(self, job_id: str, how: str) -> None:
        info = self.jobs.known(job_id)
        self.jobs.journal.update(job_id, state="running", started_at=info.started_at or self.turn.now)
        self.jobs.journal.event(job_id, "started", how)
        log.info("job %s started (%s)", job_id, how)

    def driver_not_started(self, job_id: str, why: str, now: float) -> None:
        """The driver could not be started (no disk space, no more processes, inputs it cannot
        stage): the job waits, tried again after a wait that doubles; after ``DRIVER_START_TRIES``
        it fails with the reason."""
        jobs = self.jobs
        jobs.runtimes.pop(job_id, None)
        self.sched.release(job_id)
        why = f"cannot start its driver: {why}"
        tries = jobs.start_failures.get(job_id, (0, 0.0))[0] + 1
        if tries >= DRIVER_START_TRIES:
            jobs.start_failures.pop(job_id, None)
            jobs.reasons.pop(job_id, None)
            jobs.journal.update(job_id, state="failed", ended_at=now, error=f"{why} ({tries} tries)")
            jobs.journal.event(job_id, "failed", f"{why} ({tries} tries)")
            log.error("job %s failed: %s (%d tries)", job_id, why, tries)
            return
        jobs.start_failures[job_id] = (tries, now + 2.0 ** (tries - 1))
        if jobs.reasons.get(job_id) != why:
            log.error("job %s %s", job_id, why)
        jobs.reasons[job_id] = why

    def limit_breached(self, job_id: str, why: str) -> None:
        """A jailed job went past one of its limits (``daemon.jail.JobLimits``): it fails with that
        line, its driver killed; nothing else is touched."""
        rt = self.jobs.runtimes.get(job_id)
        if rt is not None and not rt.failure:
            rt.failure = why
            self.jobs.journal.event(job_id, "limit", why)
            self.turn.add(StopDriver(job_id, kill=True))

    def interrupt_running(self) -> None:
        """The cluster goes down now: jobs still running resume from their last periodic
        checkpoint; every worker is told to exit."""
        journal = self.jobs.journal
        for rt in list(self.jobs.runtimes.values()):
            info = journal.job(rt.job_id)
            if info and info.state == "running":
                journal.update(rt.job_id, state="interrupted")
                journal.event(
                    rt.job_id,
                    "interrupted",
                    "cluster went down before the job checkpointed; it resumes from its last periodic checkpoint",
                )
        for w in self.workers.values():  # remote workers (another node, another allocation) exit too
            self.turn.send(w.identity, P.Op.SHUTDOWN, P.Empty())

    def drain(self, reason: str, urgent: bool) -> None:
        """Stop admitting; running jobs checkpoint and exit; a second urgent request stops now."""
        jobs = self.jobs
        if jobs.draining:
            if urgent:
                log.warning("%s while draining: stopping now", reason)
                jobs.stopping = True
            return
        jobs.drain_reason = reason
        jobs.drain_deadline = self.turn.now + self.settings.drain_timeout
        log.info("draining (%s): %d running jobs checkpoint and stop", reason, len(jobs.runtimes))
        for rt in jobs.runtimes.values():
            jobs.journal.event(rt.job_id, "draining", reason)

    def cancel(self, job_id: str, why: str = "") -> None:
        """Cancel a job: a queued one at once, a running one at its next call boundary."""
        jobs = self.jobs
        info = jobs.known(job_id)
        if info.state == "queued" or info.state == "interrupted":
            jobs.journal.update(job_id, state="cancelled", ended_at=self.turn.now)
            jobs.reasons.pop(job_id, None)
            jobs.journal.event(job_id, "cancelled", why or "before it started")
        elif info.state == "running":
            rt = jobs.runtimes.get(job_id)
            if rt is not None and rt.cancel_requested_at is None:
                rt.cancel_requested_at = self.turn.now
                jobs.journal.event(job_id, "cancel_requested", why)

    def chores(self, now: float) -> None:
        """Stop drivers past their cancel grace, end external jobs between their calls, place
        adopted jobs, admit queued ones (or, while draining, decide when to stop)."""
        jobs = self.jobs
        for rt in list(jobs.runtimes.values()):
            rc = rt.driver.tend(rt, now, self.turn, self.calls, jobs.draining)
            if rc is not None:
                self._judge_exit(rt, rc, now)
        if jobs.adopting:
            self._admit_adopted(now)
        if jobs.drain_deadline is not None:
            if not jobs.runtimes or now > jobs.drain_deadline:
                jobs.stopping = True
        else:
            self._admit(now)

    def _admit_adopted(self, now: float) -> None:
        """Give adopted jobs their homes once engines for them are back (``place_adopted``). Past
        ``ADOPT_TIMEOUT_S`` the job restarts."""
        for job_id, deadline in list(self.jobs.adopting.items()):
            rt = self.jobs.runtimes.get(job_id)
            if rt is not None and not self.place_adopted(job_id, now) and now > deadline:
                del self.jobs.adopting[job_id]
                self.roll_back(
                    rt, f"its engines did not come back within {ADOPT_TIMEOUT_S:.0f} s of the daemon's restart"
                )

    def place_adopted(self, job_id: str, now: float) -> bool:
        """Place an adopted job again, on the trainer that holds its state when a worker says
        so (its trainer calls stay there), then submit the calls its driver sent meanwhile.
        False while no engines for it are back."""
        jobs = self.jobs
        rt = jobs.runtimes.get(job_id)
        if rt is None:
            jobs.adopting.pop(job_id, None)
            jobs.held.pop(job_id, None)
            return True
        holder = jobs.resident.get(job_id)
        holder = holder if holder in self.sched.engines else None
        adm = self.sched.admit(
            job_id,
            os.path.realpath(rt.spec.model.path),
            now,
            state_bytes=state_bytes(rt.spec),
            priority=rt.spec.priority,
            user=rt.user,
            trainer=holder,
        )
        if not adm.ok:
            return False
        del jobs.adopting[job_id]
        jobs.resident.pop(job_id, None)
        if holder is not None:  # on some tier of it: the trainer's next inventory says which
            self.sched.state_location(job_id, holder, "host")
        for task in jobs.held.pop(job_id, []):
            self.sched.submit(task)
        log.info("job %s placed again on %s, %s", job_id, adm.rollout, adm.trainer)
        return True

    def _admit(self, now: float) -> None:
        jobs, max_running = self.jobs, self.settings.max_running
        running = len(jobs.runtimes)
        ready_models = {(e.kind, e.model) for e in self.sched.engines.values()}
        runs = collections.Counter(rt.user for rt in jobs.runtimes.values())
        no_room: dict[
            str, float
        ] = {}  # the jobs that find no engine room now, since when (an elastic allocation's cue)
        for info in jobs.journal.jobs(("queued",)):
            if running >= max_running:
                jobs.reasons[info.job_id] = (
                    f"waiting for room: {running} jobs run (the daemon's max_running: {max_running})"
                )
                continue
            if info.job_id in jobs.runtimes:  # its driver is being started
                continue
            waits = jobs.quotas.waits(info.user, runs[info.user]) if self.settings.is_isolated(info.user) else ""
            if waits:
                jobs.reasons[info.job_id] = waits
                continue
            if jobs.start_failures.get(info.job_id, (0, 0.0))[1] > now:  # its driver failed to start: later
                continue
            spec = jobs.journal.spec(info.job_id)
            model = os.path.realpath(spec.model.path)
            if ("rollout", model) not in ready_models or ("trainer", model) not in ready_models:
                no_room[info.job_id] = jobs.room_waits.get(info.job_id, now)
                continue
            adm = self.sched.admit(
                info.job_id, model, now, state_bytes=state_bytes(spec), priority=spec.priority, user=info.user
            )
            if not adm.ok:
                jobs.reasons[info.job_id] = adm.reason
                no_room[info.job_id] = jobs.room_waits.get(info.job_id, now)
                continue
            # its runtime now; ``driver_started`` (or ``driver_not_started``) once the server tried
            rt = jobs.runtimes[info.job_id] = JobRuntime(
                info.job_id,
                spec,
                jobs.job_dir(info.job_id),
                policy_version=info.policy_version,
                user=info.user,
                driver=driver_for(spec),
            )
            rt.adapter = _kept_adapter(rt, info.policy_version)  # a resumed job samples its latest policy
            rt.driver.start(info.job_id, self.turn, self._running)
            jobs.reasons.pop(info.job_id, None)
            running += 1
            runs[info.user] += 1
        jobs.room_waits = no_room

    def driver_exited(self, job_id: str, rc: int, now: float) -> None:
        """A job's driver exited with code ``rc``: judge how the job ended (or why it runs again)."""
        rt = self.jobs.runtimes.get(job_id)
        if rt is not None:
            self._judge_exit(rt, rc, now)

    def _judge_exit(self, rt: JobRuntime, rc: int, now: float) -> None:
        job_id, journal, jobs = rt.job_id, self.jobs.journal, self.jobs
        if rt.cancel_requested_at is not None:
            state, error = ("succeeded" if rt.ended_by_client else "cancelled"), ""
        elif rt.rolled_back and rc != 0:
            self._requeue_rolled_back(rt)
            return
        elif rc == 0:
            state, error = "succeeded", ""
        elif rc == DRIVER_EXIT_DRAINED and not jobs.draining:  # it gave up on its daemon
            journal.update(job_id, state="queued")
            journal.event(
                job_id, "requeued", "the driver stopped, having lost its daemon; resumes from its last checkpoint"
            )
            log.warning("job %s: its driver lost the daemon; requeued", job_id)
            self._end_job(rt)
            return
        elif rc == DRIVER_EXIT_DRAINED or (jobs.draining and not rt.failure):
            state, error = "interrupted", ""
            journal.update(job_id, state=state)
            journal.event(
                job_id,
                "interrupted",
                (
                    f"drained ({jobs.drain_reason}): checkpointed at a step boundary, resumes from there"
                    if rc == DRIVER_EXIT_DRAINED
                    else f"stopped with the cluster ({jobs.drain_reason}, driver exit {rc}): "
                    "resumes from its last checkpoint"
                ),
            )
            log.info("job %s drained", job_id)
            self._end_job(rt)
            return
        elif rc == DRIVER_EXIT_FAILED:  # the job's own failure: its report may come after its exit, its log has it
            state, error = "failed", rt.failure or _reported_failure(rt.job_dir.driver_log)
        else:
            state = "failed"
            error = rt.failure or _last_line(rt.job_dir.driver_log) or f"driver exited with code {rc}"
            if not rt.failure and rc in LIMIT_EXITS and self.settings.is_isolated(rt.user):  # a limit of its jail
                error = LIMIT_EXITS[rc]
            elif not rt.failure:  # the driver crashed (killed, out of memory) without reporting why
                how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                crashes = sum(1 for _, kind, _ in journal.events(job_id) if kind == "restarting")
                limit = rt.spec.checkpoint.max_restarts
                if crashes < limit:
                    journal.update(job_id, state="queued")
                    journal.event(
                        job_id,
                        "restarting",
                        f"driver crashed ({how}); restart {crashes + 1}/{limit} from the last checkpoint",
                    )
                    log.warning("job %s: driver crashed (%s); restarting from its checkpoint", job_id, how)
                    self._end_job(rt)
                    return
                error = f"driver crashed ({how}) {crashes + 1} times (checkpoint.max_restarts {limit}): {error}"
        journal.update(job_id, state=state, ended_at=now, error=error)
        journal.event(job_id, state, error)
        log.info("job %s %s%s", job_id, state, f": {error}" if error else "")
        self._end_job(rt)

    def _end_job(self, rt: JobRuntime) -> None:
        jobs = self.jobs
        del jobs.runtimes[rt.job_id]
        jobs.adopting.pop(rt.job_id, None)
        jobs.held.pop(rt.job_id, None)
        self.calls.drop_job(rt.job_id, self.sched.release(rt.job_id))
        for engine_id in rt.engines:  # free the job's state on the engines that held it
            engine = self.sched.engines.get(engine_id)
            worker = self.workers.get(engine.worker_id) if engine else None
            if worker is not None:
                self.turn.send(worker.identity, P.Op.RELEASE, P.ReleaseBody(rt.job_id, engine_id))

    def roll_back(self, rt: JobRuntime, why: str) -> None:
        """The job's trainer state is gone: it resumes from its last checkpoint. A driver is
        stopped (its exit requeues the job); a job with no process is requeued now, and its
        client's calls in flight are answered ``rolled_back``, so its client learns of the loss
        (and a restart count that grew) rather than waiting on calls no one will answer."""
        rt.rolled_back = why
        self.jobs.held.pop(rt.job_id, None)
        held = [(identity, header.msg_id) for waiting in rt.held_calls.values() for identity, header, _ in waiting]
        rt.held_calls.clear()
        rt.sent_ahead.clear()
        dropped = self.calls.drop_job(rt.job_id, self.sched.release(rt.job_id))
        log.warning("job %s rolls back to its last checkpoint: %s", rt.job_id, why)
        if rt.pid:
            self.turn.add(StopDriver(rt.job_id))
        elif not rt.driver.has_process:
            told = f"{why}: the job's trainer state is lost; it resumes from its last checkpoint"
            for identity, msg_id in [(c.identity, c.msg_id) for c in dropped] + held:
                self.turn.error(identity, msg_id, P.ROLLED_BACK, told)
            self._requeue_rolled_back(rt)

    def _requeue_rolled_back(self, rt: JobRuntime) -> None:
        """A rolled-back job is queued again, one restart more: it resumes from its last checkpoint."""
        info = self.jobs.known(rt.job_id)
        self.jobs.journal.update(rt.job_id, state="queued", restarts=info.restarts + 1)
        self.jobs.journal.event(rt.job_id, "rolled back", f"{rt.rolled_back}; resumes from its last checkpoint")
        self._end_job(rt)


def _reported_failure(path: Path) -> str:
    """The reason a failed driver logged last (``HH:MM:SS failed: REASON``)."""
    line = _last_line(path)
    _, sep, reason = line.partition(" failed: ")
    return reason if sep else line or "the job's driver failed"


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""
