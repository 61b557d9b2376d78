"""Benchmark: trainer-state swap throughput through each tier, against the raw hardware.

A job's trainer state moves between three tiers (``worker/state/store.py``): the device, host
memory and NVMe. This script moves real states of several sizes through a real ``StateStore``
with the calls the worker makes (``SwapCycle``), reads each move's seconds from the store's own
counters (``swap_stats``), and in the same run, interleaved, on the same sizes, times the raw
operation under each path (a memcpy, on CUDA a pinned copy; a file write + ``fdatasync``; a cold
read), on the same memory as the store's move (``SameMemory``) and on the bench's own buffers.
Every timed unit starts with the CPU caches flushed (``CacheFlush``), every read is cold, every
figure is the median of as many interleaved runs (``Samples``). Target: every path at >= 80 % of
its raw figure on the same memory.

Sizes: ``adapter`` (the tiny job's own state), then ``SIZES`` (``SIZES_QUICK`` with ``--quick``):
LoRA states of 0.5B- and 7B-class models and larger, reached by raising the LoRA rank on the tiny
model; then ``WHOLE_MODEL_SIZES`` (``--model-scale`` multiplies them): full fine-tuning states
moved by the store's copy machinery (``worker.state.job_copy``, ``worker.state.files``;
``WholeModelCycle``), not by the trainer and the store's policy. Method and history:
``docs/benchmarks.md``.

Usage: ``python bench/swap.py [--quick] [--out FILE] [--nvme-dir DIR] [--reps N] [--threads N]``;
writes ``bench/results/swap.json`` (``swap-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from plexctl.common.atomic import write_json_atomic  # noqa: E402
from plexctl.common.model_shapes import known_shape  # noqa: E402
from plexctl.common.protocol import LoraSpec, TrainBatch, TrainHParams  # noqa: E402
from plexctl.common.state_size import job_state_bytes, lora_module_shapes, model_config  # noqa: E402
from worker.state import files as copy_files  # noqa: E402
from worker.state.arena import HostArena, page_round  # noqa: E402
from worker.state.job_copy import BufferPool, JobStateCopy, SpecBuffers, StateSpec, TensorViews, state_spec  # noqa: E402
from worker.state.store import StateStore  # noqa: E402
from worker.trainer import TrainerEngine  # noqa: E402

MODEL = REPO / ".plexrl" / "models" / "tiny-arith"
MULTIPLEX_JSON = REPO / "bench" / "results" / "multiplex.json"
TINY_RANK = 8  # configs/tiny-arith.yaml
TARGET = 0.80
MiB, GiB = 1 << 20, 1 << 30
SIZES = {"adapter-0.5b": 6 * MiB, "adapter-7b": 48 * MiB, "optimizer": 128 * MiB, "full": 1 * GiB}  # see the docstring
SIZES_QUICK = {"optimizer": 16 * MiB, "full": 64 * MiB}
WHOLE_MODEL_SIZES = {"model-512m": 512 * MiB, "model-2g": 2 * GiB}  # x --model-scale
WHOLE_MODEL_SIZES_QUICK = {"model-32m": 32 * MiB}
WHOLE_MODEL_SHAPE = "qwen2.5-0.5b-instruct"  # whose layers' tensors make up a whole-model state
WHOLE_MODEL_REPS = 3  # timed rounds of a whole-model size (quick: 2): each moves gigabytes many times
IO_CHUNK = copy_files.IO_CHUNK_BYTES  # raw file I/O moves this much per request, like the store
DIRECT_ALIGN = copy_files.DIRECT_ALIGN
SMALL_BYTES = 64 * MiB  # states below this (the adapters) are timed 5x as often: cheap, and noisy on this disk
FLUSH_BYTES = 64 * MiB  # written before every timed unit: more than this machine's caches hold

T = TypeVar("T")

console = Console() if sys.stdout.isatty() else Console(width=160)  # a log keeps the table whole


# ---------------------------------------------------------------- measurements


@dataclass
class Samples:
    """Seconds of repeated runs of one transfer of ``nbytes``; reported by the median run.

    The median, for the swap paths and the raw figures alike: every figure has the same
    number of runs, interleaved, so medians compare like with like, while the best of each
    would favour whichever figure is the best of more runs (a raw figure is the best of
    several variants); on a machine shared with other processes the median is also the
    figure a neighbour's burst moves least. The best run is kept in the JSON beside it.
    """

    nbytes: int
    seconds: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median_s / 1e9

    @property
    def best_gbps(self) -> float:
        return self.nbytes / min(self.seconds) / 1e9

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "median_s": self.median_s,
            "gbps": self.gbps,
            "best_s": min(self.seconds),
            "best_gbps": self.best_gbps,
        }


def timed(run: Callable[[], T], sync: Callable[[], None] = lambda: None) -> tuple[T, float]:
    """``run()``'s result and the seconds it took (``sync`` before and after: CUDA's queue)."""
    sync()
    started = time.perf_counter()
    result = run()
    sync()
    return result, time.perf_counter() - started


class CacheFlush:
    """Writes ``FLUSH_BYTES`` before each timed unit, so that every one, the store's and the raw
    alike, starts with the CPU caches holding none of its memory: at small sizes the state of
    the caches otherwise decides which of two copies of the same bytes is faster."""

    def __init__(self) -> None:
        self.block = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
        self.value = 0

    def __call__(self) -> None:
        self.value = (self.value + 1) % 251
        self.block.fill_(self.value)


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- raw hardware figures


class RawMemory:
    """Host memcpy / clone and, on CUDA, pinned host <-> device copies of ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)  # written once: its pages are mapped
        self.clone_src = torch.ones(nbytes, dtype=torch.uint8)  # its own: a clone leaves memcpy's cold
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            self.pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
            self.on_device = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")

    def memcpy(self) -> float:
        return timed(partial(self.dst.copy_, self.src))[1]

    def clone(self) -> float:
        return timed(self.clone_src.clone)[1]  # the clone is freed on return

    def host_to_device(self) -> float:
        return timed(partial(self.on_device.copy_, self.pinned, non_blocking=True), cuda_sync)[1]

    def device_to_host(self) -> float:
        return timed(partial(self.pinned.copy_, self.on_device, non_blocking=True), cuda_sync)[1]


