"""``JobLifecycle``: a job from admission to its end: admitted and its driver started (or
adopted after a daemon restart), cancelled, drained, and its driver's exit judged: succeeded,
failed, restarted from its checkpoint, requeued or interrupted.

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
from daemon.core.base import CoreBase, log
from daemon.core.records import (
    ADOPT_TIMEOUT_S,
    DRIVER_EXIT_DRAINED,
    DRIVER_START_TRIES,
    Effect,
    JobRuntime,
    StartDriver,
    StopDriver,
    _kept_adapter,
)
from plexctl.common import protocol as P
from plexctl.common.spec import EXTERNAL, JobSpec, spec_from_wire
from plexctl.common.state_size import full_state_bytes, job_state_bytes, model_config

LIMIT_EXITS = {  # a jailed driver ended by one of its limits (daemon.jail_boot): that job fails, no restart
    jail.CPU_LIMIT_EXIT: "its driver used up its CPU-time limit (plexctl share --limit cpu=SECONDS)",
    -signal.SIGXFSZ: "its driver wrote a file past its job-dir limit (killed by SIGXFSZ)",
}


class JobLifecycle(CoreBase):
    """Jobs' admission, start, cancel, drain and end."""

    def adopt(self, job_id: str, pid: int, now: float, alive: bool = True) -> list[Effect]:
        """A job the journal has running whose driver (``pid``) outlived the last daemon: it goes
        on where it was once engines for it are back. ``alive`` False: its driver ended while no
        daemon ran; its exit is judged by ``driver_exited``."""
        self.now = now
        info = self._known_job(job_id)
        spec = spec_from_wire(self.journal.spec(job_id))
        job_dir = self._job_dir(job_id)
        rt = self.runtimes[job_id] = JobRuntime(
            job_id, spec, job_dir, pid, policy_version=info.policy_version, user=info.user
        )
        adapter_dir = job_dir.adapter(info.policy_version)
        if info.policy_version and adapter_dir.is_dir():
            rt.adapter = P.AdapterRef(job_id, info.policy_version, str(adapter_dir), full=spec.lora is None)
        asked = [kind for _, kind, _ in self.journal.events(job_id) if kind in ("started", "cancel_requested")]
        if asked and asked[-1] == "cancel_requested":  # asked before the last daemon went: still asked
            rt.cancel_requested_at = now
        if alive:
            self.adopting[job_id] = now + ADOPT_TIMEOUT_S
            self.journal.event(
                job_id, "reattached", f"driver pid {pid} outlived the daemon" if pid else "its external client goes on"
            )
        return self._effects()

    def requeue(self, job_id: str, was: str) -> None:
        """A job that was running or interrupted when the last daemon stopped, with no driver
        left: queued again, it resumes from its last checkpoint."""
        info = self._known_job(job_id)
        self.journal.update(job_id, state="queued", restarts=info.restarts + 1)
        self.journal.event(job_id, "recovered", f"was {was}")

    def driver_started(self, job_id: str, pid: int, now: float) -> list[Effect]:
        self.now = now
        rt = self.runtimes[job_id]
        rt.pid = pid
        self.start_failures.pop(job_id, None)
        self._running(job_id, f"driver pid {pid}")
        return self._effects()

    def _running(self, job_id: str, how: str) -> None:
        info = self._known_job(job_id)
        self.journal.update(job_id, state="running", started_at=info.started_at or self.now)
        self.journal.event(job_id, "started", how)
        log.info("job %s started (%s)", job_id, how)

    def driver_not_started(self, job_id: str, why: str, now: float) -> list[Effect]:
        """The driver could not be started (no disk space, no more processes, inputs it cannot
        stage): the job waits, tried again after a wait that doubles; after ``DRIVER_START_TRIES``
        it fails with the reason."""
        self.now = now
        self.runtimes.pop(job_id, None)
        self.sched.release(job_id)
        why = f"cannot start its driver: {why}"
        tries = self.start_failures.get(job_id, (0, 0.0))[0] + 1
        if tries >= DRIVER_START_TRIES:
            self.start_failures.pop(job_id, None)
            self.reasons.pop(job_id, None)
            self.journal.update(job_id, state="failed", ended_at=now, error=f"{why} ({tries} tries)")
            self.journal.event(job_id, "failed", f"{why} ({tries} tries)")
            log.error("job %s failed: %s (%d tries)", job_id, why, tries)
            return self._effects()
        self.start_failures[job_id] = (tries, now + 2.0 ** (tries - 1))
        if self.reasons.get(job_id) != why:
            log.error("job %s %s", job_id, why)
        self.reasons[job_id] = why
        return self._effects()

    def limit_breached(self, job_id: str, why: str, now: float) -> list[Effect]:
        """A jailed job went past one of its limits (``daemon.jail.JobLimits``): it fails with that
        line, its driver killed; nothing else is touched."""
        self.now = now
        rt = self.runtimes.get(job_id)
        if rt is not None and not rt.failure:
            rt.failure = why
            self.journal.event(job_id, "limit", why)
            self._out.append(StopDriver(job_id, kill=True))
        return self._effects()

    def interrupt_running(self) -> list[Effect]:
        """The cluster goes down now: jobs still running resume from their last periodic
        checkpoint; every worker is told to exit."""
        for rt in list(self.runtimes.values()):
            info = self.journal.job(rt.job_id)
            if info and info.state == "running":
                self.journal.update(rt.job_id, state="interrupted")
                self.journal.event(
                    rt.job_id,
                    "interrupted",
                    "cluster went down before the job checkpointed; it resumes from its last periodic checkpoint",
                )
        for w in self.workers.values():  # remote workers (another node, another allocation) exit too
            self._send(w.identity, P.Op.SHUTDOWN, P.Empty())
        return self._effects()

    def _drain(self, reason: str, urgent: bool) -> None:
        if self.drain_deadline is not None:
            if urgent:
                log.warning("%s while draining: stopping now", reason)
                self.stopping = True
            return
        self.drain_reason = reason
        self.drain_deadline = self.now + self.drain_timeout
        log.info("draining (%s): %d running jobs checkpoint and stop", reason, len(self.runtimes))
        for rt in self.runtimes.values():
            self.journal.event(rt.job_id, "draining", reason)

    def _cancel(self, job_id: str, why: str = "") -> None:
        """Cancel a job: a queued one at once, a running one at its next call boundary."""
        info = self._known_job(job_id)
        if info.state == "queued" or info.state == "interrupted":
            self.journal.update(job_id, state="cancelled", ended_at=self.now)
            self.specs.pop(job_id, None)
            self.reasons.pop(job_id, None)
            self.journal.event(job_id, "cancelled", why or "before it started")
        elif info.state == "running":
            rt = self.runtimes.get(job_id)
            if rt is not None and rt.cancel_requested_at is None:
                rt.cancel_requested_at = self.now
                self.journal.event(job_id, "cancel_requested", why)

    def _admit_adopted(self, now: float) -> None:
        """Give adopted jobs their homes once engines for them are back (``_adopt``). Past
        ``ADOPT_TIMEOUT_S`` the job restarts."""
        for job_id, deadline in list(self.adopting.items()):
            rt = self.runtimes.get(job_id)
            if rt is not None and not self._adopt(job_id, now) and now > deadline:
                del self.adopting[job_id]
                self._roll_back(
                    rt, f"its engines did not come back within {ADOPT_TIMEOUT_S:.0f} s of the daemon's restart"
                )

    def _adopt(self, job_id: str, now: float) -> bool:
        """Place an adopted job again, on the trainer that holds its state when a worker says
        so (its trainer calls stay there), then submit the calls its driver sent meanwhile.
        False while no engines for it are back."""
        rt = self.runtimes.get(job_id)
        if rt is None:
            self.adopting.pop(job_id, None)
            self.held.pop(job_id, None)
            return True
        holder = self.resident.get(job_id)
        holder = holder if holder in self.sched.engines else None
        adm = self.sched.admit(
            job_id,
            os.path.realpath(rt.spec.model.path),
            now,
            state_bytes=self._state_bytes(rt.spec),
            priority=rt.spec.priority,
            user=rt.user,
            trainer=holder,
        )
        if not adm.ok:
            return False
        del self.adopting[job_id]
        self.resident.pop(job_id, None)
        if holder is not None:  # on some tier of it: the trainer's next inventory says which
            self.sched.state_location(job_id, holder, "host")
        for task in self.held.pop(job_id, []):
            self.sched.submit(task)
        log.info("job %s placed again on %s, %s", job_id, adm.rollout, adm.trainer)
        return True

    def _admit(self, now: float) -> None:
        running = sum(1 for rt in self.runtimes.values())
        ready_models = {(e.kind, e.model) for e in self.sched.engines.values()}
        runs = collections.Counter(rt.user for rt in self.runtimes.values())
        for info in self.journal.jobs(("queued",)):
            if running >= self.max_running:
                self.reasons[info.job_id] = (
                    f"waiting for room: {running} jobs run (the daemon's max_running: {self.max_running})"
                )
                continue
            if info.job_id in self.runtimes:  # its driver is being started
                continue
            waits = self.quotas.waits(info.user, runs[info.user]) if self.is_isolated(info.user) else ""
            if waits:
                self.reasons[info.job_id] = waits
                continue
            if self.start_failures.get(info.job_id, (0, 0.0))[1] > now:  # its driver failed to start: later
                continue
            spec = self._spec(info.job_id)
            model = os.path.realpath(spec.model.path)
            if ("rollout", model) not in ready_models or ("trainer", model) not in ready_models:
                continue
            adm = self.sched.admit(
                info.job_id, model, now, state_bytes=self._state_bytes(spec), priority=spec.priority, user=info.user
            )
            if not adm.ok:
                self.reasons[info.job_id] = adm.reason
                continue
            # its runtime now; ``driver_started`` (or ``driver_not_started``) once the server tried
            rt = self.runtimes[info.job_id] = JobRuntime(
                info.job_id,
                spec,
                self._job_dir(info.job_id),
                policy_version=info.policy_version,
                user=info.user,
            )
            rt.adapter = _kept_adapter(rt, info.policy_version)  # a resumed job samples its latest policy
            if spec.kind == EXTERNAL:  # no driver: it runs, driven by its client's calls
                self._running(info.job_id, "driven by its external client")
            else:
                self._out.append(StartDriver(info.job_id))
            self.reasons.pop(info.job_id, None)
            self.specs.pop(info.job_id, None)
            running += 1
            runs[info.user] += 1

    def _spec(self, job_id: str) -> JobSpec:
        spec = self.specs.get(job_id)
        if spec is None:
            spec = self.specs[job_id] = spec_from_wire(self.journal.spec(job_id))
        return spec

    @staticmethod
    def _state_bytes(spec: JobSpec) -> int:
        lora = spec.lora
        try:
            config = model_config(spec.model.path)
            if lora is None:  # full fine-tuning: float32 weights (the trainer's masters) and AdamW moments
                return full_state_bytes(config, "float32")
            return job_state_bytes(lora.rank, list(lora.target_modules), config)
        except (OSError, KeyError, ValueError):
            return 0  # unknown architecture: admit, the worker's store enforces its tiers

    def driver_exited(self, job_id: str, rc: int, now: float) -> list[Effect]:
        """A job's driver exited with code ``rc``: judge how the job ended (or why it runs again)."""
        self.now = now
        rt = self.runtimes.get(job_id)
        if rt is not None:
            self._judge_exit(rt, rc, now)
        return self._effects()

    def _judge_exit(self, rt: JobRuntime, rc: int, now: float) -> None:
        job_id = rt.job_id
        if rt.cancel_requested_at is not None:
            state, error = ("succeeded" if rt.ended_by_client else "cancelled"), ""
        elif rt.rolled_back and rc != 0:
            self.journal.update(job_id, state="queued")
            self.journal.event(job_id, "rolled back", f"{rt.rolled_back}; resumes from its last checkpoint")
            self._end_job(rt)
            return
        elif rc == 0:
            state, error = "succeeded", ""
        elif rc == DRIVER_EXIT_DRAINED and self.drain_deadline is None:  # it gave up on its daemon
            self.journal.update(job_id, state="queued")
            self.journal.event(
                job_id, "requeued", "the driver stopped, having lost its daemon; resumes from its last checkpoint"
            )
            log.warning("job %s: its driver lost the daemon; requeued", job_id)
            self._end_job(rt)
            return
        elif rc == DRIVER_EXIT_DRAINED or (self.drain_deadline is not None and not rt.failure):
            state, error = "interrupted", ""
            self.journal.update(job_id, state=state)
            self.journal.event(
                job_id,
                "interrupted",
                (
                    f"drained ({self.drain_reason}): checkpointed at a step boundary, resumes from there"
                    if rc == DRIVER_EXIT_DRAINED
                    else f"stopped with the cluster ({self.drain_reason}, driver exit {rc}): "
                    "resumes from its last checkpoint"
                ),
            )
            log.info("job %s drained", job_id)
            self._end_job(rt)
            return
        else:
            state = "failed"
            error = rt.failure or _last_line(rt.job_dir.driver_log) or f"driver exited with code {rc}"
            if not rt.failure and rc in LIMIT_EXITS and self.is_isolated(rt.user):  # a limit of its jail
                error = LIMIT_EXITS[rc]
            elif not rt.failure:  # the driver crashed (killed, out of memory) without reporting why
                how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                crashes = sum(1 for _, kind, _ in self.journal.events(job_id) if kind == "restarting")
                limit = rt.spec.checkpoint.max_restarts
                if crashes < limit:
                    self.journal.update(job_id, state="queued")
                    self.journal.event(
                        job_id,
                        "restarting",
                        f"driver crashed ({how}); restart {crashes + 1}/{limit} from the last checkpoint",
                    )
                    log.warning("job %s: driver crashed (%s); restarting from its checkpoint", job_id, how)
                    self._end_job(rt)
                    return
                error = f"driver crashed ({how}) {crashes + 1} times (checkpoint.max_restarts {limit}): {error}"
        self.journal.update(job_id, state=state, ended_at=now, error=error)
        self.journal.event(job_id, state, error)
        log.info("job %s %s%s", job_id, state, f": {error}" if error else "")
        self._end_job(rt)

    def _end_job(self, rt: JobRuntime) -> None:
        del self.runtimes[rt.job_id]
        self.adopting.pop(rt.job_id, None)
        self.held.pop(rt.job_id, None)
        for task in self.sched.release(rt.job_id):
            self.calls.pop(task.task_id, None)
        for tid in [t for t, c in self.calls.items() if c.job_id == rt.job_id]:
            del self.calls[tid]
        for engine_id in rt.engines:  # free the job's state on the engines that held it
            engine = self.sched.engines.get(engine_id)
            worker = self.workers.get(engine.worker_id) if engine else None
            if worker is not None:
                self._send(worker.identity, P.Op.RELEASE, P.ReleaseBody(rt.job_id, engine_id))


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""
