"""README's benchmark results table, generated from ``bench/results/*.json``.

One row per benchmark: what it measures, the command that reproduces it, the machine and date
of the run, the headline figures read from its JSON, the target and whether the run met it.
The reasoning behind each figure stays in docs/benchmarks.md; the figures
themselves come only from here, so the table cannot drift from the results it cites.

Usage: ``python bench/table.py`` prints the table; ``--write`` puts it into README.md between
the ``bench-table`` markers; ``--check`` exits 1 when README's table differs from the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
README = REPO / "README.md"
START, END = "<!-- bench-table:start (python bench/table.py --write) -->", "<!-- bench-table:end -->"

Row = tuple[str, str, str, str]  # result, target, met, machine


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _machine(d: dict[str, Any]) -> str:
    m = d.get("machine")
    if isinstance(m, str):
        return m
    if isinstance(m, dict) and "cpu" in m:
        return m["cpu"] + (f", {m['trainer_device']}" if "trainer_device" in m else "")
    if isinstance(m, dict) and "cpus" in m:
        return f"{m['cpus']} cores" + (f", {m['trainer_device']}" if "trainer_device" in m else "")
    return "not recorded"


def multiplex(d: dict[str, Any]) -> Row:
    s = d["summary"]
    diff = max(s["max_reward_curve_diff"].values())
    ratio = s["engine_s_per_step_ratio"]
    reps = [r["ratio"] for r in s.get("repeats", [])]
    spread = f" (median of {len(reps)} alternating runs, {min(reps):.2f}-{max(reps):.2f})" if len(reps) > 1 else ""
    result = (
        f"engine-s/step shared/isolated **{ratio:.2f}**{spread}, makespan {s['makespan_ratio']:.2f}; "
        f"reward curves max diff {diff:.4f}; "
        + (f"swap time hidden {_pct(s['swap_hidden_share'])}" if s["swap_hidden_share"] is not None else "no swaps")
    )
    busy = {
        mode: m["cpu"]["seconds"] / (m["cpu"]["cores"] * m["makespan_s"])
        for mode, m in d["modes"].items()
        if "cpu" in m
    }
    if busy:
        result += "; CPU cores busy " + ", ".join(f"{_pct(share)} {mode}" for mode, share in busy.items())
    target = s["target_engine_s_per_step_ratio"]
    return result, f"<= {target}", _yes(ratio <= target and diff == 0.0), _machine(d)


def multiplex_mixed(d: dict[str, Any]) -> Row:
    """The mixed case has no ratio target of its own: what it must keep is each job's curve."""
    result, _, _, machine = multiplex(d)
    diff = max(d["summary"]["max_reward_curve_diff"].values())
    return result, "reward curves identical (ratio reported)", _yes(diff == 0.0), machine


def simulate(d: dict[str, Any]) -> Row:
    best = d["policies"][d["best"]["label"]]
    ref = d["reference"]
    p99 = best["tick_p99_us"]
    result = (
        f"{best['jobs']} jobs, {best['gpus']} GPUs, {d['best']['label'].removeprefix('best: ')}: GPU-h saved "
        f"{_pct(best['saved_allocation'])} ({d['best'].get('allocation', 'fixed')} allocation; engines "
        f"{_pct(best['saved_engine'])}, busy {_pct(best['saved_busy'])}) at makespan "
        f"{_pct(best['makespan_vs_isolated'])}; p99 {p99:.0f} µs"
    )
    calib = d.get("calibration") or {}
    if "measured_ratio" in calib:  # the parts of the prediction: docs/benchmarks.md
        result += f"; vs multiplex: predicted {calib['ratio']:.2f}, measured {calib['measured_ratio']:.2f}"
    saved_target, makespan_target = ref["target_saved_allocation"], ref["target_makespan_vs_isolated"]
    p99_ms = ref["tick_p99_target_us"] / 1000
    target = f">= {_pct(saved_target)} saved at makespan <= {_pct(makespan_target)}; p99 < {p99_ms:g} ms"
    met = (
        best["saved_allocation"] >= saved_target
        and best["makespan_vs_isolated"] <= makespan_target
        and p99 < ref["tick_p99_target_us"]
    )
    return result, target, _yes(met), _machine(d)


def swap(d: dict[str, Any]) -> Row:
    parts = []
    for size in d["sizes"]:  # each state's slowest path (every path's figure: the JSON, docs/benchmarks.md)
        low = min(size["paths"], key=lambda p: p["pct_of_raw_same_memory"])
        parts.append(f"{size['size']} {_pct(low['pct_of_raw_same_memory'])}")
    below = d["summary"]["below_target"]
    result = "slowest path per state, % of raw (which path: docs/benchmarks.md): " + ", ".join(parts)
    paths = sum(len(size["paths"]) for size in d["sizes"])
    met = "yes" if not below else f"no: {len(below)} of {paths} paths below"
    return result, f">= {_pct(d['target_pct_of_raw'])} of raw", met, _machine(d)