class RawDisk:
    """Sequential write + fdatasync and cold read of ``nbytes`` (rounded up to 4 KiB) as one
    file in ``directory``: buffered, O_DIRECT serially, and O_DIRECT with ``depth`` requests
    in flight (where the filesystem takes O_DIRECT). The bytes come from and land in one
    page-aligned, faulted-in buffer of the full size."""

    def __init__(self, directory: Path, nbytes: int, depth: int = copy_files.IO_DEPTH) -> None:
        self.path = directory / "raw.bin"
        self.nbytes = -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
        self.depth = depth
        self.block = mmap.mmap(-1, self.nbytes)  # anonymous: page aligned
        seed = os.urandom(min(IO_CHUNK, self.nbytes))
        for offset in range(0, self.nbytes, len(seed)):
            self.block[offset : offset + len(seed)] = seed[: self.nbytes - offset]
        self.view = memoryview(self.block)
        self.direct = hasattr(os, "O_DIRECT") and self._direct_works()
        self.pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="raw-io")

    def _chunks(self) -> list[tuple[int, memoryview]]:
        return [(offset, self.view[offset : offset + IO_CHUNK]) for offset in range(0, self.nbytes, IO_CHUNK)]

    def over(self, buffer: torch.Tensor, run: Callable[[], float]) -> float:
        """``run()`` (one of ``variants``) with ``buffer`` (page-aligned uint8 host memory of at
        least ``nbytes``) as the memory the bytes come from or land in, instead of the block."""
        saved, self.view = self.view, memoryview(buffer.numpy())[: self.nbytes]
        try:
            return run()
        finally:
            self.view.release()
            self.view = saved

    def write(self, direct: bool = False, parallel: bool = False, overwrite: bool = False) -> float:
        """``overwrite``: into the file's blocks from the last write, in place (no truncation)."""
        flags = os.O_WRONLY | os.O_CREAT | (0 if overwrite else os.O_TRUNC) | (os.O_DIRECT if direct else 0)
        started = time.perf_counter()
        fd = os.open(self.path, flags, 0o644)
        try:
            if parallel:
                os.ftruncate(fd, self.nbytes)
                for future in [self.pool.submit(_pwrite_all, fd, chunk, offset) for offset, chunk in self._chunks()]:
                    future.result()
            else:
                for offset, chunk in self._chunks():
                    _pwrite_all(fd, chunk, offset)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - started

    def read_cold(self, direct: bool = False, parallel: bool = False) -> float:
        drop_page_cache(self.path)
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        started = time.perf_counter()
        fd = os.open(self.path, flags)
        try:
            if parallel:
                for future in [self.pool.submit(_pread_all, fd, chunk, offset) for offset, chunk in self._chunks()]:
                    future.result()
            else:
                for offset, chunk in self._chunks():
                    _pread_all(fd, chunk, offset)
        finally:
            os.close(fd)
        return time.perf_counter() - started

    def variants(self) -> dict[str, Callable[[], float]]:
        """name -> one timed run, for every way this filesystem takes."""
        runs: dict[str, Callable[[], float]] = {
            "raw_write": self.write,
            "raw_read": self.read_cold,
            "raw_write_overwrite": partial(self.write, overwrite=True),
        }
        if self.direct:
            runs.update(
                raw_write_direct=partial(self.write, direct=True),
                raw_write_direct_overwrite=partial(self.write, direct=True, overwrite=True),
                raw_write_direct_par=partial(self.write, direct=True, parallel=True),
                raw_read_direct=partial(self.read_cold, direct=True),
                raw_read_direct_par=partial(self.read_cold, direct=True, parallel=True),
            )
        return runs

    def _direct_works(self) -> bool:
        probe = self.path.with_name("direct-probe.bin")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                os.write(fd, self.view[:DIRECT_ALIGN])
            finally:
                os.close(fd)
            return True
        except OSError:
            return False
        finally:
            probe.unlink(missing_ok=True)

    def close(self) -> None:
        self.pool.shutdown()
        self.path.unlink(missing_ok=True)
        self.view.release()
        self.block.close()


