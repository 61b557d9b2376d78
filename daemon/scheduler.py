"""The task scheduler: a pure core that places jobs' service calls on engines.

The unit of scheduling is one *call* of one job (``generate`` on a rollout engine,
``train_step`` / ``publish`` / ``checkpoint`` / ``restore`` on a trainer engine), never a
whole job. The core owns no sockets and no clock: the daemon (and later the simulator)
feeds it ``submit``, ``engine_up`` / ``engine_down`` and ``done`` events and asks
``tick(now)`` for placements. Ordering within an engine kind is by job priority, then
response ratio ``(wait + estimate) / estimate`` with estimates learned per (job, method),
so a long call cannot starve short ones. Trainer calls keep affinity to the engine that
holds the job's state (its adapter and optimizer moments); moving state between trainer
engines is the state manager's business and is not done here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Task:
    task_id: int
    job_id: str
    kind: str  # rollout | trainer
    method: str
    model: str
    submitted_at: float
    priority: int = 0


@dataclass
class Engine:
    engine_id: str
    worker_id: str
    kind: str
    model: str
    capacity: int = 1
    running: dict[int, Task] = field(default_factory=dict)
    busy_since: float | None = None
    busy_seconds: float = 0.0
    tasks_done: int = 0

    @property
    def free(self) -> int:
        return self.capacity - len(self.running)


@dataclass(frozen=True)
class Placement:
    task: Task
    engine_id: str


DEFAULT_ESTIMATE = 1.0
EMA = 0.3


class Scheduler:
    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}
        self.queue: dict[int, Task] = {}
        self.home: dict[str, str] = {}  # job_id -> trainer engine holding its state
        self.estimates: dict[tuple[str, str], float] = {}

    # -- events

    def engine_up(self, engine: Engine) -> None:
        self.engines[engine.engine_id] = engine

    def engine_down(self, engine_id: str) -> list[Task]:
        """Remove an engine; its running tasks return to the queue (returned for logging)."""
        engine = self.engines.pop(engine_id, None)
        if engine is None:
            return []
        for job, home in list(self.home.items()):
            if home == engine_id:
                del self.home[job]
        for task in engine.running.values():
            self.queue[task.task_id] = task
        return list(engine.running.values())

    def submit(self, task: Task) -> None:
        self.queue[task.task_id] = task

    def done(self, task_id: int, now: float, seconds: float | None = None) -> Task | None:
        for engine in self.engines.values():
            task = engine.running.pop(task_id, None)
            if task is None:
                continue
            engine.tasks_done += 1
            if not engine.running and engine.busy_since is not None:
                engine.busy_seconds += now - engine.busy_since
                engine.busy_since = None
            if seconds is not None:
                key = (task.job_id, task.method)
                old = self.estimates.get(key)
                self.estimates[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds
            return task
        return None

    def forget_job(self, job_id: str) -> list[Task]:
        """Drop a job's queued tasks and its affinity (the job ended)."""
        dropped = [t for t in self.queue.values() if t.job_id == job_id]
        for t in dropped:
            del self.queue[t.task_id]
        self.home.pop(job_id, None)
        return dropped

    # -- decisions

    def estimate(self, task: Task) -> float:
        return self.estimates.get((task.job_id, task.method), DEFAULT_ESTIMATE)

    def response_ratio(self, task: Task, now: float) -> float:
        est = max(self.estimate(task), 1e-3)
        return (now - task.submitted_at + est) / est

    def tick(self, now: float) -> list[Placement]:
        order = sorted(self.queue.values(), key=lambda t: (-t.priority, -self.response_ratio(t, now), t.task_id))
        placements: list[Placement] = []
        for task in order:
            engine = self._pick(task)
            if engine is None:
                continue
            del self.queue[task.task_id]
            if not engine.running:
                engine.busy_since = now
            engine.running[task.task_id] = task
            if task.kind == "trainer":
                self.home.setdefault(task.job_id, engine.engine_id)
            placements.append(Placement(task, engine.engine_id))
        return placements

    def _pick(self, task: Task) -> Engine | None:
        if task.kind == "trainer" and task.job_id in self.home:
            engine = self.engines.get(self.home[task.job_id])
            return engine if engine is not None and engine.free > 0 else None
        candidates = [e for e in self.engines.values()
                      if e.kind == task.kind and e.model == task.model and e.free > 0]
        if task.kind == "trainer":  # a new job's state goes where the fewest jobs live
            load = {e.engine_id: 0 for e in candidates}
            for home in self.home.values():
                if home in load:
                    load[home] += 1
            return min(candidates, key=lambda e: (load[e.engine_id], e.engine_id), default=None)
        return max(candidates, key=lambda e: (e.free, e.engine_id), default=None)

    def serves(self, kind: str, model: str) -> bool:
        return any(e.kind == kind and e.model == model for e in self.engines.values())
