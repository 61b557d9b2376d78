"""Benchmark: the same mixed set of tiny jobs run ``isolated`` and shared, in one run.

Each mode starts its own local cluster of one rollout engine and one trainer engine (real vLLM on
CPU, real torch + peft) and submits the same jobs (``JOBS``: four shapes, three with ``--quick``):
``isolated``, every job owns the engine pair while it runs, so jobs queue; ``spread+backfill``
(shared), all jobs at once on the same pair. The trainer's ``--device-slots`` and ``--host-mem``
are small, so sharing swaps states device <-> host <-> NVMe. ``--case mixed`` (``MIXED``) runs
jobs on two bases, one of them full fine-tuning.

Reported per mode: engine-seconds per effective training step, makespan, bubble ratio, each job's
reward curve, the trainer's swap counters and the hidden share of swap time (``swap_summary``), and
the CPU seconds of the cluster's processes (``cluster_cpu_s``); then the shared / isolated ratios
and how far each job's per-step reward curve moved between the modes (a correct runtime gives
identical curves). Method and billing: ``docs/benchmarks.md``.

Usage: ``python bench/multiplex.py [--case classic|mixed] [--quick] [--steps N] [--repeat N]
[--device-slots N] [--host-mem SIZE]`` (``--repeat``: the modes alternate N times and the median
pair is reported); writes ``bench/results/multiplex.json`` (``multiplex-mixed.json`` for the
mixed case, ``-quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from daemon.metrics import hidden_by_other_jobs  # noqa: E402
from daemon.policies import placement_policy  # noqa: E402
from plexctl.common.atomic import write_json_atomic  # noqa: E402
from plexctl.common.client import Client  # noqa: E402
from plexctl.common.cluster import read_endpoint  # noqa: E402
from plexctl.common.spec import spec_to_wire  # noqa: E402
from plexctl.spec_files import load_spec  # noqa: E402

CONFIG = REPO / "configs" / "tiny-arith.yaml"
FULL = REPO / "configs" / "tiny-arith-full.yaml"
LLAMA = REPO / "configs" / "tiny-llama.yaml"
BENCH = str(REPO / "bench")

# name -> (spec, overrides): four different shapes of job on tiny-arith
JOBS: dict[str, tuple[Path, list[str]]] = {
    "reward-wait": (
        CONFIG,
        ["reward.fn=bench_rewards:slow_exact", f"reward.path={BENCH}", "reward.name=null", "seed=1"],
    ),
    "reward-cpu": (CONFIG, ["reward.fn=bench_rewards:cpu_exact", f"reward.path={BENCH}", "reward.name=null", "seed=2"]),
    "long-tail": (CONFIG, ["sampling.max_tokens=24", "sampling.temperature=1.3", "seed=3"]),
    "train-heavy": (CONFIG, ["algo.prompts_per_step=32", "algo.kl_coef=0.01", "seed=4"]),
}
# two bases, one job fine-tuning every weight
MIXED: dict[str, tuple[Path, list[str]]] = {
    "lora-arith": (CONFIG, ["seed=1"]),
    "full-arith": (FULL, ["seed=2"]),
    "lora-llama": (LLAMA, ["seed=3"]),
    "llama-heavy": (LLAMA, ["algo.prompts_per_step=32", "seed=4"]),
}
CASES = {"classic": (JOBS, ["tiny-arith"]), "mixed": (MIXED, ["tiny-arith", "tiny-llama"])}

console = Console() if sys.stdout.isatty() else Console(width=140)  # a log keeps the tables whole


def plexctl(home: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PLEXRL_HOME": str(home), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "plexctl.cli", *args], cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout
    )


def run_mode(
    policy: str,
    jobs: dict[str, tuple[Path, list[str]]],
    steps: int,
    models: list[Path],
    tiers: list[str],
    one_at_a_time: bool = False,
) -> dict:
    """Run ``jobs`` on a fresh local cluster of ``models`` under ``policy``; ``one_at_a_time``:
    each job is submitted when the one before it has ended."""
    home = Path(tempfile.mkdtemp(prefix=f"plexrl-bench-{policy.replace('+', '-')}-"))
    up = plexctl(home, "up", "--local", *(a for m in models for a in ("--model", str(m))), "--policy", policy, *tiers)
    if up.returncode != 0:
        raise SystemExit(f"plexctl up --policy {policy} failed: {up.stderr}")
    state_dir = home / "clusters" / "default"
    endpoint = read_endpoint(state_dir)
    client = Client(endpoint.address)
    try:
        root = endpoint.pid  # the daemon: every process of the cluster descends from it
        cpu0 = cluster_cpu_s(root)
        ids: dict[str, str] = {}
        busy0 = {e.engine_id: e.busy_seconds for e in client.status().engines}
        batches = [[name] for name in jobs] if one_at_a_time else [list(jobs)]
        with console.status(f"{policy}: running {len(jobs)} jobs") as spinner:
            for batch in batches:
                for name in batch:
                    config, overrides = jobs[name]
                    spec = load_spec(config, [*overrides, f"algo.steps={steps}", "checkpoint.every=0"], name=name)
                    ids[name] = client.submit(spec_to_wire(spec), submit_id=uuid.uuid4().hex).job_id
                while True:
                    rep = client.status()
                    mine = [j for j in rep.jobs if j.job_id in ids.values()]
                    done = [j for j in mine if j.state in ("succeeded", "failed", "cancelled")]
                    spinner.update(
                        f"{policy}: {len(done)}/{len(jobs)} jobs done, "
                        f"steps {sum(j.step for j in mine)}/{steps * len(jobs)}"
                    )
                    if len(done) == len(mine):
                        break
                    time.sleep(0.5)
        failed = [j for j in mine if j.state != "succeeded"]
        if failed:
            raise SystemExit(f"{policy}: jobs did not succeed: {[(j.name, j.state, j.error) for j in failed]}")
        cpu1 = cluster_cpu_s(root)
        engines = rep.engines
        busy = sum(e.busy_seconds - busy0.get(e.engine_id, 0.0) for e in engines)
        final = client.status(timeline=True)
        swaps = {e.engine_id: e.swaps for e in final.engines if e.kind == "trainer"}
        background = {
            "moves": len(final.moves),
            "seconds": sum(m.end - m.start for m in final.moves),
            "behind_other_jobs_s": hidden_by_other_jobs(final.moves, final.timeline),
        }
    finally:
        plexctl(home, "down")
    start = min(j.started_at for j in mine)
    end = max(j.ended_at for j in mine)
    makespan = end - start
    n_engines = len({e.worker_id for e in engines})  # the devices: one model's engines or several take turns on each
    if placement_policy(policy).dedicates_engines():  # each job held its engines for its whole run
        engine_seconds = sum(n_engines * (j.ended_at - j.started_at) for j in mine)
    else:
        engine_seconds = n_engines * makespan
    total_steps = sum(j.step for j in mine)
    curves = {}
    for j in mine:
        rows = [json.loads(line) for line in open(state_dir / "jobs" / j.job_id / "metrics.jsonl")]
        steps_rows = [r for r in rows if "reward_mean" in r]
        curves[j.name] = {
            "reward": [r["reward_mean"] for r in steps_rows],
            "generate_s": sum(r["generate_s"] for r in steps_rows) / len(steps_rows),
            "train_s": sum(r["train/seconds"] for r in steps_rows) / len(steps_rows),
            "eval_first": j.eval_first,
            "eval_last": j.eval_last,
            "run_s": j.ended_at - j.started_at,
            # ensure_resident's wall time in its train_step calls (its first also creates the adapter)
            "ensure_resident_s": sum(r.get("train/swap_seconds", 0.0) for r in steps_rows),
            "swap_evicted": int(sum(r.get("train/swap_evicted", 0.0) for r in steps_rows)),
        }
    return {
        "policy": policy,
        "engines": n_engines,
        "makespan_s": makespan,
        "engine_seconds": engine_seconds,
        "steps": total_steps,
        "engine_s_per_step": engine_seconds / total_steps,
        "bubble_ratio": 1.0 - busy / (len(engines) * makespan),  # idle share of the engines' time
        "jobs": curves,
        "swaps": swaps,
        "swap": swap_summary(swaps, background),
        "engine_busy_s": {e.engine_id: e.busy_seconds - busy0.get(e.engine_id, 0.0) for e in engines},
        "cpu": {
            "cores": os.cpu_count(),
            "seconds": sum(cpu1.values()) - sum(cpu0.values()),
            "by_process": {role: cpu1.get(role, 0.0) - cpu0.get(role, 0.0) for role in sorted({*cpu0, *cpu1})},
        },
    }


def cluster_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the process tree under ``root`` (the daemon: its
    workers, their engine processes, the job drivers, the reward sandboxes), by process:
    ``rollout`` and ``trainer`` (a local worker with its descendants) and ``rest``. Ended
    children that were waited for count in their parent's (the kernel adds them to it); the
    difference of two calls is what the tree spent in between."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        children.setdefault(int(fields[1]), []).append(int(entry))
        cpu[int(entry)] = sum(int(f) for f in fields[11:15]) / tick  # utime stime cutime cstime
    out: dict[str, float] = {}
    todo = [(root, "rest")]
    while todo:
        pid, role = todo.pop()
        if role == "rest":
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                argv = []
            if b"worker.main" in argv:
                engines = argv[argv.index(b"--engines") + 1].decode() if b"--engines" in argv else "worker"
                role = engines.replace(",", "+")
        out[role] = out.get(role, 0.0) + cpu.get(pid, 0.0)
        todo += [(child, role) for child in children.get(pid, ())]
    return out


def swap_summary(swaps: dict[str, dict[str, dict]], background: dict[str, float] | None = None) -> dict:
    """The trainer's swap counters summed over directions (and trainers), and the share of swap
    time hidden behind other jobs' compute.

    ``hidden_share``: (``behind_other_jobs_s`` - ``stalled_s``) / ``seconds``, where
    ``behind_other_jobs_s`` is the time of the moves made off the trainer's thread during which
    another job's task ran on some engine (the daemon's busy spans against the trainer's
    background moves: ``daemon.metrics.hidden_by_other_jobs``) and ``stalled_s`` the time
    swap-ins waited for such moves. ``hidden_share_trainer`` counts only the trainer's own
    compute: (``overlap_s`` - ``stalled_s``) / ``seconds``."""
    total = {key: 0.0 for key in ("count", "bytes", "seconds", "critical_s", "overlap_s", "stalled_s")}
    for per_direction in swaps.values():
        for stats in per_direction.values():
            for key in total:
                total[key] += stats.get(key, 0.0)
    seconds = total["seconds"]
    trainer_hidden = max(0.0, total["overlap_s"] - total["stalled_s"])
    summary = {
        **total,
        "hidden_s": trainer_hidden,
        "hidden_share_trainer": trainer_hidden / seconds if seconds else None,
    }
    if background is not None:
        hidden = max(0.0, background["behind_other_jobs_s"] - total["stalled_s"])
        summary.update(
            background_moves=background["moves"],
            background_s=background["seconds"],
            behind_other_jobs_s=background["behind_other_jobs_s"],
            hidden_s=hidden,
        )
    summary["hidden_share"] = summary["hidden_s"] / seconds if seconds else None
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=list(CASES), default="classic", help="classic: one base; mixed: two bases")
    ap.add_argument("--quick", action="store_true", help="3 jobs x 8 steps: keeps the benchmark working")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--repeat", type=int, default=1, help="run the two modes this many times, alternating; report the median pair"
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: bench/results/...)")
    ap.add_argument(
        "--device-slots",
        type=int,
        default=None,
        help="trainer device slots, fewer than the jobs so states swap (default: jobs / 2)",
    )
    ap.add_argument("--host-mem", default=None, help="host tier of the trainer (default 512K: one tiny job's state)")
    args = ap.parse_args(argv)
    all_jobs, names = CASES[args.case]
    jobs = dict(list(all_jobs.items())[:3]) if args.quick else all_jobs
    args.device_slots = args.device_slots or max(1, len(jobs) // 2)
    args.host_mem = args.host_mem or "512K"
    tiers = [f"--device-slots={args.device_slots}", f"--host-mem={args.host_mem}"]
    steps = 8 if args.quick else args.steps  # quick: steps enough that the 3 jobs run at once
    for name in names:
        subprocess.run(
            [sys.executable, "-m", "plexctl.tiny_models", "--root", str(REPO / ".plexrl"), "--only", name],
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
    models = [REPO / ".plexrl" / "models" / name for name in names]
    mixed = args.case == "mixed"
    # the modes alternate, so a slow spell of a shared machine falls on both; the ratio reported is
    # the median of the pairs' ratios, and the details shown are those of the median pair
    pairs = []
    for _ in range(args.repeat):
        pairs.append(
            {
                mode: run_mode(mode, jobs, steps, models, tiers, one_at_a_time=mixed and mode == "isolated")
                for mode in ("isolated", "spread+backfill")
            }
        )
    ratios = [p["spread+backfill"]["engine_s_per_step"] / p["isolated"]["engine_s_per_step"] for p in pairs]
    results = pairs[sorted(range(len(pairs)), key=ratios.__getitem__)[len(pairs) // 2]]
    iso, shared = results["isolated"], results["spread+backfill"]
    curve_diff = {
        name: max(
            (abs(a - b) for a, b in zip(iso["jobs"][name]["reward"], shared["jobs"][name]["reward"])), default=0.0
        )
        for name in jobs
    }
    summary = {
        "engine_s_per_step_ratio": shared["engine_s_per_step"] / iso["engine_s_per_step"],
        "makespan_ratio": shared["makespan_s"] / iso["makespan_s"],
        "max_reward_curve_diff": curve_diff,
        "target_engine_s_per_step_ratio": 0.55,
        "trainer_tiers": {"device_slots": args.device_slots, "host_mem": args.host_mem},
        "swap_hidden_share": shared["swap"]["hidden_share"],
        "repeats": [
            {
                "isolated_engine_s_per_step": p["isolated"]["engine_s_per_step"],
                "shared_engine_s_per_step": p["spread+backfill"]["engine_s_per_step"],
                "ratio": r,
            }
            for p, r in zip(pairs, ratios)
        ],
    }
    what = "1 rollout + 1 trainer engine" if not mixed else "2 workers, a rollout or trainer engine per base on each"
    table = Table(title=f"multiplex ({args.case}): {len(jobs)} jobs x {steps} steps, {what}")
    for col in (
        "mode",
        "engine-s/step",
        "makespan s",
        "bubble",
        "CPU s",
        "steps",
        "swaps",
        "swap s",
        "critical s",
        "hidden",
    ):
        table.add_column(col, justify="right")
    for mode, r in results.items():
        sw = r["swap"]
        hidden = "-" if sw["hidden_share"] is None else f"{sw['hidden_share']:.0%}"
        table.add_row(
            mode,
            f"{r['engine_s_per_step']:.3f}",
            f"{r['makespan_s']:.1f}",
            f"{r['bubble_ratio']:.0%}",
            f"{r['cpu']['seconds']:.1f}",
            str(r["steps"]),
            str(int(sw["count"])),
            f"{sw['seconds']:.3f}",
            f"{sw['critical_s']:.3f}",
            hidden,
        )
    table.add_row(
        "shared/isolated",
        f"{summary['engine_s_per_step_ratio']:.2f}",
        f"{summary['makespan_ratio']:.2f}",
        "",
        "",
        "",
        "",
        "",
        "",
        "",
    )
    console.print(table)
    if len(pairs) > 1:
        console.print(
            "shared/isolated per repetition: "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + f" (median {summary['engine_s_per_step_ratio']:.2f})"
        )
    jt = Table(title="per job: eval reward first → last, and per-step reward curve difference")
    for col in ("job", "isolated", "shared", "max |Δ reward| per step"):
        jt.add_column(col)
    for name in jobs:
        a, b = iso["jobs"][name], shared["jobs"][name]
        jt.add_row(
            name,
            f"{a['eval_first']:.3f} → {a['eval_last']:.3f}",
            f"{b['eval_first']:.3f} → {b['eval_last']:.3f}",
            f"{curve_diff[name]:.4f}",
        )
    console.print(jt)
    stem = "multiplex" + ("-mixed" if mixed else "") + ("-quick" if args.quick else "")
    out = args.out or REPO / "bench" / "results" / f"{stem}.json"
    write_json_atomic(
        out,
        {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": describe(),
            "case": args.case,
            "steps": steps,
            "summary": summary,
            "command": " ".join(["python", "bench/multiplex.py", *(argv or sys.argv[1:])]),
            "modes": results,
        },
    )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
