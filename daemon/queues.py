"""The queues: every queued task, and for each engine the tasks eligible to run there now.

``Queues`` owns the queued tasks (and each job's queued and serial lists), the per-engine pending
sets, the homeless tasks (their job has no home of their kind yet), the movable tasks waiting on
full or suspect homes (what backfill may take), the engines with a free slot, and the dirty marks
``tick`` works from. Invariants: a queued task is eligible (any rollout task; a job's first
trainer task while none of its runs) exactly when it is pending on its home or homeless; a
pending task is in ``waiting`` exactly when its home is full or suspect and the policy may move
it; an engine is in ``free`` exactly when it has a free slot and is not suspect; an engine that
could start something is marked dirty.
"""

from __future__ import annotations

from collections import deque

from daemon.homes import Homes
from daemon.policies import PlacementPolicy
from daemon.sched_records import SERIAL_KINDS, Engine, Job, Key, Task


class Queues:
    def __init__(self, engines: dict[str, Engine], jobs: dict[str, Job], homes: Homes, policy: PlacementPolicy) -> None:
        self.engines, self.jobs = engines, jobs  # the scheduler's tables, read here
        self.homes = homes
        self.policy = policy
        self.queued: dict[int, Task] = {}  # every queued (not running) task
        self.pending: dict[str, dict[int, Task]] = {}  # engine -> eligible tasks homed there
        self.free: dict[Key, dict[str, None]] = {}  # engines with a free slot
        self.waiting: dict[Key, dict[int, Task]] = {}  # movable tasks on full homes
        self.homeless: dict[int, Task] = {}  # eligible tasks whose job has no home yet
        self._where: dict[int, str | None] = {}  # eligible task -> engine (None: homeless)
        self._dirty: dict[str, None] = {}  # engines to fill at the next tick
        self._bf_dirty: dict[Key, None] = {}  # keys whose backfill may have changed
        self._homeless_dirty = False

    # -- engines

    def add_engine(self, engine: Engine) -> None:
        self.pending[engine.engine_id] = {}
        if engine.free > 0:
            self.free.setdefault(engine.key, {})[engine.engine_id] = None
        self._bf_dirty[engine.key] = None
        self._homeless_dirty = True

    def remove_engine(self, engine: Engine) -> list[Task]:
        """Forget an engine; the tasks that were pending there (to be queued again)."""
        self.free.get(engine.key, {}).pop(engine.engine_id, None)
        self._dirty.pop(engine.engine_id, None)
        stranded = list(self.pending.pop(engine.engine_id).values())
        for task in stranded:
            self._where.pop(task.task_id, None)
            self.waiting.get(engine.key, {}).pop(task.task_id, None)
        return stranded

    def suspect(self, engine: Engine) -> None:
        """``engine`` turned suspect: it takes nothing; its movable tasks wait for backfill."""
        self.free.get(engine.key, {}).pop(engine.engine_id, None)
        self._dirty.pop(engine.engine_id, None)
        for task in self.pending[engine.engine_id].values():
            self.mark_waiting(task, self.jobs[task.job_id], engine)

    def back(self, engine: Engine) -> None:
        """``engine`` is no longer suspect."""
        if engine.free > 0:
            self.freed(engine)
        self._homeless_dirty = True

    def filled(self, engine: Engine) -> None:
        self.free[engine.key].pop(engine.engine_id, None)
        for task in self.pending[engine.engine_id].values():
            self.mark_waiting(task, self.jobs[task.job_id], engine)

    def freed(self, engine: Engine) -> None:
        self.free.setdefault(engine.key, {})[engine.engine_id] = None
        waiting = self.waiting.get(engine.key, {})
        for task_id in self.pending[engine.engine_id]:
            waiting.pop(task_id, None)
        self._dirty[engine.engine_id] = None
        self._bf_dirty[engine.key] = None

    def idle(self, engine_id: str) -> bool:
        """Nothing runs on the engine and nothing waits for it."""
        return not self.engines[engine_id].running and not self.pending.get(engine_id)

    # -- dirty marks

    def mark_dirty(self, engine_id: str) -> None:
        self._dirty[engine_id] = None

    def mark_homeless_dirty(self) -> None:
        self._homeless_dirty = True

    def take_dirty(self) -> dict[str, None]:
        """The engines to fill, marked since the last call; the marks cleared."""
        dirty, self._dirty = self._dirty, {}
        return dirty

    def take_bf_dirty(self) -> dict[Key, None]:
        """The keys whose backfill may have changed since the last call; the marks cleared."""
        bf_dirty, self._bf_dirty = self._bf_dirty, {}
        return bf_dirty

    def any_dirty(self) -> bool:
        return bool(self._dirty or self._bf_dirty)

    # -- tasks

    def add(self, job: Job, task: Task) -> None:
        """Record ``task`` as queued."""
        self.queued[task.task_id] = task
        job.queued[task.task_id] = task
        job.methods.add(task.method)

    def submit(self, job: Job, task: Task) -> None:
        """Queue a new task: behind its job's others of a serial kind, pending if eligible."""
        self.add(job, task)
        if task.kind in SERIAL_KINDS:
            job.serial.setdefault(task.kind, deque()).append(task)
        if self.eligible(job, task):
            self.enqueue(task)

    def put_back(self, job: Job, task: Task) -> None:
        """A running task whose engine went down is queued again, first of its job's kind."""
        self.queued[task.task_id] = task
        job.queued[task.task_id] = task
        job.running[task.kind] = max(0, job.running.get(task.kind, 0) - 1)
        job.started.pop(task.task_id, None)
        if task.kind in SERIAL_KINDS:
            job.serial.setdefault(task.kind, deque()).appendleft(task)

    def take(self, job: Job, task: Task) -> None:
        """``task`` starts: it leaves the queue (already out of pending)."""
        del self.queued[task.task_id]
        del job.queued[task.task_id]
        if task.kind in SERIAL_KINDS:
            job.serial[task.kind].popleft()

    def drop_job(self, job: Job) -> list[Task]:
        """A released job's queued tasks leave the queue; the tasks."""
        dropped = list(job.queued.values())
        for task in dropped:
            self.dequeue(task)
            del self.queued[task.task_id]
        job.queued.clear()
        job.serial.clear()
        return dropped

    def eligible(self, job: Job, task: Task) -> bool:
        if task.kind not in SERIAL_KINDS:
            return True
        return not job.running.get(task.kind) and job.serial_head(task.kind) is task

    def movable(self, task: Task, job: Job) -> bool:
        if not self.policy.backfills():
            return False
        return task.kind not in SERIAL_KINDS or job.state_tier is None

    def enqueue(self, task: Task) -> None:
        """Make an eligible task pending on its job's home (or homeless until one is found)."""
        job = self.jobs[task.job_id]
        engine_id = self.homes.home_for(job, task)
        self._where[task.task_id] = engine_id
        if engine_id is None:
            self.homeless[task.task_id] = task
            return
        self.pending[engine_id][task.task_id] = task
        engine = self.engines[engine_id]
        if engine.free > 0 and not engine.suspect:
            self._dirty[engine_id] = None
        else:
            self.mark_waiting(task, job, engine)

    def dequeue(self, task: Task) -> None:
        """An eligible task is no longer pending anywhere (it starts, moves or is dropped)."""
        engine_id = self._where.pop(task.task_id, "")
        if engine_id is None:
            self.homeless.pop(task.task_id, None)
        elif engine_id:
            self.pending[engine_id].pop(task.task_id, None)
            self.waiting.get((task.kind, task.model), {}).pop(task.task_id, None)

    def mark_waiting(self, task: Task, job: Job, engine: Engine) -> None:
        waiting = self.waiting.setdefault(engine.key, {})
        if (engine.free <= 0 or engine.suspect) and self.movable(task, job):
            if task.task_id not in waiting:
                waiting[task.task_id] = task
                self._bf_dirty[engine.key] = None
        else:
            waiting.pop(task.task_id, None)

    def head_moved(self, job: Job) -> None:
        """Its state moved: whether its next trainer task may move with a backfill changed."""
        head = job.serial_head("trainer")
        engine_id = self._where.get(head.task_id) if head is not None else None
        if head is not None and engine_id is not None:
            self.mark_waiting(head, job, self.engines[engine_id])

    def rehome(self, job: Job, kind: str, engine_id: str | None, requeue: bool = True) -> None:
        """Home ``job``'s ``kind`` on ``engine_id`` (None: nowhere), its pending tasks following."""
        old = job.homes.get(kind)
        if old == engine_id:
            return
        if self.homes.move(job, kind, engine_id) and old is not None:
            self._homeless_dirty = True
            self._bf_dirty[self.engines[old].key] = None
        if requeue:
            for task in [t for t in job.queued.values() if t.kind == kind and t.task_id in self._where]:
                self.dequeue(task)
                self.enqueue(task)

    def retry_homeless(self) -> None:
        """Give homeless tasks a home, if some room appeared since the last try."""
        if not self.homeless or not self._homeless_dirty:
            return
        self._homeless_dirty = False
        for task in list(self.homeless.values()):
            job = self.jobs[task.job_id]
            if self.homes.home_for(job, task) is not None:
                self.dequeue(task)
                self.enqueue(task)
