"""The daemon's core: jobs, workers and service calls, with no socket, no process and no clock.

``DaemonCore`` takes one event at a time, at a time ``now`` the caller gives: a decoded message
from a peer (``handle``), a driver that started, could not start or exited, a local worker's
process that exited, a drain, the periodic chores (``heartbeat``, ``chores``, ``place``). Each
returns the *effects* the server (``daemon.main``) carries out: messages to send (``Send``),
drivers to start or stop (``StartDriver``, ``StopDriver``), directories to prune (``Prune``).

``DaemonCore`` is four concerns on one shared state (``base.CoreBase``): the clients' requests
(``clients``), the workers' liveness (``liveness``), the service calls (``routing``) and the
jobs' lifecycle (``lifecycle``); the effects and the records they keep are in ``records``.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from daemon.core.base import log
from daemon.core.clients import ClientOps
from daemon.core.lifecycle import JobLifecycle
from daemon.core.liveness import WorkerLiveness
from daemon.core.records import (
    ADOPT_TIMEOUT_S,
    CANCEL_GRACE_S,
    DRIVER_EXIT_DRAINED,
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
from plexctl.common import protocol as P
from plexctl.common.spec import EXTERNAL

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


class DaemonCore(ClientOps, WorkerLiveness, CallRouting, JobLifecycle):
    """A cluster's jobs, workers and calls; see the module docstring. Every public method takes
    the time ``now`` and returns the effects for the server to carry out."""

    def close(self) -> None:
        self.journal.close()
        self.telemetry.close()

    def handle(self, identity: bytes, user: str, op: bytes, header: P.Header, body: Any, now: float) -> list[Effect]:
        """A decoded message from ``identity``, sent by the authenticated ``user``. A handler that
        raises costs that message an ``internal`` error (one line; the traceback goes to the log)
        and counts in ``handler_failures``; the core goes on."""
        self.now = now
        handler = self.HANDLERS.get(op)
        if handler is None:
            self._error(identity, header.msg_id, "bad_request", f"opcode {op!r} is not a request")
            return self._effects()
        refusal = self.refusal(op, user)
        if refusal:
            self._error(identity, header.msg_id, "forbidden", refusal)
            return self._effects()
        self.sender = user
        try:
            handler(self, identity, header, body)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the daemon
            log.exception("error handling %r from %r (%s)", op, identity, user or "no user")
            self.handler_failures += 1
            self._error(identity, header.msg_id, "internal", P.one_line(f"{type(exc).__name__}: {exc}"))
        return self._effects()

    def heartbeat(self, now: float) -> list[Effect]:
        """Heartbeat the workers and judge the silent ones."""
        self.now = now
        self._heartbeat_workers(now)
        return self._effects()

    def chores(self, now: float) -> list[Effect]:
        """Stop drivers past their cancel grace, place adopted jobs, admit queued ones (or, while
        draining, decide when to stop)."""
        self.now = now
        for rt in list(self.runtimes.values()):
            if rt.spec.kind != EXTERNAL:
                if rt.cancel_requested_at is not None and now - rt.cancel_requested_at > CANCEL_GRACE_S:
                    self._out.append(StopDriver(rt.job_id, kill=True))
                continue
            if rt.cancel_requested_at is None and self.drain_deadline is None:
                continue
            busy = any(c.job_id == rt.job_id for c in self.calls.values())  # no driver: it ends between calls
            if rt.cancel_requested_at is not None and (not busy or now - rt.cancel_requested_at > CANCEL_GRACE_S):
                self._judge_exit(rt, 0, now)
            elif self.drain_deadline is not None and not busy:
                self._judge_exit(rt, DRIVER_EXIT_DRAINED, now)
        if self.adopting:
            self._admit_adopted(now)
        if self.drain_deadline is not None:
            if not self.runtimes or now > self.drain_deadline:
                self.stopping = True
        else:
            self._admit(now)
        return self._effects()

    def place(self, now: float) -> list[Effect]:
        """Send the tasks the scheduler places now."""
        self.now = now
        self._place(now)
        return self._effects()

    def drain(self, reason: str, now: float, urgent: bool = True) -> list[Effect]:
        """Stop admitting; running jobs checkpoint at their step's end and exit; then stop.

        A second urgent request (SIGTERM, SIGINT) while draining stops at once; repeated
        allocation signals (SIGUSR1/2 reach every process of a Slurm step) do not."""
        self.now = now
        self._drain(reason, urgent)
        return self._effects()

    HANDLERS: ClassVar[dict[bytes, Callable[[DaemonCore, bytes, P.Header, Any], None]]] = {
        P.Op.PING: ClientOps.on_ping,
        P.Op.SUBMIT: ClientOps.on_submit,
        P.Op.STATUS: ClientOps.on_status,
        P.Op.CANCEL: ClientOps.on_cancel,
        P.Op.LOGS: ClientOps.on_logs,
        P.Op.EXPORT: ClientOps.on_export,
        P.Op.BLOB: ClientOps.on_blob,
        P.Op.DOWN: ClientOps.on_down,
        P.Op.REGISTER: WorkerLiveness.on_register,
        P.Op.HEARTBEAT: WorkerLiveness.on_heartbeat,
        P.Op.LEAVE: WorkerLiveness.on_leave,
        P.Op.WORKER_EXITED: WorkerLiveness.on_worker_exited,
        P.Op.RESULT: CallRouting.on_result,
        P.Op.INVENTORY: WorkerLiveness.on_inventory,
        P.Op.CALL: CallRouting.on_call,
        P.Op.REPORT: CallRouting.on_report,
    }
