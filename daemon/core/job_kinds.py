"""How a running job is driven, one strategy per job kind, chosen once when its runtime is made
(``driver_for``); the core asks the strategy and never compares the kind.

- ``ProcessDriver``: a driver process beside the daemon runs the job's loop. The server starts
  and stops it and tells its exit; it outlives a daemon that stops. The daemon keeps the job's
  newest adapters and checkpoints only (its loop needs no older ones).
- ``ExternalDriver`` (``kind: external``, a Tinker client's job): no process; the job runs while
  its client calls. It ends between its calls (cancelled, or drained), and the Tinker front end
  ending it means its client's session finished: it succeeded. Every version and checkpoint is
  kept (they are the client's samplers' weights and saved states).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Callable

from daemon.core.records import CANCEL_GRACE_S, JobRuntime, StartDriver, StopDriver
from daemon.core.tables import CallTable, Turn
from daemon.procs import DRIVER_EXIT_DRAINED
from plexctl.common import auth
from plexctl.common.spec import EXTERNAL, JobSpec


class JobDriver(abc.ABC):
    """What the core asks of the way a job is driven."""

    has_process: bool  # a driver process runs the job (found again after a daemon restart)

    @abc.abstractmethod
    def start(self, job_id: str, turn: Turn, running: Callable[[str, str], None]) -> None:
        """The job was admitted: start its driver (an effect), or say it runs (``running(job_id, how)``)."""

    @abc.abstractmethod
    def tend(self, rt: JobRuntime, now: float, turn: Turn, calls: CallTable, draining: bool) -> int | None:
        """The periodic look at a running job: the exit code to judge now, if it ended; None while it runs."""

    @abc.abstractmethod
    def ended_by(self, sender: str) -> bool:
        """Whether a cancel from ``sender`` means the job's client finished it (it succeeded)."""

    @abc.abstractmethod
    def kept_adapters(self, rt: JobRuntime) -> tuple[Path, int] | None:
        """After a publish: the adapters' directory and how many of its newest to keep; None: all."""

    @abc.abstractmethod
    def kept_checkpoints(self, rt: JobRuntime) -> tuple[Path, int] | None:
        """After a checkpoint: the checkpoints' directory and how many of its newest to keep; None: all."""


class ProcessDriver(JobDriver):
    has_process = True

    def start(self, job_id: str, turn: Turn, running: Callable[[str, str], None]) -> None:
        turn.add(StartDriver(job_id))  # running once the server says it started (``driver_started``)

    def tend(self, rt: JobRuntime, now: float, turn: Turn, calls: CallTable, draining: bool) -> int | None:
        if rt.cancel_requested_at is not None and now - rt.cancel_requested_at > CANCEL_GRACE_S:
            turn.add(StopDriver(rt.job_id, kill=True))  # its exit comes back from the server
        return None

    def ended_by(self, sender: str) -> bool:
        return False

    def kept_adapters(self, rt: JobRuntime) -> tuple[Path, int] | None:
        return rt.job_dir.adapters, rt.spec.algo.max_staleness + 2

    def kept_checkpoints(self, rt: JobRuntime) -> tuple[Path, int] | None:
        return rt.job_dir.checkpoints, 2


class ExternalDriver(JobDriver):
    has_process = False

    def start(self, job_id: str, turn: Turn, running: Callable[[str, str], None]) -> None:
        running(job_id, "driven by its external client")

    def tend(self, rt: JobRuntime, now: float, turn: Turn, calls: CallTable, draining: bool) -> int | None:
        if rt.cancel_requested_at is None and not draining:
            return None
        busy = calls.busy(rt.job_id)  # no driver: it ends between calls
        if rt.cancel_requested_at is not None and (not busy or now - rt.cancel_requested_at > CANCEL_GRACE_S):
            return 0
        if draining and not busy:
            return DRIVER_EXIT_DRAINED
        return None

    def ended_by(self, sender: str) -> bool:
        return sender == auth.INTERNAL_USER  # the Tinker front end: its client's session finished

    def kept_adapters(self, rt: JobRuntime) -> tuple[Path, int] | None:
        return None  # its versions are its samplers' weights

    def kept_checkpoints(self, rt: JobRuntime) -> tuple[Path, int] | None:
        return None  # its client's saved states: its quota's


def driver_for(spec: JobSpec) -> JobDriver:
    """The strategy of the job's kind."""
    return ExternalDriver() if spec.kind == EXTERNAL else ProcessDriver()
