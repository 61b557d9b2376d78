"""A CPU trainer worker's C heap keeps what it frees; a GPU worker's is left as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from worker.host_heap import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, MiB, heap_settings

REPO = Path(__file__).resolve().parents[1]


def test_a_cpu_worker_keeps_blocks_up_to_32_mib_and_a_gib_of_free_heap_top_and_a_gpu_worker_sets_nothing():
    assert heap_settings("cpu") == {M_MMAP_THRESHOLD: 32 * MiB, M_TRIM_THRESHOLD: 1024 * MiB}
    assert heap_settings("cuda") == {}


def test_glibc_takes_both_settings_in_a_fresh_process():
    """In a process of its own (the settings are process-wide): glibc accepts each value (an mmap
    threshold above 32 MiB, glibc's most, would be refused and leave its default)."""
    code = "from worker.host_heap import keep_freed_memory; print(sorted(keep_freed_memory('cpu').items()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(sorted(heap_settings("cpu").items()))
