"""Benchmark: several LoRA jobs' train steps in one pass vs one at a time, on one trainer engine.

For 2, 4 and 8 small jobs of the tiny model (``.plexrl/models/tiny-arith``, fp32, CPU), two real
``TrainerEngine``s hold the same jobs (same seeds, same LoRA as ``configs/tiny-arith.yaml``):
one trains each job's step alone (``train_step``, what the trainer did before shared passes),
the other all of them in shared passes (``train_group``, what ``TrainerServer.serve_pass`` runs;
at most ``--pass-jobs`` jobs a pass, as a trainer's device slots bound it). Each round gives
every job a new batch (``--rows``: 8 rows, the issue's small job, and 32; rows of 10-30
tokens) and times both engines on it, in alternating order; the figure is the median over
rounds of trainer engine-seconds per job-step. In the same run, the adapters the two engines
trained are compared (max absolute difference after all rounds). Target at 8 jobs of 8 rows:
at least 1.5x less time grouped. ``--quick``: 2 rounds, 8 rows, 2 and 4 jobs.

Usage: ``python bench/train_batching.py [--quick] [--rounds N] [--rows N,N] [--threads N] [--out FILE]``;
writes ``bench/results/train_batching.json`` (``train_batching-quick.json`` with ``--quick``).
Method and history: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402

JOB_COUNTS = (2, 4, 8)
ROWS = "8,32"  # rows of a job's step: the small job (8 x its tokens), and a tiny-arith-like 4 prompts x 8
TARGET_SPEEDUP_AT_8 = 1.5  # at 8 jobs of 8 rows
MODEL = REPO / ".plexrl" / "models" / "tiny-arith"


def batch(seed: int, rows: int, vocab: int) -> Any:
    """A GRPO batch of ``rows`` rows: a 6-12 token prompt, a 4-18 token completion."""
    from plexctl.common.protocol import TrainBatch

    rng = random.Random(seed)
    ids, masks, olds, advantages = [], [], [], []
    for _ in range(rows):
        prompt, completion = rng.randint(6, 12), rng.randint(4, 18)
        ids.append([rng.randrange(3, vocab) for _ in range(prompt + completion)])
        masks.append([0] * prompt + [1] * completion)
        olds.append([(-3.5 + rng.uniform(-0.3, 0.3)) * m for m in masks[-1]])
        advantages.append(rng.gauss(0.0, 1.0))
    return TrainBatch(ids, masks, olds, advantages)


def one_at_a_time(engine: Any, steps: list[Any]) -> float:
    """Seconds of every job's step alone (``train_step``), one after another."""
    t0 = time.perf_counter()
    for step in steps:
        engine.train_step(*step)
    return time.perf_counter() - t0


def shared(engine: Any, steps: list[Any], pass_jobs: int) -> float:
    """Seconds of the same steps in shared passes of at most ``pass_jobs`` jobs (``train_group``)."""
    t0 = time.perf_counter()
    for i in range(0, len(steps), pass_jobs):
        engine.train_group(steps[i : i + pass_jobs])
    return time.perf_counter() - t0


def measure(jobs: int, rounds: int, rows: int, threads: int, pass_jobs: int) -> dict[str, Any]:
    import torch

    from plexctl.common.protocol import LoraSpec, TrainHParams
    from plexctl.spec_files import load_spec
    from worker.host_heap import keep_freed_memory
    from worker.trainer import TrainerEngine

    keep_freed_memory("cpu")  # the heap a CPU trainer worker runs with (worker.main)

    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", [f"model.path={MODEL}"], "bench")
    assert spec.lora is not None
    lora = LoraSpec(
        rank=spec.lora.rank,
        alpha=spec.lora.alpha,
        target_modules=list(spec.lora.target_modules),
        dropout=spec.lora.dropout,
    )
    hp = TrainHParams(lr=spec.algo.lr)
    vocab = int(json.loads((MODEL / "config.json").read_text())["vocab_size"])
    alone, grouped = (TrainerEngine(str(MODEL), threads=threads) for _ in range(2))
    names = [f"job{i}" for i in range(jobs)]
    for engine in (alone, grouped):
        for i, name in enumerate(names):
            engine.ensure_job(name, lora, seed=100 + i)
    alone_s, grouped_s = [], []
    for r in range(rounds + 1):  # round 0 warms both up, untimed
        steps = [(name, batch(1000 * r + i, rows, vocab), hp) for i, name in enumerate(names)]
        if r % 2:
            a, g = one_at_a_time(alone, steps), shared(grouped, steps, pass_jobs)
        else:
            g, a = shared(grouped, steps, pass_jobs), one_at_a_time(alone, steps)
        if r:
            alone_s.append(a / jobs)
            grouped_s.append(g / jobs)
    diff = max(
        float((alone.adapter_state_dict(n)[k] - grouped.adapter_state_dict(n)[k]).abs().max())
        for n in names
        for k in alone.adapter_state_dict(n)
    )
    a_med, g_med = statistics.median(alone_s), statistics.median(grouped_s)
    del torch
    return {
        "rows": rows,
        "jobs": jobs,
        "rounds": rounds,
        "alone_s_per_job_step": a_med,
        "grouped_s_per_job_step": g_med,
        "speedup": a_med / g_med,
        "alone_s": alone_s,
        "grouped_s": grouped_s,
        "max_adapter_diff": diff,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 and 4 jobs (the test's mode)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default=ROWS, help="rows of each job's batch, comma-separated")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of the trainer (a local cluster's: cores / workers)"
    )
    ap.add_argument("--pass-jobs", type=int, default=8, help="jobs in one pass at most (a trainer's device slots)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (MODEL / "config.json").exists():
        print(f"no tiny model at {MODEL}: build it with `python -m plexctl.tiny_models --only tiny-arith`")
        return 2
    rows = [int(r) for r in str(args.rows).split(",")]
    counts, rounds, rows = ((2, 4), 2, rows[:1]) if args.quick else (JOB_COUNTS, args.rounds, rows)
    results = [measure(n, rounds, r, args.threads, args.pass_jobs) for r in rows for n in counts]
    print(
        f"{'ROWS':>4} {'JOBS':>4} {'ALONE s/job-step':>17} {'GROUPED s/job-step':>19} {'SPEEDUP':>8} "
        f"{'MAX ADAPTER DIFF':>17}"
    )
    for r in results:
        print(
            f"{r['rows']:>4} {r['jobs']:>4} {r['alone_s_per_job_step']:>17.4f} {r['grouped_s_per_job_step']:>19.4f} "
            f"{r['speedup']:>7.2f}x {r['max_adapter_diff']:>17.2e}"
        )
    at8 = next((r for r in results if r["jobs"] == 8 and r["rows"] == 8), None)
    name = "train_batching-quick.json" if args.quick else "train_batching.json"
    out = args.out or REPO / "bench" / "results" / name
    doc = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": describe(),
        "command": " ".join(["python", "bench/train_batching.py", *(argv if argv is not None else sys.argv[1:])]),
        "rows": rows,
        "threads": args.threads,
        "pass_jobs": args.pass_jobs,
        "target_speedup_at_8": TARGET_SPEEDUP_AT_8,
        "met": None if at8 is None else at8["speedup"] >= TARGET_SPEEDUP_AT_8,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
