"""``bench/swap.py``'s width axis: one full fine-tuning job's state swapped through every tier on
trainer engines of 1, 2, 4 ... ranks.

On a wide engine each rank's store holds its own shard of the job's state (``worker.shards``:
1/N of every weight and moment, the lm_head whole) and moves it through its own host and NVMe
tiers, the ranks at once. Each rank runs ``swap.SwapCycle`` on its shard (the store's own calls,
its own counters); a ``SwapRound`` starts every rank together and reports each rank's seconds per
move and the round's wall time on rank 0 (the slowest rank's, in effect: the time until every
shard has moved). The bytes per rank fall as the width grows; on a machine with fewer cores or
disks than ranks the ranks share them, which the table says.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from pathlib import Path
from typing import Any

from bench.swap import SwapCycle
from worker.trainer import TrainerEngine
from worker.trainer_group import GroupCall, GroupRank, TrainerGroup

DIRECTIONS = ("device->host", "host->nvme", "nvme->host", "host->device")


def rank_cycle(engine: TrainerEngine, rank: int, *, nvme_dir: str, config: dict[str, Any]) -> SwapCycle:
    """A rank's cycle: its shard of a full fine-tuning job, measured on a probe job first (the
    store's host tier is sized to exactly it), through its own store under ``nvme_dir/rank<r>``."""
    engine.ensure_job("probe", None, 0)
    nbytes = engine.export_state("probe").nbytes
    engine.release("probe")  # parked: the measured job's state comes back into its slot
    return SwapCycle(engine, None, config, Path(nvme_dir) / f"rank{rank}", "full", nbytes=nbytes)


@dataclasses.dataclass(frozen=True)
class SwapRound(GroupCall[dict[str, Any]]):
    """One round of every rank's cycle, started together: each rank's seconds per move and
    bytes, and the round's seconds on rank 0 (from the start until every rank is done)."""

    def run(self, rank: GroupRank) -> dict[str, Any]:
        cycle: SwapCycle = rank.target
        rank.gather_objects(None)  # every rank starts together
        started = time.perf_counter()
        seconds = cycle.round()
        ranks = rank.gather_objects({"seconds": seconds, "bytes": cycle.nbytes})
        return {"ranks": ranks, "wall_s": time.perf_counter() - started}


@dataclasses.dataclass(frozen=True)
class CloseCycle(GroupCall[None]):
    def run(self, rank: GroupRank) -> None:
        rank.target.close()


def run_width(model: str, config: dict[str, Any], width: int, nvme_dir: Path, reps: int) -> dict[str, Any]:
    """``reps`` rounds (after one untimed warm-up) on an engine of ``width`` ranks: per direction,
    the median over rounds of the slowest rank's seconds, and of each rank's; the bytes per rank."""
    attach = functools.partial(rank_cycle, nvme_dir=str(nvme_dir / f"width{width}"), config=config)
    with TrainerGroup(model, width, {"threads": 1}, timeout_s=600.0, attach=attach) as group:
        rounds = [group.call(SwapRound()) for _ in range(reps + 1)][1:]
        group.call(CloseCycle())
    per_rank = [r["bytes"] for r in rounds[0]["ranks"]]
    directions = {}
    for direction in DIRECTIONS:
        each = [[r["ranks"][k]["seconds"][direction] for r in rounds] for k in range(width)]
        slowest = [max(r["ranks"][k]["seconds"][direction] for k in range(width)) for r in rounds]
        directions[direction] = {
            "rank_s": [statistics.median(s) for s in each],
            "slowest_s": statistics.median(slowest),
        }
    return {
        "width": width,
        "bytes_per_rank": per_rank,
        "bytes_total": sum(per_rank),
        "round_s": statistics.median(r["wall_s"] for r in rounds),
        "directions": directions,
    }


def run_widths(model: str, config: dict[str, Any], widths: list[int], nvme_dir: Path, reps: int) -> list[dict]:
    return [run_width(model, config, width, nvme_dir, reps) for width in widths]
