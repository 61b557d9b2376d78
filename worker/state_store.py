"""The state store: which memory tier each job's trainer state lives on, and the moves between them.

What it owns. ``StateStore`` wraps one ``TrainerEngine`` and keeps every job's trainer state
(LoRA adapter, AdamW step counts and moments, RNG state, LoRA config / seed / weight decay) on
exactly one of three tiers:

- ``device``: live in the trainer's PeftModel and AdamW (on CUDA when there is a GPU), for at
  most ``device_slots`` jobs: the jobs being served;
- ``host``: a ``JobStateCopy`` in host memory (pinned when CUDA is available), up to
  ``host_bytes`` in all;
- ``nvme``: the same copy in a node-local directory, one sub-directory per job holding
  ``tensors.safetensors`` (every tensor), ``state.pt`` (the optimizer's hyper-parameters and
  the copy's layout) and ``manifest.json`` (LoRA config, seed, sizes, the sha256 of
  ``state.pt``, of each 8 MiB chunk of the tensor file, and of the manifest itself), up to
  ``nvme_bytes`` in all. A copy is written into a temp directory beside its final name,
  fsync'ed and renamed, so it exists only once complete; it is verified when read (chunks are
  hashed on a few threads while the file is written or read), and a corrupt copy raises
  ``CorruptCopyError`` and is never imported.

``ensure_resident`` (called before each trainer call of a job) makes room on the device by
evicting the resident job needed least soon according to the latest ``set_upcoming`` (ties:
least recently used), then swaps the job in from host or nvme, or creates a fresh adapter.
An evicted job goes to host if it fits; host copies needed later than it are demoted to nvme
(least soon needed first) to make it fit; otherwise it goes straight to nvme; if nvme cannot
take what must go there, ``TierFullError`` is raised and the job stays on the device.
``prefetch`` brings a job from nvme to host ahead of need. ``inventory`` reports each tier's capacity, use
and jobs, and swap counts / bytes / seconds per direction (bytes are ``JobStateCopy.nbytes``;
a device job's bytes are its adapter + optimizer bytes as of the last ``ensure_resident``).

Threads. ``ensure_resident`` and ``drop`` touch the trainer: call them from the trainer's
thread (they are serialised among themselves anyway). ``prefetch``, ``set_upcoming``,
``where`` and ``inventory`` may be called from any thread. One condition variable guards the
bookkeeping; copies and file I/O run outside it, on records marked in flight, which other
operations wait for instead of touching. Capacity is reserved on the destination tier when a
move is planned, so ``used_bytes`` counts a moving copy on both of its tiers until it lands.

What it deliberately does not do. No durable checkpoints (nvme copies are scratch that does
not outlive the process: ``TrainerEngine.save_checkpoint`` is the durable path), no moves
across nodes, no scheduling (the scheduler's queue arrives through ``set_upcoming``), no clean
copy kept on a lower tier after a job moves up (a job going down again is written again). All
moves go through the store: a job released from the trainer behind its back is not noticed.
``nvme_dir`` must belong to one store; copies left there by a crashed process are neither
read nor cleaned up. While a job swaps in from host, host memory briefly holds its copy and
the evicted job's copy.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

from plexctl.protocol import LoraConfig
from plexctl.state_size import job_state_bytes
from worker.trainer import JobConfigError, JobStateCopy, TrainerEngine, lora_signature, write_dir_atomically

DEVICE, HOST, NVME = "device", "host", "nvme"
DIRECTIONS = ("device->host", "device->nvme", "host->device", "nvme->device", "host->nvme", "nvme->host")
_DROPPING = "dropped"  # a record's moving_to while drop() forgets it

COPY_FORMAT = "plexrl.job-state/1"
TENSORS_FILE = "tensors.safetensors"
META_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
COPY_FILES = (TENSORS_FILE, META_FILE)  # checksummed by MANIFEST_FILE
HASH_CHUNK_BYTES = 8 << 20  # the tensor file is checksummed per chunk, so hashing spreads over cores
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


# ---------------------------------------------------------------- errors


class StateStoreError(Exception):
    """Base of the state store's errors; the message is one line for the user."""


