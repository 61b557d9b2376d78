"""The elastic allocation's rule: when a cluster asks Slurm for more nodes, and which it gives back.

One pure function, ``decide``, serves the daemon (``daemon.allocations``: units are joined Slurm
allocations) and the simulator (``daemon.simulator``: units are a model class's engine pairs), so
the GPU-hours the simulator charges follow the rule the runtime runs.

The rule: work that has waited for engines at least ``grow_after_s`` grows the cluster by the
units it wants, up to ``max_units``, unless units asked for earlier are still starting (they may
be what it waits for); a joined unit that has held no job for ``shrink_after_s`` is released,
the longest idle first, never below ``min_units`` and never while work waits. Base units (the
allocation ``up`` made) are never released.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class ElasticRule(msgspec.Struct, frozen=True, kw_only=True):
    min_units: int  # never fewer (the base allocation's)
    max_units: int  # never more
    grow_after_s: float
    shrink_after_s: float


class Unit(msgspec.Struct, frozen=True, kw_only=True):
    """What the rule sees of one unit: ``ready`` once its engines are up, ``idle_since`` when it
    last held no job (None: it holds one, or is not ready), ``base`` for the allocation ``up`` made."""

    unit_id: str
    ready: bool
    idle_since: float | None = None
    base: bool = False


class Decision(msgspec.Struct, frozen=True):
    grow: int  # units to ask for now
    release: tuple[str, ...]  # units to drain and give back now
    recheck_at: float | None  # when the rule may decide otherwise with nothing else changed


def decide(rule: ElasticRule, now: float, waiting_since: float | None, wanted: int, units: Sequence[Unit]) -> Decision:
    """What to do at ``now``: ``waiting_since`` is when the oldest work still waiting for engines
    began to (None: nothing waits), ``wanted`` the units it needs beyond the ready ones' room."""
    grow, release, recheck = 0, [], None
    starting = any(not u.ready for u in units)
    if waiting_since is not None and wanted > 0 and not starting:
        due = waiting_since + rule.grow_after_s
        if now >= due:
            grow = max(0, min(wanted, rule.max_units - len(units)))
        else:
            recheck = due
    if waiting_since is None:
        idle = sorted((u.idle_since, u.unit_id) for u in units if u.ready and not u.base and u.idle_since is not None)
        spare = len(units) - rule.min_units
        for since, unit_id in idle:
            due = since + rule.shrink_after_s
            if now < due:
                recheck = due if recheck is None else min(recheck, due)
                break
            if spare <= 0:
                break
            release.append(unit_id)
            spare -= 1
    return Decision(grow, tuple(release), recheck)
