"""Benchmark: trainer-state swap throughput through each tier, against the raw hardware.

A job's trainer state moves between three tiers (``worker/state_store.py``): the device (live
in the ``TrainerEngine``), host memory (a ``JobStateCopy``) and NVMe (the store's checksummed
copy directory). This script times each move on real states of three sizes and, in the same
run and on the same sizes, the raw figure of the hardware underneath:

======================  =========================================  ===============================
path                    what is timed                              raw figure it is held against
======================  =========================================  ===============================
device->host            ``TrainerEngine.export_state``             CUDA: pinned device->host copy;
                                                                   CPU: memcpy into a preallocated
                                                                   buffer (clone shown beside it)
host->device            ``release`` then ``import_state``          CUDA: pinned host->device copy;
                        (import timed)                             CPU: as above
host->nvme              the store's copy writer (temp dir,         sequential write + fsync of one
                        sha256 per 8 MiB chunk, fsync, rename)     file (best of buffered / O_DIRECT)
nvme->host              the store's verified reader, cold          sequential read, cold (best of
                        (page cache dropped with                   buffered / O_DIRECT)
                        ``posix_fadvise(DONTNEED)``)
======================  =========================================  ===============================

Sizes: ``adapter`` is the tiny job itself (``configs/tiny-arith.yaml``: rank 8 on the tiny
model, about 0.4 MB with its AdamW moments); ``optimizer`` (128 MiB) and ``full`` (1 GiB,
256 MiB with ``--quick``) are reached by raising the LoRA rank on the same tiny model, so
the bytes go through exactly the code a real state takes (the adapter, the two AdamW moments
and the step counts, packed into a few flat buffers) while the model stays small. Every job
trains one step first, so its optimizer moments exist. Each figure is the best of a few runs,
for the paths and the raw figures alike, with torch on ``--threads`` threads (default 1, as
``plexctl up --local`` runs each worker on this 2-core machine; torch's 2-thread pool stalls
when other processes hold a core). Target: every path at >= 80 % of its raw figure.

It also reports the share of swap time hidden behind other jobs' compute in the multiplex
benchmark (``bench/results/multiplex.json``), when that file holds the trainer's swap
counters, and says what is missing when it does not.

What it deliberately does not do: no end-to-end ``ensure_resident`` timing (the store's
bookkeeping is microseconds; the copies are the cost), no GPU-direct storage, no
concurrency between swaps and training (that is the multiplex benchmark's hidden share).
The NVMe path calls the store's own copy writer and reader (``StateStore._write_nvme``,
``state_store._read_copy``): the exact code a demotion and a prefetch run.

Usage: ``python bench/swap.py [--quick] [--out FILE] [--nvme-dir DIR] [--reps N] [--threads N]``; writes
``bench/results/swap.json`` (``swap-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plexctl.atomic import write_json_atomic  # noqa: E402
from plexctl.protocol import LoraConfig, TrainBatch, TrainHParams  # noqa: E402
from plexctl.state_size import job_state_bytes, model_config  # noqa: E402
from worker import state_store  # noqa: E402
from worker.state_store import StateStore  # noqa: E402
from worker.trainer import JobStateCopy, TrainerEngine  # noqa: E402

MODEL = REPO / ".plexrl" / "models" / "tiny-arith"
MULTIPLEX_JSON = REPO / "bench" / "results" / "multiplex.json"
TINY_RANK = 8  # configs/tiny-arith.yaml
TARGET = 0.80
MiB, GiB = 1 << 20, 1 << 30
SIZES = {"optimizer": 128 * MiB, "full": 1 * GiB}
SIZES_QUICK = {"optimizer": 32 * MiB, "full": 256 * MiB}
IO_CHUNK = 8 * MiB  # raw file I/O moves this much per system call
IO_BLOCK = 64 * MiB  # the raw file I/O's source / destination block, reused across the file
DIRECT_ALIGN = 4096
SMALL_BYTES = 16 * MiB  # states below this are timed 5x as often

T = TypeVar("T")

console = Console() if sys.stdout.isatty() else Console(width=120)  # a log keeps the table whole


# ---------------------------------------------------------------- measurements


@dataclass
class Samples:
    """Seconds of repeated runs of one transfer of ``nbytes``; reported by the best run.

    The best run, for the swap paths and the raw figures alike: on a machine shared with
    other processes, slower runs measure the neighbours (the median is kept in the JSON).
    """

    nbytes: int
    seconds: list[float] = field(default_factory=list)

    @property
    def best_s(self) -> float:
        return min(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.best_s / 1e9

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "seconds": self.seconds, "best_s": self.best_s, "gbps": self.gbps,
                "median_gbps": self.nbytes / statistics.median(self.seconds) / 1e9}


def timed(run: Callable[[], T], sync: Callable[[], None] = lambda: None) -> tuple[T, float]:
    """``run()``'s result and the seconds it took (``sync`` before and after: CUDA's queue)."""
    sync()
    started = time.perf_counter()
    result = run()
    sync()
    return result, time.perf_counter() - started


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
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            self.pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
            self.on_device = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")

    def memcpy(self) -> float:
        return timed(partial(self.dst.copy_, self.src))[1]

    def clone(self) -> float:
        return timed(self.src.clone)[1]  # the clone is freed on return

    def host_to_device(self) -> float:
        return timed(partial(self.on_device.copy_, self.pinned, non_blocking=True), cuda_sync)[1]

    def device_to_host(self) -> float:
        return timed(partial(self.pinned.copy_, self.on_device, non_blocking=True), cuda_sync)[1]


class RawDisk:
    """Sequential file write + fsync and cold read of ``nbytes`` (rounded up to 4 KiB) in
    ``directory``, buffered and with O_DIRECT where the filesystem takes it. The bytes come
    from (and land in) one reused, page-aligned block of random data."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        self.path = directory / "raw.bin"
        self.nbytes = -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
        self.block = mmap.mmap(-1, min(IO_BLOCK, self.nbytes))  # anonymous: page aligned
        self.block.write(os.urandom(len(self.block)))
        self.view = memoryview(self.block)
        self.direct = hasattr(os, "O_DIRECT") and self._direct_works()

    def _chunks(self) -> list[tuple[int, memoryview]]:
        """(file offset, block slice) for every chunk of the file."""
        chunks = []
        for offset in range(0, self.nbytes, IO_CHUNK):
            size = min(IO_CHUNK, self.nbytes - offset)
            start = offset % len(self.block)
            if start + size > len(self.block):
                start = 0
            chunks.append((offset, self.view[start : start + size]))
        return chunks

    def write(self, direct: bool = False) -> float:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        started = time.perf_counter()
        fd = os.open(self.path, flags, 0o644)
        try:
            for _, chunk in self._chunks():
                written = 0
                while written < len(chunk):
                    written += os.write(fd, chunk[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - started

    def read_cold(self, direct: bool = False) -> float:
        drop_page_cache(self.path)
        return self.read_warm(direct)

    def read_warm(self, direct: bool = False) -> float:
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        started = time.perf_counter()
        fd = os.open(self.path, flags)
        try:
            for _, chunk in self._chunks():
                done = 0
                while done < len(chunk):
                    count = os.readv(fd, [chunk[done:]])
                    if not count:
                        raise OSError(f"{self.path} ended early")
                    done += count
        finally:
            os.close(fd)
        return time.perf_counter() - started

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
        self.path.unlink(missing_ok=True)
        self.view.release()
        self.block.close()


def drop_page_cache(path: Path) -> None:
    """Evict a file's clean pages from the page cache (no root needed), so it is read cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the state being swapped


def lora_for_bytes(target_bytes: int, config: dict[str, Any]) -> LoraConfig:
    """The tiny job's LoRA config with the rank whose trained state is closest to ``target_bytes``."""
    modules = list(LoraConfig().target_modules)
    per_rank = job_state_bytes(2, modules, config) - job_state_bytes(1, modules, config)
    base = job_state_bytes(0, modules, config)
    return LoraConfig(rank=max(1, round((target_bytes - base) / per_rank)), target_modules=modules)


def train_once(trainer: TrainerEngine, job_id: str, lora: LoraConfig) -> None:
    """Create the job and take one optimizer step, so its AdamW moments exist."""
    trainer.ensure_job(job_id, lora, seed=0)
    rows = [[1, 5, 6, 7, 8, 9], [1, 10, 11, 12, 13, 2]]
    batch = TrainBatch(input_ids=rows, loss_mask=[[0, 0, 0, 1, 1, 1]] * 2, old_logprobs=[[0.0] * 6] * 2,
                       advantages=[1.0, -1.0])
    trainer.train_step(job_id, batch, TrainHParams())


def device_tier(trainer: TrainerEngine, job_id: str, reps: int) -> dict[str, Samples]:
    """Export, release, import, ``reps`` times after one untimed warm-up round (pinned pools,
    allocator, the parked adapter), each round beside the raw copies of the same size."""
    raw: RawMemory | None = None
    out: dict[str, Samples] = {}
    for rep in range(reps + 1):
        copy, export_s = timed(partial(trainer.export_state, job_id), cuda_sync)
        trainer.release(job_id)
        _, import_s = timed(partial(trainer.import_state, job_id, copy), cuda_sync)
        nbytes = copy.nbytes
        del copy
        raw = raw or RawMemory(nbytes)
        raw_s = {"memcpy": raw.memcpy(), "clone": raw.clone()}
        if raw.cuda:
            raw_s.update(h2d=raw.host_to_device(), d2h=raw.device_to_host())
        if rep == 0:
            continue
        for name, seconds in {"export": export_s, "import": import_s, **raw_s}.items():
            out.setdefault(name, Samples(nbytes)).seconds.append(seconds)
    return out


def nvme_tier(store: StateStore, copy: JobStateCopy, raw: RawDisk, reps: int) -> dict[str, Samples]:
    """The store's write and cold verified read of ``copy``, interleaved with the raw file I/O."""
    names = ["write", "read", "raw_write", "raw_read", "raw_read_warm"]
    if raw.direct:
        names += ["raw_write_direct", "raw_read_direct"]
    out = {name: Samples(copy.nbytes if name in ("write", "read") else raw.nbytes) for name in names}
    job_dir = store._job_dir(copy.job_id)
    for _ in range(reps):
        out["raw_write"].seconds.append(raw.write())
        out["write"].seconds.append(store._write_nvme(copy.job_id, copy))
        out["raw_read"].seconds.append(raw.read_cold())
        out["raw_read_warm"].seconds.append(raw.read_warm())
        for path in job_dir.iterdir():
            drop_page_cache(path)
        back, read_s = timed(partial(state_store._read_copy, job_dir, copy.job_id))
        out["read"].seconds.append(read_s)
        if back.nbytes != copy.nbytes:
            raise SystemExit(f"read back {back.nbytes} bytes of {copy.job_id}, wrote {copy.nbytes}")
        del back
        store._delete_nvme(copy.job_id)
        if raw.direct:
            out["raw_write_direct"].seconds.append(raw.write(direct=True))
            out["raw_read_direct"].seconds.append(raw.read_cold(direct=True))
    return out


# ---------------------------------------------------------------- one size through every tier


def run_size(name: str, lora: LoraConfig, trainer: TrainerEngine, store: StateStore, nvme_dir: Path,
             reps: int) -> dict[str, Any]:
    job_id = f"swap-{name}"
    train_once(trainer, job_id, lora)
    small = trainer.state_bytes(job_id) < SMALL_BYTES  # cheap and noisy: repeat more
    device = device_tier(trainer, job_id, reps * (5 if small else 1))
    copy = trainer.export_state(job_id)
    trainer.release(job_id)
    gc.collect()
    raw_disk = RawDisk(nvme_dir, copy.nbytes)
    try:
        nvme = nvme_tier(store, copy, raw_disk, reps * (5 if small else 1))
    finally:
        raw_disk.close()
    nbytes = copy.nbytes
    del copy
    gc.collect()
    samples = {**{f"device.{k}": v for k, v in device.items()}, **{f"nvme.{k}": v for k, v in nvme.items()}}
    return {"size": name, "lora_rank": lora.rank, "bytes": nbytes, "paths": paths_of(samples),
            "samples": {key: s.to_json() for key, s in samples.items()}}


def paths_of(samples: dict[str, Samples]) -> list[dict[str, Any]]:
    """Each swap path's throughput next to its raw figure (the best raw variant measured)."""
    cuda = "device.h2d" in samples

    def best(*keys: str) -> tuple[str, float]:
        found = [(k, samples[k].gbps) for k in keys if k in samples]
        return max(found, key=lambda kv: kv[1])

    plan = [
        ("device->host", "device.export", "TrainerEngine.export_state",
         best("device.d2h") if cuda else best("device.memcpy")),
        ("host->device", "device.import", "TrainerEngine.import_state",
         best("device.h2d") if cuda else best("device.memcpy")),
        ("host->nvme", "nvme.write", "StateStore copy write (sha256, fsync, rename)",
         best("nvme.raw_write", "nvme.raw_write_direct")),
        ("nvme->host", "nvme.read", "StateStore copy read, cold (verified)",
         best("nvme.raw_read", "nvme.raw_read_direct")),
    ]
    rows = []
    for path, key, via, (raw_key, raw_gbps) in plan:
        gbps = samples[key].gbps
        row = {"path": path, "via": via, "gbps": gbps, "seconds": samples[key].best_s, "raw": raw_key,
               "raw_gbps": raw_gbps, "pct_of_raw": gbps / raw_gbps, "meets_target": gbps >= TARGET * raw_gbps}
        if not cuda and path in ("device->host", "host->device"):
            row["pct_of_clone"] = gbps / samples["device.clone"].gbps
        rows.append(row)
    return rows


# ---------------------------------------------------------------- swap time hidden in bench 1


def hidden_share(path: Path) -> dict[str, Any]:
    """Share of the multiplex run's swap seconds spent off the trainer's critical path.

    A trainer's swaps inside ``ensure_resident`` (every direction but ``nvme->host``) run on
    the trainer's own thread before the job's call, so they stall it; ``nvme->host`` only
    happens in ``prefetch``, which the worker serves on a side thread while the trainer
    computes other jobs' steps. So hidden share = prefetch seconds / all swap seconds: an
    upper bound, since a swap-in that waits on an unfinished prefetch is not subtracted.
    Needs, per mode, ``swaps``: the trainer's swap counters as ``plexctl status`` shows them
    (direction -> count / bytes / seconds, optionally keyed by engine first).
    """
    if not path.exists():
        return {"available": False, "missing": f"{_rel(path)} does not exist (run bench/multiplex.py)"}
    modes = json.loads(path.read_text()).get("modes", {})
    result: dict[str, Any] = {"available": False, "source": _rel(path), "modes": {}}
    missing = []
    for mode, record in modes.items():
        if "swaps" not in record:
            missing.append(mode)
            continue
        totals = _swap_totals(record["swaps"])
        swap_s = sum(t["seconds"] for t in totals.values())
        hidden_s = totals.get("nvme->host", {}).get("seconds", 0.0)
        result["modes"][mode] = {
            "swaps": sum(t["count"] for t in totals.values()), "swap_s": swap_s, "hidden_s": hidden_s,
            "hidden_share": hidden_s / swap_s if swap_s else None,
        }
    result["available"] = bool(result["modes"])
    if missing and not result["modes"]:
        result["missing"] = (
            f"{_rel(path)} holds no per-direction swap counters: bench/multiplex.py does not save the "
            "trainer's `swaps` (StatusRep.engines[].swaps) per mode; and its 4 jobs fit the trainer's 4 "
            "device slots, so that run never swaps (it needs more jobs than --device-slots to exercise "
            "the host and NVMe tiers)"
        )
    elif missing:
        result["missing"] = f"modes {missing} of {_rel(path)} hold no `swaps` counters"
    return result


def _swap_totals(swaps: dict[str, Any]) -> dict[str, dict[str, float]]:
    """direction -> {count, bytes, seconds}, summed over engines if keyed by engine first."""
    if all(isinstance(v, dict) and "seconds" in v for v in swaps.values()):
        return swaps
    totals: dict[str, dict[str, float]] = {}
    for per_engine in swaps.values():
        for direction, stats in (per_engine or {}).items():
            total = totals.setdefault(direction, {"count": 0, "bytes": 0, "seconds": 0.0})
            for key in total:
                total[key] += stats.get(key, 0)
    return totals


# ---------------------------------------------------------------- report


def machine(nvme_dir: Path, trainer: TrainerEngine) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
        "trainer_device": str(trainer.device), "nvme_dir": str(nvme_dir), "nvme_mount": mount_of(nvme_dir),
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
    title = (f"swap: trainer state through each tier vs the raw hardware, same run "
             f"(device = {info['trainer_device']}, nvme = {info['nvme_mount']})")
    table = Table(title=title)
    columns = ["size", "bytes", "path", "ms", "GB/s", "raw GB/s", "raw figure", "% of raw", f">= {TARGET:.0%}"]
    if cpu:
        columns.append("% of clone")
    for col in columns:
        table.add_column(col, justify="left" if col in ("size", "path", "raw figure") else "right")
    for result in results:
        for row in result["paths"]:
            cells = [result["size"], human_bytes(result["bytes"]), row["path"], f"{row['seconds'] * 1e3:.1f}",
                     f"{row['gbps']:.2f}", f"{row['raw_gbps']:.2f}", RAW_LABELS[row["raw"]], f"{row['pct_of_raw']:.0%}",
                     "yes" if row["meets_target"] else "no"]
            if cpu:
                cells.append(f"{row['pct_of_clone']:.0%}" if "pct_of_clone" in row else "")
            table.add_row(*cells)
    console.print(table)
    if cpu:
        console.print("No CUDA: the device tier is host memory, so device<->host is a host copy; "
                      "'% of clone' compares it with allocate-and-copy (clone), '% of raw' with memcpy.")
    meets = [f"{r['size']} {p['path']}" for r in results for p in r["paths"] if p["meets_target"]]
    misses = [f"{r['size']} {p['path']}" for r in results for p in r["paths"] if not p["meets_target"]]
    console.print(f"meet >= {TARGET:.0%} of raw: {', '.join(meets) or 'none'}")
    console.print(f"below: {', '.join(misses) or 'none'}")
    if hidden.get("available"):
        for mode, h in hidden["modes"].items():
            share = "n/a (no swaps)" if h["hidden_share"] is None else f"{h['hidden_share']:.0%}"
            console.print(f"multiplex {mode}: {h['swaps']} swaps, {h['swap_s']:.2f} s, hidden behind compute: {share}")
    if hidden.get("missing"):
        console.print(f"hidden share: {hidden['missing']}")


RAW_LABELS = {
    "device.memcpy": "memcpy", "device.d2h": "pinned D2H", "device.h2d": "pinned H2D",
    "nvme.raw_write": "write+fsync", "nvme.raw_write_direct": "write+fsync, O_DIRECT",
    "nvme.raw_read": "read, cold", "nvme.raw_read_direct": "read, O_DIRECT",
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
    subprocess.run([sys.executable, "-m", "worker.tiny", "--root", str(REPO / ".plexrl")], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    return MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller states (full = 256 MiB), fewer repetitions")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/swap[-quick].json)")
    ap.add_argument("--nvme-dir", type=Path, default=None, help="directory on the NVMe tier (default: a temp dir)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per transfer (default 5, quick 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: what `plexctl up --local` gives each worker on 2 cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reps = args.reps or (2 if args.quick else 5)
    out = args.out or REPO / "bench" / "results" / ("swap-quick.json" if args.quick else "swap.json")
    model = build_tiny_model()
    config = model_config(str(model))
    loras = {"adapter": LoraConfig(rank=TINY_RANK)}
    loras.update({name: lora_for_bytes(n, config) for name, n in (SIZES_QUICK if args.quick else SIZES).items()})
    nvme_dir = Path(tempfile.mkdtemp(prefix="plexrl-swap-", dir=args.nvme_dir))
    try:
        trainer = TrainerEngine(str(model), device="cuda" if torch.cuda.is_available() else "cpu")
        store = StateStore(trainer, device_slots=1, nvme_dir=nvme_dir / "store")
        info = machine(nvme_dir, trainer)
        results = []
        for name, lora in loras.items():
            with console.status(f"swap: {name} state (LoRA rank {lora.rank})"):
                results.append(run_size(name, lora, trainer, store, nvme_dir, reps))
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    hidden = hidden_share(MULTIPLEX_JSON)
    print_report(results, hidden, info)
    rows = [p for r in results for p in r["paths"]]
    write_json_atomic(out, {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": args.quick, "reps": reps, "target_pct_of_raw": TARGET,
        "machine": info, "sizes": results, "hidden_behind_compute": hidden,
        "summary": {
            "meets_target": [f"{r['size']} {p['path']}" for r in results for p in r["paths"] if p["meets_target"]],
            "below_target": [f"{r['size']} {p['path']}" for r in results for p in r["paths"] if not p["meets_target"]],
            "min_pct_of_raw": min(p["pct_of_raw"] for p in rows),
        },
    })
    console.print(f"wrote {_rel(out)}")


if __name__ == "__main__":
    main()
