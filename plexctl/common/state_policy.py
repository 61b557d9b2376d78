"""The tier policy for jobs' trainer state: who leaves the device, where a leaving state goes,
whom to bring up from NVMe next. Plain data in, decisions out.

A trainer keeps each job's state on one tier: ``device`` (at most ``device_slots`` jobs, and
optionally ``device_bytes``), ``host`` (``host_bytes``) or ``nvme`` (``nvme_bytes``; a node may
have none); ``tier_order`` puts tier names in that order, fastest first. ``Upcoming`` is the
order in which jobs will next need the trainer (the scheduler's ``expected``); jobs not in it
come after all that are. The decisions:

- eviction (``needs_room``, ``victim``): while the device is full, the resident job needed
  least soon leaves it; ties (jobs not in the order): the least recently used;
- placement (``place``): a leaving state goes to host if it fits; else to host after host copies
  needed *later* than it are demoted to nvme (least soon first), if that makes room and nvme
  takes them; else to nvme if it fits; else, while nvme is out of space, to host within its
  spill allowance; else nowhere (the caller reports the tiers full);
- prefetch (``prefetch_choice``, ``prefetch_placement``): the first upcoming job on nvme comes
  up to host if host has room, demoting only copies needed later than it;
- host memory short (``first_to_demote``): the host copy needed least soon that nvme takes.

Invariants: every function is pure (no clock, I/O, threads or torch) and deterministic; a copy
is demoted only for a job needed sooner; no placement exceeds a tier's budget, but for host's
spill allowance while nvme is marked full. ``worker.state.store`` (the real tiers) and
``daemon.simulator`` (simulated ones) both decide through this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEVICE, HOST, NVME = "device", "host", "nvme"
TIER_ORDER = (DEVICE, HOST, NVME)  # fastest first: where a job trains, where its state goes first, the last resort
DIRECTIONS = ("device->host", "device->nvme", "host->device", "nvme->device", "host->nvme", "nvme->host")  # every move


def tier_order(names: Iterable[str]) -> list[str]:
    """The tiers ``names`` in ``TIER_ORDER``, fastest first (a store, the simulator and the
    memory plan order their tiers by this); a name not in it is a ValueError."""
    unknown = sorted(set(names) - set(TIER_ORDER))
    if unknown:
        raise ValueError(f"unknown state tiers {unknown}; known: {list(TIER_ORDER)}")
    return sorted(set(names), key=TIER_ORDER.index)


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
class Tiers:
    """What host and nvme hold at a decision: budgets and bytes used (counting copies on their
    way there). ``nvme_bytes`` None: no nvme tier. ``nvme_full``: a write ran out of disk space
    lately; until that clears nvme takes no more than ``nvme_room`` (what it held then) and
    host may exceed its budget by ``host_spill_bytes``."""

    host_bytes: int
    host_used: int
    nvme_bytes: int | None
    nvme_used: int
    host_spill_bytes: int = 0
    nvme_full: bool = False
    nvme_room: int = 0

    def nvme_fits(self, nbytes: int) -> bool:
        if self.nvme_bytes is None:
            return False
        capacity = min(self.nvme_bytes, self.nvme_room) if self.nvme_full else self.nvme_bytes
        return self.nvme_used + nbytes <= capacity

    def spill_fits(self, nbytes: int, host_credit: int = 0) -> bool:
        """Whether host takes ``nbytes`` more within its spill allowance."""
        return nbytes <= self.host_bytes + self.host_spill_bytes - self.host_used + host_credit


@dataclass(frozen=True)
class Placement:
    """Where a state leaving the device (or coming up from nvme) goes: ``tier`` (host or nvme),
    after the host copies ``demote`` (job ids, in order) are written to nvme."""

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
    host_copies: Sequence[Held],
    upcoming: Upcoming,
    host_credit: int = 0,
    spill: bool = True,
) -> Placement | None:
    """Where ``leaving`` (its ``nbytes``: the copy's size) goes; None when nothing fits.

    ``host_copies``: the host copies that may be demoted (not moving already); ``host_credit``:
    host bytes about to be freed (a copy swapping in from host); ``spill``: whether host's spill
    allowance may be used while nvme is full."""
    nbytes = leaving.nbytes
    free_host = tiers.host_bytes - tiers.host_used + host_credit
    if nbytes <= free_host:
        return Placement(HOST)
    if nbytes <= tiers.host_bytes:
        candidates = [h for h in host_copies if h.job_id != leaving.job_id]
        demote: list[Held] = []
        for candidate in sorted([*candidates, leaving], key=upcoming.least_soon_key):
            if candidate is leaving:
                break
            demote.append(candidate)
            free_host += candidate.nbytes
            if nbytes <= free_host:
                if tiers.nvme_fits(sum(h.nbytes for h in demote)):
                    return Placement(HOST, tuple(h.job_id for h in demote))
                break
    if tiers.nvme_fits(nbytes):
        return Placement(NVME)
    if spill and tiers.nvme_full and tiers.spill_fits(nbytes, host_credit):
        return Placement(HOST)
    return None


def prefetch_choice(expected: Sequence[str], tier_of: Mapping[str, str]) -> str | None:
    """The job to bring up from nvme next: the first in ``expected`` whose state is on nvme."""
    return next((job_id for job_id in expected if tier_of.get(job_id) == NVME), None)


def prefetch_placement(job: Held, tiers: Tiers, host_copies: Sequence[Held], upcoming: Upcoming) -> Placement | None:
    """Host, with the demotions that make room for ``job`` (on nvme), if host can take it
    without its spill allowance; else None: the job stays on nvme."""
    placement = place(job, tiers, host_copies, upcoming, spill=False)
    return placement if placement is not None and placement.tier == HOST else None


def first_to_demote(host_copies: Sequence[Held], tiers: Tiers, upcoming: Upcoming) -> Held | None:
    """When host memory runs short: the host copy to write to nvme first (needed least soon,
    then least recently used, of those nvme takes); None if nvme takes none."""
    fitting = [h for h in host_copies if tiers.nvme_fits(h.nbytes)]
    return min(fitting, key=upcoming.least_soon_key, default=None)
