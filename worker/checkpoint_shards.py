"""A sharded job's checkpoint: each rank writes and reads its own shards (``torch.distributed.checkpoint``).

What it owns. A job whose state is sharded over a trainer engine's ranks (a full fine-tuning job
on a sharded base) checkpoints its weights and AdamW moments with DCP: under ``SHARDS`` every rank
writes its shard of each tensor to its own file (``__<rank>_0.distcp``; a tensor every rank holds
whole, the lm_head, once), and DCP's ``.metadata`` records where each piece lies. Any width reads
them back, each rank only the pieces its own shards overlap (``read_shards``: DTensors of the
reading engine's mesh), one rank the whole tensors (no group). ``shared_dir`` agrees on the temp
dir rank 0 made; ``write_shards`` returns every rank's files with their sha256, which rank 0's
manifest lists, so ``worker.checkpoint_files.verify_checksums`` covers each shard; a group
restoring it checks them together (``verify_shared``), each rank its share of the files.

DCP's metadata is a pickle: it is read only from checkpoints this cluster's trainers wrote (in
the state directory, the owner's alone), after the manifest's sha256 of it matched.

Invariants. No rank holds another's shard, so no host ever holds a whole copy of the job's state.
Every rank of the group calls each function, or none does (they are collectives). A failure on any
rank raises on every rank: out of disk space as an ``OSError`` of that errno (so the caller names
it), anything else as one ``CheckpointError`` line.
"""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from worker.checkpoint_files import NO_SPACE_ERRNOS, SHARDS, SHARDS_METADATA, file_record, verify_checksums
from worker.errors import CheckpointError

__all__ = ["read_shards", "shared_dir", "verify_shared", "write_shards"]


def shared_dir(path: Path | None, group: Any) -> Path | None:
    """Rank 0's ``path`` on every rank of ``group`` (one broadcast); None: rank 0 has none (it failed)."""
    box: list[Any] = [None if path is None else str(path)]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return None if box[0] is None else Path(box[0])


def write_shards(state: dict[str, torch.Tensor], directory: Path, group: Any) -> dict[str, dict[str, Any]]:
    """Write ``state`` (DTensors: this rank's shards; whole tensors: written once) under
    ``directory``/``SHARDS``; return every rank's files, relative to ``directory``, with their
    sha256 and size (each rank hashes what it wrote)."""
    out = directory / SHARDS
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(out, sync_files=True), process_group=group)
    except CheckpointException as exc:
        raise _one_error(exc, f"writing the shards to {directory}", _short_of_space(directory, state)) from None
    rank = dist.get_rank(group)
    mine = {f"{SHARDS}/{p.name}": file_record(p) for p in sorted(out.glob(f"__{rank}_*.distcp"))}
    if rank == 0:
        mine[SHARDS_METADATA] = file_record(directory / SHARDS_METADATA)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return {name: record for files in every for name, record in files.items()}


def read_shards(targets: dict[str, torch.Tensor], directory: Path, group: Any | None) -> None:
    """Fill ``targets`` in place from the shards under ``directory``/``SHARDS``, written at any width:
    DTensors of this engine's mesh get their shard, whole tensors (``group`` None: one rank) the whole.
    A key the checkpoint lacks, or of another shape, is a ``CheckpointError``."""
    reader = dcp.FileSystemReader(directory / SHARDS)
    try:
        if group is None:
            with warnings.catch_warnings():  # DCP says it reads in one process: so it does
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(targets, storage_reader=reader, no_dist=True)
        else:
            dcp.load(targets, storage_reader=reader, process_group=group)
    except CheckpointException as exc:
        raise _one_error(exc, f"checkpoint {directory}: its shards do not fit the job") from None
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {directory}: unreadable shards ({type(exc).__name__}: {exc})") from None


def verify_shared(directory: Path, manifest: dict[str, Any], group: Any) -> None:
    """The checkpoint's files checked against their sha256 by the group's ranks together, each
    reading its share of them once; the first failure is every rank's ``CheckpointError``."""
    rank, width = dist.get_rank(group), dist.get_world_size(group)
    try:
        verify_checksums(directory, manifest, share=(rank, width))
        failure = ""
    except CheckpointError as exc:
        failure = str(exc)
    every: list[Any] = [None] * width
    dist.all_gather_object(every, failure, group=group)
    first = next((f for f in every if f), "")
    if first:
        raise CheckpointError(first)


def _short_of_space(directory: Path, state: dict[str, torch.Tensor]) -> bool:
    """Whether ``directory``'s filesystem has less room than this rank's part of ``state``: then a
    write that failed without an errno (torch's zip writer reports a short write as a position it
    did not reach) failed for lack of space."""
    need = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in state.values())
    try:
        return shutil.disk_usage(directory).free < need
    except OSError:
        return False


def _one_error(exc: CheckpointException, what: str, short_of_space: bool = False) -> BaseException:
    """The failure of the lowest rank that failed: out of space (its ``OSError``, or any failure
    while ``short_of_space``), an ``OSError`` of ENOSPC; else one line."""
    failures = [failure for _, (failure, _trace) in sorted(exc.failures.items())]
    for failure in failures:
        if isinstance(failure, OSError) and failure.errno in NO_SPACE_ERRNOS:
            return failure
    if short_of_space:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    first = failures[0] if failures else exc
    detail = str(first).strip().splitlines()
    return CheckpointError(f"{what} ({type(first).__name__}: {detail[-1] if detail else ''})")
