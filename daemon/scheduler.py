"""The task scheduler: a pure core that admits jobs and places their service calls on engines.

The unit of scheduling is one *call* of one job (``generate`` on a rollout engine,
``train_step`` / ``publish`` / ``checkpoint`` / ``restore`` on a trainer engine), never a whole
job. The core owns no sockets and no clock: the daemon (and the simulator) feed it engine events
(``engine_up`` / ``engine_down``, ``engine_suspect`` / ``engine_back``) and job events (``admit`` /
``release``, ``submit``, ``claim``, ``done``, ``state_location``) and ask ``tick(now)`` for placements.

It decides, asking its placement policy (``daemon.policies``) where policies differ: each job's
*home* rollout and trainer engine, within each engine's room (``Engine.job_slots``,
``Engine.state_room_bytes``, ``jobs_per_engine``; ``room_problem`` names the limit a waiting job
meets); the order of each engine's queue (priority, per-user weighted fair share, response ratio,
submission) under the ``max_switches`` and ``max_group`` bounds; which task may backfill an idle
engine (where the policy ``backfills``); which LoRA train steps share one pass (``pass_window``,
``pass_tokens``); the ``upcoming`` / ``expected`` hints.

Invariants: a task runs on its job's home engine of its kind unless backfilled or claimed; a job's
trainer calls run one at a time in submission order; a job's state stays with the trainer that
holds it, on whatever tier, so its trainer tasks wait there; a *suspect* engine starts nothing new
and is no job's new home, yet keeps its jobs and state until ``engine_down``; an engine holds one
set of weights at a time, engines sharing a ``device`` run one at a time, and a switch starts only
on an engine with nothing running, charged to the task that needs it. ``tick`` costs O(changed
engines + their queues). It does not move state, prefetch or evict (the state manager does), nor
preempt running tasks. The rules in full: ``docs/sharing.md``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

from daemon.policies import PlacementPolicy, placement_policy
from plexctl.common.cluster_config import DEFAULTS
from plexctl.common.memplan import DEFAULT_MICRO_BATCH_TOKENS
from plexctl.common.scheduling import union_length  # shared with the CLI and the daemon's metrics

DEFAULT_ESTIMATE = 1.0
DEFAULT_SWITCH_ESTIMATE = 1.0  # seconds of a switch (a weights load or a wake) before one is measured
EMA = 0.3
INTERVALS_KEPT = 100_000
SERIAL_KINDS = frozenset({"trainer"})  # a job's tasks of these kinds run one at a time, in order
UNDECLARED_JOBS_PER_ENGINE = 8  # jobs an engine that declares no room (an older worker, a test's) is home to

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
    lead: int = 0  # the task whose pass it shares (0: its own pass; see ``Scheduler._share_pass``)


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


@dataclass
class Running:
    engine_id: str
    job: Job  # the record it was started for (a job id may be released and reused)
    user: str
    charge: float  # estimated engine-seconds charged to the user's fair share until done
    switch: str | None = None  # the weights it switched the engine to (None: no switch)
    share: int = 1  # tasks in its pass: each is served its part of the pass's time


class Scheduler:
    def __init__(
        self,
        policy: str = DEFAULTS.policy,
        jobs_per_engine: int | None = None,
        max_switches: int = 4,
        max_group: int = 16,
        pass_window: float | None = None,
    ) -> None:
        self.policy: PlacementPolicy = placement_policy(policy)  # ValueError for an unknown name
        if jobs_per_engine is not None and jobs_per_engine < 1:
            raise ValueError(f"jobs_per_engine must be >= 1, not {jobs_per_engine}")
        if max_switches < 0:
            raise ValueError(f"max_switches must be >= 0, not {max_switches}")
        if max_group < 1:
            raise ValueError(f"max_group must be >= 1, not {max_group}")
        if pass_window is not None and pass_window < 0:
            raise ValueError(f"pass_window must be >= 0 seconds, not {pass_window}")
        self.jobs_per_engine = jobs_per_engine  # a cap on the jobs homed on one engine (None: what it holds)
        self.max_switches = max_switches
        self.max_group = max_group
        self.pass_window = pass_window  # None: every train step runs alone; else shared passes, waiting this long
        self.engines: dict[str, Engine] = {}
        self.queue: dict[int, Task] = {}  # every queued (not running) task
        self.jobs: dict[str, Job] = {}
        self.home: dict[str, str] = {}  # job_id -> home trainer engine (holds its state)
        self.rollout_home: dict[str, str] = {}  # job_id -> home rollout engine
        self.estimates: dict[tuple[str, str], float] = {}
        self.switch_estimates: dict[str, float] = {}  # weights -> seconds of switching an engine to them
        self.shares: dict[str, float] = {}  # user -> weight (default 1)
        self.served: dict[str, float] = {}  # user -> engine-seconds of finished tasks
        self.charged: dict[str, float] = {}  # user -> estimated engine-seconds of running tasks
        self.intervals: deque[Interval] = deque(maxlen=INTERVALS_KEPT)
        self.now = 0.0  # the clock of the last tick
        # indexes, all kept in step by the event methods
        self._by_key: dict[Key, dict[str, None]] = {}
        self._buckets: dict[Key, dict[int, dict[str, None]]] = {}  # jobs homed -> engines
        self._homed: dict[str, dict[str, None]] = {}  # engine -> jobs it is home to
        self._free: dict[Key, dict[str, None]] = {}  # engines with a free slot
        self._pending: dict[str, dict[int, Task]] = {}  # engine -> eligible tasks homed there
        self._where: dict[int, str | None] = {}  # eligible task -> engine (None: homeless)
        self._homeless: dict[int, Task] = {}  # eligible tasks whose job has no home yet
        self._waiting: dict[Key, dict[int, Task]] = {}  # movable tasks on full homes
        self._running: dict[int, Running] = {}
        self._dirty: dict[str, None] = {}  # engines to fill at the next tick
        self._bf_dirty: dict[Key, None] = {}  # keys whose backfill may have changed
        self._homeless_dirty = False
        self._devices: dict[str, dict[str, None]] = {}  # device -> its engines
        self._awake: dict[str, str] = {}  # device -> the engine that ran last (or came up last)
        self._holding: dict[str, float] = {}  # trainer -> until when it waits for more steps to share a pass

    # -- engines

    def engine_up(self, engine: Engine, now: float | None = None) -> None:
        if engine.engine_id in self.engines:
            self.engine_down(engine.engine_id)
        eid, key = engine.engine_id, engine.key
        if now is not None:
            engine.up_at = now
        self.engines[eid] = engine
        self._by_key.setdefault(key, {})[eid] = None
        self._homed[eid] = {}
        self._buckets.setdefault(key, {}).setdefault(0, {})[eid] = None
        self._pending[eid] = {}
        if engine.free > 0:
            self._free.setdefault(key, {})[eid] = None
        if engine.device:
            self._devices.setdefault(engine.device, {})[eid] = None
            self._awake[engine.device] = eid
        self._bf_dirty[key] = None
        self._homeless_dirty = True

    def engine_down(self, engine_id: str) -> list[Task]:
        """Remove an engine; its running tasks return to the queue (returned for logging;
        those of released jobs are dropped).

        Jobs homed there lose that home (and any state the core believed was on it) and get
        a new one by the policy's rule when they next have a task of that kind.
        """
        engine = self.engines.pop(engine_id, None)
        if engine is None:
            return []
        key = engine.key
        del self._by_key[key][engine_id]
        self._buckets[key][len(self._homed[engine_id])].pop(engine_id, None)
        self._free.get(key, {}).pop(engine_id, None)
        self._dirty.pop(engine_id, None)
        if engine.device:
            mates = self._devices[engine.device]
            mates.pop(engine_id, None)
            if self._awake.get(engine.device) == engine_id:
                self._awake.pop(engine.device)
                if mates:
                    self._awake[engine.device] = next(reversed(mates))
            self._dirty.update(dict.fromkeys(mates))
        requeued = []  # the running tasks of jobs still known (a released job's are dropped)
        for task in engine.running.values():
            run = self._running.pop(task.task_id)
            self.charged[run.user] = self.charged.get(run.user, 0.0) - run.charge
            job = run.job
            if self.jobs.get(task.job_id) is not job:
                continue  # released (perhaps re-submitted since under the same id)
            requeued.append(task)
            self.queue[task.task_id] = task
            job.queued[task.task_id] = task
            job.running[task.kind] = max(0, job.running.get(task.kind, 0) - 1)
            job.started.pop(task.task_id, None)
            if task.kind in SERIAL_KINDS:
                job.serial.setdefault(task.kind, deque()).appendleft(task)
        engine.running.clear()
        engine.started_at.clear()
        engine.pass_of.clear()
        engine.passes.clear()
        self._holding.pop(engine_id, None)
        stranded = list(self._pending.pop(engine_id).values())
        for task in stranded:
            self._where.pop(task.task_id, None)
            self._waiting.get(key, {}).pop(task.task_id, None)
        for job_id in list(self._homed.pop(engine_id)):
            job = self.jobs[job_id]
            if job.state_engine == engine_id:
                job.state_engine, job.state_tier = None, None
            for kind, home in list(job.homes.items()):
                if home == engine_id:
                    del job.homes[kind]
                    (self.home if kind == "trainer" else self.rollout_home).pop(job_id, None)
        for task in stranded:
            self._enqueue(task)
        for task in requeued:
            if self._eligible(self.jobs[task.job_id], task):
                self._enqueue(task)
        self._homeless_dirty = True
        return requeued

    def engine_suspect(self, engine_id: str) -> None:
        """The engine's worker fell silent (a stall or a death, not yet told apart): nothing
        new starts on it until ``engine_back``, and it is no job's new home. What runs there
        stays running, its jobs keep their homes and state there; its queued rollout tasks may
        backfill elsewhere as if it were full."""
        engine = self.engines.get(engine_id)
        if engine is None or engine.suspect:
            return
        engine.suspect = True
        self._free.get(engine.key, {}).pop(engine_id, None)
        self._dirty.pop(engine_id, None)
        for task in self._pending[engine_id].values():
            self._mark_waiting(task, self.jobs[task.job_id], engine)

    def engine_back(self, engine_id: str) -> None:
        """A suspect engine's worker answers again: it takes tasks as before."""
        engine = self.engines.get(engine_id)
        if engine is None or not engine.suspect:
            return
        engine.suspect = False
        if engine.free > 0:
            self._engine_freed(engine)
        self._homeless_dirty = True

    def serves(self, kind: str, model: str) -> bool:
        return bool(self._by_key.get((kind, model)))

    # -- jobs

    def admit(
        self,
        job_id: str,
        model: str,
        now: float,
        state_bytes: int = 0,
        priority: int = 0,
        user: str = "",
        trainer: str | None = None,
    ) -> Admission:
        """Give a job its home rollout and trainer engines, or say why it must wait. ``trainer``
        names the engine that already holds the job's state (a job adopted after a restart)."""
        job = self.jobs.get(job_id)
        rollouts = self._by_key.get(("rollout", model), {})
        trainers = self._by_key.get(("trainer", model), {})
        if not rollouts or not trainers:
            missing = " and ".join(k for k, e in (("rollout", rollouts), ("trainer", trainers)) if not e)
            return Admission(False, f"no ready engine serves {model} (no {missing} engine)")
        caps = [self.engines[e].state_capacity_bytes for e in trainers]
        if state_bytes > 0 and all(c > 0 for c in caps) and state_bytes > max(caps):
            return Admission(False, f"state {_mb(state_bytes)} MB does not fit any tier (largest: {_mb(max(caps))} MB)")
        rollout = job.homes.get("rollout") if job else None
        trainer = (job.homes.get("trainer") if job else None) or (trainer if trainer in trainers else None)
        rollout = rollout or self._pick_home("rollout", model, 0)
        trainer = trainer or self._pick_home("trainer", model, state_bytes)
        if rollout is None or trainer is None:
            return Admission(False, self._full_reason(model, state_bytes, rollout is None, trainer is None))
        if job is None:
            job = self.jobs[job_id] = Job(job_id, model)
        job.model, job.user, job.priority, job.state_bytes = model, user, priority, state_bytes
        if job.admitted_at is None:
            job.admitted_at = now
        self._set_home(job, "rollout", rollout)
        self._set_home(job, "trainer", trainer)
        return Admission(True, "admitted", rollout, trainer)

    def release(self, job_id: str) -> list[Task]:
        """Forget a job (it ended): free its homes, drop its queued tasks (returned) and estimates.

        Its running tasks finish normally; ``done`` still accounts for them.
        """
        job = self.jobs.pop(job_id, None)
        if job is None:
            return []
        dropped = list(job.queued.values())
        for task in dropped:
            self._dequeue(task)
            del self.queue[task.task_id]
        job.queued.clear()
        job.serial.clear()
        for kind in list(job.homes):
            self._set_home(job, kind, None, requeue=False)
        for method in job.methods:
            self.estimates.pop((job_id, method), None)
        return dropped

    forget_job = release

    def home_of(self, job_id: str, kind: str) -> str | None:
        job = self.jobs.get(job_id)
        return job.homes.get(kind) if job else None

    def state_location(self, job_id: str, engine_id: str | None, tier: str | None) -> None:
        """The state manager says where a job's trainer state lives now.

        ``tier == "device"`` makes that trainer engine the job's home. On any tier the job's
        trainer tasks stay on that engine; ``None`` (no copy anywhere) lets one move.
        """
        job = self.jobs.get(job_id)
        if job is None:
            return
        job.state_engine, job.state_tier = engine_id, tier
        engine = self.engines.get(engine_id) if engine_id is not None else None
        if tier == "device" and engine is not None and engine.kind == "trainer":
            self._set_home(job, "trainer", engine_id)
        head = self._serial_head(job, "trainer")
        engine_id = self._where.get(head.task_id) if head is not None else None
        if head is not None and engine_id is not None:
            self._mark_waiting(head, job, self.engines[engine_id])

    def set_share(self, user: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"share weight must be > 0, not {weight}")
        self.shares[user] = weight

    # -- tasks

    def submit(self, task: Task) -> None:
        if task.task_id in self.queue or task.task_id in self._running:
            return
        job = self._queued(task)
        if task.kind in SERIAL_KINDS:
            job.serial.setdefault(task.kind, deque()).append(task)
        if self._eligible(job, task):
            self._enqueue(task)

    def claim(self, task: Task, engine_id: str, now: float) -> None:
        """Record ``task`` (not a trainer task) as started on ``engine_id`` at ``now``, whatever
        the order: its worker started it on its own, e.g. a task sent ahead of the one it follows,
        started as that one ended. It may take the engine past its capacity."""
        if task.kind in SERIAL_KINDS:
            raise ValueError(f"a {task.kind} task runs in its job's order: it cannot be claimed")
        self._queued(task)
        self._start(task, self.engines[engine_id], now, [])

    def _queued(self, task: Task) -> Job:
        """Record ``task`` as queued, its job made if new; the job."""
        job = self.jobs.get(task.job_id)
        if job is None:
            job = self.jobs[task.job_id] = Job(task.job_id, task.model, priority=task.priority)
        self.queue[task.task_id] = task
        job.queued[task.task_id] = task
        job.methods.add(task.method)
        return job

    def idle(self, engine_id: str) -> bool:
        """Nothing runs on the engine and nothing waits for it."""
        return not self.engines[engine_id].running and not self._pending.get(engine_id)

    def done(
        self, task_id: int, now: float, seconds: float | None = None, switch_seconds: float | None = None
    ) -> Task | None:
        """A task ended. ``seconds``: what the call itself took, its engine's switch left out
        (learned as its job's estimate for the method); ``switch_seconds``: what that switch
        took, when it needed one (learned as the switch estimate of its weights)."""
        run = self._running.pop(task_id, None)
        if run is None:
            return None
        engine_id, user = run.engine_id, run.user
        engine = self.engines[engine_id]
        was_full = engine.free <= 0
        task = engine.running.pop(task_id)
        start = engine.started_at.pop(task_id)
        lead = engine.pass_of.pop(task_id, task_id)
        left = engine.passes.pop(lead, 1) - 1
        if left > 0:
            engine.passes[lead] = left
        engine.tasks_done += 1
        engine.last_done_at = now
        if not engine.running and engine.busy_since is not None:
            engine.busy_seconds += now - engine.busy_since
            engine.busy_since = None
        took = max(0.0, now - start)
        engine.busy_by_job[task.job_id] = engine.busy_by_job.get(task.job_id, 0.0) + took
        self.intervals.append(Interval(engine_id, task.job_id, task.method, start, now))
        self.served[user] = self.served.get(user, 0.0) + took / engine.capacity / run.share
        self.charged[user] = self.charged.get(user, 0.0) - run.charge
        job = run.job
        job.started.pop(task_id, None)
        if self.jobs.get(task.job_id) is job:  # not released meanwhile
            job.running[task.kind] = max(0, job.running.get(task.kind, 0) - 1)
            job.last_done = (task.kind, now)
            if seconds is not None:
                key = (task.job_id, task.method)
                old = self.estimates.get(key)
                self.estimates[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds
            head = self._serial_head(job, task.kind)
            if head is not None and self._eligible(job, head):
                self._enqueue(head)
        if run.switch is not None and switch_seconds is not None:
            old = self.switch_estimates.get(run.switch)
            self.switch_estimates[run.switch] = (
                switch_seconds if old is None else (1 - EMA) * old + EMA * switch_seconds
            )
        if was_full and engine.free > 0 and not engine.suspect:
            self._engine_freed(engine)
        elif not engine.running and self._pending[engine_id] and not engine.suspect:
            self._dirty[engine_id] = None  # a switch may have waited for it to drain
        if engine.device and not engine.running:  # the device may pass to another engine
            for mate in self._devices[engine.device]:
                if mate != engine_id and self._pending.get(mate):
                    self._dirty[mate] = None
        return task

    # -- switches

    def switch_estimate(self, weights: str) -> float:
        """Seconds of switching an engine to ``weights`` (a load, a wake): learned, else the default."""
        return self.switch_estimates.get(weights, DEFAULT_SWITCH_ESTIMATE)

    def set_switch_estimate(self, weights: str, seconds: float) -> None:
        """What switching to ``weights`` costs, known beforehand (e.g. from their size)."""
        if seconds < 0:
            raise ValueError(f"a switch takes >= 0 seconds, not {seconds}")
        self.switch_estimates[weights] = seconds

    def _switch_to(self, engine: Engine, task: Task) -> str | None:
        """The weights ``task`` switches ``engine`` to (its own, or for a wake whatever the engine
        holds), or None if the engine runs it as it is."""
        asleep = bool(engine.device) and self._awake.get(engine.device) != engine.engine_id
        if task.weights and task.weights != engine.holds:
            return task.weights
        if asleep:
            return engine.holds or engine.model
        return None

    def _device_turn(self, engine: Engine, now: float) -> bool:
        """Whether ``engine`` may start tasks now: alone on its device; or its device's other
        engines idle and the turn its (see the module doc)."""
        mates = self._devices.get(engine.device) if engine.device else None
        if not mates or len(mates) == 1:
            return True
        eid = engine.engine_id
        if any(self.engines[m].running for m in mates if m != eid):
            return False
        awake = self._awake.get(engine.device)
        others = [m for m in mates if m != awake and self._pending.get(m)]
        if eid == awake:
            return not others or engine.group < self.max_group
        if awake is not None and self._pending.get(awake) and self.engines[awake].group < self.max_group:
            return False  # the awake engine keeps its turn while its tasks wait
        if awake is not None and self.engines[awake].running:
            return False
        best = min(others, key=lambda m: min(self._order_key(t, now) for t in self._pending[m].values()))
        return best == eid

    def _group_first(self, engine: Engine, order: list[Task]) -> list[Task]:
        """Tasks for the weights the engine holds first, while its group may grow."""
        if engine.group >= self.max_group or not any(t.weights and t.weights != engine.holds for t in order):
            return order
        same = [t for t in order if not t.weights or t.weights == engine.holds]
        return [*same, *(t for t in order if t.weights and t.weights != engine.holds)]

    # -- ordering

    def estimate(self, task: Task) -> float:
        return self.estimates.get((task.job_id, task.method), DEFAULT_ESTIMATE)

    def response_ratio(self, task: Task, now: float) -> float:
        est = max(self.estimate(task), 1e-3)
        return (now - task.submitted_at + est) / est

    def share_score(self, user: str) -> float:
        """Engine-seconds served (plus estimates of running tasks) per unit of share weight."""
        return (self.served.get(user, 0.0) + self.charged.get(user, 0.0)) / self.shares.get(user, 1.0)

    def _order_key(self, task: Task, now: float) -> tuple[int, float, float, int]:
        job = self.jobs.get(task.job_id)
        user = job.user if job else ""
        return (-task.priority, self.share_score(user), -self.response_ratio(task, now), task.task_id)

    def _switch_first(self, engine: Engine, order: list[Task]) -> list[Task]:
        """Apply the switch bound: continue the engine's last job if it may (see module doc)."""
        if (
            engine.kind not in SERIAL_KINDS
            or engine.last_job is None
            or not order
            or engine.streak >= self.max_switches
            or order[0].job_id == engine.last_job
        ):
            return order
        for i, task in enumerate(order):
            if task.job_id == engine.last_job:
                if task.priority == order[0].priority:
                    return [task, *order[:i], *order[i + 1 :]]
                break
        return order

    # -- decisions

    def tick(self, now: float) -> list[Placement]:
        self.now = now
        placements: list[Placement] = []
        for engine_id, until in list(self._holding.items()):
            if until <= now:
                del self._holding[engine_id]
                self._dirty[engine_id] = None
        if self._homeless and self._homeless_dirty:
            self._homeless_dirty = False
            for task in list(self._homeless.values()):
                job = self.jobs[task.job_id]
                if self._home_or_assign(job, task) is not None:
                    self._dequeue(task)
                    self._enqueue(task)
        while self._dirty or self._bf_dirty:
            dirty, self._dirty = self._dirty, {}
            for engine_id in dirty:
                engine = self.engines.get(engine_id)
                if engine is not None and engine.free > 0 and not engine.suspect and self._pending.get(engine_id):
                    self._fill(engine, now, placements)
            bf_dirty, self._bf_dirty = self._bf_dirty, {}
            if self.policy.backfills():
                for key in bf_dirty:
                    self._backfill(key, now, placements)
        return placements

    def _fill(self, engine: Engine, now: float, placements: list[Placement]) -> None:
        if not self._device_turn(engine, now):
            return
        pending = self._pending[engine.engine_id]
        order = self._group_first(
            engine, self._switch_first(engine, sorted(pending.values(), key=lambda t: self._order_key(t, now)))
        )
        if self._waits_for_pass(engine, order, now):
            return
        for i, task in enumerate(order):
            if task.task_id not in pending:  # started in an earlier task's pass
                continue
            if engine.free <= 0 or (engine.running and self._switch_to(engine, task) is not None):
                break  # a switch waits for the engine to drain; the tasks behind it wait too
            self._dequeue(task)
            self._start(task, engine, now, placements)
            if task.tokens > 0 and self.pass_window is not None:
                self._share_pass(engine, task, order[i + 1 :], now, placements)

    # -- shared passes (several jobs' train steps in one forward and backward)

    def _share_pass(
        self, engine: Engine, lead: Task, rest: list[Task], now: float, placements: list[Placement]
    ) -> None:
        """Start in ``lead``'s pass the train steps behind it, in their order, that may share it
        (other jobs', same weights), while the pass's tokens stay within the engine's
        micro-batch budget: the first that would not fit ends the pass (none jumps it)."""
        budget = engine.pass_tokens or DEFAULT_MICRO_BATCH_TOKENS
        pending = self._pending[engine.engine_id]
        used, members = lead.tokens, [lead]
        for task in rest:
            if task.tokens <= 0 or task.task_id not in pending or task.weights != lead.weights:
                continue
            if used + task.tokens > budget:
                break
            used += task.tokens
            self._dequeue(task)
            self._start(task, engine, now, placements, lead)
            members.append(task)
        engine.last_pass = len(members)
        engine.largest_pass = max(engine.largest_pass, len(members))
        if len(members) > 1:
            engine.shared_passes += 1
            engine.shared_tasks += len(members)
            for task in members:
                self._running[task.task_id].share = len(members)

    def _waits_for_pass(self, engine: Engine, order: list[Task], now: float) -> bool:
        """Whether a trainer waits for more train steps to share its next pass: its first task
        may share one, fewer such steps are queued than jobs are homed on it and fill its
        budget, and ``pass_window`` has not passed since that first task came. ``tick`` looks
        at it again when the window ends (``next_wake``)."""
        eid = engine.engine_id
        if not self.pass_window or engine.kind not in SERIAL_KINDS or not order or order[0].tokens <= 0:
            self._holding.pop(eid, None)
            return False
        until = order[0].submitted_at + self.pass_window
        sharing = [t.tokens for t in order if t.tokens > 0]
        full = sum(sharing) >= (engine.pass_tokens or DEFAULT_MICRO_BATCH_TOKENS)
        if now >= until or full or len(sharing) >= len(self._homed[eid]):
            self._holding.pop(eid, None)
            return False
        self._holding[eid] = until
        return True

    def next_wake(self) -> float | None:
        """When a trainer waiting for a pass's steps must be looked at again (None: none waits)."""
        return min(self._holding.values(), default=None)

    def _backfill(self, key: Key, now: float, placements: list[Placement]) -> None:
        free, waiting = self._free.get(key), self._waiting.get(key)
        if not free or not waiting:
            return
        candidates = sorted(waiting.values(), key=lambda t: self._order_key(t, now))
        if key[0] in SERIAL_KINDS:
            for task in candidates:
                job = self.jobs[task.job_id]
                target = self._trainer_to_move_to(job, key)
                if target is not None:
                    self._dequeue(task)
                    self._set_home(job, task.kind, target.engine_id)
                    self._start(task, target, now, placements)
            return
        idle = iter(list(free))  # rollout: the idle engines in turn, each until it is full
        engine: Engine | None = None
        for task in candidates:
            while engine is None or engine.free <= 0 or (engine.running and self._switch_to(engine, task)):
                engine_id = next(idle, None)
                if engine_id is None:
                    return
                engine = self.engines[engine_id]
                if engine.free <= 0 or self._pending[engine_id] or not self._device_turn(engine, now):
                    engine = None
            self._dequeue(task)
            self._start(task, engine, now, placements)

    def _trainer_to_move_to(self, job: Job, key: Key) -> Engine | None:
        """The idle trainer with the fewest jobs that has room for this job and its state."""
        home = job.homes.get(key[0])
        best: Engine | None = None
        for engine_id in self._free[key]:
            load = len(self._homed[engine_id])
            engine = self.engines[engine_id]
            if (
                engine_id == home
                or self._pending[engine_id]
                or not self._fits(engine, job.state_bytes)
                or self.room_problem(engine, job.state_bytes)
            ):
                continue
            if best is None or load < len(self._homed[best.engine_id]):
                best = engine
                if load == 0:
                    break
        return best

    def _start(
        self, task: Task, engine: Engine, now: float, placements: list[Placement], lead: Task | None = None
    ) -> None:
        """Start ``task`` on ``engine``: alone, or (``lead``) in the pass ``lead`` started."""
        del self.queue[task.task_id]
        job = self.jobs[task.job_id]
        del job.queued[task.task_id]
        if task.kind in SERIAL_KINDS:
            job.serial[task.kind].popleft()
            job.state_engine, job.state_tier = engine.engine_id, "device"
        job.running[task.kind] = job.running.get(task.kind, 0) + 1
        job.started[task.task_id] = engine.engine_id
        if not engine.running:
            engine.busy_since = now
        engine.running[task.task_id] = task
        engine.started_at[task.task_id] = now
        if lead is not None:  # it rides in lead's pass: the engine's order and switches are lead's
            engine.pass_of[task.task_id] = lead.task_id
            engine.passes[lead.task_id] += 1
            charge = self.estimate(task) / engine.capacity
            self.charged[job.user] = self.charged.get(job.user, 0.0) + charge
            self._running[task.task_id] = Running(engine.engine_id, job, job.user, charge)
            placements.append(Placement(task, engine.engine_id, lead.task_id))
            return
        engine.pass_of[task.task_id] = task.task_id
        engine.passes[task.task_id] = 1
        if engine.last_job == task.job_id:
            engine.streak += 1
        else:
            engine.last_job, engine.streak = task.job_id, 1
        charge = self.estimate(task) / engine.capacity
        switch = self._switch_to(engine, task)
        if switch is not None:  # the task pays for it: the engine serves nothing else meanwhile
            charge += self.switch_estimate(switch)
            engine.holds, engine.group = switch, 0
            engine.switches += 1
            if engine.device:
                self._awake[engine.device] = engine.engine_id
        engine.group += 1
        self.charged[job.user] = self.charged.get(job.user, 0.0) + charge
        self._running[task.task_id] = Running(engine.engine_id, job, job.user, charge, switch)
        placements.append(Placement(task, engine.engine_id))
        if engine.free <= 0:
            self._engine_filled(engine)

    # -- hints for the state manager

    def upcoming(self, engine_id: str, now: float | None = None) -> list[str]:
        """Jobs homed on an engine, in the order their queued tasks would run there.

        For a trainer engine: the least-soon-needed job is last (evict it first), the first
        is the one to prefetch. ``now`` defaults to the last tick's clock.
        """
        engine = self.engines.get(engine_id)
        if engine is None:
            return []
        now = self.now if now is None else now
        best: list[tuple[tuple[int, float, float, int], Task]] = []
        for job_id in self._homed[engine_id]:
            job = self.jobs[job_id]
            if engine.kind in SERIAL_KINDS:
                head = self._serial_head(job, engine.kind)
                tasks: Iterable[Task] = () if head is None else (head,)
            else:
                tasks = (t for t in job.queued.values() if t.kind == engine.kind)
            keys = [(self._order_key(t, now), t) for t in tasks]
            if keys:
                best.append(min(keys, key=lambda kt: kt[0]))
        best.sort(key=lambda kt: kt[0])
        return [t.job_id for t in self._switch_first(engine, [t for _, t in best])]

    def expected(self, engine_id: str, now: float | None = None) -> list[str]:
        """Every job homed on a trainer engine, soonest needed there first: ``upcoming``, then the
        jobs with nothing queued for it, by when they should next call it. First those between a
        rollout and their trainer call (the last task that ended was another kind's and none
        runs: the driver is scoring), longest waiting first; then those with tasks running on
        other engines, soonest expected end (start + learned estimate) first; last the rest (a
        task here ended last, or runs now: a new rollout is ahead of them), least recent first.
        The state manager prefetches the first that sits on NVMe while the engine serves
        another job, and evicts from the end. Other engines: ``upcoming``. O(homed jobs and
        their running tasks)."""
        engine = self.engines.get(engine_id)
        listed = self.upcoming(engine_id, now)
        if engine is None or engine.kind not in SERIAL_KINDS:
            return listed
        scoring, running, rest = [], [], []
        seen = set(listed)
        for job_id in self._homed[engine_id]:
            if job_id in seen:
                continue
            job = self.jobs[job_id]
            kind, when = job.last_done or (engine.kind, float("-inf"))
            ends = [
                other.started_at[task_id] + self.estimate(other.running[task_id])
                for task_id, other in ((t, self.engines[e]) for t, e in job.started.items())
                if other.kind != engine.kind
            ]
            if ends:  # its soonest expected end elsewhere
                running.append((min(ends), job_id))
            elif kind != engine.kind and not job.running.get(engine.kind):
                scoring.append((when, job_id))
            else:
                rest.append((when, job_id))
        return listed + [job_id for group in (scoring, running, rest) for _, job_id in sorted(group)]

    # -- accounting

    def utilization(self, engine_id: str, now: float, since: float) -> float:
        """Busy share of one engine's time in [since, now] (or since it came up, if later)."""
        return self.utilizations(now, since, (engine_id,)).get(engine_id, 0.0)

    def utilizations(self, now: float, since: float, engine_ids: Iterable[str] | None = None) -> dict[str, float]:
        """Busy share per engine in [since, now], in one pass over the kept intervals."""
        busy, spans = self._busy_in(now, since, engine_ids)
        return {e: (b / spans[e] if spans[e] > 0 else 0.0) for e, b in busy.items()}

    def bubble_ratio(self, now: float, since: float) -> float:
        """Idle share of engine time in [since, now], over the engines up now."""
        busy, spans = self._busy_in(now, since, None)
        total = sum(spans.values())
        return 1.0 - sum(busy.values()) / total if total > 0 else 0.0

    def _busy_in(
        self, now: float, since: float, engine_ids: Iterable[str] | None
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Busy seconds (union over slots) and window length per engine up now.

        Finished tasks come from ``intervals`` (the last ``INTERVALS_KEPT``; a window reaching
        further back under-counts), running tasks count up to ``now``.
        """
        wanted = [e for e in (self.engines if engine_ids is None else engine_ids) if e in self.engines]
        starts = {e: since if (up := self.engines[e].up_at) is None else max(since, up) for e in wanted}
        runs: dict[str, list[tuple[float, float]]] = {e: [] for e in wanted}
        for i in self.intervals:
            if i.engine_id in runs and i.end > since:
                runs[i.engine_id].append((i.start, i.end))
        busy, spans = {}, {}
        for e in wanted:
            runs[e].extend((s, now) for s in self.engines[e].started_at.values())
            spans[e] = max(0.0, now - starts[e])
            busy[e] = union_length(runs[e], starts[e], now) if spans[e] > 0 else 0.0
        return busy, spans

    # -- internals: homes

    def room_problem(self, engine: Engine, state_bytes: int = 0) -> str:
        """Why ``engine`` cannot be home to one more job with ``state_bytes`` of state ("" if it
        can): the policy (isolated: one job), the cluster's cap (``jobs_per_engine``), the jobs
        its memory holds (``job_slots``: a rollout engine's adapters), the job state its tiers
        hold together (``state_room_bytes``: a trainer's host and NVMe). An engine that declares
        neither holds ``UNDECLARED_JOBS_PER_ENGINE``. O(jobs homed there)."""
        homed = self._homed.get(engine.engine_id, {})
        load = len(homed)
        if self.policy.dedicates_engines():
            return "" if load < 1 else f"holds a job ({self.policy.name})"
        if self.jobs_per_engine is not None and load >= self.jobs_per_engine:
            return f"holds {load} jobs (jobs_per_engine cap: {self.jobs_per_engine})"
        if engine.job_slots > 0 and load >= engine.job_slots:
            return f"holds {load} jobs (its adapter slots: {engine.job_slots})"
        if engine.state_room_bytes > 0 and engine.kind in SERIAL_KINDS:
            held = sum(self.jobs[j].state_bytes for j in homed)
            if held + state_bytes > engine.state_room_bytes:
                return (
                    f"holds {load} jobs whose state ({_mb(held)} MB) leaves no room for {_mb(state_bytes)} MB "
                    f"(its tiers hold {_mb(engine.state_room_bytes)} MB)"
                )
        elif engine.job_slots <= 0 and engine.state_room_bytes <= 0 and load >= UNDECLARED_JOBS_PER_ENGINE:
            return f"holds {load} jobs (undeclared room: {UNDECLARED_JOBS_PER_ENGINE})"
        return ""

    def job_room(self, engine_id: str) -> int | None:
        """How many jobs the engine may be home to by count (the cap, its slots, the undeclared
        default; None: only its state room bounds it)."""
        engine = self.engines[engine_id]
        if self.policy.dedicates_engines():
            return 1
        limits = [n for n in (self.jobs_per_engine, engine.job_slots or None) if n]
        if not engine.job_slots and not engine.state_room_bytes:
            limits.append(UNDECLARED_JOBS_PER_ENGINE)
        return min(limits) if limits else None

    @staticmethod
    def _fits(engine: Engine, state_bytes: int) -> bool:
        return engine.state_capacity_bytes <= 0 or state_bytes <= engine.state_capacity_bytes

    def _pick_home(self, kind: str, model: str, state_bytes: int) -> str | None:
        buckets = self._buckets.get((kind, model))
        if not buckets:
            return None
        for load in self.policy.home_order(n for n, b in buckets.items() if b):
            for engine_id in buckets[load]:
                engine = self.engines[engine_id]
                if (
                    not engine.suspect
                    and (kind != "trainer" or self._fits(engine, state_bytes))
                    and not self.room_problem(engine, state_bytes if kind == "trainer" else 0)
                ):
                    return engine_id
        return None

    def _full_reason(self, model: str, state_bytes: int, rollout_full: bool, trainer_full: bool) -> str:
        silent = [
            k
            for k, full in (("rollout", rollout_full), ("trainer", trainer_full))
            if full and all(self.engines[e].suspect for e in self._by_key[(k, model)])
        ]
        if silent:
            return (
                f"waiting for its engines: every {' and '.join(silent)} engine of {model} is suspect "
                "(its worker missed heartbeats)"
            )
        if self.policy.dedicates_engines():
            counts = []
            for kind in ("rollout", "trainer"):
                engines = self._by_key[(kind, model)]
                free = sum(
                    1
                    for e in engines
                    if not self._homed[e] and (kind != "trainer" or self._fits(self.engines[e], state_bytes))
                )
                counts.append(f"{free} of {len(engines)} {kind}")
            return f"waiting for dedicated engines ({self.policy.name}: {' / '.join(counts)} free)"
        parts = []
        for kind, full in (("rollout", rollout_full), ("trainer", trainer_full)):
            if not full:
                continue
            up = [self.engines[e] for e in self._by_key[(kind, model)] if not self.engines[e].suspect]
            least = min(up, key=lambda e: len(self._homed[e.engine_id]))  # the nearest to room
            why = self.room_problem(least, state_bytes if kind == "trainer" else 0)
            if kind == "trainer" and not why and not self._fits(least, state_bytes):
                why = f"cannot hold {_mb(state_bytes)} MB of state on one tier"
            if len(up) == 1:
                parts.append(f"the {kind} engine of {model} {why}")
            else:
                parts.append(f"every {kind} engine of {model} is full (the least loaded {why})")
        return "waiting for room: " + "; ".join(parts)

    def _set_home(self, job: Job, kind: str, engine_id: str | None, requeue: bool = True) -> None:
        old = job.homes.get(kind)
        if old == engine_id:
            return
        if old is not None and old in self.engines:
            self._homed[old].pop(job.job_id, None)
            self._load_changed(old, +1)
            self._homeless_dirty = True
            self._bf_dirty[self.engines[old].key] = None
        mirror = self.home if kind == "trainer" else self.rollout_home
        if engine_id is None:
            job.homes.pop(kind, None)
            mirror.pop(job.job_id, None)
        else:
            job.homes[kind] = engine_id
            mirror[job.job_id] = engine_id
            self._homed[engine_id][job.job_id] = None
            self._load_changed(engine_id, -1)
        if requeue:
            for task in [t for t in job.queued.values() if t.kind == kind and t.task_id in self._where]:
                self._dequeue(task)
                self._enqueue(task)

    def _load_changed(self, engine_id: str, delta_before: int) -> None:
        """Move an engine between load buckets; ``delta_before``: old load minus new load."""
        buckets = self._buckets[self.engines[engine_id].key]
        load = len(self._homed[engine_id])
        buckets.get(load + delta_before, {}).pop(engine_id, None)
        buckets.setdefault(load, {})[engine_id] = None

    def _home_or_assign(self, job: Job, task: Task) -> str | None:
        home = job.homes.get(task.kind)
        if home is not None:
            return home
        home = self._pick_home(task.kind, task.model, job.state_bytes)
        if home is not None:
            self._set_home(job, task.kind, home, requeue=False)
        return home

    # -- internals: queues

    @staticmethod
    def _serial_head(job: Job, kind: str) -> Task | None:
        queue = job.serial.get(kind)
        return queue[0] if queue else None

    def _eligible(self, job: Job, task: Task) -> bool:
        if task.kind not in SERIAL_KINDS:
            return True
        return not job.running.get(task.kind) and self._serial_head(job, task.kind) is task

    def _movable(self, task: Task, job: Job) -> bool:
        if not self.policy.backfills():
            return False
        return task.kind not in SERIAL_KINDS or job.state_tier is None

    def _enqueue(self, task: Task) -> None:
        """Make an eligible task pending on its job's home (or homeless until one is found)."""
        job = self.jobs[task.job_id]
        engine_id = self._home_or_assign(job, task)
        self._where[task.task_id] = engine_id
        if engine_id is None:
            self._homeless[task.task_id] = task
            return
        self._pending[engine_id][task.task_id] = task
        engine = self.engines[engine_id]
        if engine.free > 0 and not engine.suspect:
            self._dirty[engine_id] = None
        else:
            self._mark_waiting(task, job, engine)

    def _mark_waiting(self, task: Task, job: Job, engine: Engine) -> None:
        waiting = self._waiting.setdefault(engine.key, {})
        if (engine.free <= 0 or engine.suspect) and self._movable(task, job):
            if task.task_id not in waiting:
                waiting[task.task_id] = task
                self._bf_dirty[engine.key] = None
        else:
            waiting.pop(task.task_id, None)

    def _dequeue(self, task: Task) -> None:
        engine_id = self._where.pop(task.task_id, "")
        if engine_id is None:
            self._homeless.pop(task.task_id, None)
        elif engine_id:
            self._pending[engine_id].pop(task.task_id, None)
            self._waiting.get((task.kind, task.model), {}).pop(task.task_id, None)

    def _engine_filled(self, engine: Engine) -> None:
        self._free[engine.key].pop(engine.engine_id, None)
        for task in self._pending[engine.engine_id].values():
            self._mark_waiting(task, self.jobs[task.job_id], engine)

    def _engine_freed(self, engine: Engine) -> None:
        self._free.setdefault(engine.key, {})[engine.engine_id] = None
        waiting = self._waiting.get(engine.key, {})
        for task_id in self._pending[engine.engine_id]:
            waiting.pop(task_id, None)
        self._dirty[engine.engine_id] = None
        self._bf_dirty[engine.key] = None


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}".rstrip("0").rstrip(".")
