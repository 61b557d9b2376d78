"""Switches: the weights each engine holds, and the turns engines sharing a device take on it.

``Switches`` owns the device table (device -> its engines, and which of them ran last: the one
awake) and the learned cost of switching an engine to some weights (a load, or a wake).
Invariants: an engine holds one set of weights at a time; of the engines naming one device, at
most one runs at a time, and a switch starts only on an engine with nothing running, charged to
the task that needs it; the awake engine keeps its turn while its group (tasks since its last
switch) is under ``max_group`` or no other engine of the device has tasks waiting.
"""

from __future__ import annotations

from collections.abc import Callable

from daemon.sched_records import Engine, Task
from daemon.task_order import EMA, OrderKey

DEFAULT_SWITCH_ESTIMATE = 1.0  # seconds of a switch (a weights load or a wake) before one is measured


class Switches:
    def __init__(self, engines: dict[str, Engine], max_group: int) -> None:
        if max_group < 1:
            raise ValueError(f"max_group must be >= 1, not {max_group}")
        self.engines = engines  # the scheduler's table, read here
        self.max_group = max_group
        self.estimates: dict[str, float] = {}  # weights -> seconds of switching an engine to them
        self._devices: dict[str, dict[str, None]] = {}  # device -> its engines
        self._awake: dict[str, str] = {}  # device -> the engine that ran last (or came up last)

    def add_engine(self, engine: Engine) -> None:
        if engine.device:
            self._devices.setdefault(engine.device, {})[engine.engine_id] = None
            self._awake[engine.device] = engine.engine_id

    def remove_engine(self, engine: Engine) -> list[str]:
        """Forget an engine; its device's other engines (each may take the device now)."""
        if not engine.device:
            return []
        mates = self._devices[engine.device]
        mates.pop(engine.engine_id, None)
        if self._awake.get(engine.device) == engine.engine_id:
            self._awake.pop(engine.device)
            if mates:
                self._awake[engine.device] = next(reversed(mates))
        return list(mates)

    def mates(self, engine: Engine) -> list[str]:
        """The engines sharing ``engine``'s device, itself included (none without a device)."""
        return list(self._devices[engine.device]) if engine.device else []

    def estimate(self, weights: str) -> float:
        """Seconds of switching an engine to ``weights`` (a load, a wake): learned, else the default."""
        return self.estimates.get(weights, DEFAULT_SWITCH_ESTIMATE)

    def set_estimate(self, weights: str, seconds: float) -> None:
        """What switching to ``weights`` costs, known beforehand (e.g. from their size)."""
        if seconds < 0:
            raise ValueError(f"a switch takes >= 0 seconds, not {seconds}")
        self.estimates[weights] = seconds

    def learn(self, weights: str, seconds: float) -> None:
        old = self.estimates.get(weights)
        self.estimates[weights] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def switch_to(self, engine: Engine, task: Task) -> str | None:
        """The weights ``task`` switches ``engine`` to (its own, or for a wake whatever the engine
        holds), or None if the engine runs it as it is."""
        asleep = bool(engine.device) and self._awake.get(engine.device) != engine.engine_id
        if task.weights and task.weights != engine.holds:
            return task.weights
        if asleep:
            return engine.holds or engine.model
        return None

    def switched(self, engine: Engine, weights: str) -> None:
        """A task starts a switch of ``engine`` to ``weights``: it holds them, its group restarts."""
        engine.holds, engine.group = weights, 0
        engine.switches += 1
        if engine.device:
            self._awake[engine.device] = engine.engine_id

    def device_turn(
        self, engine: Engine, pending: dict[str, dict[int, Task]], rank: Callable[[Task], OrderKey]
    ) -> bool:
        """Whether ``engine`` may start tasks now: alone on its device; or its device's other
        engines idle and the turn its (the awake engine keeps it while its group may grow, else
        the engine whose first waiting task ``rank`` puts first)."""
        mates = self._devices.get(engine.device) if engine.device else None
        if not mates or len(mates) == 1:
            return True
        eid = engine.engine_id
        if any(self.engines[m].running for m in mates if m != eid):
            return False
        awake = self._awake.get(engine.device)
        others = [m for m in mates if m != awake and pending.get(m)]
        if eid == awake:
            return not others or engine.group < self.max_group
        if awake is not None and pending.get(awake) and self.engines[awake].group < self.max_group:
            return False  # the awake engine keeps its turn while its tasks wait
        if awake is not None and self.engines[awake].running:
            return False
        if not others:
            return True  # no engine of the device has tasks waiting (a backfill asks): the device is free
        best = min(others, key=lambda m: min(rank(t) for t in pending[m].values()))
        return best == eid

    def group_first(self, engine: Engine, order: list[Task]) -> list[Task]:
        """Tasks for the weights the engine holds first, while its group may grow."""
        if engine.group >= self.max_group or not any(t.weights and t.weights != engine.holds for t in order):
            return order
        same = [t for t in order if not t.weights or t.weights == engine.holds]
        return [*same, *(t for t in order if t.weights and t.weights != engine.holds)]
