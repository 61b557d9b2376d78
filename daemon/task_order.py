"""The order of queued tasks: priority, then the user's weighted fair share, then response ratio,
then submission; and the ``max_switches`` bound that lets a trainer continue its last job.

``TaskOrder`` owns what the order is made of: each job's learned estimate per method (an EMA of
what its calls took), each user's share weight, the engine-seconds served to each user by finished
tasks and those charged for running ones. Invariants: a running task's charge is on its user's
``charged`` from its start until it ends or its engine goes down, then comes off exactly once; a
released job's estimates are forgotten. It reads the scheduler's engine and job tables. From the
same order come the hints for the state manager: which homed jobs a trainer needs next.
"""

from __future__ import annotations

from collections.abc import Iterable

from daemon.sched_records import SERIAL_KINDS, Engine, Job, Running, Task

DEFAULT_ESTIMATE = 1.0
EMA = 0.3
INTERACTIVE_SHARE = 0.5  # the interactive class goes first while its share of recent engine time is below this
SHARE_HALF_LIFE_S = 60.0  # how fast that share forgets: engine-seconds count half after this long

OrderKey = tuple[int, int, float, float, int]


class TaskOrder:
    def __init__(self, engines: dict[str, Engine], jobs: dict[str, Job], max_switches: int) -> None:
        if max_switches < 0:
            raise ValueError(f"max_switches must be >= 0, not {max_switches}")
        self.engines, self.jobs = engines, jobs  # the scheduler's tables, read here
        self.max_switches = max_switches
        self.estimates: dict[tuple[str, str], float] = {}
        self.shares: dict[str, float] = {}  # user -> weight (default 1)
        self.served: dict[str, float] = {}  # user -> engine-seconds of finished tasks
        self.charged: dict[str, float] = {}  # user -> estimated engine-seconds of running tasks
        self.recent = {True: 0.0, False: 0.0}  # interactive? -> engine-seconds served, decayed
        self.recent_at = 0.0

    def estimate(self, task: Task) -> float:
        return self.estimates.get((task.job_id, task.method), DEFAULT_ESTIMATE)

    def learn(self, task: Task, seconds: float) -> None:
        """What ``task``'s call took, folded into its job's estimate for the method."""
        key = (task.job_id, task.method)
        old = self.estimates.get(key)
        self.estimates[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def forget(self, job_id: str, methods: Iterable[str]) -> None:
        for method in methods:
            self.estimates.pop((job_id, method), None)

    def set_share(self, user: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"share weight must be > 0, not {weight}")
        self.shares[user] = weight

    def charge(self, user: str, seconds: float) -> None:
        self.charged[user] = self.charged.get(user, 0.0) + seconds

    def refund(self, run: Running) -> None:
        """A running task's charge comes off (it ended, or its engine went down)."""
        self.charged[run.user] = self.charged.get(run.user, 0.0) - run.charge

    def serve(self, user: str, seconds: float, interactive: bool = False, now: float | None = None) -> None:
        self.served[user] = self.served.get(user, 0.0) + seconds
        if now is not None:
            self._decay(now)
        self.recent[interactive] += seconds

    def _decay(self, now: float) -> None:
        if now > self.recent_at:
            keep = 0.5 ** ((now - self.recent_at) / SHARE_HALF_LIFE_S)
            self.recent = {k: v * keep for k, v in self.recent.items()}
            self.recent_at = now

    def interactive_share(self, now: float | None = None) -> float:
        """The interactive class's share of recent engine time (decayed, ``SHARE_HALF_LIFE_S``;
        to ``now`` where given)."""
        if now is not None:
            self._decay(now)
        total = self.recent[True] + self.recent[False]
        return self.recent[True] / total if total > 0 else 0.0

    def response_ratio(self, task: Task, now: float) -> float:
        est = max(self.estimate(task), 1e-3)
        return (now - task.submitted_at + est) / est

    def share_score(self, user: str) -> float:
        """Engine-seconds served (plus estimates of running tasks) per unit of share weight."""
        return (self.served.get(user, 0.0) + self.charged.get(user, 0.0)) / self.shares.get(user, 1.0)

    def key(self, task: Task, now: float) -> OrderKey:
        """Priority; then an interactive task first, while its class has less than
        ``INTERACTIVE_SHARE`` of recent engine time (so neither class starves the other); then
        the user's fair share, response ratio, submission."""
        job = self.jobs.get(task.job_id)
        user = job.user if job else ""
        first = 0 if task.interactive and self.interactive_share() < INTERACTIVE_SHARE else 1
        return (-task.priority, first, self.share_score(user), -self.response_ratio(task, now), task.task_id)

    def switch_first(self, engine: Engine, order: list[Task]) -> list[Task]:
        """Apply the switch bound: a trainer continues its last job while its streak is under
        ``max_switches`` and that job's next task has the first task's priority."""
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

    def upcoming(self, engine: Engine, homed: Iterable[str], now: float) -> list[str]:
        """The ``homed`` jobs with a task queued for ``engine`` (for a serial kind: their next),
        in the order those would run there, the switch bound applied."""
        best: list[tuple[OrderKey, Task]] = []
        for job_id in homed:
            job = self.jobs[job_id]
            if engine.kind in SERIAL_KINDS:
                head = job.serial_head(engine.kind)
                tasks: Iterable[Task] = () if head is None else (head,)
            else:
                tasks = (t for t in job.queued.values() if t.kind == engine.kind)
            keys = [(self.key(t, now), t) for t in tasks]
            if keys:
                best.append(min(keys, key=lambda kt: kt[0]))
        best.sort(key=lambda kt: kt[0])
        return [t.job_id for t in self.switch_first(engine, [t for _, t in best])]

    def expected(self, engine: Engine, homed: Iterable[str], listed: set[str]) -> list[str]:
        """The ``homed`` jobs not ``listed`` (nothing queued for the trainer ``engine``), by when
        they should next call it. First those between a rollout and their trainer call (the last
        task that ended was another kind's and none runs: the driver is scoring), longest waiting
        first; then those with tasks running on other engines, soonest expected end (start +
        learned estimate) first; last the rest (a task here ended last, or runs now: a new rollout
        is ahead of them), least recent first. O(homed jobs and their running tasks)."""
        scoring, running, rest = [], [], []
        for job_id in homed:
            if job_id in listed:
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
        return [job_id for group in (scoring, running, rest) for _, job_id in sorted(group)]

    @staticmethod
    def started(engine: Engine, task: Task) -> None:
        """A task leads a new pass on ``engine``: its job's streak there grows or restarts."""
        if engine.last_job == task.job_id:
            engine.streak += 1
        else:
            engine.last_job, engine.streak = task.job_id, 1
