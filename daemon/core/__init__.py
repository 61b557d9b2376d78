"""The daemon's core: jobs, workers and service calls, with no socket, no process and no clock.

``DaemonCore`` takes one event at a time, at a time ``now`` the caller gives: a decoded message
from a peer (``handle``), a driver that started, could not start or exited, a local worker's
process that exited, a drain, the periodic chores (``heartbeat``, ``chores``, ``place``). Each
returns the *effects* the server (``daemon.main``) carries out: messages to send (``Send``),
drivers to start or stop (``StartDriver``, ``StopDriver``), directories to prune (``Prune``).

``DaemonCore`` composes parts that own the state (``tables``: ``Settings``, ``Turn``, ``JobTable``,
``WorkerTable``, ``CallTable``; and the scheduler and telemetry) and four concerns, each handed
the parts it uses: the jobs' lifecycle (``lifecycle``), the workers' liveness (``liveness``), the
service calls (``routing``) and the clients' requests (``clients``). A concern reaches another
only through its methods (clients, liveness and routing ask lifecycle; routing asks liveness).
A running job's kind is a strategy its runtime holds (``job_kinds``: a driver process, or an
external client), asked instead of compared. The effects and the records the parts keep are in
``records``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

from daemon import metrics as M
from daemon.core.clients import ClientOps
from daemon.core.lifecycle import JobLifecycle
from daemon.core.liveness import WorkerLiveness
from daemon.core.records import (
    ADOPT_TIMEOUT_S,
    CANCEL_GRACE_S,
    DRAIN_TIMEOUT_S,
    DRIVER_START_TRIES,
    HEARTBEAT_S,
    MAX_RUNNING,
    PASS_WINDOW_S,
    VERSION,
    WORKER_GRACE_S,
    Effect,
    JobRuntime,
    PendingCall,
    Prune,
    Send,
    StartDriver,
    StopDriver,
    WorkerState,
)
from daemon.core.routing import CallRouting
from daemon.core.tables import CallTable, JobTable, Settings, Turn, WorkerTable, log
from daemon.procs import DRIVER_EXIT_DRAINED
from daemon.scheduler import Scheduler
from plexctl.common import protocol as P
from plexctl.common.cluster_config import DEFAULTS

__all__ = [
    "ADOPT_TIMEOUT_S",
    "CANCEL_GRACE_S",
    "DRIVER_EXIT_DRAINED",
    "DRIVER_START_TRIES",
    "DaemonCore",
    "Effect",
    "HEARTBEAT_S",
    "JobRuntime",
    "MAX_RUNNING",
    "PASS_WINDOW_S",
    "PendingCall",
    "Prune",
    "Send",
    "StartDriver",
    "StopDriver",
    "VERSION",
    "WORKER_GRACE_S",
    "WorkerState",
]


Handler = Callable[["DaemonCore", bytes, P.Header, Any], None]


class DaemonCore:
    """A cluster's jobs, workers and calls; see the module docstring. Every event method takes
    the time ``now`` and returns the effects for the server to carry out."""

    def __init__(
        self,
        state_dir: Path,
        models: Iterable[str],
        owner: str,
        max_running: int = MAX_RUNNING,
        policy: str = DEFAULTS.policy,
        jobs_per_engine: int | None = None,
        pass_window: float | None = None,  # None: each train step in a pass of its own (plexd: PASS_WINDOW_S)
        drain_timeout: float = DRAIN_TIMEOUT_S,
        trusted_users: Iterable[str] = (),
        worker_grace: float = WORKER_GRACE_S,
        now: float | None = None,
    ) -> None:
        now = time.time() if now is None else now
        self.settings = Settings(
            owner, max_running, policy, drain_timeout, set(trusted_users), worker_grace, started_at=now
        )
        self.turn = Turn(now)
        self.jobs = JobTable(state_dir)
        self.workers = WorkerTable(models)
        self.calls = CallTable(started_at=now)
        self.sched = Scheduler(policy=policy, jobs_per_engine=jobs_per_engine, pass_window=pass_window)
        self.telemetry = M.Telemetry()  # call latencies, swap marks; served on /metrics by the server
        parts = (self.settings, self.turn, self.jobs, self.workers)
        self.lifecycle = JobLifecycle(*parts, self.calls, self.sched)
        self.liveness = WorkerLiveness(*parts, self.sched, self.telemetry, self.lifecycle)
        self.routing = CallRouting(*parts, self.calls, self.sched, self.telemetry, self.liveness, self.lifecycle)
        self.clients = ClientOps(*parts, self.sched, self.telemetry, self.lifecycle)
        self.state_dir = state_dir
        self.journal, self.jobs_dir, self.blobs = self.jobs.journal, self.jobs.jobs_dir, self.jobs.blobs
        self.handler_failures = 0  # messages whose handler raised (each answered ``internal``)

    @property
    def stopping(self) -> bool:
        """The server stops its loop and shuts down (a drain ended, or was asked twice)."""
        return self.jobs.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self.jobs.stopping = value

    def close(self) -> None:
        self.jobs.close()
        self.telemetry.close()

    def handle(self, identity: bytes, user: str, op: bytes, header: P.Header, body: Any, now: float) -> list[Effect]:
        """A decoded message from ``identity``, sent by the authenticated ``user``. A handler that
        raises costs that message an ``internal`` error (one line; the traceback goes to the log)
        and counts in ``handler_failures``; the core goes on."""
        turn = self.turn
        turn.now = now
        handler = self.HANDLERS.get(op)
        if handler is None:
            turn.error(identity, header.msg_id, "bad_request", f"opcode {op!r} is not a request")
            return turn.effects()
        refusal = self.refusal(op, user)
        if refusal:
            turn.error(identity, header.msg_id, "forbidden", refusal)
            return turn.effects()
        turn.sender = user
        try:
            handler(self, identity, header, body)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the daemon
            log.exception("error handling %r from %r (%s)", op, identity, user or "no user")
            self.handler_failures += 1
            turn.error(identity, header.msg_id, "internal", P.one_line(f"{type(exc).__name__}: {exc}"))
        return turn.effects()

    def refusal(self, op: bytes, user: str) -> str:
        """Why ``user`` may not send ``op`` ("" if they may): asked before the body is decoded."""
        return self.clients.refusal(op, user)

    def is_isolated(self, user: str) -> bool:
        return self.settings.is_isolated(user)

    def snapshot_gauges(self, now: float) -> None:
        self.clients.snapshot_gauges(now)

    def heartbeat(self, now: float) -> list[Effect]:
        """Heartbeat the workers and judge the silent ones."""
        self.turn.now = now
        self.liveness.heartbeat(now)
        return self.turn.effects()

    def chores(self, now: float) -> list[Effect]:
        """Stop drivers past their cancel grace, place adopted jobs, admit queued ones (or, while
        draining, decide when to stop)."""
        self.turn.now = now
        self.lifecycle.chores(now)
        return self.turn.effects()

    def place(self, now: float) -> list[Effect]:
        """Send the tasks the scheduler places now."""
        self.turn.now = now
        self.routing.place(now)
        return self.turn.effects()

    def drain(self, reason: str, now: float, urgent: bool = True) -> list[Effect]:
        """Stop admitting; running jobs checkpoint at their step's end and exit; then stop.

        A second urgent request (SIGTERM, SIGINT) while draining stops at once; repeated
        allocation signals (SIGUSR1/2 reach every process of a Slurm step) do not."""
        self.turn.now = now
        self.lifecycle.drain(reason, urgent)
        return self.turn.effects()

    def adopt(self, job_id: str, pid: int, now: float, alive: bool = True) -> list[Effect]:
        """A job whose driver (``pid``) outlived the last daemon (``JobLifecycle.adopt``)."""
        self.turn.now = now
        self.lifecycle.adopt(job_id, pid, now, alive)
        return self.turn.effects()

    def requeue(self, job_id: str, was: str) -> None:
        """A job with no driver left from the last daemon: queued again (``JobLifecycle.requeue``)."""
        self.lifecycle.requeue(job_id, was)

    def driver_started(self, job_id: str, pid: int, now: float) -> list[Effect]:
        self.turn.now = now
        self.lifecycle.driver_started(job_id, pid)
        return self.turn.effects()

    def driver_not_started(self, job_id: str, why: str, now: float) -> list[Effect]:
        """The driver could not be started (``JobLifecycle.driver_not_started``)."""
        self.turn.now = now
        self.lifecycle.driver_not_started(job_id, why, now)
        return self.turn.effects()

    def driver_exited(self, job_id: str, rc: int, now: float) -> list[Effect]:
        """A job's driver exited with code ``rc``: judge how the job ended (or why it runs again)."""
        self.turn.now = now
        self.lifecycle.driver_exited(job_id, rc, now)
        return self.turn.effects()

    def limit_breached(self, job_id: str, why: str, now: float) -> list[Effect]:
        """A jailed job went past one of its limits: it fails with that line, its driver killed."""
        self.turn.now = now
        self.lifecycle.limit_breached(job_id, why)
        return self.turn.effects()

    def interrupt_running(self) -> list[Effect]:
        """The cluster goes down now: running jobs resume from their last periodic checkpoint;
        every worker is told to exit."""
        self.lifecycle.interrupt_running()
        return self.turn.effects()

    def worker_process_exited(self, worker_id: str, code: int, now: float) -> list[Effect]:
        """The process of a worker the server started exited."""
        self.turn.now = now
        self.liveness.worker_process_exited(worker_id, code)
        return self.turn.effects()

    HANDLERS: ClassVar[dict[bytes, Handler]] = {
        P.Op.PING: lambda core, i, h, b: core.clients.on_ping(i, h, b),
        P.Op.SUBMIT: lambda core, i, h, b: core.clients.on_submit(i, h, b),
        P.Op.STATUS: lambda core, i, h, b: core.clients.on_status(i, h, b),
        P.Op.CANCEL: lambda core, i, h, b: core.clients.on_cancel(i, h, b),
        P.Op.PUBLISH: lambda core, i, h, b: core.clients.on_publish(i, h, b),
        P.Op.LOGS: lambda core, i, h, b: core.clients.on_logs(i, h, b),
        P.Op.EXPORT: lambda core, i, h, b: core.clients.on_export(i, h, b),
        P.Op.BLOB: lambda core, i, h, b: core.clients.on_blob(i, h, b),
        P.Op.DOWN: lambda core, i, h, b: core.clients.on_down(i, h, b),
        P.Op.REGISTER: lambda core, i, h, b: core.liveness.on_register(i, h, b),
        P.Op.HEARTBEAT: lambda core, i, h, b: core.liveness.on_heartbeat(i, h, b),
        P.Op.LEAVE: lambda core, i, h, b: core.liveness.on_leave(i, h, b),
        P.Op.WORKER_EXITED: lambda core, i, h, b: core.liveness.on_worker_exited(i, h, b),
        P.Op.RESULT: lambda core, i, h, b: core.routing.on_result(i, h, b),
        P.Op.PARTIAL: lambda core, i, h, b: core.routing.on_partial(i, h, b),
        P.Op.INVENTORY: lambda core, i, h, b: core.liveness.on_inventory(i, h, b),
        P.Op.CALL: lambda core, i, h, b: core.routing.on_call(i, h, b),
        P.Op.REPORT: lambda core, i, h, b: core.routing.on_report(i, h, b),
    }