class SameMemory:
    """The raw operations on the very memory the store's moves use: the job's flat buffer on
    the device (its slot in the engine) and a host buffer from the store's pool, taken right
    before each operation and given back after it, as the store takes it (the pool gives the
    same buffer the store's copies of this size land in). On a VM the speed of memory, and of
    a disk's DMA into it, can depend on which physical pages back it, which a process does not
    choose: this figure holds the store to what the hardware does on the same memory, the raw
    figures beside it to what it does on the bench's own buffers."""

    def __init__(self, cycle: SwapCycle, disk: RawDisk) -> None:
        self.cycle = cycle
        self.disk = disk
        self.pool = cycle.store._pool

    def _slot(self) -> torch.Tensor:
        """The job's flat device buffer (resident whenever the raw figures run: between rounds)."""
        return self.cycle.store.trainer._job(self.cycle.job).slot.device

    @property
    def nbytes(self) -> int:
        return self._slot().numel()

    def _on_pool_buffer(self, nbytes: int, run: Callable[[torch.Tensor], float]) -> float:
        """``run(buffer)`` on a buffer of ``nbytes`` taken from the store's pool, given back after."""
        buffer = self.pool.take(nbytes)
        try:
            return run(buffer)
        finally:
            self.pool.give(buffer)

    def device_to_host(self) -> float:
        slot = self._slot()
        return self._on_pool_buffer(
            slot.numel(),
            lambda buffer: timed(partial(buffer[: slot.numel()].copy_, slot, non_blocking=slot.is_cuda), cuda_sync)[1],
        )

    def host_to_device(self) -> float:
        slot = self._slot()
        return self._on_pool_buffer(
            slot.numel(),
            lambda buffer: timed(
                partial(slot.copy_, buffer[: slot.numel()], non_blocking=buffer.is_pinned()), cuda_sync
            )[1],
        )

    def file(self, run: Callable[[], float]) -> Callable[[], float]:
        """A raw file variant over the pool's buffer."""
        return lambda: self._on_pool_buffer(self.disk.nbytes, lambda buffer: self.disk.over(buffer, run))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _pread_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        count = os.preadv(fd, [data], offset)
        if not count:
            raise OSError(f"file ended early at {offset}")
        data, offset = data[count:], offset + count


def drop_page_cache(path: Path) -> None:
    """Evict a file's clean pages from the page cache (no root needed), so it is read cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the state being swapped


def lora_for_bytes(target_bytes: int, config: dict[str, Any]) -> LoraSpec:
    """The tiny job's LoRA config with the rank whose trained state is closest to ``target_bytes``."""
    modules = list(LoraSpec().target_modules)
    per_rank = job_state_bytes(2, modules, config) - job_state_bytes(1, modules, config)
    base = job_state_bytes(0, modules, config)
    return LoraSpec(rank=max(1, round((target_bytes - base) / per_rank)), target_modules=modules)


def train_once(trainer: TrainerEngine, job_id: str) -> None:
    """One optimizer step of a resident job, so its AdamW moments exist."""
    rows = [[1, 5, 6, 7, 8, 9], [1, 10, 11, 12, 13, 2]]
    batch = TrainBatch(
        input_ids=rows, loss_mask=[[0, 0, 0, 1, 1, 1]] * 2, old_logprobs=[[0.0] * 6] * 2, advantages=[1.0, -1.0]
    )
    trainer.train_step(job_id, batch, TrainHParams())


FILLER = LoraSpec(rank=1)  # two tiny untrained jobs that push the measured state around


class SwapCycle:
    """One state of a given size moved through every tier by the store's own calls.

    ``device_slots=1`` and host room for exactly the state: with two tiny filler jobs, each
    round is (1) ``ensure_resident(f1)``: the state is evicted to host (device->host), the
    filler on host demoted for it; (2) ``ensure_resident(f2)``: the state, needed last, is
    demoted to nvme (host->nvme) to make room for f1; (3) ``prefetch(state)``: read back to
    host (nvme->host), f1 demoted for it; (4) ``ensure_resident(state)``: swapped in from host
    (host->device). Each step's seconds are the delta of that direction in the store's swap
    counters, checked to be one move of exactly the state's bytes.
    """

    def __init__(
        self,
        trainer: TrainerEngine,
        lora: LoraSpec | None,
        config: dict[str, Any],
        nvme_dir: Path,
        name: str,
        nbytes: int | None = None,
    ) -> None:
        """``lora`` None: a full fine-tuning job; ``nbytes``: its state's bytes where the
        model's config does not say them (a rank's shard of a sharded job)."""
        self.job = f"swap-{name}"
        self.lora = lora
        self.nbytes = nbytes or StateStore.job_bytes(lora, config)
        self.store = StateStore(trainer, device_slots=1, host_bytes=self.nbytes, nvme_dir=nvme_dir)
        self.f1, self.f2 = f"{self.job}-f1", f"{self.job}-f2"
        for job in (self.f1, self.f2):
            self.store.ensure_resident(job, FILLER, seed=1)
        self.store.ensure_resident(self.job, lora, seed=0)
        train_once(trainer, self.job)

    def steps(self) -> list[tuple[str, Callable[[], float]]]:
        """One round, in order: (direction, a call that makes that move and returns its seconds)."""
        store, job = self.store, self.job
        return [
            (
                "device->host",
                partial(
                    self._step,
                    "device->host",
                    [self.f1, job, self.f2],
                    lambda: store.ensure_resident(self.f1, FILLER, seed=1),
                ),
            ),
            (
                "host->nvme",
                partial(
                    self._step,
                    "host->nvme",
                    [self.f2, self.f1, job],
                    lambda: store.ensure_resident(self.f2, FILLER, seed=1),
                ),
            ),
            ("nvme->host", partial(self._step, "nvme->host", [job, self.f2, self.f1], lambda: store.prefetch(job))),
            (
                "host->device",
                partial(
                    self._step,
                    "host->device",
                    [job, self.f1, self.f2],
                    lambda: store.ensure_resident(job, self.lora, seed=0),
                ),
            ),
        ]

    def round(self) -> dict[str, float]:
        """One round; direction -> seconds of the state's move."""
        return {direction: step() for direction, step in self.steps()}

    def _step(self, direction: str, upcoming: list[str], call: Callable[[], Any]) -> float:
        store, job = self.store, self.job
        store.set_upcoming(upcoming)
        before = store.swap_stats(direction)  # one counter: the whole inventory would churn the caches
        call()
        after = store.swap_stats(direction)
        moved = (after["count"] - before["count"], after["bytes"] - before["bytes"])
        if moved != (1, self.nbytes) or store.where(job) != direction.split("->")[1]:
            raise SystemExit(
                f"{self.job}: expected one {direction} move of {self.nbytes} bytes, "
                f"got {moved}; the state is on {store.where(job)}"
            )
        return after["seconds"] - before["seconds"]

    def close(self) -> None:
        for job in (self.job, self.f1, self.f2):
            self.store.drop(job)


