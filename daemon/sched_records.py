"""The scheduler's plain records: a task, an engine, a job as the scheduler knows it, a running
task's charge, and what ``Scheduler.tick`` and ``Scheduler.admit`` answer.

They hold data and no rules, beyond ``Engine.free`` and ``Engine.key``; the scheduler's parts
(``daemon.homes``, ``daemon.queues``, ``daemon.passes``, ``daemon.switches``, ``daemon.task_order``,
``daemon.engine_time``) keep them in step. ``SERIAL_KINDS`` names the kinds whose tasks a job runs
one at a time, in order, on the engine that holds its state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

SERIAL_KINDS = frozenset({"trainer"})  # a job's tasks of these kinds run one at a time, in order

Key = tuple[str, str]  # (kind, model)


@dataclass
class Task:
    task_id: int
    job_id: str
    kind: str  # rollout | trainer
    method: str
    model: str
    submitted_at: float
    priority: int = 0
    weights: str = ""  # what its engine must hold to run it ("": whatever it holds)
    tokens: int = 0  # padded tokens of a train step that may share a pass (``can_share_pass``; 0: runs alone)
    interactive: bool = False  # a client waits on it: first in its priority while the class is under its share


@dataclass
class Engine:
    engine_id: str
    worker_id: str
    kind: str
    model: str
    capacity: int = 1
    state_capacity_bytes: int = 0  # most job state one engine can hold on any tier; 0 = unknown
    job_slots: int = 0  # jobs it holds at once as its memory goes (rollout: adapters it keeps loaded); 0 = not said
    state_room_bytes: int = 0  # job state its tiers hold together (trainer: host + NVMe); 0 = not said
    running: dict[int, Task] = field(default_factory=dict)
    started_at: dict[int, float] = field(default_factory=dict)  # task_id -> start
    busy_since: float | None = None
    busy_seconds: float = 0.0  # union of busy time (tasks overlap when capacity > 1)
    busy_by_job: dict[str, float] = field(default_factory=dict)  # task seconds per job (slots overlap)
    tasks_done: int = 0
    last_done_at: float = 0.0  # when its latest task ended
    up_at: float | None = None
    last_job: str | None = None  # job of the task started last
    streak: int = 0  # consecutive tasks of last_job started
    suspect: bool = False  # its worker fell silent: nothing new starts here until it is back
    device: str = ""  # engines naming the same device take turns on it ("": the engine's own)
    holds: str = ""  # the weights it holds ("": none known; the first task that names some loads them)
    group: int = 0  # tasks started since its last switch
    switches: int = 0  # switches started here (weights loaded, or a wake)
    pass_tokens: int = 0  # a trainer's micro-batch budget: what one shared pass may hold (0: the default)
    pass_of: dict[int, int] = field(default_factory=dict)  # running task -> its pass (the task that leads it)
    passes: dict[int, int] = field(default_factory=dict)  # running pass -> its tasks still running
    shared_passes: int = 0  # passes started here with several jobs' train steps
    shared_tasks: int = 0  # the tasks in them
    last_pass: int = 0  # tasks in the pass started last
    largest_pass: int = 0

    @property
    def free(self) -> int:
        return self.capacity - len(self.passes)

    @property
    def key(self) -> Key:
        return (self.kind, self.model)


@dataclass(frozen=True)
class Placement:
    task: Task
    engine_id: str
    lead: int = 0  # the task whose pass it shares (0: its own pass; see ``daemon.passes``)


@dataclass(frozen=True)
class Admission:
    ok: bool
    reason: str
    rollout: str | None = None
    trainer: str | None = None


class Interval(NamedTuple):
    engine_id: str
    job_id: str
    method: str
    start: float
    end: float


@dataclass
class Job:
    job_id: str
    model: str
    user: str = ""
    priority: int = 0
    state_bytes: int = 0
    admitted_at: float | None = None  # None: known only from its tasks
    homes: dict[str, str] = field(default_factory=dict)  # kind -> engine_id
    state_engine: str | None = None
    state_tier: str | None = None  # device | host | nvme | ... | None (no copy known)
    queued: dict[int, Task] = field(default_factory=dict)
    serial: dict[str, deque[Task]] = field(default_factory=dict)  # kind -> queued, in order
    running: dict[str, int] = field(default_factory=dict)  # kind -> tasks running
    methods: set[str] = field(default_factory=set)
    last_done: tuple[str, float] | None = None  # (kind, when) of its task that ended last
    started: dict[int, str] = field(default_factory=dict)  # its running tasks: task_id -> engine_id

    def serial_head(self, kind: str) -> Task | None:
        """Its next queued task of a serial kind (None: none queued)."""
        queue = self.serial.get(kind)
        return queue[0] if queue else None


@dataclass
class Running:
    engine_id: str
    job: Job  # the record it was started for (a job id may be released and reused)
    user: str
    charge: float  # estimated engine-seconds charged to the user's fair share until done
    switch: str | None = None  # the weights it switched the engine to (None: no switch)
    share: int = 1  # tasks in its pass: each is served its part of the pass's time


def mb(n: int) -> str:
    """Bytes as megabytes for a message: one decimal, trailing zeros dropped."""
    return f"{n / 1e6:.1f}".rstrip("0").rstrip(".")
