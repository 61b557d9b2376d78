"""Checkpoint directories on disk: written atomically, read back verified.

``write_dir_atomically`` fills a temp dir beside the target, fsyncs it and renames it onto the
target, so a reader sees the previous complete directory or the new complete one; out of disk
space or quota it removes the temp dir and raises ``NoSpaceError`` (one line: the directory,
the bytes needed, the bytes free). A checkpoint holds ``CHECKPOINT_FILES`` and a sha256
``MANIFEST`` of them; ``read_manifest``, ``verify_checksums`` and ``read_checkpoint_payload``
read one back or refuse it with a one-line ``CheckpointError``.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file

from worker.errors import CheckpointError, NoSpaceError

T = TypeVar("T")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINER_STATE = "trainer_state.pt"
EXTRA = "extra.json"
MANIFEST = "manifest.json"
CHECKPOINT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, TRAINER_STATE, EXTRA)  # checksummed by MANIFEST
SHARDED_FILES = (ADAPTER_CONFIG, TRAINER_STATE, EXTRA)  # a sharded checkpoint's, beside its shards
SHARDS = "shards"  # a sharded checkpoint's subdirectory: DCP's files (``worker.checkpoint_shards``)
SHARDS_METADATA = f"{SHARDS}/.metadata"  # DCP's index of the pieces (its fixed name)
_SHARD_FILE = re.compile(rf"{SHARDS}/__[0-9]+_[0-9]+\.distcp")
CHECKPOINT_FORMAT = "plexrl.trainer-checkpoint/1"
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a write failed for lack of disk space or quota


def write_dir_atomically(out_dir: Path, write: Callable[[Path], T], what: str = "directory", nbytes: int = 0) -> T:
    """Fill a temp dir next to ``out_dir``, fsync it, rename it onto ``out_dir``.

    A reader sees either the previous complete ``out_dir`` or the new complete one (an existing
    ``out_dir`` is swapped with the new one in one step, then removed; where the system cannot
    swap, it is renamed aside first); a failure removes the temp dir. Out of
    disk space or quota, ``NoSpaceError`` names ``what``, ``out_dir`` and ``nbytes`` (about
    what the files need).
    """
    parent = out_dir.parent
    tmp: Path | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
        result = write(tmp)
        os.chmod(tmp, 0o755)
        _fsync_tree(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            raise NoSpaceError(_no_space_message(exc, what, out_dir, nbytes)) from None
        raise
    _fsync_path(parent)
    return result


def _replace_dir(new: Path, target: Path) -> None:
    if not target.exists():
        os.rename(new, target)
        return
    if _exchange(new, target):  # one step: there is no moment without a complete ``target``
        shutil.rmtree(new, ignore_errors=True)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)  # the previous one stays where readers look for it
        raise
    shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    kernel, C library or filesystem cannot."""
    renameat2 = getattr(_libc(), "renameat2", None) if _libc() is not None else None
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def no_space_reason(exc: OSError) -> str:
    """``no space left on device`` (ENOSPC) or ``no space left in the disk quota`` (EDQUOT)."""
    return "no space left in the disk quota" if exc.errno == errno.EDQUOT else "no space left on device"


def free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged writer can still use on ``directory``'s filesystem (None: unknown)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _no_space_message(exc: OSError, what: str, out_dir: Path, nbytes: int) -> str:
    """One line: ``no space left on device writing checkpoint step 12 to DIR (needs ~3.1 MB,
    0.2 MB free); nothing was written``, or ``...; the previous one there is kept``."""
    free = free_bytes(out_dir.parent)
    sizes = [f"needs ~{_megabytes(nbytes)}"] if nbytes else []
    sizes += [f"{_megabytes(free)} free"] if free is not None else []
    detail = f" ({', '.join(sizes)})" if sizes else ""
    kept = "the previous one there is kept" if out_dir.exists() else "nothing was written"
    return f"{no_space_reason(exc)} writing {what} to {out_dir}{detail}; {kept}"


def _megabytes(nbytes: int) -> str:
    mb = nbytes / 1e6
    return f"{mb:.1f} MB" if mb < 100 else f"{mb:.0f} MB"


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        _fsync_path(path)
    _fsync_path(directory)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    return {"sha256": _sha256(path), "bytes": path.stat().st_size}


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {directory}: unreadable {MANIFEST} ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} is not a {CHECKPOINT_FORMAT} manifest")
    return manifest


def is_sharded(manifest: dict[str, Any]) -> bool:
    """Whether the checkpoint's weights and moments are shards each rank wrote (else whole files)."""
    return manifest.get("layout") == "sharded"


def verify_checksums(directory: Path, manifest: dict[str, Any], share: tuple[int, int] = (0, 1)) -> None:
    """Every file the manifest lists is there with its sha256: a whole checkpoint's
    ``CHECKPOINT_FILES``, a sharded one's ``SHARDED_FILES`` and DCP's files under ``SHARDS``.
    ``share`` (r, n): the files are checked by n readers, this one every n-th from the r-th."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not _expected(set(files), is_sharded(manifest)):
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} does not list the expected files")
    reader, readers = share
    for name, record in sorted(files.items())[reader::readers]:
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory}: {name} is missing")
        if _sha256(path) != record.get("sha256"):
            raise CheckpointError(f"checkpoint {directory}: {name} does not match its sha256 (corrupt)")


def _expected(names: set[str], sharded: bool) -> bool:
    if not sharded:
        return names == set(CHECKPOINT_FILES)
    shards = names - set(SHARDED_FILES)
    return (
        set(SHARDED_FILES) <= names
        and SHARDS_METADATA in shards
        and all(n == SHARDS_METADATA or _SHARD_FILE.fullmatch(n) for n in shards)
    )


def read_checkpoint_payload(
    directory: Path, sharded: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict]:
    """The weights, trainer state and ``extra`` of a verified checkpoint (``sharded``: no weights,
    which are its shards, ``worker.checkpoint_shards.read_shards``)."""
    try:
        tensors = {} if sharded else load_file(str(directory / ADAPTER_WEIGHTS))
        trainer_state = torch.load(directory / TRAINER_STATE, map_location="cpu", weights_only=True)
        extra = json.loads((directory / EXTRA).read_text())
    except Exception as exc:  # noqa: BLE001 - checksums matched, so the writer itself was broken
        raise CheckpointError(f"checkpoint {directory}: unreadable payload ({type(exc).__name__}: {exc})") from None
    return tensors, trainer_state, extra
