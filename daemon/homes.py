"""Homes: which rollout and trainer engine each job is homed on, and the room engines have.

``Homes`` owns the engine indexes by (kind, model) and by load (how many jobs each is home to),
each engine's homed jobs, and the ``home`` / ``rollout_home`` maps (job -> engine). It answers
where a new or moving job may go (``pick``, ``mover_target``), within each engine's room
(``room_problem``: the policy, ``jobs_per_engine``, ``Engine.job_slots``,
``Engine.state_room_bytes``), and why a job waits (``full_reason``). Invariants: ``Job.homes``,
the homed sets, the load buckets and the two maps agree; a suspect engine is no job's new home;
a trainer home can hold the job's state on one tier. Moving a task's queue with its home is
``daemon.queues``' part.
"""

from __future__ import annotations

from collections.abc import Iterable

from daemon.policies import PlacementPolicy
from daemon.sched_records import SERIAL_KINDS, Engine, Job, Key, Task, mb

UNDECLARED_JOBS_PER_ENGINE = 8  # jobs an engine that declares no room (an older worker, a test's) is home to


class Homes:
    def __init__(
        self, engines: dict[str, Engine], jobs: dict[str, Job], policy: PlacementPolicy, jobs_per_engine: int | None
    ) -> None:
        if jobs_per_engine is not None and jobs_per_engine < 1:
            raise ValueError(f"jobs_per_engine must be >= 1, not {jobs_per_engine}")
        self.engines, self.jobs = engines, jobs  # the scheduler's tables, read here
        self.policy = policy
        self.jobs_per_engine = jobs_per_engine  # a cap on the jobs homed on one engine (None: what it holds)
        self.home: dict[str, str] = {}  # job_id -> home trainer engine (holds its state)
        self.rollout_home: dict[str, str] = {}  # job_id -> home rollout engine
        self.by_key: dict[Key, dict[str, None]] = {}
        self.buckets: dict[Key, dict[int, dict[str, None]]] = {}  # jobs homed -> engines
        self.homed: dict[str, dict[str, None]] = {}  # engine -> jobs it is home to

    def add_engine(self, engine: Engine) -> None:
        self.by_key.setdefault(engine.key, {})[engine.engine_id] = None
        self.homed[engine.engine_id] = {}
        self.buckets.setdefault(engine.key, {}).setdefault(0, {})[engine.engine_id] = None

    def remove_engine(self, engine: Engine) -> None:
        """Forget an engine: its jobs lose that home, and any state believed to be on it."""
        engine_id = engine.engine_id
        del self.by_key[engine.key][engine_id]
        self.buckets[engine.key][len(self.homed[engine_id])].pop(engine_id, None)
        for job_id in list(self.homed.pop(engine_id)):
            job = self.jobs[job_id]
            if job.state_engine == engine_id:
                job.state_engine, job.state_tier = None, None
            for kind, home in list(job.homes.items()):
                if home == engine_id:
                    del job.homes[kind]
                    (self.home if kind == "trainer" else self.rollout_home).pop(job_id, None)

    def serves(self, kind: str, model: str) -> bool:
        return bool(self.by_key.get((kind, model)))

    def room_problem(self, engine: Engine, state_bytes: int = 0) -> str:
        """Why ``engine`` cannot be home to one more job with ``state_bytes`` of state ("" if it
        can): the policy (isolated: one job), the cluster's cap (``jobs_per_engine``), the jobs
        its memory holds (``job_slots``: a rollout engine's adapters), the job state its tiers
        hold together (``state_room_bytes``: a trainer's host and NVMe). An engine that declares
        neither holds ``UNDECLARED_JOBS_PER_ENGINE``. O(jobs homed there)."""
        homed = self.homed.get(engine.engine_id, {})
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
                    f"holds {load} jobs whose state ({mb(held)} MB) leaves no room for {mb(state_bytes)} MB "
                    f"(its tiers hold {mb(engine.state_room_bytes)} MB)"
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
    def fits(engine: Engine, state_bytes: int) -> bool:
        """Whether one tier of ``engine`` holds ``state_bytes`` of job state."""
        return engine.state_capacity_bytes <= 0 or state_bytes <= engine.state_capacity_bytes

    def pick(self, kind: str, model: str, state_bytes: int) -> str | None:
        """A new home for a job of ``model``, by the policy's order of loads (None: none has room)."""
        buckets = self.buckets.get((kind, model))
        if not buckets:
            return None
        for load in self.policy.home_order(n for n, b in buckets.items() if b):
            for engine_id in buckets[load]:
                engine = self.engines[engine_id]
                if (
                    not engine.suspect
                    and (kind != "trainer" or self.fits(engine, state_bytes))
                    and not self.room_problem(engine, state_bytes if kind == "trainer" else 0)
                ):
                    return engine_id
        return None

    def home_for(self, job: Job, task: Task) -> str | None:
        """The job's home for ``task``'s kind, one picked now if it has none (None: no room)."""
        home = job.homes.get(task.kind)
        if home is not None:
            return home
        home = self.pick(task.kind, task.model, job.state_bytes)
        if home is not None:
            self.move(job, task.kind, home)
        return home

    def move(self, job: Job, kind: str, engine_id: str | None) -> bool:
        """Home ``job``'s ``kind`` on ``engine_id`` (None: nowhere); whether an engine still up
        lost it (its room grew)."""
        old = job.homes.get(kind)
        left = old is not None and old in self.engines
        if old is not None and left:
            self.homed[old].pop(job.job_id, None)
            self._load_changed(old, +1)
        mirror = self.home if kind == "trainer" else self.rollout_home
        if engine_id is None:
            job.homes.pop(kind, None)
            mirror.pop(job.job_id, None)
        else:
            job.homes[kind] = engine_id
            mirror[job.job_id] = engine_id
            self.homed[engine_id][job.job_id] = None
            self._load_changed(engine_id, -1)
        return left

    def _load_changed(self, engine_id: str, delta_before: int) -> None:
        """Move an engine between load buckets; ``delta_before``: old load minus new load."""
        buckets = self.buckets[self.engines[engine_id].key]
        load = len(self.homed[engine_id])
        buckets.get(load + delta_before, {}).pop(engine_id, None)
        buckets.setdefault(load, {})[engine_id] = None

    def mover_target(self, job: Job, kind: str, idle: Iterable[str]) -> Engine | None:
        """Of the ``idle`` engines, the one with the fewest jobs that has room for ``job`` and
        its state and is not its home now."""
        home = job.homes.get(kind)
        best: Engine | None = None
        for engine_id in idle:
            load = len(self.homed[engine_id])
            engine = self.engines[engine_id]
            if (
                engine_id == home
                or not self.fits(engine, job.state_bytes)
                or self.room_problem(engine, job.state_bytes)
            ):
                continue
            if best is None or load < len(self.homed[best.engine_id]):
                best = engine
                if load == 0:
                    break
        return best

    def full_reason(self, model: str, state_bytes: int, rollout_full: bool, trainer_full: bool) -> str:
        """Why a job of ``model`` finds no home (on the full kinds named), for its waiting message."""
        silent = [
            k
            for k, full in (("rollout", rollout_full), ("trainer", trainer_full))
            if full and all(self.engines[e].suspect for e in self.by_key[(k, model)])
        ]
        if silent:
            return (
                f"waiting for its engines: every {' and '.join(silent)} engine of {model} is suspect "
                "(its worker missed heartbeats)"
            )
        if self.policy.dedicates_engines():
            counts = []
            for kind in ("rollout", "trainer"):
                engines = self.by_key[(kind, model)]
                free = sum(
                    1
                    for e in engines
                    if not self.homed[e] and (kind != "trainer" or self.fits(self.engines[e], state_bytes))
                )
                counts.append(f"{free} of {len(engines)} {kind}")
            return f"waiting for dedicated engines ({self.policy.name}: {' / '.join(counts)} free)"
        parts = []
        for kind, full in (("rollout", rollout_full), ("trainer", trainer_full)):
            if not full:
                continue
            up = [self.engines[e] for e in self.by_key[(kind, model)] if not self.engines[e].suspect]
            least = min(up, key=lambda e: len(self.homed[e.engine_id]))  # the nearest to room
            why = self.room_problem(least, state_bytes if kind == "trainer" else 0)
            if kind == "trainer" and not why and not self.fits(least, state_bytes):
                why = f"cannot hold {mb(state_bytes)} MB of state on one tier"
            if len(up) == 1:
                parts.append(f"the {kind} engine of {model} {why}")
            else:
                parts.append(f"every {kind} engine of {model} is full (the least loaded {why})")
        return "waiting for room: " + "; ".join(parts)