# ---------------------------------------------------------------- one size through every tier


def run_size(
    name: str, lora: LoraSpec, trainer: TrainerEngine, config: dict[str, Any], nvme_dir: Path, reps: int
) -> dict[str, Any]:
    """``reps`` rounds of the cycle (after one untimed warm-up round: the host buffer pool,
    the allocator, the parked adapters), each beside the raw memory and file figures."""
    slabs = trainer.slabs  # the trainer's, shared by the sizes: counted for this one
    device_before = (slabs.allocated, slabs.allocated_bytes, slabs.reused)
    cycle = SwapCycle(trainer, lora, config, nvme_dir / "store", name)
    small = cycle.nbytes < SMALL_BYTES  # cheap and noisy: repeat more
    raw_mem = RawMemory(cycle.nbytes)
    raw_disk = RawDisk(nvme_dir, cycle.nbytes)
    samples: dict[str, Samples] = {}

    def add(key: str, nbytes: int, seconds: float) -> None:
        samples.setdefault(key, Samples(nbytes)).seconds.append(seconds)

    memory_units: list[tuple[str, Callable[[], float]]] = [
        ("device.memcpy", raw_mem.memcpy),
        ("device.clone", raw_mem.clone),
    ]
    if raw_mem.cuda:
        memory_units += [("device.h2d", raw_mem.host_to_device), ("device.d2h", raw_mem.device_to_host)]
    same = SameMemory(cycle, raw_disk)
    flush = CacheFlush()
    memory_units += [("same.device.d2h", same.device_to_host), ("same.device.h2d", same.host_to_device)]
    store_units = [(f"store.{direction}", step) for direction, step in cycle.steps()]
    disk_units = [(f"nvme.{key}", run) for key, run in raw_disk.variants().items()]
    disk_units += [(f"same.nvme.{key}", same.file(run)) for key, run in raw_disk.variants().items()]
    try:
        for rep in range(reps * (5 if small else 1) + 1):
            # the memory figures take turns with the round at coming right after the file I/O
            units = memory_units + store_units if rep % 2 else store_units + memory_units
            for key, run in units + disk_units:
                flush()
                seconds = run()
                if rep:  # the first is a warm-up
                    if key.startswith(("nvme.", "same.nvme.")):
                        add(key, raw_disk.nbytes, seconds)
                    else:
                        add(key, same.nbytes if key.startswith("same.device.") else cycle.nbytes, seconds)
    finally:
        raw_disk.close()
        cycle.close()
    del raw_mem
    gc.collect()
    pool = cycle.store._pool
    return {
        "size": name,
        "lora_rank": lora.rank,
        "bytes": cycle.nbytes,
        "paths": paths_of(samples),
        "host_pool": {"allocated": pool.allocated, "allocated_bytes": pool.allocated_bytes, "reused": pool.reused},
        "device_buffers": {
            "allocated": slabs.allocated - device_before[0],
            "allocated_bytes": slabs.allocated_bytes - device_before[1],
            "reused": slabs.reused - device_before[2],
        },
        "samples": {key: s.to_json() for key, s in samples.items()},
    }


def paths_of(samples: dict[str, Samples]) -> list[dict[str, Any]]:
    """Each swap path's median throughput next to its raw figures: the raw variant with the
    best median on the same memory as the store's move (``raw_same_memory``: what the target
    is held against) and on the bench's own buffers (``raw``); ``best_run``: the best runs of
    the path and of that same-memory variant."""
    cuda = "device.h2d" in samples

    def best(*prefixes: str) -> tuple[str, float]:
        found = [(k, s.gbps) for k, s in samples.items() if any(k == p or k.startswith(p + "_") for p in prefixes)]
        return max(found, key=lambda kv: kv[1])

    plan = [
        (
            "device->host",
            "TrainerEngine.export_state (eviction)",
            "device.d2h" if cuda else "device.memcpy",
            "same.device.d2h",
        ),
        (
            "host->device",
            "TrainerEngine.import_state (swap-in)",
            "device.h2d" if cuda else "device.memcpy",
            "same.device.h2d",
        ),
        ("host->nvme", "StateStore demotion (xxh3, fdatasync)", "nvme.raw_write", "same.nvme.raw_write"),
        ("nvme->host", "StateStore.prefetch, cold (verified)", "nvme.raw_read", "same.nvme.raw_read"),
    ]
    rows = []
    for path, via, own, same in plan:
        got = samples[f"store.{path}"]
        (raw_key, raw_gbps), (same_key, same_gbps) = best(own), best(same)
        best_same = samples[same_key].best_gbps
        row = {
            "path": path,
            "via": via,
            "gbps": got.gbps,
            "seconds": got.median_s,
            "raw_same_memory": same_key,
            "raw_same_memory_gbps": same_gbps,
            "pct_of_raw_same_memory": got.gbps / same_gbps,
            "meets_target": got.gbps >= TARGET * same_gbps,
            "raw": raw_key,
            "raw_gbps": raw_gbps,
            "pct_of_raw": got.gbps / raw_gbps,
            "best_run": {
                "gbps": got.best_gbps,
                "raw_same_memory_gbps": best_same,
                "pct_of_raw_same_memory": got.best_gbps / best_same,
            },
        }
        if not cuda and path in ("device->host", "host->device"):
            row["pct_of_clone"] = got.gbps / samples["device.clone"].gbps
        rows.append(row)
    return rows


