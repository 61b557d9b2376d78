"""The state store: which memory tier each job's trainer state lives on, and the moves between them.

``StateStore`` wraps one trainer engine (a ``StateEngine``) and keeps every job's trainer state
(LoRA adapter or a full fine-tuning job's weights, AdamW step counts and moments, RNG state) on one
tier: ``device`` (live in the trainer, at most ``device_slots`` jobs), ``host`` (a ``JobStateCopy``
in the store's ``HostArena``, up to ``host_bytes``) or ``nvme`` (one file of raw bytes per copy in
``nvme_dir``, up to ``nvme_bytes``, described only in memory: scratch that never outlives the
process). Each tier is an object (``worker.state.tiers``) that holds its copies; the store builds
one per entry of ``state_policy.STATE_TIERS``, in its order, and asks the one a job is on. The decisions are
``plexctl.common.state_policy``'s; this module carries them out: ``ensure_resident``
(before each trainer call: evict, then swap in or create), ``prefetch`` (nvme to host), ``drop``,
``set_upcoming`` (the scheduler's order), ``inventory`` and ``background_moves`` (what moved).

Invariants. A job has one complete copy, on one tier. A record points at an nvme file only once
its write and fdatasync completed; a copy is verified when read (else ``CorruptCopyError``, never
imported). Capacity is reserved on the destination when a move is planned, so a moving copy counts
on both tiers until it lands; ``nvme_bytes`` bounds the files on disk, spares included. When
nothing fits, ``TierFullError``, and the job stays where it was. Write-behind copies stay in host
memory (over ``host_bytes`` by at most ``write_behind_bytes``) until written. A full disk marks
nvme ``full`` for ``NVME_FULL_RETRY_S`` (``inventory``: ``nospace``, ``full``, ``error``), while host
may hold ``host_spill_bytes`` over its budget.

Threads: ``ensure_resident`` and ``drop`` run on the trainer's thread, the others on any; one
condition variable guards the bookkeeping, copies and file I/O run outside it on records marked in
flight. Not here: durable checkpoints, moves across nodes, scheduling. Details: docs/state.md.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, NamedTuple, TypeVar

import torch

from plexctl.common import state_policy
from plexctl.common.cluster_config import DEFAULTS
from plexctl.common.spec import LoraSpec
from plexctl.common.state_policy import DEVICE, DIRECTIONS, HOST, NVME, TIER_ORDER, Held, Tiers, Upcoming
from plexctl.common.state_size import full_state_bytes, job_state_bytes
from worker.errors import JobConfigError, TierFullError
from worker.state.arena import HostArena, HostMemoryError
from worker.state.engine import StateEngine
from worker.state.files import unlink_all
from worker.state.job_copy import BufferPool, JobStateCopy, lora_signature
from worker.state.tiers import (
    DROPPING,
    NVME_FULL_RETRY_S,
    TIER_CLASSES,
    DeviceTier,
    HostTier,
    NoSpace,
    NvmeTier,
    Record,
    Tier,
    TierContext,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")
E = TypeVar("E", bound=StateEngine)  # the engine a store wraps (``trainer``), with its own methods

__all__ = ["NVME_FULL_RETRY_S", "TRANSIT_MIN_BYTES", "BackgroundMove", "HostBufferPool", "StateStore"]

BACKGROUND_MOVES_KEPT = 4096  # background moves kept for background_moves()
TRANSIT_MIN_BYTES = 256 << 20  # host memory for copies between tiers (StateStore's transit_bytes), at least


# ---------------------------------------------------------------- moves


@dataclass
class _Placement:
    tier: str  # HOST or NVME, for the state that leaves the device
    demote: list[Record]  # host copies to write to nvme first


STATE_KINDS = ("adapter", "model")  # a LoRA job's state, a full fine-tuning job's


def state_kind(record: Record) -> str:
    return "adapter" if record.lora is not None else "model"


@dataclass
class _SwapStats:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    critical_s: float = 0.0  # of ``seconds``: inside ensure_resident, on the trainer's thread
    overlap_s: float = 0.0  # of ``seconds``: off it, while the trainer's thread computed
    stalled_s: float = 0.0  # ensure_resident waiting for another thread's move to land

    def add(self, nbytes: int, seconds: float, critical: bool = True, overlap_s: float = 0.0) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds += seconds
        if critical:
            self.critical_s += seconds
        else:
            self.overlap_s += min(overlap_s, seconds)

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "critical_s": self.critical_s,
            "overlap_s": self.overlap_s,
            "stalled_s": self.stalled_s,
        }


class BackgroundMove(NamedTuple):
    """One move made off the trainer's thread: its direction, whose state, and when (wall
    clock, ``time.time()``: comparable with the daemon's record of when engines were busy)."""

    direction: str
    job_id: str
    start: float
    end: float


