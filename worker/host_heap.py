"""How a worker process's C heap keeps the memory it frees: the trainer's tensors on a CPU.

On a CPU a trainer's activations and gradients are ordinary heap blocks of a few MiB, allocated
and freed in every forward and backward. glibc's defaults hand such blocks back to the kernel
(a block above the mmap threshold is unmapped when freed; the heap's free top is trimmed), so the
next step page-faults its memory in again, and the cost of a step then depends on what the
allocator did before it. ``heap_settings`` decides what a worker's heap keeps (pure, per
platform: on a GPU the tensors are the CUDA caching allocator's, nothing is set);
``keep_freed_memory`` applies it with glibc's ``mallopt``, and does nothing where the C library
is not glibc. Invariant: it only raises thresholds (no allocation is refused or moved).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MiB = 1 << 20


def heap_settings(platform: str) -> dict[int, int]:
    """``mallopt`` parameter -> value for a worker whose engines run on ``platform``: on a CPU,
    blocks up to 32 MiB (glibc's largest mmap threshold) from the heap, and up to 1 GiB of free
    heap top kept; on a GPU, none."""
    if platform != "cpu":
        return {}
    return {M_MMAP_THRESHOLD: 32 * MiB, M_TRIM_THRESHOLD: 1024 * MiB}


def keep_freed_memory(platform: str) -> dict[int, int]:
    """Apply ``heap_settings(platform)`` to this process; the settings glibc took (none where
    the C library is not glibc)."""
    settings = heap_settings(platform)
    if not settings:
        return {}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: its own defaults stand
        return {}
    return {param: value for param, value in settings.items() if mallopt(param, value) == 1}