# ---------------------------------------------------------------- whole-model states


def whole_model_spec(target_bytes: int) -> StateSpec:
    """The layout of a full fine-tuning state of about ``target_bytes`` (at most, and at least one
    tensor): Qwen2.5-0.5B's layer tensors in order, each as bf16 weights, an fp32 master and
    AdamW's two fp32 moments (14 bytes a parameter), grouped by kind and dtype as a state's are."""
    config = known_shape(WHOLE_MODEL_SHAPE) or {}
    hidden = int(config["hidden_size"])
    layer = [(f"{name}.weight", (n_out, n_in)) for name, (n_in, n_out) in lora_module_shapes(config).items()]
    layer += [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    tensors: list[tuple[str, tuple[int, ...]]] = []
    total = 0
    for index in range(1 << 16):
        name, shape = layer[index % len(layer)]
        size = 14 * math.prod(shape)
        if tensors and total + size > target_bytes:
            break
        tensors.append((f"model.layers.{index // len(layer)}.{name}", shape))
        total += size
    return state_spec(
        [
            ("weights.bfloat16", torch.bfloat16, [(f"weights/{n}", s) for n, s in tensors]),
            ("master.float32", torch.float32, [(f"master/{n}", s) for n, s in tensors]),
            (
                "optim.float32",
                torch.float32,
                [(f"optim/{n}/{m}", s) for n, s in tensors for m in ("exp_avg", "exp_avg_sq")],
            ),
        ]
    )


class WholeModelCycle:
    """A whole-model state moved through every tier by the copy machinery, one direction at a
    time, as the store moves a state: device->host (its flat device buffer copied into a buffer
    from the ``BufferPool``, a ``JobStateCopy`` laid over it, as ``export_state`` makes one),
    host->nvme (``copy_files.write_copy``: checksummed, fdatasync'd, in place over the spare file
    of the previous round, the host buffer then given back), nvme->host (``copy_files.read_copy``
    into a pool buffer, verified), host->device (one ``copy_`` back into the device buffer, the
    host buffer given back). ``job`` is the device buffer: the raw figures use it and the pool
    as ``SameMemory`` does a trainer's slot and the store's pool."""

    def __init__(self, spec: StateSpec, nvme_dir: Path, name: str) -> None:
        self.name, self.spec, self.nbytes = name, spec, spec.nbytes
        self.cuda = torch.cuda.is_available()
        self.device = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda" if self.cuda else "cpu")
        self.device.copy_(torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8))
        # room for two copies (the export and a read may overlap by a page or so) and the raw figures' take
        self.pool = BufferPool(HostArena(2 * page_round(self.nbytes) + (1 << 24), pinned=self.cuda))
        self.dir = nvme_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.host: JobStateCopy | None = None
        self.on_nvme: copy_files.NvmeCopy | None = None
        self.spare: int | None = None  # a file of the previous round, overwritten in place
        self.lora = None  # a copy of a full fine-tuning state has no adapter config

    def steps(self) -> list[tuple[str, Callable[[], float]]]:
        return [
            ("device->host", self.export),
            ("host->nvme", self.demote),
            ("nvme->host", self.read),
            ("host->device", self.swap_in),
        ]

    def round(self) -> dict[str, float]:
        return {direction: step() for direction, step in self.steps()}

    def export(self) -> float:
        started = time.perf_counter()
        memory = self.pool.take(page_round(self.nbytes))
        memory[: self.nbytes].copy_(self.device, non_blocking=self.cuda)
        cuda_sync()
        buffers = SpecBuffers(self.spec, memory)
        self.host = JobStateCopy(
            self.name, self.lora, 0, 0.0, self.spec.param_keys, TensorViews(self.spec, buffers), buffers,
            self.spec.layout, [], {}, memory, self.spec,
        )  # fmt: skip
        return time.perf_counter() - started

    def demote(self) -> float:
        assert self.host is not None and self.host.memory is not None
        path = self.dir / f"{self.name}.state"
        started = time.perf_counter()
        self.on_nvme = copy_files.write_copy(path, self.host, reuse=self.spare)
        memory, self.host = self.host.memory, None
        self.pool.give(memory)
        seconds = time.perf_counter() - started
        self.spare = self.on_nvme.file_bytes
        return seconds

    def read(self) -> float:
        assert self.on_nvme is not None
        drop_page_cache(self.on_nvme.path)
        started = time.perf_counter()
        self.host, _ = copy_files.read_copy(self.on_nvme, self.pool)
        return time.perf_counter() - started

    def swap_in(self) -> float:
        assert self.host is not None and self.host.memory is not None
        started = time.perf_counter()
        memory, self.host = self.host.memory, None
        self.device.copy_(memory[: self.nbytes], non_blocking=self.cuda)
        cuda_sync()
        self.pool.give(memory)
        return time.perf_counter() - started

    def same_memory(self, disk: RawDisk) -> list[tuple[str, Callable[[], float]]]:
        """The raw figures on the same memory: memcpy between the device buffer and a pool
        buffer, each way; file I/O over a pool buffer."""

        def on_pool(run: Callable[[torch.Tensor], float]) -> float:
            buffer = self.pool.take(page_round(self.nbytes))
            try:
                return run(buffer)
            finally:
                self.pool.give(buffer)

        def d2h(buffer: torch.Tensor) -> float:
            return timed(partial(buffer[: self.nbytes].copy_, self.device, non_blocking=self.cuda), cuda_sync)[1]

        def h2d(buffer: torch.Tensor) -> float:
            return timed(partial(self.device.copy_, buffer[: self.nbytes], non_blocking=self.cuda), cuda_sync)[1]

        units: list[tuple[str, Callable[[], float]]] = [
            ("same.device.d2h", partial(on_pool, d2h)),
            ("same.device.h2d", partial(on_pool, h2d)),
        ]
        units += [
            (f"same.nvme.{key}", partial(on_pool, partial(disk.over, run=run))) for key, run in disk.variants().items()
        ]
        return units

    def close(self) -> None:
        self.host = None
        if self.on_nvme is not None:
            self.on_nvme.path.unlink(missing_ok=True)


