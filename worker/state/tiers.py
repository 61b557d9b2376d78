"""The state store's tiers as objects behind one interface, ``Tier``, and the record of a job's state.

A tier owns what a job's one complete copy is held with while the job is on it: ``DeviceTier``
the trainer engine (a ``StateEngine``) and its ``slots``; ``HostTier`` the store's ``HostArena``
and the ``BufferPool`` that hands out its blocks (host copies live there, as does every copy in
transit); ``NvmeTier`` a directory of copy files (``CopyDirectory``, with spares to overwrite) and
the record of a full disk. ``worker.state.store`` keeps them in ``state_policy.TIER_ORDER``
(fastest first) and asks the tier a record is on rather than branching on its name: ``read`` (the
copy in host memory), ``write`` (a copy onto the tier: the I/O), ``land`` (the record now holds what
``write`` made), ``free`` (its copy left the tier, having landed on another), ``discard`` (the job
ended, or its copy is not wanted), ``reserve`` and ``used`` (bytes on it, copies on their way
counted from the moment the move is planned), ``details`` (the inventory's fields). Where a copy
goes is ``state_policy``'s decision, not a tier's. Adding a tier: its entry in
``state_policy.STATE_TIERS`` and one class here in ``TIER_CLASSES``, built by ``build`` from the
store's ``TierContext``; ``room`` is how the policy sees it.

Invariants. A record's tier fields (``host_copy``/``host_buffer``, ``nvme``) are set only by the
tier they belong to. Every tier shares the store's condition variable and records table:
``read``, ``write`` and ``discard`` run outside it (they copy, write files or call the trainer),
``land``, ``free``, ``reserve`` and ``used`` with it held.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plexctl.common.spec import LoraSpec
from plexctl.common.state_policy import DEVICE, HOST, NVME, Room
from worker.checkpoint_files import NO_SPACE_ERRNOS, free_bytes, no_space_reason
from worker.state.arena import HostArena
from worker.state.dirs import CopyDirectory
from worker.state.engine import StateEngine
from worker.state.files import NvmeCopy, read_copy, unlink_all, write_copy
from worker.state.job_copy import BufferPool, JobStateCopy

log = logging.getLogger(__name__)

DROPPING = "dropped"  # a record's moving_to while the store's drop() forgets it
NVME_FULL_RETRY_S = 60.0  # after a write ran out of space: nvme takes only room the store freed, this long


class NoSpace(Exception):
    """An nvme write ran out of disk space or quota (logged and counted); the caller falls back."""


@dataclass
class Record:
    """One job's state as the store tracks it: which tier holds its one complete copy, and the
    tier's handle on it."""

    job_id: str
    lora: LoraSpec | None  # None: full fine-tuning
    seed: int
    tier: str  # where the job's one complete copy is
    nbytes: int
    last_used: int  # store tick of its last ensure_resident
    host_copy: JobStateCopy | None = field(default=None, repr=False)  # set while tier == HOST
    host_buffer: torch.Tensor | None = field(default=None, repr=False)  # the pool's memory under host_copy
    moving_to: str | None = None  # set while a thread moves it: others wait, plans skip it
    nvme: NvmeCopy | None = field(default=None, repr=False)  # set while tier == NVME: its file and metadata
    behind: int | None = None  # handoff number while the write-behind thread is to write host_copy to nvme
    writing_from: torch.Tensor | None = field(default=None, repr=False)  # the buffer that thread reads now
    orphan: torch.Tensor | None = field(default=None, repr=False)  # that buffer, once the copy was taken back


@dataclass(frozen=True)
class TierContext:
    """What a store gives each tier it builds: its records table and condition variable, the
    trainer, the host arena and buffer pool, the clock, and the settings of every tier
    (``budgets``: bytes per storage tier; ``host_spill_bytes``: how far host may go over its
    budget while nvme is full; ``nvme_dir``: None, no nvme tier)."""

    records: Mapping[str, Record]
    lock: threading.Condition
    trainer: StateEngine
    arena: HostArena
    pool: BufferPool
    clock: Callable[[], float]
    device_slots: int
    budgets: Mapping[str, int]
    host_spill_bytes: int
    nvme_dir: Path | None


