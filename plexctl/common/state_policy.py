"""The tier policy for jobs' trainer state: who leaves the device, where a leaving state goes,
whom to bring up from a slower tier next. Plain data in, decisions out.

The tiers are one registry, ``STATE_TIERS``, fastest first: ``device`` (where a job trains: at
most ``device_slots`` jobs, and optionally ``device_bytes``), then the storage tiers a state goes
to off the device, ``host`` (``host_mem``) and ``nvme`` (``nvme_bytes``; a node may have none).
Each entry names its budget's cluster setting and the medium it takes room in, so the store, the
simulator and the memory plan build the same list from it. At a decision the storage tiers are
``Room``s in that order (``Tiers``). ``Upcoming`` is the order in which jobs will next need the
trainer (the scheduler's ``expected``); jobs not in it come after all that are. The decisions:

- eviction (``needs_room``, ``victim``): while the device is full, the resident job needed
  least soon leaves it; ties (jobs not in the order): the least recently used;
- placement (``place``): a leaving state goes to the first storage tier that takes it; or to
  one after the copies it holds needed *later* than the leaving state are demoted to the tier
  below it (least soon first), if that makes room and the tier below takes them; while a tier
  is out of space, the tier above it may exceed its budget by its spill allowance; else nowhere
  (the caller reports the tiers full);
- prefetch (``prefetch_choice``, ``prefetch_placement``): the first upcoming job below the first
  storage tier comes up to it if it has room, demoting only copies needed later than it;
- memory short on a tier (``first_to_demote``): its copy needed least soon that the tier below takes.

Invariants: every function is pure (no clock, I/O, threads or torch) and deterministic; a copy
is demoted only for a job needed sooner, and only one tier down; no placement exceeds a tier's
budget, but for a spill allowance while the tier below is marked full. ``worker.state.store``
(the real tiers) and ``daemon.simulator`` (simulated ones) both decide through this module.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plexctl.common.sizes import parse_bytes

DEVICE, HOST, NVME = "device", "host", "nvme"


@dataclass(frozen=True)
class TierKind:
    """One tier of the registry: its ``name``, how plans and messages call it (``label``), the
    cluster setting of its budget per trainer rank (``setting``; None: the device, held by its
    slots), and the node's ``medium`` it takes room in (``gpu``, ``host``, ``nvme``)."""

    name: str
    label: str
    setting: str | None
    medium: str


STATE_TIERS = (
    TierKind(DEVICE, "device", None, "gpu"),  # where a job trains
    TierKind(HOST, "host tier", "host_mem", "host"),  # where a leaving state goes first
    TierKind(NVME, "NVMe tier", "nvme_bytes", "nvme"),  # the last resort
)
TIER_ORDER = tuple(kind.name for kind in STATE_TIERS)  # fastest first
STORAGE_TIERS = TIER_ORDER[1:]  # where a state goes off the device, fastest first
TIER_KINDS = {kind.name: kind for kind in STATE_TIERS}
DIRECTIONS = tuple(f"{a}->{b}" for a in TIER_ORDER for b in TIER_ORDER if a != b and DEVICE in (a, b)) + tuple(
    f"{a}->{b}" for a in STORAGE_TIERS for b in STORAGE_TIERS if a != b
)  # every move


def tier_order(names: Iterable[str]) -> list[str]:
    """The tiers ``names`` in ``TIER_ORDER``, fastest first (a store, the simulator and the
    memory plan order their tiers by this); a name not in it is a ValueError."""
    unknown = sorted(set(names) - set(TIER_ORDER))
    if unknown:
        raise ValueError(f"unknown state tiers {unknown}; known: {list(TIER_ORDER)}")
    return sorted(set(names), key=TIER_ORDER.index)


def tier_budgets(cluster: Any) -> dict[str, int]:
    """Each storage tier's budget per trainer rank, in bytes, from a ``ClusterConfig`` (or any
    object with the tiers' settings), fastest first."""
    return {kind.name: parse_bytes(getattr(cluster, kind.setting)) for kind in STATE_TIERS if kind.setting}


@dataclass(frozen=True)
class Held:
    """A job's state as the policy sees it: its size, and when it last ran on the trainer (a
    counter: larger is more recent)."""

    job_id: str
    nbytes: int
    last_used: int


class Upcoming:
    """The order in which jobs will next need the trainer, first = soonest (a job listed twice
    keeps its first place); jobs not in it rank after all that are, tied."""

    def __init__(self, job_ids: Iterable[str] = ()) -> None:
        self._rank: dict[str, int] = {}
        for position, job_id in enumerate(job_ids):
            self._rank.setdefault(job_id, position)

    def rank(self, job_id: str) -> int:
        return self._rank.get(job_id, len(self._rank))

    def eviction_key(self, held: Held) -> tuple[int, int]:
        """``max()`` by this is the job needed least soon, then the least recently used."""
        return (self.rank(held.job_id), -held.last_used)

    def least_soon_key(self, held: Held) -> tuple[int, int]:
        """``sorted()`` by this puts the job needed least soon (then least recently used) first."""
        return (-self.rank(held.job_id), held.last_used)


