"""The state store's host memory: one mapping of a fixed size, carved into page-aligned blocks.

``HostArena`` maps ``capacity`` bytes once, up front: anonymous memory, whose pages the
kernel supplies as they are first touched (on CPU nothing is touched up front). On CUDA it
pins the mapping once with ``cudaHostRegister``: torch's pinned allocator would round a
request up to a power of two and keep it. ``allocate`` hands out blocks of it as 1-D uint8
tensors: best fit over an address-ordered free list, each block exactly its request rounded
up to whole pages; ``free`` takes a block back and merges it with free neighbours.

Invariants: blocks are page-aligned and never overlap; ``in_use + free == capacity``; a
request that no free block can take raises ``HostMemoryError``: the arena never allocates
outside itself. A block that is never freed goes back when the last tensor over its memory
dies (the views of a tensor keep its block). Thread-safe.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import platform
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from worker.errors import TierFullError

log = logging.getLogger(__name__)

PAGE_BYTES = 4096  # host buffers start on a page (O_DIRECT file I/O needs it)
# no commit charge up front (a big arena is not refused for being big): pages count as they are touched
_MAP_NORESERVE = 0x4000 if platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64") else 0
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch pins


def page_round(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (at least one)."""
    return -(-max(nbytes, 1) // PAGE_BYTES) * PAGE_BYTES


@dataclass(frozen=True)
class ArenaStats:
    """An arena's accounting at one moment: ``in_use + free == capacity``."""

    capacity: int
    in_use: int
    free: int
    largest_free: int  # the largest request that can succeed now
    blocks: int  # blocks in use


class HostMemoryError(TierFullError):
    """No free block of the host arena takes a request (the arena is full, or too fragmented)."""

    def __init__(self, nbytes: int, stats: ArenaStats, what: str = "a block") -> None:
        super().__init__(
            f"no host memory for {what} ({nbytes} bytes): {stats.in_use} of {stats.capacity} bytes "
            f"in use, the largest free block {stats.largest_free} bytes"
        )
        self.nbytes = nbytes
        self.stats = stats


class _Block:
    """A block in use: its size, the tensor ``allocate`` returned (weakly), and the finalizer
    that reclaims it when the last tensor over its memory dies."""

    __slots__ = ("size", "tensor", "finalizer")
    finalizer: weakref.finalize

    def __init__(self, size: int, tensor: weakref.ref[torch.Tensor]) -> None:
        self.size = size
        self.tensor = tensor


class HostArena:
    """``capacity`` bytes of host memory (rounded up to whole pages), pinned when ``pinned``,
    given out in page-aligned blocks."""

    def __init__(self, capacity: int, pinned: bool = False) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = page_round(capacity) if capacity else 0
        self.pinned = pinned and self.capacity > 0
        self._lock = threading.Lock()
        self._starts: list[int] = [0] if self.capacity else []  # free extents' offsets, ascending
        self._sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}  # offset -> bytes
        self._live: dict[int, _Block] = {}  # offset -> block in use
        self._in_use = 0
        self._dead: deque[tuple[int, _Block]] = deque()  # blocks whose tensors died: reclaimed under the lock
        self._map: mmap.mmap | None = None
        self.address = 0
        if self.capacity:
            self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
            if self.pinned:
                if hasattr(mmap, "MADV_DONTFORK"):  # a forked child would copy pinned pages at once
                    self._map.madvise(mmap.MADV_DONTFORK)
                _register(self.address, self.capacity)
                unpin = weakref.finalize(self, _unregister, self.address, self._map)
                unpin.atexit = False  # the process's exit frees it

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A block of ``nbytes`` rounded up to whole pages, page-aligned, uninitialised (the
        smallest free extent that takes it); ``HostMemoryError`` when none does."""
        size = page_round(nbytes)
        with self._lock:
            self._reclaim()
            fits = [(extent, start) for start, extent in self._sizes.items() if extent >= size]
            if not fits:
                raise HostMemoryError(size, self._stats())
            _, start = min(fits)
            assert self._map is not None  # free extents exist only with a capacity, and so a mapping
            memory = (ctypes.c_char * size).from_buffer(self._map, start)  # keeps the mapping alive
            tensor = torch.frombuffer(memory, dtype=torch.uint8)  # its storage keeps ``memory`` alive
            block = _Block(size, weakref.ref(tensor))
            block.finalizer = weakref.finalize(memory, self._dead.append, (start, block))
            block.finalizer.atexit = False
            self._take_extent(start, size)
            self._live[start] = block
            self._in_use += size
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Take back a block: ``tensor`` is what ``allocate`` returned (no other view of it);
        nothing may use its memory after this. ValueError for anything else (a block freed
        already, a view, another arena's)."""
        with self._lock:
            self._reclaim()
            start = self._block_start(tensor)
            if start is None:
                raise ValueError("not a block in use of this host arena (freed already, or a view of one?)")
            block = self._live[start]
            block.finalizer.detach()
            self._release(start, block)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a block in use of this arena, as ``allocate`` returned it."""
        with self._lock:
            return self._block_start(tensor) is not None

    def stats(self) -> ArenaStats:
        with self._lock:
            self._reclaim()
            return self._stats()

    def __repr__(self) -> str:
        stats = self.stats()
        return (
            f"HostArena(capacity={stats.capacity}, in_use={stats.in_use}, largest_free={stats.largest_free}, "
            f"pinned={self.pinned})"
        )

    # ------------------------------------------------------------ the free list (callers hold the lock)

    def _block_start(self, tensor: torch.Tensor) -> int | None:
        start = tensor.data_ptr() - self.address
        block = self._live.get(start)
        return start if block is not None and block.tensor() is tensor else None

    def _stats(self) -> ArenaStats:
        free = self.capacity - self._in_use
        return ArenaStats(self.capacity, self._in_use, free, max(self._sizes.values(), default=0), len(self._live))

    def _take_extent(self, start: int, size: int) -> None:
        """Carve ``size`` bytes from the front of the free extent at ``start``."""
        extent = self._sizes.pop(start)
        index = bisect.bisect_left(self._starts, start)
        if extent == size:
            del self._starts[index]
        else:
            self._starts[index] = start + size
            self._sizes[start + size] = extent - size

    def _release(self, start: int, block: _Block) -> None:
        """Return a block to the free list, merged with the free extents either side of it."""
        del self._live[start]
        self._in_use -= block.size
        size = block.size
        index = bisect.bisect_left(self._starts, start)
        after = self._starts[index] if index < len(self._starts) else None
        if after is not None and start + size == after:
            size += self._sizes.pop(after)
            del self._starts[index]
        before = self._starts[index - 1] if index > 0 else None
        if before is not None and before + self._sizes[before] == start:
            self._sizes[before] += size
        else:
            self._starts.insert(index, start)
            self._sizes[start] = size

    def _reclaim(self) -> None:
        """Blocks whose last tensor died since (their finalizers only queue them: they may run
        on any thread, at any allocation, this one's included)."""
        while self._dead:
            start, block = self._dead.popleft()
            if self._live.get(start) is block:
                self._release(start, block)


def _register(address: int, nbytes: int) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(
            f"cannot pin the state store's {nbytes} bytes of host memory (cudaHostRegister: "
            f"CUDA error {code}); lower --host-mem or its allowances"
        )


def _unregister(address: int, mapping: Any) -> None:
    """Unpin (the mapping, an argument here, stays until this ran)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001 - CUDA may be going down with the process
        log.debug("cudaHostUnregister failed", exc_info=True)
