"""Shared trainer passes: several jobs' LoRA train steps in one forward and backward.

``Passes`` decides which queued train steps join the pass a step leads, whether a trainer waits
(at most ``pass_window`` seconds from its first step's submission) for more steps to share its
next pass, and keeps each engine's pass table (``Engine.pass_of``, ``Engine.passes``) and pass
counters. Invariants: a pass holds steps of the same weights whose tokens stay within the
engine's micro-batch budget (``Engine.pass_tokens``, else the default); steps join in queue order
and the first that does not fit ends the pass (none jumps it); a pass takes one engine slot until
its last step ends. ``pass_window`` None: every train step runs alone and no trainer waits.
"""

from __future__ import annotations

from daemon.sched_records import SERIAL_KINDS, Engine, Task
from plexctl.common.memplan import DEFAULT_MICRO_BATCH_TOKENS


class Passes:
    def __init__(self, pass_window: float | None) -> None:
        if pass_window is not None and pass_window < 0:
            raise ValueError(f"pass_window must be >= 0 seconds, not {pass_window}")
        self.window = pass_window  # None: every train step runs alone; else shared passes, waiting this long
        self._holding: dict[str, float] = {}  # trainer -> until when it waits for more steps to share a pass

    def leads(self, task: Task) -> bool:
        """Whether ``task``, started alone, may take others into its pass."""
        return task.tokens > 0 and self.window is not None

    def lead(self, engine: Engine, task: Task) -> None:
        """``task`` starts a pass of its own on ``engine``."""
        engine.pass_of[task.task_id] = task.task_id
        engine.passes[task.task_id] = 1

    def join(self, engine: Engine, task: Task, lead: Task) -> None:
        """``task`` rides in the pass ``lead`` started."""
        engine.pass_of[task.task_id] = lead.task_id
        engine.passes[lead.task_id] += 1

    def task_ended(self, engine: Engine, task_id: int) -> None:
        lead = engine.pass_of.pop(task_id, task_id)
        left = engine.passes.pop(lead, 1) - 1
        if left > 0:
            engine.passes[lead] = left

    def engine_stopped(self, engine: Engine) -> None:
        """The engine went down: its passes end, it waits for no step."""
        engine.pass_of.clear()
        engine.passes.clear()
        self._holding.pop(engine.engine_id, None)

    def members(self, engine: Engine, lead: Task, rest: list[Task], pending: dict[int, Task]) -> list[Task]:
        """The train steps of ``rest`` (in their order, still ``pending``) that join ``lead``'s pass."""
        budget = engine.pass_tokens or DEFAULT_MICRO_BATCH_TOKENS
        used, joining = lead.tokens, []
        for task in rest:
            if task.tokens <= 0 or task.task_id not in pending or task.weights != lead.weights:
                continue
            if used + task.tokens > budget:
                break
            used += task.tokens
            joining.append(task)
        return joining

    @staticmethod
    def started(engine: Engine, size: int) -> None:
        """A pass of ``size`` steps started on ``engine``: its counters."""
        engine.last_pass = size
        engine.largest_pass = max(engine.largest_pass, size)
        if size > 1:
            engine.shared_passes += 1
            engine.shared_tasks += size

    def waits(self, engine: Engine, order: list[Task], now: float, homed: int) -> bool:
        """Whether a trainer waits for more train steps to share its next pass: its first task
        may share one, fewer such steps are queued than its ``homed`` jobs and fill its budget,
        and ``pass_window`` has not passed since that first task came. ``expired`` hands it
        back when the window ends (``next_wake``)."""
        eid = engine.engine_id
        if not self.window or engine.kind not in SERIAL_KINDS or not order or order[0].tokens <= 0:
            self._holding.pop(eid, None)
            return False
        until = order[0].submitted_at + self.window
        sharing = [t.tokens for t in order if t.tokens > 0]
        full = sum(sharing) >= (engine.pass_tokens or DEFAULT_MICRO_BATCH_TOKENS)
        if now >= until or full or len(sharing) >= homed:
            self._holding.pop(eid, None)
            return False
        self._holding[eid] = until
        return True

    def expired(self, now: float) -> list[str]:
        """The trainers whose wait ended by ``now``, no longer waiting."""
        ended = []
        for engine_id, until in list(self._holding.items()):
            if until <= now:
                del self._holding[engine_id]
                ended.append(engine_id)
        return ended

    def next_wake(self) -> float | None:
        """When a trainer waiting for a pass's steps must be looked at again (None: none waits)."""
        return min(self._holding.values(), default=None)