class Tier(ABC):
    """One place a job's state can live. ``records`` and ``lock``: the store's table and the
    condition variable that guards it (and the tiers' own bookkeeping)."""

    name: str
    unit = "bytes"
    reserves = True  # a copy moving here counts on it from the moment its move is planned
    in_host_memory = False  # its copies are host memory: reading one costs nothing, writing one is landing it

    def __init__(self, records: Mapping[str, Record], lock: threading.Condition) -> None:
        self._records = records
        self._lock = lock

    @property
    @abstractmethod
    def capacity(self) -> int:
        """In ``unit``s: the most it holds."""

    def used(self) -> int:
        """Bytes of the copies on it (not those being dropped), and of those on their way here
        if it ``reserves`` (lock held)."""
        return sum(
            r.nbytes
            for r in self._records.values()
            if (r.tier == self.name and r.moving_to != DROPPING) or (self.reserves and r.moving_to == self.name)
        )

    def jobs(self) -> list[str]:
        """The jobs whose copy is on it, sorted (lock held)."""
        return sorted(r.job_id for r in self._records.values() if r.tier == self.name)

    def reserve(self, record: Record) -> None:
        """Mark the record as moving here: its bytes count here until it lands (lock held)."""
        record.moving_to = self.name

    @abstractmethod
    def read(self, record: Record) -> tuple[JobStateCopy, torch.Tensor | None]:
        """The record's copy in host memory and the pool buffer under it (outside the lock); a
        read that made a new buffer hands it to the caller (``abandon`` gives it back)."""

    def abandon(self, record: Record, buffer: torch.Tensor) -> None:
        """A ``read`` that was not used: its buffer, if the read made one, goes back."""
        return None

    @abstractmethod
    def write(self, record: Record, copy: JobStateCopy) -> Any:
        """Put ``copy`` onto this tier (outside the lock); returns what ``land`` records."""

    def unwrite(self, written: Any) -> None:
        """What ``write`` made, when the move it was for failed before it landed (outside the lock)."""
        return None

    @abstractmethod
    def land(self, record: Record, copy: JobStateCopy | None, written: Any) -> bool:
        """The record is on this tier now, holding what ``write`` made (lock held); True when the
        tier keeps ``copy``'s host buffer, False when the caller gives it back."""

    def free(self, record: Record) -> list[Path]:
        """The record's copy left this tier, having landed on another (lock held): let go of the
        handle; returns files to delete outside the lock."""
        return []

    @abstractmethod
    def discard(self, record: Record) -> None:
        """The record's copy on this tier is not wanted any more (outside the lock)."""

    def details(self) -> dict[str, Any]:
        """The inventory's fields beyond capacity, unit, used bytes and jobs (lock held)."""
        return {}

    def room(self) -> Room:
        """The tier as ``state_policy`` sees it at a decision (lock held; storage tiers)."""
        return Room(self.name, self.capacity, self.used())

    @classmethod
    @abstractmethod
    def build(cls, context: TierContext) -> Tier:
        """The tier of a store, from what the store made and was given."""


class DeviceTier(Tier):
    """The trainer's device: live jobs, at most ``slots`` of them."""

    name, unit, reserves = DEVICE, "slots", False

    def __init__(
        self,
        records: Mapping[str, Record],
        lock: threading.Condition,
        engine: StateEngine,
        slots: int,
        pool: BufferPool,
    ) -> None:
        super().__init__(records, lock)
        self.engine = engine
        self.slots = slots
        self._pool = pool

    @classmethod
    def build(cls, context: TierContext) -> DeviceTier:
        return cls(context.records, context.lock, context.trainer, context.device_slots, context.pool)

    @property
    def capacity(self) -> int:
        return self.slots

    def read(self, record: Record) -> tuple[JobStateCopy, torch.Tensor | None]:
        copy = self.engine.export_state(record.job_id, self._pool)
        return copy, copy.memory

    def create(self, job_id: str, lora: LoraSpec | None, seed: int) -> None:
        """A new job's state, made on the device (a function of ``seed`` only)."""
        self.engine.ensure_job(job_id, lora, seed)

    def write(self, record: Record, copy: JobStateCopy) -> None:
        self.engine.import_state(record.job_id, copy)

    def land(self, record: Record, copy: JobStateCopy | None, written: Any) -> bool:
        record.tier = DEVICE
        return False

    def discard(self, record: Record) -> None:
        self.engine.release(record.job_id)

    def details(self) -> dict[str, Any]:
        return {"step": getattr(self.engine, "step_info", {})}

    def on_cuda(self) -> bool:
        """Whether the engine runs on CUDA: then host copies are pinned."""
        return getattr(getattr(self.engine, "device", None), "type", None) == "cuda"


