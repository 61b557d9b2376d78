"""The state store's nvme directory: the names of its copy files, and the files it keeps to reuse.

A copy file is named ``copy-<pid>.<host>-<store>-<serial>.bin``: the writing process and a tag
of its host's name (nodes may share the directory), a random tag of the store, a counter. When a
copy leaves nvme (read back, or dropped) its file becomes a *spare*, kept to be overwritten in
place by a later copy of about its size: no block is allocated or freed then, which on most
filesystems is what makes a rewrite as fast as the disk. ``CopyDirectory`` keeps the spares
(oldest first), hands out the one that fits a copy, and says which to delete when there are too
many or the tier needs their room; the store decides when (``worker.state.store``, which holds
its lock around every call here) and deletes them outside its lock. At start it deletes the
copies of processes that are gone (a crashed worker's on this host: nothing can read them
without it); when the store goes, or at exit, its spares are deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import socket
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

from worker.state.files import DIRECT_ALIGN, unlink_all

log = logging.getLogger(__name__)

KEEP_SPARES = 4  # spare files kept at most (and never more bytes than the tier leaves beside its copies)


@dataclass
class Spare:
    """The file of a copy that left nvme, kept to be overwritten by a later copy."""

    path: Path
    nbytes: int  # its size on disk


class CopyDirectory:
    """One store's copy files in ``path`` (created if missing). Not thread-safe: the store's lock
    guards every call but ``delete_spares``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        remove_orphan_copies(self.path)
        self.spares: list[Spare] = []  # oldest first
        self._prefix = f"copy-{os.getpid()}.{host_tag()}-{uuid.uuid4().hex[:8]}-"
        self._serial = itertools.count()
        self.delete_spares = weakref.finalize(self, _unlink_spares, self.spares)  # when it goes, or at exit

    def new_path(self) -> Path:
        """A file name no copy of this store has had."""
        return self.path / f"{self._prefix}{next(self._serial)}.bin"

    def take_spare(self, nbytes: int) -> Spare | None:
        """The spare to overwrite with a copy of ``nbytes``: the smallest that holds it and is not
        more than twice its size (one of its size, if any: overwritten in place, no block is
        allocated or freed); None if there is none (a new file then: a larger spare is kept for a
        larger copy, a smaller one would be extended)."""
        size = -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
        spares = self.spares
        for i, spare in enumerate(spares):  # one of its size: no list made (this is on every write)
            if spare.nbytes == size:
                return spares.pop(i)
        fits = [spare for spare in spares if size <= spare.nbytes <= 2 * size]
        if not fits:
            return None
        spare = min(fits, key=lambda spare: spare.nbytes)
        self.spares.remove(spare)
        return spare

    def add_spare(self, path: Path, nbytes: int) -> None:
        """Keep a copy's file (``nbytes`` on disk) to be overwritten later."""
        self.spares.append(Spare(path, nbytes))

    def trim(self, full: bool, room: int) -> list[Path]:
        """Spares to delete now (the caller deletes them): all when ``full`` (what the store frees
        must really be free on disk), else the oldest beyond KEEP_SPARES or beyond ``room``, the
        bytes the tier leaves beside its copies."""
        doomed = []
        while self.spares and (full or len(self.spares) > KEEP_SPARES or sum(s.nbytes for s in self.spares) > room):
            doomed.append(self.spares.pop(0).path)
        return doomed


def host_tag() -> str:
    """Eight hex digits of this host's name, in the names of the copies written here."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def remove_orphan_copies(directory: Path) -> None:
    """Delete the copies in ``directory`` written on this host by processes that are gone.
    Files of live processes, copies written on other hosts and other files stay."""
    removed, freed, here = 0, 0, host_tag()
    for entry in os.scandir(directory):
        parts = entry.name.split("-")
        if len(parts) != 4 or parts[0] != "copy" or not entry.name.endswith(".bin"):
            continue
        pid, _, host = parts[1].partition(".")
        if not pid.isdigit() or host not in ("", here):  # no tag: written by a version that had none
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its writer lives (or the pid was reused: kept, to be safe)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        with contextlib.suppress(FileNotFoundError):
            freed += entry.stat().st_size
            os.unlink(entry.path)
            removed += 1
    if removed:
        log.info("removed %d state copies (%d bytes) left in %s by processes that are gone", removed, freed, directory)


def _unlink_spares(spares: list[Spare]) -> None:
    with contextlib.suppress(OSError):
        unlink_all([spare.path for spare in spares])
    spares.clear()
