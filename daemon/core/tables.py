"""The parts that own the daemon core's state. A concern (``clients``, ``liveness``, ``routing``,
``lifecycle``) is handed the parts it uses and asks them; no class sees every field.

- ``Settings``: what the cluster was started with (owner, trusted users, limits, timings).
- ``Turn``: the event being handled: its time, its sender, and the effects it produced so far
  (handed back once by ``effects``).
- ``JobTable``: the journal and the jobs' directories, uploaded inputs and quotas, and what the
  daemon keeps of jobs in memory: running jobs' runtimes, why queued ones wait, drivers that
  failed to start, adopted jobs and their held tasks, and the drain.
- ``WorkerTable``: the registered workers by id, the models served, the trainers' tier
  inventories and prefetches, the problems workers reported.
- ``CallTable``: the pending service calls by task id, and the task ids, never repeated across
  daemon restarts (a late result for a task of the previous daemon, whose workers live on, cannot
  be taken for the reply to a new call).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from daemon.blobs import BlobStore
from daemon.core.records import Effect, JobRuntime, PendingCall, Send, WorkerState
from daemon.journal import Journal
from daemon.quotas import UserQuotas
from daemon.scheduler import Task
from plexctl.common import auth
from plexctl.common import protocol as P
from plexctl.common.jobdir import JobDir

log = logging.getLogger("plexd")


@dataclass
class Settings:
    """What the cluster was started with; fixed for the daemon's life."""

    owner: str
    max_running: int  # job drivers at once; the engines' room admits within it
    policy: str  # the scheduler's placement policy
    drain_timeout: float
    trusted_users: set[str]  # may run their own code in the trainer (algo.loss_fn)
    worker_grace: float  # a silent worker whose process may live is lost after this
    started_at: float
    pid: int = field(default_factory=os.getpid)  # shown by ping

    def is_isolated(self, user: str) -> bool:
        """Whether ``user``'s jobs run isolated, held to their own rights (every user the cluster
        does not trust: not its owner, not named with ``--trust-user-code``)."""
        return user not in (self.owner, auth.INTERNAL_USER) and user not in self.trusted_users


class Turn:
    """The event being handled: its time ``now``, its authenticated ``sender`` (a message's
    User-Id; "" for other events), and the effects it produced, for the server to carry out."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.sender = ""
        self._out: list[Effect] = []

    def add(self, effect: Effect) -> None:
        self._out.append(effect)

    def send(self, identity: bytes, op: bytes, body: Any, in_reply_to: int = 0) -> None:
        self._out.append(Send(identity, op, body, in_reply_to))

    def error(self, identity: bytes, msg_id: int, code: str, message: str) -> None:
        self.send(identity, P.Op.ERROR, P.ErrorBody(code, message), msg_id)

    def effects(self) -> list[Effect]:
        """The effects gathered so far, handed over once."""
        out, self._out = self._out, []
        return out


class JobTable:
    """The journal and the jobs' in-memory state; invariants in ``lifecycle``."""

    def __init__(self, state_dir: Path) -> None:
        self.jobs_dir = state_dir / "jobs"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(state_dir / "journal.db")
        self.blobs = BlobStore(state_dir / "blobs")  # jailed users' uploaded inputs
        self.quotas = UserQuotas(state_dir)  # what each of them may run and submit at once
        self.runtimes: dict[str, JobRuntime] = {}
        self.reasons: dict[str, str] = {}  # queued job -> why it is not running yet
        self.room_waits: dict[str, float] = {}  # queued job with no engine room (or none up) -> since when
        self.start_failures: dict[str, tuple[int, float]] = {}  # job -> (drivers that failed to start, next try)
        self.adopting: dict[str, float] = {}  # adopted job -> when to give up waiting for engines
        self.resident: dict[str, str] = {}  # job -> trainer engine that holds its state (workers' word)
        self.held: dict[str, list[Task]] = {}  # an adopted job's calls until it is placed again
        self.drain_deadline: float | None = None  # set once a drain starts
        self.drain_reason = ""
        self.stopping = False  # the server stops its loop and shuts down

    def close(self) -> None:
        self.journal.close()

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def known(self, job_id: str) -> P.JobInfo:
        """The journal's record of a job it holds (an id the journal or a running job gave)."""
        info = self.journal.job(job_id)
        assert info is not None
        return info

    def job_dir(self, job_id: str) -> JobDir:
        return JobDir(self.jobs_dir / job_id)

    def on_engines(self, engines: set[str]) -> list[str]:
        """The running jobs that have used one of ``engines``."""
        return [rt.job_id for rt in self.runtimes.values() if rt.engines & engines]


