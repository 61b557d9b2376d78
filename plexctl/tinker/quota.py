"""Which of a user's Tinker saves go to make room for a new one, or why the new one is refused.

A user's saves (each ``save_state``'s directory, each published version of sampler weights:
``save_weights_for_sampler``'s and ``save_weights_and_get_sampling_client``'s) are counted
together, across all of their runs, against their ``tinker-disk`` (bytes) and ``tinker-saves``
(count) limits (``plexctl.common.limits``). ``make_room`` is the decision, a pure function: a save
in use is never chosen; the others go oldest first, and only as many as the new save needs.
What "in use" means (a live run's latest state and newest weights, the state it would resume
from, sampler weights a live run made or sampled lately) and the carrying out (deleting,
forgetting) are the backend's.

Invariants: with what ``make_room`` returns gone, the saves kept and the new one fit both limits;
when no choice fits, ``QuotaFull`` says so in one line and nothing is chosen.
"""

from __future__ import annotations

import msgspec

from plexctl.common.sizes import fmt_bytes
from plexctl.tinker.backend import UserError


class Kept(msgspec.Struct, frozen=True):
    """One save on disk: ``key`` names it to the caller, ``at`` when it was made (Unix seconds)."""

    key: str
    at: float
    size: int
    in_use: bool


class Quota(msgspec.Struct, frozen=True):
    """A user's limits on their saves: bytes and count (0: no limit)."""

    disk_bytes: int
    saves: int

    def passed_by(self, size: int, count: int) -> bool:
        return bool(self.passed(size, count))

    def passed(self, size: int, count: int) -> str:
        """The limits that ``size`` bytes in ``count`` saves pass, as the user sets them ("": none)."""
        passed = []
        if self.disk_bytes and size > self.disk_bytes:
            passed.append(f"{fmt_bytes(self.disk_bytes)} (tinker-disk)")
        if self.saves and count > self.saves:
            passed.append(f"{self.saves} saves (tinker-saves)")
        return " and ".join(passed)


class QuotaFull(UserError):
    """A new save would pass the user's limits and none of their saves may go to make room."""

    def __init__(self, quota: Quota, kept: list[Kept], needed: int, size: int, count: int) -> None:
        used, in_use = fmt_bytes(sum(k.size for k in kept)), sum(k.in_use for k in kept)
        if in_use == len(kept):
            held = f"all {len(kept)} of your saves ({used}) are in use"
        else:
            room = f"the others leave no room for {fmt_bytes(needed)}"
            held = f"{in_use} of your {len(kept)} saves ({used}) are in use, {room}"
        super().__init__(
            f"it would pass your limit of {quota.passed(size, count)}: {held} (a live run's latest state and "
            "weights, sampler weights made or sampled lately); end the sessions you no longer use, or ask the "
            "cluster's owner for more"
        )


def make_room(kept: list[Kept], quota: Quota, new_bytes: int, new_saves: int = 1) -> list[Kept]:
    """The saves to delete, oldest first, so that ``kept`` less them plus a new save of
    ``new_bytes`` (``new_saves`` of them: 0 when it is among ``kept`` already) fits ``quota``;
    ``QuotaFull`` when deleting every save not in use would not do."""
    size = sum(k.size for k in kept) + new_bytes
    count = len(kept) + new_saves
    chosen: list[Kept] = []
    for save in sorted((k for k in kept if not k.in_use), key=lambda k: (k.at, k.key)):
        if not quota.passed_by(size, count):
            break
        chosen.append(save)
        size -= save.size
        count -= 1
    if quota.passed_by(size, count):
        raise QuotaFull(quota, kept, new_bytes, size, count)
    return chosen