class HostTier(Tier):
    """Host memory: copies in blocks of the store's arena, up to ``nbytes`` (over it by
    ``spill_bytes`` while nvme is out of space)."""

    name = HOST
    in_host_memory = True

    def __init__(
        self,
        records: Mapping[str, Record],
        lock: threading.Condition,
        arena: HostArena,
        pool: BufferPool,
        nbytes: int,
        spill_bytes: int,
    ) -> None:
        super().__init__(records, lock)
        self.arena = arena
        self.pool = pool
        self.nbytes = nbytes
        self.spill_bytes = spill_bytes

    @classmethod
    def build(cls, context: TierContext) -> HostTier:
        return cls(
            context.records, context.lock, context.arena, context.pool, context.budgets[HOST], context.host_spill_bytes
        )

    @property
    def capacity(self) -> int:
        return self.nbytes

    def room(self) -> Room:
        return Room(self.name, self.capacity, self.used(), spill_bytes=self.spill_bytes)

    def read(self, record: Record) -> tuple[JobStateCopy, torch.Tensor | None]:
        assert record.host_copy is not None
        return record.host_copy, record.host_buffer

    def write(self, record: Record, copy: JobStateCopy) -> None:
        return None  # a copy in host memory is on this tier already

    def land(self, record: Record, copy: JobStateCopy | None, written: Any) -> bool:
        assert copy is not None
        record.tier, record.host_copy, record.host_buffer = HOST, copy, copy.memory
        return True

    def free(self, record: Record) -> list[Path]:
        record.host_copy = record.host_buffer = None
        return []

    def discard(self, record: Record) -> None:
        if record.host_buffer is not None:
            self.give_back(record, record.host_buffer)
            record.host_copy = record.host_buffer = None

    def give_back(self, record: Record | None, buffer: torch.Tensor) -> None:
        """A host copy's buffer that is done with (imported, written, dropped): back to the pool,
        unless the write-behind thread still reads it (a copy taken back mid-write): then that
        thread gives it back."""
        with self._lock:
            if record is not None and record.writing_from is buffer:
                record.orphan = buffer
                return
        self.pool.give(buffer)

    def details(self) -> dict[str, Any]:
        arena = self.arena.stats()
        return {
            "arena": {
                "capacity": arena.capacity,
                "in_use": arena.in_use,
                "largest_free": arena.largest_free,
                "pinned": self.arena.pinned,
            }
        }