class WorkerTable(Mapping[str, WorkerState]):
    """The registered workers by id, and what they report of their engines."""

    def __init__(self, models: Iterable[str]) -> None:
        self._workers: dict[str, WorkerState] = {}
        self.models = {os.path.realpath(m) for m in models}  # served: configured, then as registered
        self.engine_stats: dict[str, dict[str, Any]] = {}  # engine -> its latest tier inventory
        self.prefetched: dict[str, str] = {}  # trainer engine -> job whose prefetch was last asked
        self.problems: list[str] = []
        self.local_workers = 0  # workers the server starts itself (ping counts their engines as expected)

    def __getitem__(self, worker_id: str) -> WorkerState:
        return self._workers[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    def add(self, worker: WorkerState) -> None:
        self._workers[worker.worker_id] = worker

    def pop(self, worker_id: str) -> WorkerState | None:
        return self._workers.pop(worker_id, None)

    def decls(self) -> list[P.EngineDecl]:
        """Every registered engine's declaration."""
        return [d for w in self._workers.values() for d in w.engines]

    def trainer_of(self, identity: bytes, named: str = "") -> str:
        """The trainer engine a worker's report is about: the one it names (a worker hosts a
        trainer per model), else its first; "" for a worker this daemon does not know."""
        for w in self._workers.values():
            if w.identity == identity:
                trainers = [d.engine_id for d in w.engines if d.kind == "trainer"]
                return named if named in trainers else next(iter(trainers), "")
        return ""

    def where(self, engine_id: str) -> dict[str, str]:
        """Job -> tier of the states a trainer last said it holds."""
        where: dict[str, str] = self.engine_stats.get(engine_id, {}).get("where", {})
        return where


class CallTable(Mapping[int, PendingCall]):
    """The pending service calls by their task's id; invariants in ``routing``."""

    def __init__(self, started_at: float) -> None:
        self._calls: dict[int, PendingCall] = {}
        self._task_ids = itertools.count(int(started_at * 1000) * 1000)

    def __getitem__(self, task_id: int) -> PendingCall:
        return self._calls[task_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._calls)

    def __len__(self) -> int:
        return len(self._calls)

    def next_task_id(self) -> int:
        return next(self._task_ids)

    def add(self, task_id: int, call: PendingCall) -> None:
        self._calls[task_id] = call

    def pop(self, task_id: int) -> PendingCall | None:
        return self._calls.pop(task_id, None)

    def drop_job(self, job_id: str, tasks: Iterable[Task] = ()) -> list[PendingCall]:
        """Forget the job's calls: those of ``tasks`` (released by the scheduler) and any other;
        the calls forgotten, unanswered."""
        dropped = [c for task in tasks if (c := self._calls.pop(task.task_id, None)) is not None]
        for tid in [t for t, c in self._calls.items() if c.job_id == job_id]:
            dropped.append(self._calls.pop(tid))
        return dropped

    def busy(self, job_id: str) -> bool:
        """Whether a call of the job is pending."""
        return any(c.job_id == job_id for c in self._calls.values())

    def pending(self, job_id: str, msg_id: int) -> bool:
        """Whether the job's call ``msg_id`` is pending."""
        return any(c.job_id == job_id and c.msg_id == msg_id for c in self._calls.values())
