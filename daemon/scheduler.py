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

The ``Scheduler`` holds the engine and job tables and the running tasks, and composes the parts
that own the rest, each asked rather than reached into: ``daemon.homes`` (homes and room),
``daemon.queues`` (queued, pending, waiting tasks and what ``tick`` must look at),
``daemon.task_order`` (estimates, fair shares, the order), ``daemon.switches`` (weights held,
device turns), ``daemon.passes`` (shared train passes) and ``daemon.engine_time`` (busy time).
The records they share are ``daemon.sched_records``'.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from functools import partial

from daemon.engine_time import INTERVALS_KEPT, EngineTime
from daemon.homes import UNDECLARED_JOBS_PER_ENGINE, Homes
from daemon.passes import Passes
from daemon.policies import PlacementPolicy, placement_policy
from daemon.queues import Queues
from daemon.sched_records import SERIAL_KINDS, Admission, Engine, Interval, Job, Key, Placement, Running, Task, mb
from daemon.switches import DEFAULT_SWITCH_ESTIMATE, Switches
from daemon.task_order import DEFAULT_ESTIMATE, EMA, TaskOrder
from plexctl.common.cluster_config import DEFAULTS
from plexctl.common.scheduling import union_length  # shared with the CLI and the daemon's metrics

__all__ = [
    "DEFAULT_ESTIMATE",
    "DEFAULT_SWITCH_ESTIMATE",
    "EMA",
    "INTERVALS_KEPT",
    "SERIAL_KINDS",
    "UNDECLARED_JOBS_PER_ENGINE",
    "Admission",
    "Engine",
    "Interval",
    "Job",
    "Key",
    "Placement",
    "Running",
    "Scheduler",
    "Task",
    "union_length",
]


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
        self.engines: dict[str, Engine] = {}
        self.jobs: dict[str, Job] = {}
        # the parts, each owning its tables (they read ``engines`` and ``jobs``, never change them)
        self.homes = Homes(self.engines, self.jobs, self.policy, jobs_per_engine)
        self.order = TaskOrder(self.engines, self.jobs, max_switches)
        self.switches = Switches(self.engines, max_group)
        self.passes = Passes(pass_window)
        self.queues = Queues(self.engines, self.jobs, self.homes, self.policy)
        self.time = EngineTime(self.engines)
        self._running: dict[int, Running] = {}
        self.now = 0.0  # the clock of the last tick

    # -- the parts' tables, read by the daemon, the simulator and the metrics

    @property
    def jobs_per_engine(self) -> int | None:
        return self.homes.jobs_per_engine

    @property
    def queue(self) -> dict[int, Task]:
        return self.queues.queued

    def interactive(self, now: float) -> tuple[float, int]:
        """The interactive class: its share of recent engine time, and its tasks queued now."""
        return self.order.interactive_share(now), sum(1 for t in self.queues.queued.values() if t.interactive)

    @property
    def home(self) -> dict[str, str]:
        return self.homes.home

    @property
    def rollout_home(self) -> dict[str, str]:
        return self.homes.rollout_home

    @property
    def estimates(self) -> dict[tuple[str, str], float]:
        return self.order.estimates

    @property
    def shares(self) -> dict[str, float]:
        return self.order.shares

    @property
    def served(self) -> dict[str, float]:
        return self.order.served

    @property
    def charged(self) -> dict[str, float]:
        return self.order.charged

    @property
    def switch_estimates(self) -> dict[str, float]:
        return self.switches.estimates

    @property
    def intervals(self) -> deque[Interval]:
        return self.time.intervals

    # -- engines

    def engine_up(self, engine: Engine, now: float | None = None) -> None:
        if engine.engine_id in self.engines:
            self.engine_down(engine.engine_id)
        if now is not None:
            engine.up_at = now
        self.engines[engine.engine_id] = engine
        self.homes.add_engine(engine)
        self.queues.add_engine(engine)
        self.switches.add_engine(engine)

    def engine_down(self, engine_id: str) -> list[Task]:
        """Remove an engine; its running tasks return to the queue (returned for logging;
        those of released jobs are dropped).

        Jobs homed there lose that home (and any state the core believed was on it) and get
        a new one by the policy's rule when they next have a task of that kind.
        """
        engine = self.engines.pop(engine_id, None)
        if engine is None:
            return []
        stranded = self.queues.remove_engine(engine)
        for mate in self.switches.remove_engine(engine):
            self.queues.mark_dirty(mate)
        requeued = []  # the running tasks of jobs still known (a released job's are dropped)
        for task in engine.running.values():
            run = self._running.pop(task.task_id)
            self.order.refund(run)
            if self.jobs.get(task.job_id) is not run.job:
                continue  # released (perhaps re-submitted since under the same id)
            requeued.append(task)
            self.queues.put_back(run.job, task)
        engine.running.clear()
        engine.started_at.clear()
        self.passes.engine_stopped(engine)
        self.homes.remove_engine(engine)
        for task in stranded:
            self.queues.enqueue(task)
        for task in requeued:
            if self.queues.eligible(self.jobs[task.job_id], task):
                self.queues.enqueue(task)
        self.queues.mark_homeless_dirty()
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
        self.queues.suspect(engine)

    def engine_back(self, engine_id: str) -> None:
        """A suspect engine's worker answers again: it takes tasks as before."""
        engine = self.engines.get(engine_id)
        if engine is None or not engine.suspect:
            return
        engine.suspect = False
        self.queues.back(engine)

    def serves(self, kind: str, model: str) -> bool:
        return self.homes.serves(kind, model)

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
        rollouts = self.homes.by_key.get(("rollout", model), {})
        trainers = self.homes.by_key.get(("trainer", model), {})
        if not rollouts or not trainers:
            missing = " and ".join(k for k, e in (("rollout", rollouts), ("trainer", trainers)) if not e)
            return Admission(False, f"no ready engine serves {model} (no {missing} engine)")
        caps = [self.engines[e].state_capacity_bytes for e in trainers]
        if state_bytes > 0 and all(c > 0 for c in caps) and state_bytes > max(caps):
            return Admission(False, f"state {mb(state_bytes)} MB does not fit any tier (largest: {mb(max(caps))} MB)")
        rollout = job.homes.get("rollout") if job else None
        trainer = (job.homes.get("trainer") if job else None) or (trainer if trainer in trainers else None)
        rollout = rollout or self.homes.pick("rollout", model, 0)
        trainer = trainer or self.homes.pick("trainer", model, state_bytes)
        if rollout is None or trainer is None:
            return Admission(False, self.homes.full_reason(model, state_bytes, rollout is None, trainer is None))
        if job is None:
            job = self.jobs[job_id] = Job(job_id, model)
        job.model, job.user, job.priority, job.state_bytes = model, user, priority, state_bytes
        if job.admitted_at is None:
            job.admitted_at = now
        self.queues.rehome(job, "rollout", rollout)
        self.queues.rehome(job, "trainer", trainer)
        return Admission(True, "admitted", rollout, trainer)

    def release(self, job_id: str) -> list[Task]:
        """Forget a job (it ended): free its homes, drop its queued tasks (returned) and estimates.

        Its running tasks finish normally; ``done`` still accounts for them.
        """
        job = self.jobs.pop(job_id, None)
        if job is None:
            return []
        dropped = self.queues.drop_job(job)
        for kind in list(job.homes):
            self.queues.rehome(job, kind, None, requeue=False)
        self.order.forget(job_id, job.methods)
        return dropped

    forget_job = release

    def home_of(self, job_id: str, kind: str) -> str | None:
        job = self.jobs.get(job_id)
        return job.homes.get(kind) if job else None

    def room_problem(self, engine: Engine, state_bytes: int = 0) -> str:
        """Why ``engine`` cannot be home to one more job (``Homes.room_problem``; "" if it can)."""
        return self.homes.room_problem(engine, state_bytes)

    def job_room(self, engine_id: str) -> int | None:
        """How many jobs the engine may be home to by count (``Homes.job_room``)."""
        return self.homes.job_room(engine_id)

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
            self.queues.rehome(job, "trainer", engine_id)
        self.queues.head_moved(job)

    def set_share(self, user: str, weight: float) -> None:
        self.order.set_share(user, weight)

    # -- tasks

    def submit(self, task: Task) -> None:
        if task.task_id in self.queues.queued or task.task_id in self._running:
            return
        self.queues.submit(self._job_of(task), task)

    def claim(self, task: Task, engine_id: str, now: float) -> None:
        """Record ``task`` (not a trainer task) as started on ``engine_id`` at ``now``, whatever
        the order: its worker started it on its own, e.g. a task sent ahead of the one it follows,
        started as that one ended. It may take the engine past its capacity."""
        if task.kind in SERIAL_KINDS:
            raise ValueError(f"a {task.kind} task runs in its job's order: it cannot be claimed")
        self.queues.add(self._job_of(task), task)
        self._start(task, self.engines[engine_id], now, [])

    def _job_of(self, task: Task) -> Job:
        """``task``'s job, made if new."""
        job = self.jobs.get(task.job_id)
        if job is None:
            job = self.jobs[task.job_id] = Job(task.job_id, task.model, priority=task.priority)
        return job

    def idle(self, engine_id: str) -> bool:
        """Nothing runs on the engine and nothing waits for it."""
        return self.queues.idle(engine_id)

    def done(
        self, task_id: int, now: float, seconds: float | None = None, switch_seconds: float | None = None
    ) -> Task | None:
        """A task ended. ``seconds``: what the call itself took, its engine's switch left out
        (learned as its job's estimate for the method); ``switch_seconds``: what that switch
        took, when it needed one (learned as the switch estimate of its weights)."""
        run = self._running.pop(task_id, None)
        if run is None:
            return None
        engine = self.engines[run.engine_id]
        was_full = engine.free <= 0
        self.passes.task_ended(engine, task_id)
        task, took = self.time.task_ended(engine, task_id, now)
        self.order.serve(run.user, took / engine.capacity / run.share, task.interactive, now)
        self.order.refund(run)
        job = run.job
        job.started.pop(task_id, None)
        if self.jobs.get(task.job_id) is job:  # not released meanwhile
            job.running[task.kind] = max(0, job.running.get(task.kind, 0) - 1)
            job.last_done = (task.kind, now)
            if seconds is not None:
                self.order.learn(task, seconds)
            head = job.serial_head(task.kind)
            if head is not None and self.queues.eligible(job, head):
                self.queues.enqueue(head)
        if run.switch is not None and switch_seconds is not None:
            self.switches.learn(run.switch, switch_seconds)
        pending = self.queues.pending
        if was_full and engine.free > 0 and not engine.suspect:
            self.queues.freed(engine)
        elif not engine.running and pending[engine.engine_id] and not engine.suspect:
            self.queues.mark_dirty(engine.engine_id)  # a switch may have waited for it to drain
        if engine.device and not engine.running:  # the device may pass to another engine
            for mate in self.switches.mates(engine):
                if mate != engine.engine_id and pending.get(mate):
                    self.queues.mark_dirty(mate)
        return task

    # -- switches

    def switch_estimate(self, weights: str) -> float:
        """Seconds of switching an engine to ``weights`` (a load, a wake): learned, else the default."""
        return self.switches.estimate(weights)

    def set_switch_estimate(self, weights: str, seconds: float) -> None:
        """What switching to ``weights`` costs, known beforehand (e.g. from their size)."""
        self.switches.set_estimate(weights, seconds)

    # -- ordering

    def estimate(self, task: Task) -> float:
        return self.order.estimate(task)

    def response_ratio(self, task: Task, now: float) -> float:
        return self.order.response_ratio(task, now)

    def share_score(self, user: str) -> float:
        """Engine-seconds served (plus estimates of running tasks) per unit of share weight."""
        return self.order.share_score(user)

    # -- decisions

    def tick(self, now: float) -> list[Placement]:
        self.now = now
        placements: list[Placement] = []
        for engine_id in self.passes.expired(now):
            self.queues.mark_dirty(engine_id)
        self.queues.retry_homeless()
        while self.queues.any_dirty():
            for engine_id in self.queues.take_dirty():
                engine = self.engines.get(engine_id)
                if engine is not None and engine.free > 0 and not engine.suspect and self.queues.pending.get(engine_id):
                    self._fill(engine, now, placements)
            bf_dirty = self.queues.take_bf_dirty()  # those the fills above marked too
            if self.policy.backfills():
                for key in bf_dirty:
                    self._backfill(key, now, placements)
        return placements

    def _fill(self, engine: Engine, now: float, placements: list[Placement]) -> None:
        pending = self.queues.pending[engine.engine_id]
        rank = partial(self.order.key, now=now)
        if not self.switches.device_turn(engine, self.queues.pending, rank):
            return
        order = self.switches.group_first(engine, self.order.switch_first(engine, sorted(pending.values(), key=rank)))
        if self.passes.waits(engine, order, now, len(self.homes.homed[engine.engine_id])):
            return
        for i, task in enumerate(order):
            if task.task_id not in pending:  # started in an earlier task's pass
                continue
            if engine.free <= 0 or (engine.running and self.switches.switch_to(engine, task) is not None):
                break  # a switch waits for the engine to drain; the tasks behind it wait too
            self.queues.dequeue(task)
            self._start(task, engine, now, placements)
            if self.passes.leads(task):
                joining = self.passes.members(engine, task, order[i + 1 :], pending)
                for member in joining:
                    self.queues.dequeue(member)
                    self._start(member, engine, now, placements, task)
                self.passes.started(engine, 1 + len(joining))
                if joining:
                    for member in (task, *joining):
                        self._running[member.task_id].share = 1 + len(joining)

    def next_wake(self) -> float | None:
        """When a trainer waiting for a pass's steps must be looked at again (None: none waits)."""
        return self.passes.next_wake()

    def _backfill(self, key: Key, now: float, placements: list[Placement]) -> None:
        free, waiting = self.queues.free.get(key), self.queues.waiting.get(key)
        if not free or not waiting:
            return
        pending, rank = self.queues.pending, partial(self.order.key, now=now)
        candidates = sorted(waiting.values(), key=rank)
        if key[0] in SERIAL_KINDS:
            for task in candidates:
                job = self.jobs[task.job_id]
                target = self.homes.mover_target(job, key[0], (e for e in free if not pending[e]))
                if target is not None:
                    self.queues.dequeue(task)
                    self.queues.rehome(job, task.kind, target.engine_id)
                    self._start(task, target, now, placements)
            return
        idle = iter(list(free))  # rollout: the idle engines in turn, each until it is full
        engine: Engine | None = None
        for task in candidates:
            while engine is None or engine.free <= 0 or (engine.running and self.switches.switch_to(engine, task)):
                engine_id = next(idle, None)
                if engine_id is None:
                    return
                engine = self.engines[engine_id]
                if engine.free <= 0 or pending[engine_id] or not self.switches.device_turn(engine, pending, rank):
                    engine = None
            self.queues.dequeue(task)
            self._start(task, engine, now, placements)

    def _start(
        self, task: Task, engine: Engine, now: float, placements: list[Placement], lead: Task | None = None
    ) -> None:
        """Start ``task`` on ``engine``: alone, or (``lead``) in the pass ``lead`` started."""
        job = self.jobs[task.job_id]
        self.queues.take(job, task)
        if task.kind in SERIAL_KINDS:
            job.state_engine, job.state_tier = engine.engine_id, "device"
        job.running[task.kind] = job.running.get(task.kind, 0) + 1
        job.started[task.task_id] = engine.engine_id
        self.time.task_started(engine, task, now)
        charge = self.order.estimate(task) / engine.capacity
        if lead is not None:  # it rides in lead's pass: the engine's order and switches are lead's
            self.passes.join(engine, task, lead)
            self.order.charge(job.user, charge)
            self._running[task.task_id] = Running(engine.engine_id, job, job.user, charge)
            placements.append(Placement(task, engine.engine_id, lead.task_id))
            return
        self.passes.lead(engine, task)
        self.order.started(engine, task)
        switch = self.switches.switch_to(engine, task)
        if switch is not None:  # the task pays for it: the engine serves nothing else meanwhile
            charge += self.switches.estimate(switch)
            self.switches.switched(engine, switch)
        engine.group += 1
        self.order.charge(job.user, charge)
        self._running[task.task_id] = Running(engine.engine_id, job, job.user, charge, switch)
        placements.append(Placement(task, engine.engine_id))
        if engine.free <= 0:
            self.queues.filled(engine)

    # -- hints for the state manager

    def upcoming(self, engine_id: str, now: float | None = None) -> list[str]:
        """Jobs homed on an engine, in the order their queued tasks would run there.

        For a trainer engine: the least-soon-needed job is last (evict it first), the first
        is the one to prefetch. ``now`` defaults to the last tick's clock.
        """
        engine = self.engines.get(engine_id)
        if engine is None:
            return []
        return self.order.upcoming(engine, self.homes.homed[engine_id], self.now if now is None else now)

    def expected(self, engine_id: str, now: float | None = None) -> list[str]:
        """Every job homed on a trainer engine, soonest needed there first: ``upcoming``, then the
        jobs with nothing queued for it, by when they should next call it (``TaskOrder.expected``).
        The state manager prefetches the first that sits on NVMe while the engine serves another
        job, and evicts from the end. Other engines: ``upcoming``."""
        engine = self.engines.get(engine_id)
        listed = self.upcoming(engine_id, now)
        if engine is None or engine.kind not in SERIAL_KINDS:
            return listed
        return listed + self.order.expected(engine, self.homes.homed[engine_id], set(listed))

    # -- accounting

    def utilization(self, engine_id: str, now: float, since: float) -> float:
        """Busy share of one engine's time in [since, now] (or since it came up, if later)."""
        return self.time.utilizations(now, since, (engine_id,)).get(engine_id, 0.0)

    def utilizations(self, now: float, since: float, engine_ids: Iterable[str] | None = None) -> dict[str, float]:
        """Busy share per engine in [since, now], in one pass over the kept intervals."""
        return self.time.utilizations(now, since, engine_ids)

    def bubble_ratio(self, now: float, since: float) -> float:
        """Idle share of engine time in [since, now], over the engines up now."""
        return self.time.bubble_ratio(now, since)