class TierFullError(StateStoreError):
    """No tier has room for a state that must leave the device."""


class CorruptCopyError(StateStoreError):
    """An nvme copy that is incomplete, fails its sha256, or cannot be read back."""


# ---------------------------------------------------------------- records


@dataclass
class _Record:
    job_id: str
    lora: LoraConfig
    seed: int
    weight_decay: float
    tier: str  # where the job's one complete copy is
    nbytes: int
    last_used: int  # store tick of its last ensure_resident
    host_copy: JobStateCopy | None = field(default=None, repr=False)  # set while tier == HOST
    moving_to: str | None = None  # set while a thread moves it: others wait, plans skip it


@dataclass
class _Placement:
    tier: str  # HOST or NVME, for the state that leaves the device
    demote: list[_Record]  # host copies to write to nvme first


@dataclass
class _SwapStats:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds += seconds


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


class StateStore:
    """Keeps each job's trainer state on device, host or nvme; swaps jobs in on demand."""

    def __init__(
        self,
        trainer: TrainerEngine,
        device_slots: int = 4,
        host_bytes: int = 8 << 30,
        nvme_dir: Path | None = None,
        nvme_bytes: int = 64 << 30,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if device_slots < 1:
            raise ValueError(f"device_slots must be >= 1, got {device_slots}")
        if host_bytes < 0 or nvme_bytes < 0:
            raise ValueError(f"host_bytes and nvme_bytes must be >= 0, got {host_bytes} and {nvme_bytes}")
        self.trainer = trainer
        self.device_slots = device_slots
        self.host_bytes = host_bytes
        self.nvme_dir = Path(nvme_dir) if nvme_dir is not None else None
        self.nvme_bytes = nvme_bytes if nvme_dir is not None else 0
        if self.nvme_dir is not None:
            self.nvme_dir.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._serial = threading.RLock()  # one trainer-side operation at a time
        self._cond = threading.Condition()  # guards everything below
        self._records: dict[str, _Record] = {}
        self._upcoming: dict[str, int] = {}
        self._tick = 0
        self._swaps = {direction: _SwapStats() for direction in DIRECTIONS}

    # ------------------------------------------------------------ the public operations

    def ensure_resident(self, job_id: str, lora: LoraConfig, seed: int, weight_decay: float = 0.0) -> dict[str, Any]:
        """Put the job's state on the device (swap in, or create it); return what moved.

        ``{"swap_in": "host" | "nvme" | None, "evicted": [...], "demoted": [...], "bytes": n,
        "seconds": s}``: ``bytes`` counts every copy this call moved.
        """
        started = self._clock()
        with self._serial:
            self._refresh_device_bytes()
            with self._cond:
                record = self._settled(job_id)
                if record is not None:
                    _check_same_lora(record, lora)
                    if record.tier == DEVICE:
                        self._touch(record)
                        return _Moves().report(self._clock() - started)
                    record.moving_to = DEVICE
            moves = _Moves()
            try:
                incoming, read_seconds = self._take_incoming(record)
                credit = record.nbytes if record is not None and record.tier == HOST else 0
                self._make_room(job_id, credit, moves)
                self._swap_in(job_id, record, incoming, read_seconds, lora, seed, weight_decay, moves)
            except BaseException:
                self._unmark([record] if record is not None else [])
                raise
        return moves.report(self._clock() - started)

    def set_upcoming(self, job_ids: list[str]) -> None:
        """The order in which jobs will next need the trainer (first = soonest)."""
        upcoming: dict[str, int] = {}
        for position, job_id in enumerate(job_ids):
            upcoming.setdefault(job_id, position)
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
            placement = self._plan_placement(record, record.nbytes, host_credit=0)
            if placement is None or placement.tier != HOST:
                return False
            record.moving_to = HOST
            for demoted in placement.demote:
                demoted.moving_to = NVME
        try:
            for demoted in placement.demote:
                self._demote(demoted)
            started = self._clock()
            state = self._read_nvme(record)
            seconds = self._clock() - started
            self._delete_nvme(job_id)
        except BaseException:
            self._unmark([record, *placement.demote])
            raise
        with self._cond:
            record.tier, record.host_copy, record.moving_to = HOST, state, None
            self._swaps["nvme->host"].add(state.nbytes, seconds)
            self._cond.notify_all()
        return True

    def drop(self, job_id: str) -> None:
        """Forget the job on every tier (it ended): release it, free its copy, delete its files."""
        with self._serial:
            with self._cond:
                record = self._settled(job_id)
                if record is None:
                    return
                record.moving_to = _DROPPING
            try:
                if record.tier == DEVICE:
                    self.trainer.release(job_id)
                elif record.tier == NVME:
                    self._delete_nvme(job_id)
            finally:
                with self._cond:
                    del self._records[job_id]
                    self._cond.notify_all()

    def where(self, job_id: str) -> str | None:
        """``"device"``, ``"host"``, ``"nvme"`` or None (unknown); a moving job is where it comes from."""
        with self._cond:
            record = self._records.get(job_id)
            return record.tier if record is not None else None

    def inventory(self) -> dict[str, Any]:
        """Per tier: capacity, unit, used bytes (moving copies count on both tiers), job ids;
        the jobs in flight; and swap count / bytes / seconds per direction."""
        with self._cond:
            tiers = {
                DEVICE: {"capacity": self.device_slots, "unit": "slots"},
                HOST: {"capacity": self.host_bytes, "unit": "bytes"},
                NVME: {"capacity": self.nvme_bytes, "unit": "bytes", "dir": str(self.nvme_dir or "") or None},
            }
            for tier, info in tiers.items():
                info["used_bytes"] = self._used(tier)
                info["jobs"] = sorted(r.job_id for r in self._records.values() if r.tier == tier)
            in_flight = {
                r.job_id: f"{r.tier}->{r.moving_to}"
                for r in self._records.values()
                if r.moving_to in (DEVICE, HOST, NVME)
            }
            swaps = {d: {"count": s.count, "bytes": s.bytes, "seconds": s.seconds} for d, s in self._swaps.items()}
            return {**tiers, "in_flight": in_flight, "swaps": swaps}

    @staticmethod
    def job_bytes(lora: LoraConfig, model_config: Mapping[str, Any] | Any) -> int:
        """A job's state size once it has trained (fp32 adapter + AdamW's two moments + step
        counts + RNG state), from its LoRA config and the base model's config (a ``config.json``
        mapping or a transformers config); see ``plexctl.state_size``."""
        config = model_config if isinstance(model_config, Mapping) else model_config.to_dict()
        return job_state_bytes(lora.rank, list(lora.target_modules), config, cuda=torch.cuda.is_available())

    # ------------------------------------------------------------ swapping in

    def _take_incoming(self, record: _Record | None) -> tuple[JobStateCopy | None, float]:
        """The copy to import (read and verified if on nvme) and the seconds the read took."""
        if record is None:
            return None, 0.0
        if record.tier == HOST:
            assert record.host_copy is not None
            return record.host_copy, 0.0
        started = self._clock()
        state = self._read_nvme(record)
        return state, self._clock() - started

    def _swap_in(
        self,
        job_id: str,
        record: _Record | None,
        incoming: JobStateCopy | None,
        read_seconds: float,
        lora: LoraConfig,
        seed: int,
        weight_decay: float,
        moves: _Moves,
    ) -> None:
        started = self._clock()
        if incoming is None:
            self.trainer.ensure_job(job_id, lora, seed, weight_decay)
        else:
            self.trainer.import_state(job_id, incoming)
        seconds = self._clock() - started + read_seconds
        source = record.tier if record is not None else None
        if source == NVME:
            self._delete_nvme(job_id)
        device_bytes = self.trainer.state_bytes(job_id)
        with self._cond:
            if record is None:
                record = _Record(job_id, lora, seed, weight_decay, DEVICE, device_bytes, 0)
                self._records[job_id] = record
            record.tier, record.host_copy, record.moving_to, record.nbytes = DEVICE, None, None, device_bytes
            self._touch(record)
            if incoming is not None:
                self._swaps[f"{source}->device"].add(incoming.nbytes, seconds)
            self._cond.notify_all()
        if incoming is not None:
            moves.swap_in = source
            moves.bytes += incoming.nbytes

    # ------------------------------------------------------------ evicting

    def _make_room(self, job_id: str, host_credit: int, moves: _Moves) -> None:
        """Evict until fewer than ``device_slots`` other jobs are on the device."""
        while True:
            with self._cond:
                others = [r for r in self._records.values() if r.tier == DEVICE and r.job_id != job_id]
                if len(others) < self.device_slots:
                    return
                victim = max(others, key=self._eviction_order)
            self._evict(victim, host_credit, moves)
            host_credit = 0

    def _evict(self, victim: _Record, host_credit: int, moves: _Moves) -> None:
        """Copy the victim off the device, place the copy (demoting others if needed), release it."""
        started = self._clock()
        state = self.trainer.export_state(victim.job_id)
        export_seconds = self._clock() - started
        with self._cond:
            placement = self._place_or_wait(victim, state.nbytes, host_credit)
            victim.moving_to, victim.nbytes = placement.tier, state.nbytes  # reserve the copy's size
            for demoted in placement.demote:
                demoted.moving_to = NVME
        try:
            for demoted in placement.demote:
                self._demote(demoted)
                moves.demoted.append(demoted.job_id)
                moves.bytes += demoted.nbytes
            write_seconds = self._write_nvme(victim.job_id, state) if placement.tier == NVME else 0.0
        except BaseException:
            self._unmark([victim, *placement.demote])
            raise
        self.trainer.release(victim.job_id)
        with self._cond:
            victim.tier, victim.moving_to, victim.nbytes = placement.tier, None, state.nbytes
            victim.host_copy = state if placement.tier == HOST else None
            self._swaps[f"device->{placement.tier}"].add(state.nbytes, export_seconds + write_seconds)
            self._cond.notify_all()
        moves.evicted.append(victim.job_id)
        moves.bytes += state.nbytes

    def _demote(self, record: _Record) -> None:
        """Write a host copy (marked moving to nvme) to nvme, then let go of it."""
        assert record.host_copy is not None
        state = record.host_copy
        seconds = self._write_nvme(record.job_id, state)
        with self._cond:
            record.tier, record.host_copy, record.moving_to = NVME, None, None
            self._swaps["host->nvme"].add(state.nbytes, seconds)
            self._cond.notify_all()

    # ------------------------------------------------------------ planning (callers hold the lock)

    def _place_or_wait(self, record: _Record, nbytes: int, host_credit: int) -> _Placement:
        """A placement for a state leaving the device; waits out other threads' moves when they
        hold the room, raises TierFullError when nothing fits and nothing is moving."""
        while True:
            placement = self._plan_placement(record, nbytes, host_credit)
            if placement is not None:
                return placement
            if not any(r.moving_to in (HOST, NVME) for r in self._records.values()):
                raise TierFullError(self._tier_full_message(record.job_id, nbytes))
            self._cond.wait()

    def _plan_placement(self, record: _Record, nbytes: int, host_credit: int) -> _Placement | None:
        """Host if it fits, after demoting host copies needed later than ``record`` (least soon
        first) if that makes it fit and nvme takes them; else nvme if it fits; else None.
        ``host_credit``: host bytes the caller is about to free (a copy it is swapping in)."""
        free_host = self.host_bytes - self._used(HOST) + host_credit
        if nbytes <= free_host:
            return _Placement(HOST, [])
        if nbytes <= self.host_bytes:
            settled = [r for r in self._records.values() if r.tier == HOST and r.moving_to is None and r is not record]
            demote: list[_Record] = []
            for candidate in sorted([*settled, record], key=self._least_soon_first):
                if candidate is record:
                    break
                demote.append(candidate)
                free_host += candidate.nbytes
                if nbytes <= free_host:
                    if self._nvme_fits(sum(r.nbytes for r in demote)):
                        return _Placement(HOST, demote)
                    break
        if self._nvme_fits(nbytes):
            return _Placement(NVME, [])
        return None

    def _nvme_fits(self, nbytes: int) -> bool:
        return self.nvme_dir is not None and self._used(NVME) + nbytes <= self.nvme_bytes

    def _used(self, tier: str) -> int:
        """Bytes on ``tier``, counting reservations of copies moving there (not for device)."""
        return sum(
            r.nbytes
            for r in self._records.values()
            if (r.tier == tier and r.moving_to != _DROPPING) or (tier != DEVICE and r.moving_to == tier)
        )

    def _tier_full_message(self, job_id: str, nbytes: int) -> str:
        nvme = (
            f"nvme {self._used(NVME)}/{self.nvme_bytes} bytes used"
            if self.nvme_dir is not None
            else "nvme tier off (no nvme_dir)"
        )
        return (
            f"no room for job {job_id!r}'s state ({nbytes} bytes) off the device: "
            f"host {self._used(HOST)}/{self.host_bytes} bytes used, {nvme}"
        )

    def _rank(self, job_id: str) -> int:
        """Position in the upcoming order; jobs not in it come after all that are."""
        return self._upcoming.get(job_id, len(self._upcoming))

    def _eviction_order(self, record: _Record) -> tuple[int, int]:
        """max() of this picks the job needed least soon, then the least recently used."""
        return (self._rank(record.job_id), -record.last_used)

    def _least_soon_first(self, record: _Record) -> tuple[int, int]:
        """sorted() by this puts the job needed least soon (then least recently used) first."""
        return (-self._rank(record.job_id), record.last_used)

    # ------------------------------------------------------------ bookkeeping helpers

    def _settled(self, job_id: str) -> _Record | None:
        """The job's record once no other thread is moving it (caller holds the lock)."""
        while True:
            record = self._records.get(job_id)
            if record is None or record.moving_to is None:
                return record
            self._cond.wait()

    def _unmark(self, records: list[_Record]) -> None:
        """After a failed move: what did not land stays where it was."""
        with self._cond:
            for record in records:
                record.moving_to = None
            self._cond.notify_all()

    def _touch(self, record: _Record) -> None:
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

    # ------------------------------------------------------------ nvme copies

    def _job_dir(self, job_id: str) -> Path:
        assert self.nvme_dir is not None
        slug = re.sub(r"[^A-Za-z0-9_-]+", "_", job_id)[:48]
        return self.nvme_dir / f"{slug}-{hashlib.sha256(job_id.encode()).hexdigest()[:12]}"

    def _write_nvme(self, job_id: str, state: JobStateCopy) -> float:
        """Write a copy atomically (temp dir, fsync, rename); return the seconds it took."""
        started = self._clock()
        write_dir_atomically(self._job_dir(job_id), lambda tmp: _write_copy_files(tmp, state))
        return self._clock() - started

    def _read_nvme(self, record: _Record) -> JobStateCopy:
        return _read_copy(self._job_dir(record.job_id), record.job_id)

    def _delete_nvme(self, job_id: str) -> None:
        shutil.rmtree(self._job_dir(job_id), ignore_errors=True)


# ---------------------------------------------------------------- module helpers


def _check_same_lora(record: _Record, lora: LoraConfig) -> None:
    if lora_signature(record.lora) != lora_signature(lora):
        raise JobConfigError(
            f"job {record.job_id!r} is stored with LoRA {lora_signature(record.lora)}, not {lora_signature(lora)}"
        )


def _pin_if_cuda() -> bool:
    return torch.cuda.is_available()


# ---------------------------------------------------------------- writing a copy


def _write_copy_files(directory: Path, state: JobStateCopy) -> None:
    files = {TENSORS_FILE: _write_safetensors(directory / TENSORS_FILE, state)}
    meta = {
        "names": list(state.tensors),
        "layout": state.layout,
        "param_keys": state.param_keys,
        "param_groups": state.param_groups,
        "state_values": state.state_values,
    }
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    data = buffer.getvalue()
    (directory / META_FILE).write_bytes(data)
    files[META_FILE] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest = {
        "format": COPY_FORMAT,
        "job_id": state.job_id,
        "lora": lora_signature(state.lora),
        "seed": state.seed,
        "weight_decay": state.weight_decay,
        "nbytes": state.nbytes,
        "files": files,
    }
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's own fields (all but this one), so it is checked like the files."""
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _file_segments(state: JobStateCopy) -> list[tuple[list[str], torch.Tensor]]:
    """What the data section holds, in order: each buffer (its members back to back), then
    each standalone tensor; widest dtypes first, so every tensor stays aligned."""
    segments = [(members, state.buffers[name]) for name, members in state.layout.items()]
    in_buffers = state.buffer_members()
    segments += [([name], t) for name, t in state.tensors.items() if name not in in_buffers]
    return sorted(segments, key=lambda segment: -segment[1].element_size())


def _write_safetensors(path: Path, state: JobStateCopy) -> dict[str, Any]:
    """A valid safetensors file written from the copy's buffers without staging copies; its
    sha256 is computed on the bytes as they are written."""
    segments = _file_segments(state)
    header: dict[str, Any] = {"__metadata__": {"format": COPY_FORMAT}}
    offset = 0
    for members, _ in segments:
        for name in members:
            tensor = state.tensors[name]
            size = tensor.numel() * tensor.element_size()
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # keeps the data section 8-byte aligned
    hasher = _ChunkHasher(HASH_CHUNK_BYTES)
    written = 0
    with open(path, "wb") as f:
        pieces = [memoryview(struct.pack("<Q", len(header_bytes))), memoryview(header_bytes)]
        for piece in [*pieces, *(_raw_bytes(t) for _, t in segments)]:
            hasher.add(piece)  # hashed on the pool while this thread writes
            f.write(piece)
            written += len(piece)
    return {"bytes": written, "chunk_bytes": HASH_CHUNK_BYTES, "sha256_chunks": hasher.hexdigests()}


class _ChunkHasher:
    """sha256 of each ``chunk_bytes`` chunk of a byte stream, computed on a small thread pool
    while the caller goes on writing or reading the stream (hashlib releases the GIL)."""

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk_bytes = chunk_bytes
        self._pieces: list[memoryview] = []
        self._filled = 0
        self._digests: list[Future[str]] = []

    def add(self, data: memoryview) -> None:
        """Queue the next bytes of the stream (they must stay unchanged until ``hexdigests``)."""
        while len(data):
            take = min(len(data), self._chunk_bytes - self._filled)
            self._pieces.append(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self._chunk_bytes:
                self._submit()

    def hexdigests(self) -> list[str]:
        if self._pieces:
            self._submit()
        return [digest.result() for digest in self._digests]

    def _submit(self) -> None:
        self._digests.append(_hash_pool().submit(_sha256_hex, self._pieces))
        self._pieces, self._filled = [], 0


def _sha256_hex(pieces: list[memoryview]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """The process's sha256 threads, started on first use and shared by all stores."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="plexrl-sha256")
        return _pool


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (it is contiguous host memory)."""
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


# ---------------------------------------------------------------- reading a copy back


def _read_copy(directory: Path, job_id: str) -> JobStateCopy:
    """Read and verify a copy; every failure is a one-line CorruptCopyError."""
    where = f"nvme copy of job {job_id!r} at {directory}"
    manifest = _read_manifest(directory, where)
    if manifest.get("job_id") != job_id:
        raise CorruptCopyError(f"{where}: manifest is for job {manifest.get('job_id')!r}")
    meta_bytes = _read_verified_bytes(directory / META_FILE, manifest["files"][META_FILE], where)
    raw = _read_verified_tensor(directory / TENSORS_FILE, manifest["files"][TENSORS_FILE], where)
    try:
        meta = torch.load(io.BytesIO(meta_bytes), map_location="cpu", weights_only=True)
        state = _copy_from_file(raw, meta, manifest)
    except CorruptCopyError:
        raise
    except Exception as exc:  # checksums matched: the writer or the format is at fault
        raise CorruptCopyError(f"{where}: unreadable ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    if state.nbytes != manifest.get("nbytes"):
        raise CorruptCopyError(f"{where}: holds {state.nbytes} bytes, manifest says {manifest.get('nbytes')}")
    return state


def _read_manifest(directory: Path, where: str) -> dict[str, Any]:
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        raise CorruptCopyError(f"{where}: no {MANIFEST_FILE} (missing or incomplete copy)") from None
    except (OSError, ValueError) as exc:
        raise CorruptCopyError(f"{where}: unreadable {MANIFEST_FILE} ({exc})".replace("\n", " ")) from None
    if not isinstance(manifest, dict) or manifest.get("format") != COPY_FORMAT:
        raise CorruptCopyError(f"{where}: {MANIFEST_FILE} is not a {COPY_FORMAT} manifest")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CorruptCopyError(f"{where}: {MANIFEST_FILE} does not match its sha256 (corrupt)")
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(COPY_FILES):
        raise CorruptCopyError(f"{where}: {MANIFEST_FILE} is not a {COPY_FORMAT} manifest")
    return manifest


def _read_verified_bytes(path: Path, record: dict[str, Any], where: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptCopyError(f"{where}: cannot read {path.name} ({exc.strerror})") from None
    if len(data) != record.get("bytes") or hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise CorruptCopyError(f"{where}: {path.name} does not match its sha256 (corrupt)")
    return data


def _read_verified_tensor(path: Path, record: dict[str, Any], where: str) -> torch.Tensor:
    """The whole file in one uint8 tensor (pinned when CUDA is available), each chunk hashed
    on the pool while the next one is read."""
    chunk_bytes = record.get("chunk_bytes")
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or not isinstance(record.get("sha256_chunks"), list):
        raise CorruptCopyError(f"{where}: {MANIFEST_FILE} has no chunk checksums for {path.name}")
    hasher = _ChunkHasher(chunk_bytes)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != record.get("bytes"):
                raise CorruptCopyError(f"{where}: {path.name} has {size} bytes, manifest says {record.get('bytes')}")
            raw = torch.empty(size, dtype=torch.uint8, pin_memory=_pin_if_cuda())
            view = memoryview(raw.numpy())
            position = 0
            while position < size:
                count = f.readinto(view[position : position + chunk_bytes])
                if not count:
                    raise CorruptCopyError(f"{where}: {path.name} ended early")
                hasher.add(view[position : position + count])
                position += count
    except OSError as exc:
        raise CorruptCopyError(f"{where}: cannot read {path.name} ({exc.strerror})") from None
    if hasher.hexdigests() != record["sha256_chunks"]:
        raise CorruptCopyError(f"{where}: {path.name} does not match its sha256 (corrupt)")
    return raw


def _copy_from_file(raw: torch.Tensor, meta: dict[str, Any], manifest: dict[str, Any]) -> JobStateCopy:
    """Rebuild a JobStateCopy whose tensors and buffers are views into the file's bytes."""
    header_size = struct.unpack("<Q", raw[:8].numpy().tobytes())[0]
    header = json.loads(raw[8 : 8 + header_size].numpy().tobytes())
    data = raw[8 + header_size :]

    def span(name: str) -> tuple[int, int]:
        begin, end = header[name]["data_offsets"]
        return int(begin), int(end)

    def view(name: str) -> torch.Tensor:
        begin, end = span(name)
        entry = header[name]
        return data[begin:end].view(TORCH_DTYPES[entry["dtype"]]).view(entry["shape"])

    tensors = {name: view(name) for name in meta["names"]}
    buffers: dict[str, torch.Tensor] = {}
    for buffer_name, members in meta["layout"].items():
        spans = [span(name) for name in members]
        if any(prev[1] != nxt[0] for prev, nxt in zip(spans, spans[1:])):
            raise ValueError(f"buffer {buffer_name!r} is not contiguous in the file")
        buffers[buffer_name] = data[spans[0][0] : spans[-1][1]].view(tensors[members[0]].dtype)
    return JobStateCopy(
        job_id=manifest["job_id"],
        lora=msgspec.convert(manifest["lora"], LoraConfig),
        seed=int(manifest["seed"]),
        weight_decay=float(manifest["weight_decay"]),
        param_keys=list(meta["param_keys"]),
        tensors=tensors,
        buffers=buffers,
        layout={name: list(members) for name, members in meta["layout"].items()},
        param_groups=meta["param_groups"],
        state_values=meta["state_values"],
    )
