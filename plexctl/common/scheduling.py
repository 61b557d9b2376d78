"""What the scheduler's users share with it without importing the daemon: the names of the
placement policies (``plexctl up --policy``, ``plexd --policy``, the simulator; the daemon's
``daemon.policies`` has one class per name), ``can_share_pass``, the rule for which train steps
may share a trainer pass (the daemon sizes its shared passes by it, the trainer refuses a pass
that breaks it), and ``union_length``, the busy time of a set of spans, which the scheduler's
utilization, the daemon's metrics and ``plexctl report`` count alike. The placement rules
themselves stay in ``daemon/``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plexctl.common.spec import LoraSpec

POLICIES = ("isolated", "pack", "spread", "spread+backfill", "pack+backfill")


def can_share_pass(lora: LoraSpec | None) -> bool:
    """Whether a job's train steps may share a trainer pass with other jobs': a LoRA job
    (``lora`` None: full fine-tuning, whose steps train weights of their own) without dropout
    (dropout would draw every row of the pass from one random stream, not each job's own)."""
    return lora is not None and lora.dropout <= 0


def union_length(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of spans, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for s, e in sorted(spans):
        s, e = max(s, end), min(e, hi)
        if e > s:
            total += e - s
            end = e
    return total