def run_whole_model(name: str, target_bytes: int, nvme_dir: Path, reps: int) -> dict[str, Any]:
    """``reps`` rounds of a whole-model state's cycle (after an untimed warm-up round), each
    beside the raw memory and file figures on the same memory and on the bench's own buffers
    (the raw disk figures' block; memcpy from it into the device buffer)."""
    cycle = WholeModelCycle(whole_model_spec(target_bytes), nvme_dir / "whole", name)
    raw_disk = RawDisk(nvme_dir, cycle.nbytes)
    device = cycle.device
    own = [torch.frombuffer(raw_disk.block, dtype=torch.uint8)[: cycle.nbytes]]  # emptied before the block closes
    samples: dict[str, Samples] = {}
    flush = CacheFlush()

    def memcpy_in() -> float:
        return timed(partial(device.copy_, own[0], non_blocking=cycle.cuda), cuda_sync)[1]

    def memcpy_out() -> float:
        return timed(partial(own[0].copy_, device, non_blocking=cycle.cuda), cuda_sync)[1]

    memory_units: list[tuple[str, Callable[[], float]]] = [("device.memcpy", memcpy_in)]
    if cycle.cuda:
        memory_units += [("device.h2d", memcpy_in), ("device.d2h", memcpy_out)]
    else:
        memory_units.append(("device.clone", lambda: timed(device.clone)[1]))
    same = cycle.same_memory(raw_disk)
    disk_units = [(f"nvme.{key}", run) for key, run in raw_disk.variants().items()]
    disk_units += [(key, run) for key, run in same if key.startswith("same.nvme.")]
    memory_units += [(key, run) for key, run in same if key.startswith("same.device.")]
    store_units = [(f"store.{direction}", step) for direction, step in cycle.steps()]
    try:
        for rep in range(reps + 1):
            units = memory_units + store_units if rep % 2 else store_units + memory_units
            for key, run in units + disk_units:
                flush()
                seconds = run()
                if rep:  # the first is a warm-up
                    nbytes = raw_disk.nbytes if key.startswith(("nvme.", "same.nvme.")) else cycle.nbytes
                    samples.setdefault(key, Samples(nbytes)).seconds.append(seconds)
    finally:
        own.clear()
        raw_disk.close()
        cycle.close()
    groups = {g.name: g.nbytes for g in cycle.spec.groups}
    result = {
        "size": name,
        "kind": "whole model",
        "bytes": cycle.nbytes,
        "parts": groups,
        "tensors": len(cycle.spec.groups[0].names),
        "paths": paths_of(samples),
        "host_pool": {
            "allocated": cycle.pool.allocated,
            "allocated_bytes": cycle.pool.allocated_bytes,
            "reused": cycle.pool.reused,
        },
        "samples": {key: s.to_json() for key, s in samples.items()},
    }
    gc.collect()
    return result


# ---------------------------------------------------------------- swap time hidden in bench 1


def hidden_share(path: Path) -> dict[str, Any]:
    """Share of the multiplex run's swap seconds hidden behind other jobs' compute, per mode:
    the ``swap`` summary bench/multiplex.py wrote for it (``bench.multiplex.swap_summary``).

    ``critical_s`` ran inside ``ensure_resident`` on the trainer's thread (the job's call
    waited for it); the rest ran off it (prefetches, their demotions, writes left behind);
    ``stalled_s`` is time ``ensure_resident`` then waited for such a move to land, so it was
    not hidden after all. ``hidden_share`` = (``behind_other_jobs_s`` - ``stalled_s``) /
    seconds, where ``behind_other_jobs_s`` is the time of the background moves while another
    job's task ran on either engine; ``hidden_share_trainer`` counts only the trainer's compute.
    """
    if not path.exists():
        return {"available": False, "missing": f"{_rel(path)} does not exist (run bench/multiplex.py)"}
    modes = json.loads(path.read_text()).get("modes", {})
    result: dict[str, Any] = {"available": False, "source": _rel(path), "modes": {}}
    missing = []
    for mode, record in modes.items():
        summary = record.get("swap", {})
        if "behind_other_jobs_s" not in summary and summary.get("count"):  # written before moves were logged
            missing.append(mode)
            continue
        result["modes"][mode] = {
            "swaps": int(summary.get("count", 0)),
            "swap_s": summary.get("seconds", 0.0),
            "critical_s": summary.get("critical_s", 0.0),
            "stalled_s": summary.get("stalled_s", 0.0),
            "behind_other_jobs_s": summary.get("behind_other_jobs_s", 0.0),
            "background_s": summary.get("background_s", 0.0),
            "hidden_s": summary.get("hidden_s", 0.0),
            "hidden_share": summary.get("hidden_share"),
            "hidden_share_trainer": summary.get("hidden_share_trainer"),
        }
    result["available"] = bool(result["modes"])
    if missing:
        result["missing"] = (
            f"modes {missing} of {_rel(path)} hold no background-move summary (rerun bench/multiplex.py)"
        )
    return result