def daemon(d: dict[str, Any]) -> Row:
    rt, tp, tg = d["round_trip"], d["throughput"], d["targets"]
    result = (
        f"p50 {rt['p50_ms']:.2f} ms, p99 {rt['p99_ms']:.2f} ms; {tp['msgs_per_s'] / 1000:.0f} k msg/s "
        f"with {tp['clients']} clients"
    )
    return (
        result,
        f"p50 < {tg['p50_ms']:g} ms, >= {tg['msgs_per_s'] // 1000} k msg/s",
        _yes(all(d["met"].values())),
        _machine(d),
    )


def overhead(d: dict[str, Any]) -> Row:
    runs = (
        (
            f" (medians of {sum(d['phases_median'][m]['steps_timed'] for m in d['phases_median'])} steps in "
            f"{d['turns']} turns of {d['block']} steps; adjacent turns' own ratios: median "
            f"{100 * d['pair_overhead_median']:+.1f} %, {100 * min(p['overhead'] for p in d['pairs']):+.1f} to "
            f"{100 * max(p['overhead'] for p in d['pairs']):+.1f} %)"
        )
        if d.get("pairs") and d.get("turns")
        else ""
    )
    result = (
        f"{d['daemon_step_s']:.3f} vs {d['in_process_step_s']:.3f} s/step: **{100 * d['overhead']:+.1f} %**{runs}; "
        f"per-step rewards identical: {'yes' if d['same_rewards'] else 'no'}"
    )
    return result, f"<= +{_pct(d['target'])}", _yes(d["overhead"] <= d["target"] and d["same_rewards"]), _machine(d)


def status_load(d: dict[str, Any]) -> Row:
    s, t, met = d["summary"], d["targets"], d["met"]
    result = (
        f"{t['status_per_s']:.0f} status/s served; job step time {s['ratio']:.2f}x "
        f"(bound C/(C-L) {s['cpu_bound']:.2f}x); daemon {s['daemon_cpu_us_per_status']:.0f} µs CPU per call"
    )
    target = f"{t['status_per_s']:.0f}/s within the CPU-share bound (fixed {t['step_time_ratio_fixed']}x)"
    verdict = "yes" if met["rate"] and met["bound"] and met["no_errors"] else "no"
    if verdict == "yes" and not met["fixed_bound"]:
        verdict = f"yes; fixed {t['step_time_ratio_fixed']}x: no"
    return result, target, verdict, _machine(d)


def tools(d: dict[str, Any]) -> Row:
    s = d["summary"]
    result = (
        f"tool-latency job ({d['latency_s']:g} s tools): bubble alone {_pct(s['bubble_alone'])}, with neighbours "
        f"{_pct(s['bubble_shared'])}; its slowdown {s['job_slowdown_shared']:.2f}x"
    )
    return result, "gaps filled by other jobs", _yes(s["bubble_shared"] < s["bubble_alone"]), _machine(d)


def cli_startup(d: dict[str, Any]) -> Row:
    rows = {r["command"]: r for r in d["rows"]}
    base = rows["python -c pass"]["median_s"]
    verbs = [r for c, r in rows.items() if c.startswith("plexctl")]
    result = f"`python -c pass` {base:.3f} s; " + ", ".join(
        f"`{r['command'].split(' (')[0]}` {r['median_s']:.3f} s" for r in verbs
    )
    daily = [r for r in verbs if r["command"].split()[1] in ("--help", "status", "logs")]
    met = _yes(bool(daily) and all(r["median_s"] < d["target_s"] for r in daily))
    return result, f"--help, status, logs < {d['target_s']:g} s", met, _machine(d)


def tinker(d: dict[str, Any]) -> Row:
    fb, sample, rl = d["fb_added"], d["sample_added"], d["rl_step"]
    result = (
        f"HTTP adds p50 {fb['p50_ms']:.1f} ms / p99 {fb['p99_ms']:.1f} ms per `forward_backward` "
        f"(native p50 {d['fb_native']['p50_ms']:.1f} ms), p50 {sample['p50_ms']:.1f} ms / p99 "
        f"{sample['p99_ms']:.1f} ms per `sample` (native p50 {d['sample_native']['p50_ms']:.1f} ms); "
        f"RL step {rl['http_median_s']:.3f} s vs {rl['native_median_s']:.3f} s through `plexctl.rl` "
        f"({rl['ratio']:.2f}x)"
    )
    return result, "measured (no target)", "-", _machine(d)


