"""The placement policies: one small class per name in ``plexctl.common.scheduling.POLICIES``,
behind ``PlacementPolicy``, the questions the scheduler (and the simulator) ask of a policy.

A policy decides three things: whether each job gets engines to itself, in which order a model's
engines are tried as a new job's home (by how many jobs each is already home to), and whether an
idle engine may take a waiting task that is homed elsewhere (backfill). Everything else (room,
queue order, switches, shared passes) is the scheduler's and the same under every policy.

Invariants: ``POLICY_CLASSES`` is keyed by exactly ``POLICIES``, in their order (checked at
import); a policy holds no state, so one instance per scheduler serves every decision. Adding a
policy is one class here and one name in ``POLICIES``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import ClassVar

from plexctl.common.scheduling import POLICIES


class PlacementPolicy(abc.ABC):
    name: ClassVar[str]  # its entry in ``POLICIES`` (``plexctl up --policy``)

    @abc.abstractmethod
    def dedicates_engines(self) -> bool:
        """Whether each job has its engines to itself: one job homed on an engine, whatever
        room the engine has (the cluster's ``jobs_per_engine`` does not apply)."""

    @abc.abstractmethod
    def home_order(self, loads: Iterable[int]) -> list[int]:
        """The loads (jobs homed) of a model's engines, in the order a new job's home is sought
        among them; the first engine with room wins."""

    @abc.abstractmethod
    def backfills(self) -> bool:
        """Whether an idle engine may run a task that waits on its busy home (a rollout, or a
        train step whose job has no state held anywhere)."""


class Isolated(PlacementPolicy):
    """Each job alone on its rollout and trainer engine: the baseline sharing is measured against."""

    name = "isolated"

    def dedicates_engines(self) -> bool:
        return True

    def home_order(self, loads: Iterable[int]) -> list[int]:
        return sorted(loads)  # only empty engines have room

    def backfills(self) -> bool:
        return False


class Pack(PlacementPolicy):
    """Jobs share engines, each new one on the fullest engine with room: the fewest engines in use."""

    name = "pack"

    def dedicates_engines(self) -> bool:
        return False

    def home_order(self, loads: Iterable[int]) -> list[int]:
        return sorted(loads, reverse=True)

    def backfills(self) -> bool:
        return False


class Spread(PlacementPolicy):
    """Jobs share engines, each new one on the emptiest: the least contention per engine."""

    name = "spread"

    def dedicates_engines(self) -> bool:
        return False

    def home_order(self, loads: Iterable[int]) -> list[int]:
        return sorted(loads)

    def backfills(self) -> bool:
        return False


class SpreadBackfill(Spread):
    """Spread, and an idle engine takes movable tasks waiting on busy homes (the default)."""

    name = "spread+backfill"

    def backfills(self) -> bool:
        return True


class PackBackfill(Pack):
    """Pack, and an idle engine takes movable tasks waiting on busy homes: jobs on as few engines
    as their work allows, the rest idle (and, in an elastic allocation, given back)."""

    name = "pack+backfill"

    def backfills(self) -> bool:
        return True


POLICY_CLASSES: dict[str, type[PlacementPolicy]] = {
    cls.name: cls for cls in (Isolated, Pack, Spread, SpreadBackfill, PackBackfill)
}
if tuple(POLICY_CLASSES) != POLICIES:
    raise RuntimeError(f"placement policies {tuple(POLICY_CLASSES)} differ from POLICIES {POLICIES}")


def placement_policy(name: str) -> PlacementPolicy:
    """The policy called ``name``; ValueError naming the choices if there is none."""
    cls = POLICY_CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    return cls()