# ---------------------------------------------------------------- report


def machine(nvme_dir: Path, trainer: TrainerEngine) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": describe(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg": os.getloadavg(),
        "trainer_device": str(trainer.device),
        "nvme_dir": str(nvme_dir),
        "nvme_mount": mount_of(nvme_dir),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def mount_of(path: Path) -> str:
    """'device on mountpoint (fstype)' for the filesystem holding ``path``, best effort."""
    try:
        mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    resolved = str(path.resolve())
    matches = [m for m in mounts if resolved == m[1] or resolved.startswith(m[1].rstrip("/") + "/")]
    if not matches:
        return "unknown"
    device, point, fstype = max(matches, key=lambda m: len(m[1]))
    return f"{device} on {point} ({fstype})"


def print_report(results: list[dict[str, Any]], hidden: dict[str, Any], info: dict[str, Any]) -> None:
    cpu = "pct_of_clone" in results[0]["paths"][0]
    title = (
        f"swap: trainer state through each tier vs the raw hardware, same run, medians "
        f"(device = {info['trainer_device']}, nvme = {info['nvme_mount']})"
    )
    table = Table(title=title)
    columns = [
        "size",
        "bytes",
        "path",
        "ms",
        "GB/s",
        "raw figure",
        "its ms",
        "same memory GB/s",
        "% of it",
        f">= {TARGET:.0%}",
        "own buffers GB/s",
        "% of it",
    ]
    if cpu:
        columns.append("% of clone")
    for col in columns:
        table.add_column(col, justify="left" if col in ("size", "path", "raw figure") else "right")

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.{2 if seconds < 0.01 else 1}f}"

    for result in results:
        for row in result["paths"]:
            cells = [
                result["size"],
                human_bytes(result["bytes"]),
                row["path"],
                ms(row["seconds"]),
                f"{row['gbps']:.2f}",
                raw_label(row["raw_same_memory"], cpu),
                ms(result["samples"][row["raw_same_memory"]]["median_s"]),
                f"{row['raw_same_memory_gbps']:.2f}",
                f"{row['pct_of_raw_same_memory']:.0%}",
                "yes" if row["meets_target"] else "no",
                f"{row['raw_gbps']:.2f}",
                f"{row['pct_of_raw']:.0%}",
            ]
            if cpu:
                cells.append(f"{row['pct_of_clone']:.0%}" if "pct_of_clone" in row else "")
            table.add_row(*cells)
    console.print(table)
    if cpu:
        console.print(
            "No CUDA: the device tier is host memory, so device<->host is a host copy; "
            "'% of clone' compares it with allocate-and-copy (clone), the raw figures are memcpy."
        )
    console.print(
        "Same memory: the raw operation between the job's device buffer and the store's pool buffer "
        "(memory), or over the pool buffer (file I/O); own buffers: the bench's own."
    )
    meets = [f"{r['size']} {p['path']}" for r in results for p in r["paths"] if p["meets_target"]]
    misses = [f"{r['size']} {p['path']}" for r in results for p in r["paths"] if not p["meets_target"]]
    console.print(f"meet >= {TARGET:.0%} of raw on the same memory: {', '.join(meets) or 'none'}")
    console.print(f"below: {', '.join(misses) or 'none'}")
    if hidden.get("available"):
        for mode, h in hidden["modes"].items():
            share = "n/a (no swaps)" if h["hidden_share"] is None else f"{h['hidden_share']:.0%}"
            console.print(
                f"multiplex {mode}: {h['swaps']} swaps, {h['swap_s']:.3f} s "
                f"({h['critical_s']:.3f} s on the trainer's critical path), hidden behind compute: {share}"
            )
    if hidden.get("missing"):
        console.print(f"hidden share: {hidden['missing']}")


CONDITIONS = (
    "same bytes per copy (raw file rounded up to 4 KiB), one file per copy, repetitions interleaved (the raw "
    "memory figures before the store's round in every other one, after it in the rest); "
    "writes end with fdatasync; reads cold (posix_fadvise DONTNEED first, or O_DIRECT); reads land in a "
    "reused faulted-in page-aligned full-size buffer (the store: its host buffer pool); the target is held "
    "against the raw figures on the same memory as the store's move (memcpy between the job's device buffer "
    "and the store's pool buffer; file I/O from or into the pool buffer), the raw figures on the bench's own "
    "buffers are reported beside them; every figure is the median of its runs (the same number for all); "
    "raw file I/O = the best (by median) of buffered, "
    "O_DIRECT serial, O_DIRECT with the store's request depth, and for writes also in place over the last "
    "write's blocks (no truncation, as the store reuses a spare file); device tier on CPU: memcpy into a "
    "preallocated faulted-in buffer (clone beside it)"
)