def tinker_cookbook(d: dict[str, Any]) -> Row:
    s = d["summary"]
    result = (
        f"tinker-cookbook {d['cookbook']}: `chat_sl.train` {s['sl_steps']} steps, train NLL "
        f"{s['sl_nll_first']:.2f} -> {s['sl_nll_last']:.2f}; `rl_basic` (arithmetic env) {s['rl_steps']} steps "
        f"end to end; {len(d['jobs'])} Tinker jobs on the cluster"
    )
    return result, "both recipes run unchanged", _yes(s["sl_ok"] and s["rl_ok"]), _machine(d)


def train_batching(d: dict[str, Any]) -> Row:
    runs = d["results"]
    by_rows: dict[int, list[dict[str, Any]]] = {}
    for r in runs:
        by_rows.setdefault(r["rows"], []).append(r)
    jobs = "/".join(str(r["jobs"]) for r in next(iter(by_rows.values()), []))
    parts = [f"{n} rows " + "/".join(f"{r['speedup']:.2f}" for r in rs) + "x" for n, rs in sorted(by_rows.items())]
    at8 = next((r for r in runs if r["jobs"] == 8 and r["rows"] == 8), None)
    head = f"one pass vs one at a time: **{at8['speedup']:.2f}x** at 8 jobs of 8 rows; " if at8 else ""
    diff = max(r["max_adapter_diff"] for r in runs)
    result = head + f"{jobs} jobs: " + ", ".join(parts) + f"; adapters max diff {diff:.1e}; off by default"
    target = f">= {d['target_speedup_at_8']:g}x at 8 jobs of 8 rows"
    return result, target, "-" if d.get("met") is None else _yes(bool(d["met"])), _machine(d)


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


# (results file and script name, what it measures, its row)
BENCHES: list[tuple[str, str, Callable[[dict[str, Any]], Row]]] = [
    ("multiplex", "4 mixed tiny jobs, isolated vs shared, real engines", multiplex),
    (
        "multiplex-mixed",
        "two bases (Qwen2- and Llama-style), a full fine-tuning job, isolated vs shared",
        multiplex_mixed,
    ),
    ("simulate", "the daemon's scheduler on a simulated clock, 2,048 GPUs", simulate),
    ("swap", "state through each tier vs raw copies, same run", swap),
    ("daemon", "no-op round trip and messages/s on loopback, CURVE on", daemon),
    ("overhead", "one job through the daemon vs the same loop in one process", overhead),
    ("status_load", "1,000 status calls/s while jobs run", status_load),
    ("tools", "a tool-latency-heavy job alone vs with neighbours", tools),
    ("cli_startup", "each verb's start-up beside a bare interpreter", cli_startup),
    ("tinker", "the Tinker HTTP front end vs the native client, same cluster", tinker),
    ("tinker_cookbook", "tinker-cookbook's recipes, unchanged, against a local cluster", tinker_cookbook),
    ("train_batching", "several LoRA jobs' train steps in one pass vs one at a time, tiny, CPU", train_batching),
]
# results file -> script, where they differ
SCRIPTS = {"daemon": "daemon_rtt", "multiplex-mixed": "multiplex", "tinker": "tinker_latency"}


def table(results: Path = RESULTS) -> str:
    lines = ["| benchmark | command | run (machine, date) | result | target | met |", "|---|---|---|---|---|---|"]
    for name, what, row in BENCHES:
        path = results / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name}: {what} | `python bench/{SCRIPTS.get(name, name)}.py` | not run | | | |")
            continue
        d = json.loads(path.read_text())
        result, target, met, machine = row(d)
        when = str(d.get("when") or d.get("date") or "")[:10]
        command = (d.get("command") or f"python bench/{SCRIPTS.get(name, name)}.py").strip()
        lines.append(f"| {name}: {what} | `{command}` | {machine}, {when} | {result} | {target} | {met} |")
    return "\n".join(lines) + "\n"


def readme_with(text: str, generated: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"README.md has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{generated}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="put the table into README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs from the JSON")
    args = ap.parse_args(argv)
    generated = table()
    if not (args.write or args.check):
        sys.stdout.write(generated)
        return 0
    text = README.read_text()
    wanted = readme_with(text, generated)
    if args.check:
        if wanted != text:
            print(
                "README.md's benchmark table differs from bench/results/*.json: run python bench/table.py --write",
                file=sys.stderr,
            )
            return 1
        return 0
    if wanted != text:
        tmp = README.with_suffix(".md.tmp")
        tmp.write_text(wanted)
        tmp.replace(README)
    return 0


if __name__ == "__main__":
    sys.exit(main())