class NvmeTier(Tier):
    """Files in ``directory`` (None: no nvme tier), up to ``nbytes`` on disk, spares included.
    After a write ran out of space the tier is marked ``full`` for ``NVME_FULL_RETRY_S``: it
    takes no more than it held then (``room``) and keeps no spares."""

    name = NVME

    def __init__(
        self,
        records: Mapping[str, Record],
        lock: threading.Condition,
        directory: Path | None,
        nbytes: int,
        pool: BufferPool,
        host_spill_bytes: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``host_spill_bytes``: what host may hold over its budget while this tier is full (for
        the warning)."""
        super().__init__(records, lock)
        self.directory = directory
        self._host_spill_bytes = host_spill_bytes
        self.nbytes = nbytes if directory is not None else 0
        # its copy files, and the spares kept to be overwritten by new copies (within nbytes)
        self.files = CopyDirectory(directory) if directory is not None else None
        self._pool = pool
        self._clock = clock
        self.nospace = 0  # writes that failed for lack of space
        self._full_at: float | None = None  # clock time of the latest such failure
        self.room_bytes = 0  # bytes the tier held then: all it may hold while marked full
        self.error = ""  # the latest such failure, one line

    @classmethod
    def build(cls, context: TierContext) -> NvmeTier:
        return cls(
            context.records,
            context.lock,
            context.nvme_dir,
            context.budgets[NVME],
            context.pool,
            context.host_spill_bytes,
            context.clock,
        )

    @property
    def capacity(self) -> int:
        return self.nbytes

    def room(self) -> Room:
        return Room(self.name, self.capacity if self.on else None, self.used(), full=self.full(), room=self.room_bytes)

    @property
    def on(self) -> bool:
        return self.directory is not None

    def full(self) -> bool:
        """Whether a write ran out of space less than NVME_FULL_RETRY_S ago."""
        return self._full_at is not None and self._clock() - self._full_at < NVME_FULL_RETRY_S

    def read(self, record: Record) -> tuple[JobStateCopy, torch.Tensor | None]:
        """The verified copy and the pool buffer holding it (``CorruptCopyError`` else)."""
        assert record.nvme is not None
        return read_copy(record.nvme, self._pool)

    def abandon(self, record: Record, buffer: torch.Tensor) -> None:
        self._pool.give(buffer)

    def write(self, record: Record, copy: JobStateCopy) -> NvmeCopy:
        """Write a copy into a spare file (overwritten in place) or a new one, one fdatasync.
        Out of disk space or quota: ``NoSpace``, the file deleted, the tier marked full (and
        every spare deleted)."""
        files = self.files
        assert files is not None
        with self._lock:
            spare = files.take_spare(copy.nbytes)
            doomed = self.trim_spares()
        unlink_all(doomed)
        path = spare.path if spare is not None else files.new_path()
        try:
            while True:
                try:
                    return write_copy(path, copy, reuse=spare.nbytes if spare is not None else None)
                except FileExistsError:  # not ours (a crashed process's?): never reused, another name
                    if spare is not None:
                        raise
                    path = files.new_path()
        except BaseException as exc:
            if not isinstance(exc, FileExistsError):
                unlink_all([path])
            if not isinstance(exc, OSError) or exc.errno not in NO_SPACE_ERRNOS:
                raise
            self._mark_full(record.job_id, copy.nbytes, exc)
            raise NoSpace() from None

    def unwrite(self, written: Any) -> None:
        unlink_all([written.path])

    def land(self, record: Record, copy: JobStateCopy | None, written: Any) -> bool:
        record.tier, record.nvme = NVME, written
        return False

    def free(self, record: Record) -> list[Path]:
        """Its file becomes a spare; returns the files to delete now."""
        copy, record.nvme = record.nvme, None
        if copy is None:
            return []
        assert self.files is not None
        self.files.add_spare(copy.path, copy.file_bytes)
        return self.trim_spares()

    def discard(self, record: Record) -> None:
        with self._lock:
            copy, record.nvme = record.nvme, None
        if copy is not None:
            unlink_all([copy.path])

    def keep_as_spare(self, written: NvmeCopy) -> list[Path]:
        """A file written for a copy that was taken back meanwhile (lock held): a spare now;
        returns the files to delete."""
        assert self.files is not None
        self.files.add_spare(written.path, written.file_bytes)
        return self.trim_spares()

    def trim_spares(self) -> list[Path]:
        """Spare files to delete now (lock held, the caller deletes them): all while the tier is
        marked full, else those beyond what ``nbytes`` leaves beside the copies (reserved ones
        included) or beyond ``copy_dir.KEEP_SPARES``."""
        assert self.files is not None
        if not self.files.spares:  # (the bytes used cost a look at every record)
            return []
        return self.files.trim(self.full(), self.nbytes - self.used())

    def usage(self) -> str:
        """How full it is, one phrase for ``TierFullError`` (lock held)."""
        if not self.on:
            return "nvme tier off (no nvme_dir)"
        out_of_space = f", out of space ({self.error})" if self.full() else ""
        return f"nvme {self.used()}/{self.nbytes} bytes used{out_of_space}"

    def _mark_full(self, job_id: str, nbytes: int, exc: OSError) -> None:
        """Count the failure; until NVME_FULL_RETRY_S passes, the tier takes only room the store
        frees (spares are deleted, not kept). One warning line when it was not marked full
        already."""
        with self._lock:
            doomed = self.files.trim(full=True, room=0) if self.files is not None else []
        unlink_all(doomed)
        free = free_bytes(self.directory) if self.directory is not None else None
        error = f"{no_space_reason(exc)} writing job {job_id!r}'s copy ({nbytes} bytes) to {self.directory}" + (
            f", {free} bytes free" if free is not None else ""
        )
        with self._lock:
            was_full = self.full()
            self.nospace += 1
            self._full_at = self._clock()
            self.room_bytes = sum(
                r.nbytes for r in self._records.values() if r.tier == NVME and r.moving_to != DROPPING
            )
            self.error = error
        if not was_full:
            log.warning(
                "nvme tier full: %s; copies stay in host memory (up to %d bytes over its budget) or on the "
                "device, nvme takes only what the store frees for %.0f s",
                error,
                self._host_spill_bytes,
                NVME_FULL_RETRY_S,
            )

    def details(self) -> dict[str, Any]:
        return {
            "dir": str(self.directory or "") or None,
            "nospace": self.nospace,
            "full": self.full(),
            "error": self.error or None,
        }


# one class per entry of state_policy.STATE_TIERS, in its order
TIER_CLASSES: dict[str, type[Tier]] = {cls.name: cls for cls in (DeviceTier, HostTier, NvmeTier)}
