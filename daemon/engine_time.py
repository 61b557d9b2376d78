"""Engine time: when each engine is busy, and the busy and idle shares the metrics report.

``EngineTime`` keeps the finished tasks' intervals (the last ``INTERVALS_KEPT``) and each
engine's busy counters (``Engine.busy_since``, ``busy_seconds``, ``busy_by_job``, ``tasks_done``,
``last_done_at``, ``running``, ``started_at``). Invariants: an engine is busy exactly while a task
runs on it (slots overlap: busy time is the union); a finished task is one interval. It reads
the scheduler's engine table and never changes which engines exist.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from daemon.sched_records import Engine, Interval, Task
from plexctl.common.scheduling import union_length  # shared with the CLI and the daemon's metrics

INTERVALS_KEPT = 100_000


class EngineTime:
    def __init__(self, engines: dict[str, Engine]) -> None:
        self.engines = engines  # the scheduler's table, read here
        self.intervals: deque[Interval] = deque(maxlen=INTERVALS_KEPT)

    def task_started(self, engine: Engine, task: Task, now: float) -> None:
        if not engine.running:
            engine.busy_since = now
        engine.running[task.task_id] = task
        engine.started_at[task.task_id] = now

    def task_ended(self, engine: Engine, task_id: int, now: float) -> tuple[Task, float]:
        """Close a running task's interval; the task and the seconds it ran."""
        task = engine.running.pop(task_id)
        start = engine.started_at.pop(task_id)
        engine.tasks_done += 1
        engine.last_done_at = now
        if not engine.running and engine.busy_since is not None:
            engine.busy_seconds += now - engine.busy_since
            engine.busy_since = None
        took = max(0.0, now - start)
        engine.busy_by_job[task.job_id] = engine.busy_by_job.get(task.job_id, 0.0) + took
        self.intervals.append(Interval(engine.engine_id, task.job_id, task.method, start, now))
        return task, took

    def utilizations(self, now: float, since: float, engine_ids: Iterable[str] | None = None) -> dict[str, float]:
        """Busy share per engine in [since, now], in one pass over the kept intervals."""
        busy, spans = self.busy_in(now, since, engine_ids)
        return {e: (b / spans[e] if spans[e] > 0 else 0.0) for e, b in busy.items()}

    def bubble_ratio(self, now: float, since: float) -> float:
        """Idle share of engine time in [since, now], over the engines up now."""
        busy, spans = self.busy_in(now, since, None)
        total = sum(spans.values())
        return 1.0 - sum(busy.values()) / total if total > 0 else 0.0

    def busy_in(
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