def print_widths(by_width: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """The width axis: bytes per rank, and per move the slowest rank's seconds and each rank's."""
    from bench.swap_width import DIRECTIONS  # it builds on this module's SwapCycle

    table = Table(
        title=(
            f"swap by trainer width: one full fine-tuning job, each rank moving its own shard at once "
            f"(medians; {info.get('cpu_count', os.cpu_count())} CPU cores shared by the ranks)"
        )
    )
    for column in ("width", "bytes per rank", "total bytes", *DIRECTIONS, "round s"):
        table.add_column(column, justify="right")
    for row in by_width:
        moves = [
            f"{row['directions'][d]['slowest_s'] * 1e3:.1f} ms ("
            + " / ".join(f"{s * 1e3:.1f}" for s in row["directions"][d]["rank_s"])
            + ")"
            for d in DIRECTIONS
        ]
        table.add_row(
            str(row["width"]),
            human_bytes(max(row["bytes_per_rank"])),
            human_bytes(row["bytes_total"]),
            *moves,
            f"{row['round_s']:.3f}",
        )
    console.print(table)
    console.print("per move: the slowest rank's time (each rank's); every rank's store moves its shard in parallel")


def raw_label(key: str, cpu: bool) -> str:
    """A raw figure's key in a few words (the same-memory copies are memcpy without CUDA)."""
    if cpu and key.startswith("same.device."):
        return "memcpy"
    return RAW_LABELS[key.removeprefix("same.")]


RAW_LABELS = {
    "device.memcpy": "memcpy",
    "device.d2h": "pinned D2H",
    "device.h2d": "pinned H2D",
    "nvme.raw_write": "write+fdatasync",
    "nvme.raw_write_direct": "O_DIRECT write+fdatasync",
    "nvme.raw_write_direct_par": f"O_DIRECT x{copy_files.IO_DEPTH} write+fdatasync",
    "nvme.raw_write_overwrite": "overwrite+fdatasync",
    "nvme.raw_write_direct_overwrite": "O_DIRECT overwrite+fdatasync",
    "nvme.raw_read": "read, cold",
    "nvme.raw_read_direct": "O_DIRECT read",
    "nvme.raw_read_direct_par": f"O_DIRECT x{copy_files.IO_DEPTH} read",
}


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def build_tiny_model() -> Path:
    subprocess.run(
        [sys.executable, "-m", "plexctl.tiny_models", "--root", str(REPO / ".plexrl"), "--only", "tiny-arith"],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    return MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller states (full = 64 MiB), fewer repetitions")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/swap[-quick].json)")
    ap.add_argument("--nvme-dir", type=Path, default=None, help="directory on the NVMe tier (default: a temp dir)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per transfer (default 8, quick 2)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: what `plexctl up --local` gives each worker on 2 cores)",
    )
    ap.add_argument(
        "--model-scale",
        type=float,
        default=1.0,
        help="multiplies the whole-model sizes (512 MiB, 2 GiB; quick: 32 MiB); 0: none",
    )
    ap.add_argument(
        "--model-reps",
        type=int,
        default=None,
        help=f"rounds per whole-model size (default {WHOLE_MODEL_REPS}, quick 2)",
    )
    ap.add_argument(
        "--widths",
        default=None,
        help="trainer engine widths for the width axis, comma-separated (default 1,2,4; quick 1,2; '': none)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    asked = args.widths if args.widths is not None else "1,2" if args.quick else "1,2,4"
    widths = [int(w) for w in asked.split(",") if w]
    reps = args.reps or (2 if args.quick else 8)
    out = args.out or REPO / "bench" / "results" / ("swap-quick.json" if args.quick else "swap.json")
    model = build_tiny_model()
    config = model_config(str(model))
    loras = {"adapter": LoraSpec(rank=TINY_RANK)}
    loras.update({name: lora_for_bytes(n, config) for name, n in (SIZES_QUICK if args.quick else SIZES).items()})
    nvme_dir = Path(tempfile.mkdtemp(prefix="plexrl-swap-", dir=args.nvme_dir))
    try:
        trainer = TrainerEngine(str(model), device="cuda" if torch.cuda.is_available() else "cpu")
        info = machine(nvme_dir, trainer)
        results = []
        for name, lora in loras.items():
            with console.status(f"swap: {name} state (LoRA rank {lora.rank})"):
                results.append(run_size(name, lora, trainer, config, nvme_dir, reps))
        model_reps = args.model_reps or (2 if args.quick else WHOLE_MODEL_REPS)
        for name, nbytes in (WHOLE_MODEL_SIZES_QUICK if args.quick else WHOLE_MODEL_SIZES).items():
            if args.model_scale > 0:
                with console.status(f"swap: {name} whole-model state"):
                    results.append(run_whole_model(name, int(nbytes * args.model_scale), nvme_dir, model_reps))
        from bench.swap_width import run_widths  # it builds on this module's SwapCycle

        with console.status(f"swap: a full fine-tuning job's state at widths {widths}"):
            by_width = run_widths(str(model), config, widths, nvme_dir, reps) if widths else []
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    hidden = hidden_share(MULTIPLEX_JSON)
    print_report(results, hidden, info)
    if by_width:
        print_widths(by_width, info)
    rows = [p for r in results for p in r["paths"]]
    write_json_atomic(
        out,
        {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "quick": args.quick,
            "reps": reps,
            "model_scale": args.model_scale,
            "target_pct_of_raw": TARGET,
            "command": " ".join(["python", _rel(Path(sys.argv[0])), *sys.argv[1:]]),
            "conditions": CONDITIONS,
            "machine": info,
            "sizes": results,
            "widths": by_width,
            "hidden_behind_compute": hidden,
            "summary": {
                "meets_target": [f"{r['size']} {p['path']}" for r in results for p in r["paths"] if p["meets_target"]],
                "below_target": [
                    f"{r['size']} {p['path']}" for r in results for p in r["paths"] if not p["meets_target"]
                ],
                "min_pct_of_raw_same_memory": min(p["pct_of_raw_same_memory"] for p in rows),
                "min_pct_of_raw": min(p["pct_of_raw"] for p in rows),
            },
        },
    )
    console.print(f"wrote {_rel(out)}")


if __name__ == "__main__":
    main()