@dataclass
class _Moves:
    """What one ensure_resident moved, for its return value."""

    swap_in: str | None = None
    evicted: list[str] = field(default_factory=list)
    demoted: list[str] = field(default_factory=list)
    bytes: int = 0

    def report(self, seconds: float) -> dict[str, Any]:
        return {
            "swap_in": self.swap_in,
            "evicted": self.evicted,
            "demoted": self.demoted,
            "bytes": self.bytes,
            "seconds": seconds,
        }


# ---------------------------------------------------------------- the store


_TierT = TypeVar("_TierT", bound=Tier)


def _of(cls: type[_TierT], tiers: dict[str, Tier]) -> _TierT:
    tier = tiers[cls.name]
    assert isinstance(tier, cls)
    return tier


class StateStore(Generic[E]):
    """Keeps each job's trainer state on device, host or nvme; swaps jobs in on demand."""

    def __init__(
        self,
        trainer: E,
        device_slots: int = DEFAULTS.device_slots,
        host_bytes: int = 8 << 30,
        nvme_dir: Path | None = None,
        nvme_bytes: int = 64 << 30,
        clock: Callable[[], float] = time.perf_counter,
        host_spill_bytes: int | None = None,
        write_behind_bytes: int = 0,
        transit_bytes: int | None = None,
    ) -> None:
        """``host_spill_bytes``: how far host copies may exceed ``host_bytes`` while nvme is out
        of space (default a quarter of ``host_bytes``). ``write_behind_bytes``: how far they may
        exceed it while on their way to nvme, written by a background thread after
        ``ensure_resident`` returned (0: written before it returns). ``transit_bytes``: host
        memory for copies no tier counts, in transit (an evicted state before it is placed or
        while it is written to nvme, one read from nvme until it is imported, the copy swapped
        in from host while the evicted one takes its room) and whole pages (default an eighth
        of ``host_bytes``, at least ``TRANSIT_MIN_BYTES``).

        Host copies live in ``self.arena``, a ``HostArena`` of the sum of the four, made here
        (pinned on a CUDA engine): all the host memory the store uses. When it has no block for
        a copy, host copies are demoted to nvme (least soon needed first) until it has, else
        ``HostMemoryError`` (a ``TierFullError``): the job stays where it was."""
        if device_slots < 1:
            raise ValueError(f"device_slots must be >= 1, got {device_slots}")
        if host_bytes < 0 or nvme_bytes < 0:
            raise ValueError(f"host_bytes and nvme_bytes must be >= 0, got {host_bytes} and {nvme_bytes}")
        self.trainer = trainer
        self.device_slots = device_slots
        self.host_bytes = host_bytes
        self.host_spill_bytes = host_bytes // 4 if host_spill_bytes is None else max(0, host_spill_bytes)
        self.write_behind_bytes = max(0, write_behind_bytes)
        self.transit_bytes = max(host_bytes // 8, TRANSIT_MIN_BYTES) if transit_bytes is None else max(0, transit_bytes)
        self.nvme_dir = Path(nvme_dir) if nvme_dir is not None else None
        self._clock = clock
        self._serial = threading.RLock()  # one trainer-side operation at a time
        self._cond = threading.Condition()  # guards everything below, and the tiers' bookkeeping
        self._records: dict[str, Record] = {}
        self._upcoming = Upcoming()
        self._tick = 0
        self._swaps = {direction: _SwapStats() for direction in DIRECTIONS}
        self._swaps_by_kind = {kind: _SwapStats() for kind in STATE_KINDS}  # the same moves, by what moved
        self._background: deque[BackgroundMove] = deque(maxlen=BACKGROUND_MOVES_KEPT)
        self._background_seq = 0  # background moves ever logged
        self._behind_bytes = 0  # bytes of copies handed to the write-behind thread, not yet written
        self._writer: ThreadPoolExecutor | None = None  # the write-behind thread, made on first use
        self._handoffs = itertools.count(1)  # numbers the copies handed to the write-behind thread
        self.arena = HostArena(
            self.host_bytes + self.host_spill_bytes + self.write_behind_bytes + self.transit_bytes,
            pinned=_on_cuda(trainer),
        )
        # host copies, exported or read from nvme: blocks of exactly their pages (none sits on a larger one)
        self._pool = HostBufferPool(self.arena, oversize=1.0)
        context = TierContext(
            self._records,
            self._cond,
            trainer,
            self.arena,
            self._pool,
            clock,
            device_slots,
            {HOST: host_bytes, NVME: nvme_bytes},
            self.host_spill_bytes,
            self.nvme_dir,
        )
        self.tiers: list[Tier] = [TIER_CLASSES[name].build(context) for name in TIER_ORDER]  # fastest first
        self._tier = {tier.name: tier for tier in self.tiers}
        # the tiers whose own mechanics the store drives: the trainer's slots, host memory, copy files
        self.device, self.host, self.nvme = (
            _of(DeviceTier, self._tier),
            _of(HostTier, self._tier),
            _of(NvmeTier, self._tier),
        )
        self._files = self.nvme.files  # its copy files and spares (None without nvme_dir)
        self._trainer_thread: int | None = None  # the thread that calls ensure_resident

    @property
    def nvme_bytes(self) -> int:
        """The nvme tier's budget (0 without ``nvme_dir``)."""
        return self.nvme.capacity

    # ------------------------------------------------------------ the public operations

    def ensure_resident(self, job_id: str, lora: LoraSpec | None, seed: int) -> dict[str, Any]:
        """Put the job's state on the device (swap in, or create it); return what moved.

        ``{"swap_in": "host" | "nvme" | None, "evicted": [...], "demoted": [...], "bytes": n,
        "seconds": s}``: ``bytes`` counts every copy this call moved.
        """
        started = self._clock()
        self._trainer_thread = threading.get_ident()
        with self._serial:
            self._refresh_device_bytes()
            with self._cond:
                record = self._take_back(job_id, lora) or self._settled(job_id)
                if record is not None:
                    _check_same_lora(record, lora)
                    if record.tier == DEVICE:
                        self._touch(record)
                        return _Moves().report(self._clock() - started)
                    self.device.reserve(record)
            moves, buffer = _Moves(), None
            try:
                incoming, read_seconds, buffer = self._take_incoming(record, moves)
                credit = self._credit(record)
                self._make_room(job_id, credit, moves)
                self._swap_in(job_id, record, incoming, read_seconds, lora, seed, moves)
            except BaseException:
                self._unmark([record] if record is not None else [])
                if buffer is not None and record is not None:  # read for nothing
                    self._tier[record.tier].abandon(record, buffer)
                raise
            if buffer is not None:  # imported: the engine keeps no reference to the copy's memory
                self.host.give_back(record, buffer)
        return moves.report(self._clock() - started)

    def set_upcoming(self, job_ids: list[str]) -> None:
        """The order in which jobs will next need the trainer (first = soonest)."""
        upcoming = Upcoming(job_ids)
        with self._cond:
            self._upcoming = upcoming

    def prefetch(self, job_id: str) -> bool:
        """Bring a job's state from nvme to host ahead of need; True if it moved.

        A no-op (False) for a job not on nvme, already moving, or for which host has no room
        without demoting copies needed sooner. Safe to call from another thread than the
        trainer's: the read runs without holding the store's lock.
        """
        with self._cond:
            record = self._records.get(job_id)
            if record is None or record.tier != NVME or record.moving_to is not None:
                return False
            tiers = self._tiers()
            chosen = state_policy.prefetch_placement(
                self._held(record, record.nbytes), tiers, self._copies(record), self._upcoming
            )
            if chosen is None:
                return False
            placement = self._placement(chosen)
            self.host.reserve(record)
            self._reserve_demotions(placement, tiers)
        pending = [record, *placement.demote]  # marked, not landed: unmarked if the move fails
        try:
            for demoted in placement.demote:
                self._demote(demoted, critical=False)
                pending.remove(demoted)
            trainer_cpu, wall = self._trainer_cpu(), time.time()
            started = self._clock()  # the read alone
            state, buffer = self.nvme.read(record)
            seconds, overlap = self._clock() - started, self._trainer_cpu_since(trainer_cpu)
        except (NoSpace, HostMemoryError):  # host copies that did not go down stay; so does the job, on nvme
            self._unmark(pending)
            return False
        except BaseException:
            self._unmark(pending)
            raise
        with self._cond:
            self.host.land(record, state, None)
            record.moving_to = None
            doomed = self.nvme.free(record)
            self._swapped("nvme->host", record, state.nbytes, seconds, critical=False, overlap_s=overlap)
            self._log_background(BackgroundMove("nvme->host", job_id, wall, wall + seconds))
            self._cond.notify_all()
        unlink_all(doomed)
        return True

    def drop(self, job_id: str) -> None:
        """Forget the job on every tier (it ended): release it, free its copy, delete its files."""
        with self._serial:
            with self._cond:
                record = self._settled(job_id)
                if record is None:
                    return
                record.moving_to = DROPPING
            try:
                self._tier[record.tier].discard(record)
            except BaseException:  # still where it was (the trainer kept it): counted there
                self._unmark([record])
                raise
            with self._cond:
                del self._records[job_id]
                self._cond.notify_all()

    def where(self, job_id: str) -> str | None:
        """``"device"``, ``"host"``, ``"nvme"`` or None (unknown); a moving job is where it comes from."""
        with self._cond:
            record = self._records.get(job_id)
            return record.tier if record is not None else None

    def background_moves(self, since: int = 0) -> tuple[int, list[BackgroundMove]]:
        """The moves made off the trainer's thread (``prefetch``'s reads and the demotions it
        made, the write-behind thread's writes) that were logged after the first ``since``,
        oldest first (at most the latest ``BACKGROUND_MOVES_KEPT``), and how many were ever
        logged: the next call's ``since``."""
        with self._cond:
            new = self._background_seq - max(0, since)
            return self._background_seq, list(self._background)[max(0, len(self._background) - new) :]

    def _swapped(self, direction: str, record: Record, nbytes: int, seconds: float, **kw: Any) -> None:
        """Count one move of ``record``'s state (under the lock), by direction and by kind."""
        self._swaps[direction].add(nbytes, seconds, **kw)
        self._swaps_by_kind[state_kind(record)].add(nbytes, seconds, **kw)

    def swap_stats(self, direction: str) -> dict[str, Any]:
        """One direction's swap counters (``inventory()["swaps"][direction]``), without building
        the rest of the inventory: for a caller timing moves one by one."""
        with self._cond:
            return self._swaps[direction].to_json()

    def inventory(self) -> dict[str, Any]:
        """Per tier: capacity, unit, used bytes (moving copies count on both tiers), job ids
        (nvme: also ``nospace``, ``full``, ``error``, see the module docstring); the jobs in
        flight; and swap count / bytes / seconds per direction."""
        with self._cond:
            tiers = {
                tier.name: {
                    "capacity": tier.capacity,
                    "unit": tier.unit,
                    "used_bytes": tier.used(),
                    "jobs": tier.jobs(),
                    **tier.details(),
                }
                for tier in self.tiers
            }
            in_flight = {
                r.job_id: f"{r.tier}->{r.moving_to}" for r in self._records.values() if r.moving_to in self._tier
            }
            swaps = {d: s.to_json() for d, s in self._swaps.items()}
            by_kind = {k: s.to_json() for k, s in self._swaps_by_kind.items()}
            return {**tiers, "in_flight": in_flight, "swaps": swaps, "swaps_by_kind": by_kind}

    @staticmethod
    def job_bytes(lora: LoraSpec | None, model_config: Mapping[str, Any] | Any) -> int:
        """A job's state size once it has trained (fp32 adapter, or for a full fine-tuning job
        (``lora`` None) fp32 weights, + AdamW's two moments + step counts + RNG state), from its
        LoRA config and the base model's config (a ``config.json`` mapping or a transformers
        config); see ``plexctl.common.state_size``."""
        config = model_config if isinstance(model_config, Mapping) else model_config.to_dict()
        if lora is None:
            return full_state_bytes(config, "float32", cuda=torch.cuda.is_available())
        return job_state_bytes(lora.rank, list(lora.target_modules), config, cuda=torch.cuda.is_available())

    # ------------------------------------------------------------ swapping in

    def _take_incoming(
        self, record: Record | None, moves: _Moves
    ) -> tuple[JobStateCopy | None, float, torch.Tensor | None]:
        """The copy to import (read and verified if on nvme), the seconds the read took, and
        the pool buffer under the copy (to give back once imported), if any."""
        if record is None:
            return None, 0.0, None
        tier = self._tier[record.tier]
        if tier.in_host_memory:
            state, buffer = tier.read(record)
            return state, 0.0, buffer
        started = self._clock()
        state, buffer = self._in_host_memory(lambda: tier.read(record), record, moves)
        return state, self._clock() - started, buffer

    def _swap_in(
        self,
        job_id: str,
        record: Record | None,
        incoming: JobStateCopy | None,
        read_seconds: float,
        lora: LoraSpec | None,
        seed: int,
        moves: _Moves,
    ) -> None:
        started = self._clock()
        if record is None or incoming is None:
            self.device.create(job_id, lora, seed)
        else:
            self.device.write(record, incoming)
        seconds = self._clock() - started + read_seconds
        source = record.tier if record is not None else None
        device_bytes = self.trainer.state_bytes(job_id)
        with self._cond:
            if record is None:
                record = Record(job_id, lora, seed, DEVICE, device_bytes, 0)
                self._records[job_id] = record
            self.device.land(record, incoming, None)
            record.moving_to, record.nbytes = None, device_bytes
            doomed = self._tier[source].free(record) if source is not None else []
            self._touch(record)
            if incoming is not None:
                self._swapped(f"{source}->device", record, incoming.nbytes, seconds)
            self._cond.notify_all()
        unlink_all(doomed)
        if incoming is not None:
            moves.swap_in = source
            moves.bytes += incoming.nbytes

    # ------------------------------------------------------------ evicting

    def _make_room(self, job_id: str, credit: dict[str, int], moves: _Moves) -> None:
        """Evict until fewer than ``device_slots`` other jobs are on the device."""
        while True:
            with self._cond:
                others = [r for r in self._records.values() if r.tier == DEVICE and r.job_id != job_id]
                if len(others) < self.device_slots:
                    return
                victim = self._records[state_policy.victim([self._held(r) for r in others], self._upcoming).job_id]
            self._evict(victim, credit, moves)
            credit = {}

    def _evict(self, victim: Record, credit: dict[str, int], moves: _Moves) -> None:
        """Copy the victim off the device into a pool buffer, place the copy (demoting others if
        needed), release it."""
        started = self._clock()
        state = self._in_host_memory(lambda: self.device.read(victim)[0], victim, moves)
        export_seconds = self._clock() - started
        try:
            with self._cond:
                placement, tiers = self._place_or_wait(victim, state.nbytes, credit)
                victim.nbytes = state.nbytes  # reserve the copy's size
                self._tier[placement.tier].reserve(victim)
                self._reserve_demotions(placement, tiers)
                behind = self._write_behind_room(placement, state.nbytes)
                self._behind_bytes += behind
        except BaseException:
            self._give_back(state)
            raise
        if behind:
            self._evict_behind(victim, state, placement, export_seconds, behind, moves)
            return
        tier, write_seconds, written = placement.tier, 0.0, None  # tier: its name, the policy's answer
        pending = [victim, *placement.demote]  # marked, not landed: unmarked if the move fails
        try:
            try:
                for demoted in placement.demote:
                    self._demote(demoted)
                    pending.remove(demoted)
                    moves.demoted.append(demoted.job_id)
                    moves.bytes += demoted.nbytes
                if not self._tier[tier].in_host_memory:
                    written, write_seconds = self._write(self._tier[tier], victim, state)
            except NoSpace:  # host copies that did not go down stay there; the victim spills to host
                self._unmark(pending[1:])
                pending = [victim]
                tier = self._spill_to_host(victim, state.nbytes)
        except BaseException:
            self._unmark(pending)
            self._give_back(state)
            raise
        try:
            self.device.discard(victim)
        except BaseException:  # the job stays on the device: its copy is not one
            if written is not None:
                self._tier[tier].unwrite(written)
            self._unmark([victim])
            self._give_back(state)
            raise
        with self._cond:
            keeps_buffer = self._tier[tier].land(victim, state, written)
            victim.moving_to, victim.nbytes = None, state.nbytes
            self.device.free(victim)
            self._swapped(f"device->{tier}", victim, state.nbytes, export_seconds + write_seconds)
            self._cond.notify_all()
        if not keeps_buffer:  # written: its buffer is free again
            self._give_back(state)
        moves.evicted.append(victim.job_id)
        moves.bytes += state.nbytes

    def _write_behind_room(self, placement: _Placement, nbytes: int) -> int:
        """Bytes this eviction would write to nvme (the demotions, and the victim if it goes
        there) if the write-behind allowance takes them all, else 0 (caller holds the lock)."""
        writes = sum(r.nbytes for r in placement.demote) + (nbytes if placement.tier == NVME else 0)
        return writes if 0 < writes <= self.write_behind_bytes - self._behind_bytes else 0

    def _evict_behind(
        self,
        victim: Record,
        state: JobStateCopy,
        placement: _Placement,
        export_seconds: float,
        behind: int,
        moves: _Moves,
    ) -> None:
        """The eviction with its nvme writes left to the write-behind thread: the victim lands
        in host memory (still marked for nvme if it goes there), the host copies marked for
        demotion stay there, and the thread writes them down after this returns."""
        writes = [*placement.demote, *([victim] if placement.tier == NVME else [])]
        try:
            self.device.discard(victim)
        except BaseException:
            self._unmark([victim, *placement.demote])
            self._give_back(state)
            with self._cond:
                self._behind_bytes -= behind
                self._cond.notify_all()
            raise
        with self._cond:
            self.host.land(victim, state, None)
            victim.nbytes = state.nbytes
            self.device.free(victim)
            victim.moving_to = NVME if placement.tier == NVME else None
            self._swapped("device->host", victim, state.nbytes, export_seconds)
            handoffs = []
            for record in writes:
                record.behind = next(self._handoffs)
                handoffs.append((record, record.behind))
            self._cond.notify_all()
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="write-behind")
        try:
            self._writer.submit(self._write_behind, handoffs, behind)
        except RuntimeError:  # the interpreter is shutting down (no new work for threads): write here
            self._write_behind(handoffs, behind)
        moves.evicted.append(victim.job_id)
        moves.bytes += state.nbytes

    def _write_behind(self, handoffs: list[tuple[Record, int]], nbytes: int) -> None:
        """On the write-behind thread: demote the host copies handed over (records marked for
        nvme, with their handoff numbers) in order, but for those taken back meanwhile. A copy
        that cannot go down (no space, an I/O error: logged) stays in host memory with those
        after it."""
        try:
            for i, (record, handoff) in enumerate(handoffs):
                try:
                    self._demote(record, critical=False, handoff=handoff)
                except NoSpace:
                    self._unmark_behind(handoffs[i:])
                    return
                except Exception:  # noqa: BLE001 - the copies stay on host; the next eviction tries again
                    log.warning(
                        "write-behind of %s's state to nvme failed; it stays in host memory",
                        record.job_id,
                        exc_info=True,
                    )
                    self._unmark_behind(handoffs[i:])
                    return
        finally:
            with self._cond:
                self._behind_bytes -= nbytes
                self._cond.notify_all()

    def wait_written(self, timeout: float | None = None) -> bool:
        """Wait until every write handed to the write-behind thread is done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._behind_bytes == 0, timeout)

    def _give_back(self, state: JobStateCopy) -> None:
        """An exported copy that is not kept: its buffer goes back to the pool."""
        if state.memory is not None:
            self._pool.give(state.memory)

    def _in_host_memory(self, copy: Callable[[], _T], record: Record, moves: _Moves) -> _T:
        """``copy()``, which fills a pool buffer (an export, a read from nvme); when the arena
        has no block for it, settled host copies go to nvme (least soon needed first), or moves
        under way are waited for, and it is tried again. ``HostMemoryError`` when neither is
        possible (nothing was copied)."""
        while True:
            try:
                return copy()
            except HostMemoryError as exc:
                short = exc
            with self._cond:
                tiers = self._tiers()
                first = state_policy.first_to_demote(HOST, self._copies(record)[HOST], tiers, self._upcoming)
                demoted = self._records[first.job_id] if first is not None else None
                if demoted is None:
                    if self._behind_bytes or any(r.moving_to in (HOST, NVME) for r in self._records.values()):
                        self._cond.wait()  # copies landing on nvme free their blocks
                        continue
                    raise HostMemoryError(short.nbytes, self.arena.stats(), f"job {record.job_id!r}'s state") from None
                self.nvme.reserve(demoted)
            try:
                self._demote(demoted)
            except BaseException as exc:
                self._unmark([demoted])
                if isinstance(exc, NoSpace):
                    raise HostMemoryError(short.nbytes, self.arena.stats(), f"job {record.job_id!r}'s state") from None
                raise
            moves.demoted.append(demoted.job_id)
            moves.bytes += demoted.nbytes

    def _spill_to_host(self, victim: Record, nbytes: int) -> str:
        """After nvme ran out of space for the victim's copy or for the demotions that made room:
        HOST if host takes it within its spill allowance; else TierFullError (it stays on the device)."""
        with self._cond:
            victim.moving_to = None
            if not self._tiers().room(HOST).spill_fits(nbytes):
                raise TierFullError(self._tier_full_message(victim.job_id, nbytes))
            self.host.reserve(victim)
            return HOST

    def _demote(self, record: Record, critical: bool = True, handoff: int | None = None) -> None:
        """Write a host copy (marked moving to nvme) to nvme, then let go of it (its pool
        buffer, if any, goes back to the pool). ``critical``: called by ensure_resident.
        ``handoff``: the write-behind thread's number for the copy; a copy taken back
        (``_take_back``) before its write begins is skipped, one taken back while written is
        not landed (its file becomes a spare)."""
        with self._cond:
            if handoff is not None:
                if record.behind != handoff:
                    return
                record.writing_from = record.host_buffer
            state, buffer = record.host_copy, record.host_buffer
        assert state is not None
        trainer_cpu, wall = None if critical else self._trainer_cpu(), time.time()
        try:
            written, seconds = self._write(self.nvme, record, state)
        except BaseException:
            if handoff is not None:  # the copy stays in host memory (or was taken back): its buffer is not freed
                self._end_write(record, None)
            raise
        overlap = self._trainer_cpu_since(trainer_cpu)
        doomed: list[Path] = []
        with self._cond:
            if handoff is None or record.behind == handoff:
                self.nvme.land(record, state, written)
                self.host.free(record)
                record.moving_to, record.behind = None, None
                self._swapped("host->nvme", record, state.nbytes, seconds, critical=critical, overlap_s=overlap)
                if not critical:
                    self._log_background(BackgroundMove("host->nvme", record.job_id, wall, wall + seconds))
                self._cond.notify_all()
            else:  # taken back while written: the file is no copy of anything
                doomed = self.nvme.keep_as_spare(written)
                buffer = None
                self._cond.notify_all()
        unlink_all(doomed)
        if handoff is not None:
            self._end_write(record, buffer)
        elif buffer is not None:
            self.host.give_back(record, buffer)

    def _end_write(self, record: Record, landed: torch.Tensor | None) -> None:
        """The write-behind thread is done reading the record's copy: give back the buffer of a
        copy that landed on nvme (``landed``), or that of one taken back meanwhile, once the
        trainer has imported it (else the trainer gives it back: ``HostTier.give_back``)."""
        with self._cond:
            orphan, record.orphan, record.writing_from = record.orphan, None, None
        for buffer in (landed, orphan):
            if buffer is not None:
                self._pool.give(buffer)

    def _take_back(self, job_id: str, lora: LoraSpec | None) -> Record | None:
        """The job's record, marked moving to the device, if its host copy was handed to the
        write-behind thread and not yet landed on nvme: the handoff is void, the copy swaps in
        from host memory (caller holds the lock). Else None."""
        record = self._records.get(job_id)
        if record is None or record.behind is None or record.moving_to != NVME:
            return None
        if lora_signature(record.lora) != lora_signature(lora):
            return None  # refused by the caller, once the write landed
        record.behind = None
        self.device.reserve(record)
        return record

    def _unmark_behind(self, handoffs: list[tuple[Record, int]]) -> None:
        """After a failed write-behind: the copies handed over and not taken back stay in host memory."""
        with self._cond:
            for record, handoff in handoffs:
                if record.behind == handoff:
                    record.behind, record.moving_to = None, None
            self._cond.notify_all()

    # ------------------------------------------------------------ planning (callers hold the lock)

    def _place_or_wait(self, record: Record, nbytes: int, credit: dict[str, int]) -> tuple[_Placement, Tiers]:
        """A placement for a state leaving the device, and the tiers it was decided on; waits
        out other threads' moves when they hold the room, raises TierFullError when nothing fits
        and nothing is moving."""
        while True:
            tiers = self._tiers()
            chosen = state_policy.place(self._held(record, nbytes), tiers, self._copies(record), self._upcoming, credit)
            if chosen is not None:
                return self._placement(chosen), tiers
            if not any(r.moving_to in (HOST, NVME) for r in self._records.values()):
                raise TierFullError(self._tier_full_message(record.job_id, nbytes))
            self._cond.wait()

    def _placement(self, chosen: state_policy.Placement) -> _Placement:
        return _Placement(chosen.tier, [self._records[job_id] for job_id in chosen.demote])

    def _held(self, record: Record, nbytes: int | None = None) -> Held:
        return Held(record.job_id, record.nbytes if nbytes is None else nbytes, record.last_used)

    def _copies(self, beside: Record | None) -> dict[str, list[Held]]:
        """Per storage tier, its settled copies other than ``beside``'s: those a placement may
        demote (caller holds the lock)."""
        copies: dict[str, list[Held]] = {tier.name: [] for tier in self.tiers[1:]}
        for r in self._records.values():
            if r.tier != DEVICE and r.moving_to is None and r is not beside:
                copies[r.tier].append(self._held(r))
        return copies

    def _tiers(self) -> Tiers:
        """The storage tiers as the policy sees them now (caller holds the lock)."""
        return Tiers(tuple(tier.room() for tier in self.tiers[1:]))

    def _credit(self, record: Record | None) -> dict[str, int]:
        """Bytes a swap-in of ``record`` frees where it comes from before an eviction lands: a
        copy in host memory gives its room up (caller holds the lock)."""
        if record is None or not self._tier[record.tier].in_host_memory:
            return {}
        return {record.tier: record.nbytes}

    def _reserve_demotions(self, placement: _Placement, tiers: Tiers) -> None:
        """Mark the copies a placement demotes as moving one tier down (caller holds the lock)."""
        below = tiers.below(placement.tier)
        for demoted in placement.demote:
            assert below is not None  # the policy demotes only where a tier lies below
            self._tier[below.name].reserve(demoted)

    def _tier_full_message(self, job_id: str, nbytes: int) -> str:
        spill = f" (+{self.host.spill_bytes} allowed while nvme is out of space)" if self.nvme.full() else ""
        return (
            f"no room for job {job_id!r}'s state ({nbytes} bytes) off the device: "
            f"host {self.host.used()}/{self.host.capacity} bytes used{spill}, {self.nvme.usage()}"
        )

    # ------------------------------------------------------------ bookkeeping helpers

    def _settled(self, job_id: str) -> Record | None:
        """The job's record once no other thread is moving it (caller holds the lock); the
        wait counts as ``stalled_s`` of the move's direction."""
        while True:
            record = self._records.get(job_id)
            if record is None or record.moving_to is None:
                return record
            direction = f"{record.tier}->{record.moving_to}"
            started = self._clock()
            self._cond.wait()
            if direction in self._swaps:
                self._swaps[direction].stalled_s += self._clock() - started

    def _trainer_cpu(self) -> float | None:
        """CPU seconds of the trainer's thread so far; None from that thread itself (or if unknown)."""
        ident = self._trainer_thread
        if ident is None or ident == threading.get_ident():
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (AttributeError, OSError):  # no such clock here, or the thread has ended
            return None

    def _trainer_cpu_since(self, before: float | None) -> float:
        """The trainer thread's CPU seconds since ``before`` (0.0 when not measurable)."""
        after = self._trainer_cpu() if before is not None else None
        return max(0.0, after - before) if before is not None and after is not None else 0.0

    def _log_background(self, move: BackgroundMove) -> None:
        """Keep a background move for ``background_moves`` (caller holds the lock)."""
        self._background.append(move)
        self._background_seq += 1

    def _unmark(self, records: list[Record]) -> None:
        """After a failed move: what did not land stays where it was."""
        with self._cond:
            for record in records:
                record.moving_to = None
            self._cond.notify_all()

    def _touch(self, record: Record) -> None:
        self._tick += 1
        record.last_used = self._tick

    def _refresh_device_bytes(self) -> None:
        """Device jobs grow AdamW moments on their first step: re-read their sizes."""
        with self._cond:
            resident = [r.job_id for r in self._records.values() if r.tier == DEVICE]
        on_trainer = set(self.trainer.jobs())
        sizes = {job_id: self.trainer.state_bytes(job_id) for job_id in resident if job_id in on_trainer}
        with self._cond:
            for job_id, nbytes in sizes.items():
                record = self._records.get(job_id)
                if record is not None and record.tier == DEVICE:
                    record.nbytes = nbytes

    # ------------------------------------------------------------ writes to a tier

    def _write(self, tier: Tier, record: Record, state: JobStateCopy) -> tuple[Any, float]:
        """``tier.write`` (outside the lock) and the seconds it took: on nvme, a file written
        and fdatasync'd, ``NoSpace`` when the disk is full."""
        started = self._clock()
        written = tier.write(record, state)
        return written, self._clock() - started


# ---------------------------------------------------------------- module helpers


def _check_same_lora(record: Record, lora: LoraSpec | None) -> None:
    if lora_signature(record.lora) != lora_signature(lora):
        raise JobConfigError(
            f"job {record.job_id!r} is stored with LoRA {lora_signature(record.lora)}, not {lora_signature(lora)}"
        )


def _on_cuda(trainer: StateEngine) -> bool:
    """Whether the trainer runs on CUDA: then host copies are pinned."""
    return getattr(getattr(trainer, "device", None), "type", None) == "cuda"


HostBufferPool = BufferPool  # the store's host copies live in its buffers, blocks of its arena
