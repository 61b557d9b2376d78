"""``CoreBase``: the state every concern of ``DaemonCore`` shares, and the helpers they all use.

It owns the journal (SQLite), the scheduler core, the jobs' runtimes, the pending calls and
the workers' state, and it reads and writes the files of a job's directory that the call logic
needs (its latest checkpoint, logs and exports, uploaded inputs; names from ``JobDir``). An
event's effects gather in ``_out`` until ``_effects`` hands them back. A method one concern calls
on another is declared here, abstract, so that every such call is type-checked; ``DaemonCore``
takes its body from the concern that defines it.
"""

from __future__ import annotations

import abc
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable

from daemon import metrics as M
from daemon.blobs import BlobStore
from daemon.core.records import (
    DRAIN_TIMEOUT_S,
    MAX_RUNNING,
    WORKER_GRACE_S,
    Effect,
    JobRuntime,
    PendingCall,
    Send,
    WorkerState,
)
from daemon.journal import Journal
from daemon.quotas import UserQuotas
from daemon.scheduler import Scheduler, Task
from plexctl.common import auth
from plexctl.common import protocol as P
from plexctl.common.jobdir import JobDir
from plexctl.common.spec import JobSpec

log = logging.getLogger("plexd")


class CoreBase(abc.ABC):
    """What every concern of ``DaemonCore`` reads and changes; see the module docstring."""

    def __init__(
        self,
        state_dir: Path,
        models: Iterable[str],
        owner: str,
        max_running: int = MAX_RUNNING,
        policy: str = "spread+backfill",
        jobs_per_engine: int | None = None,
        pass_window: float | None = None,  # None: each train step in a pass of its own (plexd: PASS_WINDOW_S)
        drain_timeout: float = DRAIN_TIMEOUT_S,
        trusted_users: Iterable[str] = (),
        worker_grace: float = WORKER_GRACE_S,
        now: float | None = None,
    ) -> None:
        self.now = time.time() if now is None else now
        self.state_dir = state_dir
        self.jobs_dir = state_dir / "jobs"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(state_dir / "journal.db")
        self.blobs = BlobStore(state_dir / "blobs")  # jailed users' uploaded inputs
        self.quotas = UserQuotas(state_dir)  # what each of them may run and submit at once
        self.telemetry = M.Telemetry()  # call latencies, swap marks; served on /metrics by the server
        self.models = {os.path.realpath(m) for m in models}
        self.owner = owner
        self.max_running = max_running
        self.policy = policy
        self.sched = Scheduler(policy=policy, jobs_per_engine=jobs_per_engine, pass_window=pass_window)
        self.drain_timeout = drain_timeout
        self.trusted_users = set(trusted_users)  # may run their own code in the trainer (algo.loss_fn)
        self.worker_grace = worker_grace  # a silent worker whose process may live is lost after this
        self.started_at = self.now
        self.pid = os.getpid()  # shown by ping
        self.local_workers = 0  # workers the server starts itself (ping counts their engines as expected)
        self.reasons: dict[str, str] = {}  # queued job -> why it is not running yet
        self.start_failures: dict[str, tuple[int, float]] = {}  # job -> (drivers that failed to start, next try)
        self.specs: dict[str, JobSpec] = {}  # parsed specs of queued jobs
        self.engine_stats: dict[str, dict[str, Any]] = {}  # engine -> its latest tier inventory
        self.prefetched: dict[str, str] = {}  # trainer engine -> job whose prefetch was last asked
        self.workers: dict[str, WorkerState] = {}
        self.runtimes: dict[str, JobRuntime] = {}
        self.calls: dict[int, PendingCall] = {}
        self.adopting: dict[str, float] = {}  # adopted job -> when to give up waiting for engines
        self.resident: dict[str, str] = {}  # job -> trainer engine that holds its state (workers' word)
        self.held: dict[str, list[Task]] = {}  # an adopted job's calls until it is placed again
        # task ids never repeat across daemon restarts: a late result for a task of the previous daemon
        # (its workers live on) cannot be taken for the reply to a new call
        self.task_ids = itertools.count(int(self.started_at * 1000) * 1000)
        self.stopping = False  # the server stops its loop and shuts down
        self.drain_deadline: float | None = None  # set once a drain starts
        self.drain_reason = ""
        self.problems: list[str] = []
        self.sender = ""  # the authenticated user of the message being handled (its User-Id)
        self.handler_failures = 0  # messages whose handler raised (each answered ``internal``)
        self._out: list[Effect] = []

    def _effects(self) -> list[Effect]:
        out, self._out = self._out, []
        return out

    def _send(self, identity: bytes, op: bytes, body: Any, in_reply_to: int = 0) -> None:
        self._out.append(Send(identity, op, body, in_reply_to))

    def _error(self, identity: bytes, msg_id: int, code: str, message: str) -> None:
        self._send(identity, P.Op.ERROR, P.ErrorBody(code, message), msg_id)

    def is_isolated(self, user: str) -> bool:
        """Whether ``user``'s jobs run isolated, held to their own rights (every user the cluster
        does not trust: not its owner, not named with ``--trust-user-code``)."""
        return user not in (self.owner, auth.INTERNAL_USER) and user not in self.trusted_users

    def _known_job(self, job_id: str) -> P.JobInfo:
        """The journal's record of a job it holds (an id the journal or a running job gave)."""
        info = self.journal.job(job_id)
        assert info is not None
        return info

    def _job_dir(self, job_id: str) -> JobDir:
        return JobDir(self.jobs_dir / job_id)

    # ------------------------------------------------------------------ across concerns

    @abc.abstractmethod
    def _cancel(self, job_id: str, why: str = "") -> None:
        """Cancel a job: a queued one at once, a running one at its next call boundary (lifecycle)."""
        ...

    @abc.abstractmethod
    def _drain(self, reason: str, urgent: bool) -> None:
        """Stop admitting; running jobs checkpoint and exit; a second urgent request stops now (lifecycle)."""
        ...

    @staticmethod
    @abc.abstractmethod
    def _state_bytes(spec: JobSpec) -> int:
        """The bytes of a job's trainer state (adapter or weights, optimizer), 0 if unknown (lifecycle)."""
        ...

    @abc.abstractmethod
    def _adopt(self, job_id: str, now: float) -> bool:
        """Place an adopted job again; False while no engines for it are back (lifecycle)."""
        ...

    @abc.abstractmethod
    def _roll_back(self, rt: JobRuntime, why: str) -> None:
        """The job's trainer state is gone: stop its driver; it resumes from its last checkpoint (liveness)."""
        ...

    @abc.abstractmethod
    def _take_inventory(self, identity: bytes, info: dict[str, Any]) -> None:
        """A trainer's tier inventory and background moves, from a worker's message (liveness)."""
        ...

    @abc.abstractmethod
    def _trainer_of(self, identity: bytes, named: str = "") -> str:
        """The trainer engine a worker's report is about; "" for an unknown worker (liveness)."""
        ...

    @abc.abstractmethod
    def _prefetch(self, engine_id: str, worker: WorkerState, expected: list[str] | None = None) -> None:
        """Ask the trainer to bring up from NVMe the state of the job expected to need it next (liveness)."""
        ...

    @abc.abstractmethod
    def _prefetch_for(self, job_id: str) -> None:
        """After one of the job's tasks ended: the prefetch of its trainer may change (liveness)."""
        ...
