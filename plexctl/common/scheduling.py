"""What the scheduler's users share with it without importing the daemon: the names of the
placement policies (``plexctl up --policy``, ``plexd --policy``, the simulator) and
``union_length``, the busy time of a set of spans, which the scheduler's utilization, the
daemon's metrics and ``plexctl report`` count alike. The rules themselves stay in
``daemon/scheduler.py``.
"""

from __future__ import annotations

POLICIES = ("isolated", "pack", "spread", "spread+backfill")


def union_length(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of spans, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for s, e in sorted(spans):
        s, e = max(s, end), min(e, hi)
        if e > s:
            total += e - s
            end = e
    return total
