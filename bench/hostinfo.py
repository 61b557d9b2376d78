"""The machine a benchmark ran on, in one line for its JSON and README's table: results
from different machines are not comparable, and the CPU model says which one it was."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def vector_isa() -> str:
    """The widest x86 vector extension the CPU has (it changes float results and speed)."""
    try:
        flags = next(
            (
                line.split(":", 1)[1].split()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("flags")
            ),
            [],
        )
    except OSError:
        return ""
    return next((isa for isa in ("avx512f", "avx2", "avx") if isa in flags), "")


def describe() -> str:
    """e.g. ``AMD EPYC, x86_64, 2 cores, avx2``."""
    parts = [cpu_model(), platform.machine(), f"{os.cpu_count()} cores", vector_isa()]
    return ", ".join(p for p in parts if p)


if __name__ == "__main__":
    print(describe())