@dataclass(frozen=True)
class Room:
    """One storage tier at a decision: its ``budget`` (None: the node has no such tier) and the
    bytes it holds (``used``, counting copies on their way there). ``full``: a write to it ran
    out of space lately; until that clears it takes no more than ``room`` (what it held then)
    and the tier above may exceed its budget by that tier's ``spill_bytes``."""

    name: str
    budget: int | None
    used: int
    spill_bytes: int = 0
    full: bool = False
    room: int = 0

    @property
    def capacity(self) -> int | None:
        if self.budget is None:
            return None
        return min(self.budget, self.room) if self.full else self.budget

    def takes(self, nbytes: int, credit: int = 0) -> bool:
        """Whether ``nbytes`` more fit (``credit``: bytes about to leave it)."""
        capacity = self.capacity
        return capacity is not None and self.used - credit + nbytes <= capacity

    def spill_fits(self, nbytes: int, credit: int = 0) -> bool:
        """Whether ``nbytes`` more fit within its spill allowance."""
        return self.budget is not None and nbytes <= self.budget + self.spill_bytes - self.used + credit


@dataclass(frozen=True)
class Tiers:
    """The storage tiers at a decision, fastest first (``rooms``, named once each)."""

    rooms: tuple[Room, ...]

    def __post_init__(self) -> None:
        names = [room.name for room in self.rooms]
        if len(set(names)) != len(names) or DEVICE in names or not names:
            raise ValueError(f"storage tiers must be named once each, device not among them: {names}")

    def room(self, name: str) -> Room:
        return next(room for room in self.rooms if room.name == name)

    def below(self, name: str) -> Room | None:
        """The tier after ``name``, where its copies are demoted to; None for the last."""
        names = [room.name for room in self.rooms]
        at = names.index(name) + 1
        return self.rooms[at] if at < len(self.rooms) else None


@dataclass(frozen=True)
class Placement:
    """Where a state leaving the device (or coming up from a slower tier) goes: ``tier``, after
    the copies ``demote`` (job ids, in order) held there are written to the tier below it."""

    tier: str
    demote: tuple[str, ...] = ()


def needs_room(
    resident: Sequence[Held], incoming_bytes: int, device_slots: int, device_bytes: int | None = None
) -> bool:
    """Whether a job must leave the device before one more of ``incoming_bytes`` comes in
    (``resident``: the other jobs there)."""
    if not resident:
        return False
    if len(resident) >= device_slots:
        return True
    return device_bytes is not None and sum(h.nbytes for h in resident) + incoming_bytes > device_bytes


def victim(resident: Sequence[Held], upcoming: Upcoming) -> Held:
    """The resident job to evict: needed least soon, then least recently used."""
    return max(resident, key=upcoming.eviction_key)


def place(
    leaving: Held,
    tiers: Tiers,
    copies: Mapping[str, Sequence[Held]],
    upcoming: Upcoming,
    credit: Mapping[str, int] | None = None,
    spill: bool = True,
) -> Placement | None:
    """Where ``leaving`` (its ``nbytes``: the copy's size) goes; None when nothing fits.

    ``copies``: per tier, the copies that may be demoted (not moving already); ``credit``: per
    tier, bytes about to be freed (a copy swapping in from it); ``spill``: whether a spill
    allowance may be used while the tier below is full."""
    nbytes = leaving.nbytes
    credit = credit or {}
    for room in tiers.rooms:
        freed = credit.get(room.name, 0)
        if room.takes(nbytes, freed):
            return Placement(room.name)
        below, capacity = tiers.below(room.name), room.capacity
        if below is None or capacity is None or nbytes > capacity:
            continue
        free = capacity - room.used + freed
        candidates = [h for h in copies.get(room.name, ()) if h.job_id != leaving.job_id]
        demote: list[Held] = []
        for candidate in sorted([*candidates, leaving], key=upcoming.least_soon_key):
            if candidate is leaving:
                break
            demote.append(candidate)
            free += candidate.nbytes
            if nbytes <= free:
                if below.takes(sum(h.nbytes for h in demote)):
                    return Placement(room.name, tuple(h.job_id for h in demote))
                break
    if spill:
        for room, below in zip(tiers.rooms, tiers.rooms[1:], strict=False):
            if below.full and room.spill_fits(nbytes, credit.get(room.name, 0)):
                return Placement(room.name)
    return None


def prefetch_choice(
    expected: Sequence[str], tier_of: Mapping[str, str], slow: Collection[str] = STORAGE_TIERS[1:]
) -> str | None:
    """The job to bring up next: the first in ``expected`` whose state is on a ``slow`` tier
    (below the first storage tier)."""
    return next((job_id for job_id in expected if tier_of.get(job_id) in slow), None)


def prefetch_placement(
    job: Held, tiers: Tiers, copies: Mapping[str, Sequence[Held]], upcoming: Upcoming
) -> Placement | None:
    """The first storage tier, with the demotions that make room for ``job`` (on a slower tier),
    if it takes the job without its spill allowance; else None: the job stays where it is."""
    placement = place(job, tiers, copies, upcoming, spill=False)
    return placement if placement is not None and placement.tier == tiers.rooms[0].name else None


def first_to_demote(tier: str, copies: Sequence[Held], tiers: Tiers, upcoming: Upcoming) -> Held | None:
    """When ``tier`` runs short: its copy (of ``copies``) to write to the tier below first
    (needed least soon, then least recently used, of those the tier below takes); None if it
    takes none, or there is no tier below."""
    below = tiers.below(tier)
    if below is None:
        return None
    fitting = [h for h in copies if below.takes(h.nbytes)]
    return min(fitting, key=upcoming.least_soon_key, default=None)
