"""``python -m daemon.simulate`` (``plexctl simulate``): a job trace replayed through the
daemon's own scheduler core (``daemon/simulator.py``), under every placement policy.

Draws a trace (``daemon/trace.py``: by default 1,000 jobs over 90 days of the ``mixed``
scenario: 7B- to 70B-class jobs on several base models, many full fine-tuning, on 16-192 GPUs;
``--scenario classic``: the 7B/30B/235B-class trace of one base per class the earlier figures
came from) or reads one, and replays it on a simulated clock under every policy
(``POLICIES``) and *our best*: ``spread+backfill`` or ``pack+backfill`` with the ``jobs_per_engine`` that did best on a
held-out trace (the same generator with the next seed at a quarter of the scale; a trace read
from a file is tuned on itself). Best = lowest makespan, then (within 1 % of it) fewest GPU-hours
per step the allocation held, then shortest p99 queueing. The allocation is elastic by default
(``daemon/elastic.py``'s rule: pairs join while jobs wait and leave when idle; ``--join-wait``,
``--engine-start``, ``--grow-after``, ``--shrink-after``, ``--base-pairs``); ``--fixed`` charges
every GPU from the first arrival to the last finish.

Reported per policy: makespan and GPU-hours per step relative to isolated, GPU-hours saved three
ways (what the allocation held, what engines held, what they were busy), bubble ratio, queueing
p50 / p99, swap traffic, model switches (weights loaded because an engine held others), the
scheduler's decision latency, and the trace's critical-path bound. With ``--multiplex FILE`` (a
``bench/multiplex.py`` result) the table also shows the simulator's prediction of that real run
beside what it measured (``daemon.simulator.predict``). ``--train-grouping``
(``--group-window-ms``, ``--train-tokens``) runs every policy with shared train passes, the
daemon's option, charged by the simulator's cost model (``daemon.simulator.TrainPassCost``); the
table's note gives the passes and the trainer engine-hours they saved. Writes a JSON file
(``--out``; ``./simulate.json``). The benchmark ``bench/simulate.py`` is this with the
benchmark's defaults (``Defaults``). It imports neither torch nor vLLM: it runs anywhere the
package is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from daemon.core import PASS_WINDOW_S
from daemon.policies import placement_policy
from daemon.simulator import SimConfig, SimResult, calibrate_from, predict, simulate
from daemon.trace import DAY_S, SCENARIOS, Trace, generate_trace, read_trace, write_trace
from plexctl.common.atomic import write_json_atomic
from plexctl.common.scheduling import POLICIES

BASELINES = POLICIES  # every placement policy, each run on the same trace
TUNE_JOBS_PER_ENGINE = (2, 3, 4, 6, 8)
TUNE_POLICIES = ("spread+backfill", "pack+backfill")  # what "our best" is chosen among
TUNE_MAX_SWITCHES = (4,)  # the bound never binds here: a shard has one trainer call per step
DEFAULT_SCENARIO = "mixed"
PLEXRL_GPU_HOURS_SAVED = 0.3758  # the GPU-hours PlexRL reports saved against isolated jobs
TARGET_SAVED_ALLOCATION, TARGET_MAKESPAN = 0.50, 0.60  # of isolated: GPU-hours the allocation saves, at this makespan


@dataclass(frozen=True)
class Defaults:
    """What the command and the benchmark (``bench/simulate.py``) do differently by default."""

    command: str = "python -m daemon.simulate"
    multiplex: Path | None = None  # calibration source when --multiplex is not given (None: none)
    out: Callable[[bool, str], Path] = lambda quick, scenario: Path("simulate.json")  # when --out is not given
    machine: Callable[[], str] = lambda: f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


class _Inline(Executor):
    """Runs submitted calls at once, in this process (``--workers 1``)."""

    def submit(self, fn, /, *args, **kwargs):
        f: Future = Future()
        f.set_result(fn(*args, **kwargs))
        return f


def _run(trace: Trace, policy: str, gpus: int, jpe: int, switches: int, cfg: SimConfig) -> SimResult:
    result = simulate(trace, policy, gpus, jobs_per_engine=jpe, max_switches=switches, config=cfg)
    result.outcomes, result.engine_busy_s = [], {}  # keep what crosses the process boundary small
    return result


def pick_best(results: list[SimResult]) -> SimResult:
    """Lowest makespan; within 1 % of it, fewest GPU-hours per step the allocation held; then
    shortest p99 queueing."""
    shortest = min(r.makespan_s for r in results)
    close = [r for r in results if r.makespan_s <= shortest * 1.01]
    return min(close, key=lambda r: (round(r.allocation_gpu_hours_per_step, 6), r.queue_p99_s, r.makespan_s))


def saved(result: SimResult, isolated: SimResult) -> dict[str, float]:
    """The three GPU-hours figures, each the fraction of isolated GPU-hours per step saved: what
    the allocation held (as Slurm charges), what engines held while home to a job or running a
    task, and what they were busy."""
    per_step = isolated.gpu_hours_per_step
    return {
        "saved_allocation": 1.0 - result.allocation_gpu_hours_per_step / per_step,
        "saved_engine": 1.0 - result.gpu_hours_per_step / per_step,
        "saved_busy": 1.0 - result.busy_gpu_hours / result.steps / per_step if result.steps else 0.0,
    }


def critical_path_s(trace: Trace) -> float:
    """Latest arrival + isolated run time over the trace: a bound no policy beats in this model."""
    start = min(j.arrival_s for j in trace.jobs)
    return max(j.arrival_s + j.steps * j.step_s for j in trace.jobs) - start


def calibration(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    model = calibrate_from(path)
    measured = all(
        "generate_s" in j and "train_s" in j for j in json.loads(path.read_text())["modes"]["isolated"]["jobs"].values()
    )
    out: dict[str, Any] = {
        "source": str(path),
        "phases": "measured per-step generate/train seconds"
        if measured
        else f"bubble ratio only (train share of busy time assumed {model.train_share:.2f})",
        "busy_share": model.busy_share,
        "jobs": [
            {"name": j.name, "steps": j.steps, "generate_s": j.generate_s, "stall_s": j.stall_s, "train_s": j.train_s}
            for j in model.jobs
        ],
        **predict(model),
    }
    if not measured:  # how much the one assumption moves the prediction
        out["ratio_by_train_share"] = {
            f"{ts:.2f}": predict(calibrate_from(path, train_share=ts))["ratio"] for ts in (0.2, 0.34, 0.5, 0.7)
        }
    return out


def main(argv: list[str] | None = None, defaults: Defaults = Defaults()) -> int:
    console = Console(width=None if sys.stdout.isatty() else 150)
    ap = argparse.ArgumentParser(prog=defaults.command, description=__doc__.splitlines()[0])
    ap.add_argument("trace_file", nargs="?", type=Path, help="a trace file to replay (same as --trace)")
    ap.add_argument("--trace", type=Path, help="replay this trace (.json or .jsonl) instead of drawing one")
    ap.add_argument("--quick", action="store_true", help="50 jobs on 128 GPUs: a few seconds")
    ap.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default=DEFAULT_SCENARIO,
        help=f"the drawn trace's jobs (default {DEFAULT_SCENARIO}; classic: the earlier figures' trace)",
    )
    ap.add_argument("--jobs", type=int, help="jobs in the drawn trace (default 1000)")
    ap.add_argument("--gpus", type=int, help="cluster GPUs (default 2048, or the trace's)")
    ap.add_argument("--days", type=float, default=90.0, help="arrival window of the drawn trace")
    ap.add_argument("--load", type=float, default=1.6, help="isolated GPU-time demand / cluster GPU-time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--macro-steps", type=int, help="simulated steps per job at most (default 12; 8 with --quick)")
    ap.add_argument("--jobs-per-engine", type=int, default=4, help="for pack / spread / spread+backfill")
    ap.add_argument(
        "--max-group", type=int, default=16, help="calls for the weights an engine holds in a row (1: no grouping)"
    )
    ap.add_argument(
        "--train-grouping",
        action="store_true",
        help="shared train passes: several LoRA jobs' steps on one trainer in one pass (the daemon's option)",
    )
    ap.add_argument(
        "--group-window-ms",
        type=float,
        default=PASS_WINDOW_S * 1000,
        help="with --train-grouping: how long a trainer waits for more steps to share a pass",
    )
    ap.add_argument(
        "--train-tokens",
        type=int,
        default=SimConfig().train_tokens,
        help="with --train-grouping: padded tokens of one LoRA train step (the pass budget and cost model)",
    )
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    ap.add_argument(
        "--multiplex", type=Path, default=defaults.multiplex, help="calibrate against this bench/multiplex.py JSON"
    )
    ap.add_argument(
        "--fixed",
        action="store_true",
        help="charge a fixed allocation (every GPU, first arrival to last finish) instead of an elastic one",
    )
    sim = SimConfig()
    ap.add_argument(
        "--base-pairs", type=int, default=sim.base_pairs, help="engine pairs per model class the allocation keeps"
    )
    ap.add_argument(
        "--grow-after", type=float, default=sim.grow_after_s, help="seconds jobs wait before the allocation grows"
    )
    ap.add_argument(
        "--shrink-after", type=float, default=sim.shrink_after_s, help="seconds a joined pair is idle before it leaves"
    )
    ap.add_argument(
        "--join-wait", type=float, default=sim.join_wait_s, help="seconds Slurm queues a joining allocation"
    )
    ap.add_argument(
        "--engine-start", type=float, default=sim.engine_start_s, help="seconds joined nodes' engines take to start"
    )
    ap.add_argument("--save-trace", type=Path, help="also write the replayed trace here")
    ap.add_argument("--out", type=Path, help=f"JSON output (default {defaults.out(False, DEFAULT_SCENARIO)})")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    trace_path = args.trace or args.trace_file
    if trace_path is not None:
        try:
            trace = read_trace(trace_path)
        except OSError as e:
            print(f"error: trace {trace_path}: {e.strerror}", file=sys.stderr)
            return 2
        except ValueError as e:  # it names the file
            print(f"error: {e}", file=sys.stderr)
            return 2
        gpus = args.gpus or trace.gpus or 2048
        tune_trace, tune_gpus, tuned_on = trace, gpus, f"the replayed trace ({trace_path})"
    else:
        n = args.jobs or (50 if args.quick else 1000)
        gpus = args.gpus or (128 if args.quick else 2048)
        trace = generate_trace(n, gpus, args.days, args.seed, args.load, scenario=args.scenario)
        tune_n, tune_gpus = max(50, n // 4), max(128, gpus // 4)
        tune_trace = generate_trace(tune_n, tune_gpus, args.days, args.seed + 1, args.load, scenario=args.scenario)
        tuned_on = f"a held-out trace: {tune_n} jobs on {tune_gpus} GPUs, seed {args.seed + 1}"
    if args.save_trace:
        write_trace(args.save_trace, trace)
    if args.max_group < 1:
        print(f"error: --max-group must be >= 1, not {args.max_group}", file=sys.stderr)
        return 2
    if args.group_window_ms < 0 or args.train_tokens < 1:
        print("error: --group-window-ms must be >= 0 and --train-tokens >= 1", file=sys.stderr)
        return 2
    bad = [
        f"--{k.replace('_', '-')}"
        for k in ("grow_after", "shrink_after", "join_wait", "engine_start")
        if getattr(args, k) < 0
    ]
    if args.base_pairs < 1 or bad:
        print(f"error: {', '.join(bad or ['--base-pairs'])} must be >= 0 (--base-pairs >= 1)", file=sys.stderr)
        return 2
    cfg = SimConfig(
        macro_steps=args.macro_steps or (8 if args.quick else 12),
        max_group=args.max_group,
        train_grouping=args.train_grouping,
        group_window_s=args.group_window_ms / 1000,
        train_tokens=args.train_tokens,
        elastic=not args.fixed,
        base_pairs=args.base_pairs,
        grow_after_s=args.grow_after,
        shrink_after_s=args.shrink_after,
        join_wait_s=args.join_wait,
        engine_start_s=args.engine_start,
    )
    jpe = args.jobs_per_engine

    pool: Executor = ProcessPoolExecutor(args.workers) if args.workers > 1 else _Inline()
    with pool:
        tuning = [
            pool.submit(_run, tune_trace, p, tune_gpus, j, s, cfg)
            for p in TUNE_POLICIES
            for j in TUNE_JOBS_PER_ENGINE
            for s in TUNE_MAX_SWITCHES
        ]
        limit = {p: 1 if placement_policy(p).dedicates_engines() else jpe for p in BASELINES}
        runs = {p: pool.submit(_run, trace, p, gpus, limit[p], 4, cfg) for p in BASELINES}
        tuned = [f.result() for f in tuning]
        choice = pick_best(tuned)
        best_f = pool.submit(_run, trace, choice.policy, gpus, choice.jobs_per_engine, choice.max_switches, cfg)
        calib = calibration(args.multiplex) if args.multiplex is not None else None
        results = {p: f.result() for p, f in runs.items()}
        best_label = f"best: {choice.policy} jpe={choice.jobs_per_engine}"
        results[best_label] = best_f.result()
    run_s = time.perf_counter() - t0

    iso = results["isolated"]
    bound = critical_path_s(trace)
    title = (
        f"simulate: {len(trace.jobs)} jobs, {trace.steps:,} steps, {gpus} GPUs "
        f"({iso.engines} engines of {cfg.gpus_per_engine} GPUs), macro-steps {cfg.macro_steps}"
    )
    table = Table(title=title)
    table.add_column("policy", no_wrap=True)
    for col in (
        "makespan d",
        "vs iso",
        "GPU-h/step",
        "vs iso",
        "saved alloc/engine/busy",
        "bubble",
        "queue p50/p99 h",
        "swaps (TB)",
        "switches (h)",
        "tick p50/p99/p99.9 µs",
        "sim s",
    ):
        table.add_column(col, justify="right")
    rows: dict[str, dict[str, Any]] = {}
    for label, r in results.items():
        rel_m, rel_g = r.makespan_s / iso.makespan_s, r.gpu_hours_per_step / iso.gpu_hours_per_step
        three = saved(r, iso)
        rows[label] = {
            **r.summary(),
            "makespan_vs_isolated": rel_m,
            "gpu_hours_per_step_vs_isolated": rel_g,
            "gpu_hours_saved": 1.0 - rel_g,
            **three,
        }
        table.add_row(
            label,
            f"{r.makespan_s / DAY_S:.1f}",
            f"{rel_m:.0%}",
            f"{r.gpu_hours_per_step:.2f}",
            f"{rel_g:.0%}",
            "/".join(f"{three[k]:.0%}" for k in ("saved_allocation", "saved_engine", "saved_busy")),
            f"{r.bubble_ratio:.0%}",
            f"{r.queue_p50_s / 3600:.1f} / {r.queue_p99_s / 3600:.1f}",
            f"{r.swaps.swap_ins} ({r.swaps.total_bytes / 1e12:.1f})",
            f"{sum(r.switches.count.values())} ({r.switches.total_seconds / 3600:.1f})",
            f"{r.tick_p50_us:.0f} / {r.tick_p99_us:.0f} / {r.tick_p999_us:.0f}",
            f"{r.wall_s:.1f}",
        )
    console.print(table)
    console.print(
        f"critical-path bound (latest arrival + isolated run time): {bound / DAY_S:.1f} d "
        f"= {bound / iso.makespan_s:.0%} of isolated; PlexRL reports 56 % for spread+backfill. "
        f"Our best tuned on {tuned_on}. Whole run {run_s:.1f} s."
    )
    best_row = rows[best_label]
    charged = (
        "a fixed allocation: every GPU from the first arrival to the last finish"
        if args.fixed
        else f"an elastic allocation: {cfg.base_pairs} engine pair(s) per model class kept, more joining after "
        f"{cfg.grow_after_s:g} s of waiting ({cfg.join_wait_s:g} s in Slurm's queue + {cfg.engine_start_s:g} s "
        f"engine start), leaving after {cfg.shrink_after_s:g} s idle"
    )
    console.print(
        f"GPU-hours saved against isolated ({best_label}): {best_row['saved_allocation']:.2%} by what the "
        f"allocation held ({charged}), {best_row['saved_engine']:.2%} by what engines held, "
        f"{best_row['saved_busy']:.2%} by busy time; makespan {best_row['makespan_vs_isolated']:.1%} of isolated. "
        f"PlexRL reports {PLEXRL_GPU_HOURS_SAVED:.2%} (engines held)."
    )
    if cfg.train_grouping:
        passes = results[best_label].passes
        console.print(
            f"shared train passes ({best_label}): {passes.passes:,} passes of {passes.steps:,} steps, "
            f"largest {passes.largest}; trainer engine-h {results[best_label].trainer_busy_s / 3600:,.1f}, "
            f"{passes.saved_s / 3600:,.1f} saved against the same steps alone "
            f"(window {cfg.group_window_s * 1000:g} ms, {cfg.train_tokens} tokens a step)."
        )
    if calib is not None:
        ct = Table(title="calibration against bench/multiplex.py (4 tiny jobs, 1 rollout + 1 trainer engine)")
        for col in ("", "engine-s/step isolated", "engine-s/step shared", "shared/isolated", "bubble iso / shared"):
            ct.add_column(col, justify="right")
        m = calibrate_from(args.multiplex).measured
        if "ratio" in m:
            ct.add_row(
                "measured",
                f"{m['isolated_engine_s_per_step']:.3f}",
                f"{m['shared_engine_s_per_step']:.3f}",
                f"{m['ratio']:.3f}",
                f"{m['isolated_bubble_ratio']:.0%} / {m['shared_bubble_ratio']:.0%}",
            )
        ct.add_row(
            "predicted",
            f"{calib['isolated_engine_s_per_step']:.3f}",
            f"{calib['shared_engine_s_per_step']:.3f}",
            f"{calib['ratio']:.3f}",
            f"{calib['isolated_bubble_ratio']:.0%} / {calib['shared_bubble_ratio']:.0%}",
        )
        ct.add_row("  scheduling (simulator)", "", "", f"{calib['scheduling_ratio']:.3f}", "")
        if "cpu_bound_ratio" in calib:
            ct.add_row("  cores bound (isolated run's CPU-s / cores)", "", "", f"{calib['cpu_bound_ratio']:.3f}", "")
        console.print(ct)
        sens = calib.get("ratio_by_train_share")
        console.print(
            f"phases from: {calib['phases']}"
            + (
                "; predicted ratio by assumed train share: " + ", ".join(f"{k}: {v:.3f}" for k, v in sens.items())
                if sens
                else ""
            )
        )

    out = args.out or defaults.out(args.quick, "file" if trace_path is not None else args.scenario)
    write_json_atomic(
        out,
        {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": {
                "cpu": defaults.machine(),
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "command": f"{defaults.command} " + " ".join(argv if argv is not None else sys.argv[1:]),
            "run_s": run_s,
            "workers": args.workers,
            "trace": {
                "name": trace.name,
                "scenario": None if trace_path is not None else args.scenario,
                "full_fine_tuning_jobs": sum(j.full_weights for j in trace.jobs),
                "base_models": sorted({j.base for j in trace.jobs if j.base}),
                "jobs": len(trace.jobs),
                "steps": trace.steps,
                "gpus": gpus,
                "days": trace.days,
                "seed": trace.seed,
                "load": trace.load,
                "critical_path_s": bound,
                "critical_path_vs_isolated": bound / iso.makespan_s,
            },
            "config": {"jobs_per_engine": jpe, **msgspec.to_builtins(cfg)},
            "policies": rows,
            "best": {
                "label": best_label,
                "policy": choice.policy,
                "allocation": "fixed" if args.fixed else "elastic",
                **{k: best_row[k] for k in ("saved_allocation", "saved_engine", "saved_busy", "makespan_vs_isolated")},
                "jobs_per_engine": choice.jobs_per_engine,
                "max_switches": choice.max_switches,
                "tuned_on": tuned_on,
            },
            "tuning": [
                {
                    "policy": r.policy,
                    "jobs_per_engine": r.jobs_per_engine,
                    "max_switches": r.max_switches,
                    "makespan_s": r.makespan_s,
                    "gpu_hours_per_step": r.gpu_hours_per_step,
                    "allocation_gpu_hours_per_step": r.allocation_gpu_hours_per_step,
                    "queue_p99_s": r.queue_p99_s,
                }
                for r in tuned
            ],
            "calibration": calib,
            "reference": {
                "target_saved_allocation": TARGET_SAVED_ALLOCATION,
                "target_makespan_vs_isolated": TARGET_MAKESPAN,
                "plexrl_makespan_vs_isolated_spread_backfill": 0.56,
                "plexrl_gpu_hours_saved": PLEXRL_GPU_HOURS_SAVED,
                "tick_p99_target_us": 1000,
            },
        },
    )
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
