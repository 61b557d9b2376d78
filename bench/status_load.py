"""Benchmark: 1,000 status calls per second served while jobs run, and what they cost the jobs.

One real local cluster (``plexctl up --local``: the daemon, a vLLM rollout worker and a torch
trainer worker on the tiny model) runs the demo's two jobs (``configs/tiny-arith.yaml`` and
``configs/tiny-arith-b.yaml``, ``--steps`` steps each, no evaluation, no periodic checkpoint)
again and again, in phases: ``baseline-1``, ``load-1``, ..., ``load-N``, ``baseline-N+1``
(``--rounds N``; 2, or 1 with ``--quick``). In a ``load`` phase, ``--procs`` client processes (each
a user's ``plexctl status`` loop, paced open-loop) call status at ``--rate`` calls/s in all
(default 1,000/s) from just before the jobs are submitted until both have ended. Each load phase
is compared with the baselines right before and after it; their spread (``control_ratio``:
slowest / fastest) is the noise floor.

Reported: status calls offered and served, latency percentiles, errors and timeouts (no reply
within ``--timeout``); each job's step time per phase (after ``--warmup`` steps) and its parts;
whether every phase's per-step rewards equal the first's; the daemon's and the clients' CPU; the
step time ratio under load against ``cpu_bound`` (``C / (C - L)``) and ``FIXED_BOUND``. Method:
``docs/benchmarks.md``. It sends no other requests than status, runs no remote clients and no
more than two jobs.

Usage: ``python bench/status_load.py [--quick] [--steps N] [--rounds N] [--rate R] [--procs N]
[--timeout S] [--out FILE]``; writes ``bench/results/status_load.json``
(``status_load-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.daemon_rtt import machine_cpu_seconds, percentile, process_cpu_seconds  # noqa: E402
from bench.hostinfo import describe  # noqa: E402
from bench.multiplex import plexctl  # noqa: E402
from bench.overhead import steps_of  # noqa: E402
from plexctl.common.atomic import write_json_atomic  # noqa: E402
from plexctl.common.client import Client  # noqa: E402
from plexctl.common.cluster import read_endpoint  # noqa: E402
from plexctl.common.errors import DaemonUnreachable, RemoteError  # noqa: E402
from plexctl.common.spec import spec_to_wire  # noqa: E402
from plexctl.spec_files import load_spec  # noqa: E402

TARGET_RATE = 1000.0  # status calls per second, all clients together
FIXED_BOUND = 1.10  # a job's step time under the load / without it, whatever the machine
RATE_SLACK = 0.99  # the rate counts as served at >= 99 % of the target (the window's edges)
TERMINAL = ("succeeded", "failed", "cancelled")
JOBS = {"tiny-arith": REPO / "configs" / "tiny-arith.yaml", "tiny-arith-b": REPO / "configs" / "tiny-arith-b.yaml"}
MODEL = REPO / ".plexrl" / "models" / "tiny-arith"
START_TIMEOUT_S = 120.0

console = Console() if sys.stdout.isatty() else Console(width=140)  # a log keeps the tables whole


@dataclass(frozen=True)
class Load:
    """The status load's shape."""

    rate: float  # calls per second, all processes together
    procs: int
    timeout_s: float


# ---------------------------------------------------------------- the status clients


def status_client(
    index: int,
    load: Load,
    home: str,
    state_dir: str,
    names: list[str],
    ready: Any,
    start_at: Any,
    stop_at: Any,
    results: Any,
) -> None:
    """One user's status loop, paced open-loop at ``load.rate / load.procs`` calls/s.

    Waits (after one untimed call, which also makes the CURVE handshake) until the parent sets
    ``start_at``; stops at ``stop_at``. Puts its counts and latencies on ``results``."""
    os.environ["PLEXRL_HOME"] = home  # this user's own key, as `plexctl status` presents it
    try:
        client = Client(read_endpoint(Path(state_dir)).address, timeout=load.timeout_s, retries=0)
        client.status()
    except Exception as exc:  # noqa: BLE001 - reported by the parent as one line
        ready.put(f"client {index}: {type(exc).__name__}: {exc}")
        return
    ready.put("")
    while start_at.value == 0.0:
        time.sleep(0.005)
    period = load.procs / load.rate
    first_due = start_at.value + index / load.procs * period
    latency: dict[str, list[float]] = {"all": [], "one": []}  # ms from due to reply
    service: list[float] = []  # ms from send to reply
    counts = {"ok": 0, "errors": 0, "timeouts": 0, "late": 0}
    error_kinds: dict[str, int] = {}
    cpu0 = time.process_time()
    k = 0
    while True:
        due = first_due + k * period
        now = time.time()
        if due > now:
            time.sleep(due - now)
            now = time.time()
        if due >= stop_at.value or now >= stop_at.value:
            break  # the window closed (calls due in it but not sent by then were missed)
        kind = "all" if k % 2 == 0 else "one"
        sent = time.time()
        try:
            if kind == "all":
                client.status()
            else:
                client.status(names[(k // 2) % len(names)])
        except DaemonUnreachable:
            counts["timeouts"] += 1
        except Exception as exc:  # noqa: BLE001 - the daemon's {code, message}, or anything else: counted by kind
            counts["errors"] += 1
            kind_of = exc.code if isinstance(exc, RemoteError) else type(exc).__name__
            error_kinds[kind_of] = error_kinds.get(kind_of, 0) + 1
        else:
            done = time.time()
            if done <= stop_at.value:
                counts["ok"] += 1
                latency[kind].append((done - due) * 1000.0)
                service.append((done - sent) * 1000.0)
            else:
                counts["late"] += 1  # answered after the window closed
        k += 1
    offered = max(0, math.ceil((stop_at.value - first_due) / period))  # calls due in the window
    client.close()
    results.put(
        {
            "index": index,
            "offered": offered,
            "sent": k,
            **counts,
            "error_kinds": error_kinds,
            "latency_ms": latency,
            "service_ms": service,
            "cpu_s": time.process_time() - cpu0,
        }
    )


class StatusLoad:
    """``load.procs`` spawned client processes, started, released together, stopped together."""

    def __init__(self, load: Load, home: Path, state_dir: Path, names: list[str]) -> None:
        self.load = load
        spawn = multiprocessing.get_context("spawn")
        self._ready, self._results = spawn.Queue(), spawn.Queue()
        self._start_at, self._stop_at = spawn.Value("d", 0.0), spawn.Value("d", float("inf"))
        self._procs = [
            spawn.Process(
                target=status_client,
                daemon=True,
                args=(
                    i,
                    load,
                    str(home),
                    str(state_dir),
                    names,
                    self._ready,
                    self._start_at,
                    self._stop_at,
                    self._results,
                ),
            )
            for i in range(load.procs)
        ]
        self.parts: list[dict[str, Any]] = []
        self.window_s = 0.0

    def start(self) -> None:
        """Start the processes; returns once all made their first call and the pacing began."""
        for proc in self._procs:
            proc.start()
        try:
            problems = [self._ready.get(timeout=START_TIMEOUT_S) for _ in self._procs]
        except queue.Empty:
            problems = [f"not every status client started within {START_TIMEOUT_S:.0f} s"]
        self._start_at.value = time.time() + 0.2
        if any(problems):
            self.stop()
            raise SystemExit(f"status clients could not start: {next(p for p in problems if p)}")

    def stop(self) -> None:
        """Close the window and collect every process's counts (``parts``) and the window's length."""
        self._stop_at.value = time.time()
        self.window_s = max(0.0, self._stop_at.value - self._start_at.value)
        for proc in self._procs:
            if proc.pid is None:
                continue
            try:
                self.parts.append(self._results.get(timeout=self.load.timeout_s + 30))
            except queue.Empty:  # a client that never reported
                break
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()


def summarize_load(load: Load, parts: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    """The clients' counts summed; latency percentiles over all of them."""
    total = {key: sum(p[key] for p in parts) for key in ("offered", "sent", "ok", "errors", "timeouts", "late")}
    kinds: dict[str, int] = {}
    for p in parts:
        for code, n in p["error_kinds"].items():
            kinds[code] = kinds.get(code, 0) + n
    by_kind = {kind: sorted(x for p in parts for x in p["latency_ms"][kind]) for kind in ("all", "one")}
    every = sorted(by_kind["all"] + by_kind["one"])
    service = sorted(x for p in parts for x in p["service_ms"])
    return {
        "target_per_s": load.rate,
        "procs": load.procs,
        "reported_procs": len(parts),
        "timeout_s": load.timeout_s,
        "window_s": window_s,
        **total,
        "error_kinds": kinds,
        "missed": total["offered"] - total["ok"],
        "achieved_per_s": total["ok"] / window_s if window_s > 0 else 0.0,
        "latency_ms": latency_stats(every),
        "latency_ms_by_call": {
            "status()": latency_stats(by_kind["all"]),
            "status(NAME)": latency_stats(by_kind["one"]),
        },
        "service_ms": latency_stats(service),
        "clients_cpu_s": sum(p["cpu_s"] for p in parts),
    }


def latency_stats(sorted_ms: list[float]) -> dict[str, float | int | None]:
    if not sorted_ms:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    return {
        "count": len(sorted_ms),
        "p50": percentile(sorted_ms, 50),
        "p90": percentile(sorted_ms, 90),
        "p99": percentile(sorted_ms, 99),
        "max": sorted_ms[-1],
        "mean": statistics.fmean(sorted_ms),
    }


# ---------------------------------------------------------------- the jobs


def run_phase(
    name: str,
    client: Client,
    state_dir: Path,
    overrides: list[str],
    warmup: int,
    status_load: StatusLoad | None,
    daemon_pid: int,
) -> dict[str, Any]:
    """Submit the jobs, wait for them to end (under ``status_load`` if given); their step times."""
    if status_load is not None:
        status_load.start()
    cpu0, machine0 = process_cpu_seconds(daemon_pid), machine_cpu_seconds()
    t0 = time.time()
    try:
        ids = {}
        for job, config in JOBS.items():
            spec = load_spec(config, overrides, name=job)
            ids[job] = client.submit(spec_to_wire(spec), submit_id=uuid.uuid4().hex).job_id
        with console.status(f"{name}: running {len(ids)} jobs") as spinner:
            while True:
                mine = [j for j in client.status().jobs if j.job_id in ids.values()]
                if all(j.state in TERMINAL for j in mine):
                    break
                spinner.update(f"{name}: steps {sum(j.step for j in mine)}/{sum(j.steps for j in mine)}")
                time.sleep(0.5)
    finally:
        if status_load is not None:
            status_load.stop()
    wall = time.time() - t0
    cpu1, machine1 = process_cpu_seconds(daemon_pid), machine_cpu_seconds()
    failed = [(j.name, j.state, j.error) for j in mine if j.state != "succeeded"]
    if failed:
        raise SystemExit(f"{name}: jobs did not succeed: {failed}")
    jobs = {}
    for j in mine:
        rows = steps_of(state_dir / "jobs" / j.job_id / "metrics.jsonl")
        timed_rows = rows[warmup:]
        timed = [r["step_s"] for r in timed_rows]
        jobs[j.name] = {
            "job_id": j.job_id,
            "steps": len(rows),
            "timed_steps": len(timed),
            "step_s_mean": statistics.fmean(timed),
            "step_s_median": statistics.median(timed),
            # where a step's time goes: the generate call as the driver waits for it, the
            # trainer's own compute, and the rest (the train call's trip, scoring, bookkeeping)
            "generate_s_mean": statistics.fmean(r["generate_s"] for r in timed_rows),
            "train_s_mean": statistics.fmean(r["train/seconds"] for r in timed_rows),
            "run_s": j.ended_at - j.started_at,
            "rewards": [r["reward_mean"] for r in rows],
        }
    out: dict[str, Any] = {
        "phase": name,
        "status_load": status_load is not None,
        "wall_s": wall,
        "jobs": jobs,
        "journal_jobs": len(client.status().jobs),  # what each status() call reads and sends
        "task_spans": len(client.status(timeline=True).timeline),  # the engines' busy timeline the daemon keeps
        "load_avg_1m": os.getloadavg()[0],  # other processes on the machine show here
        "step_s_mean": statistics.fmean(j["step_s_mean"] for j in jobs.values()),
        "step_s_median": statistics.fmean(j["step_s_median"] for j in jobs.values()),
        "generate_s_mean": statistics.fmean(j["generate_s_mean"] for j in jobs.values()),
        "train_s_mean": statistics.fmean(j["train_s_mean"] for j in jobs.values()),
        "daemon_cpu_s": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
    }
    out["rest_s_mean"] = out["step_s_mean"] - out["generate_s_mean"] - out["train_s_mean"]
    if out["daemon_cpu_s"] is not None:
        out["daemon_core_share"] = out["daemon_cpu_s"] / wall
    if machine0 is not None and machine1 is not None:
        busy, total = machine1[0] - machine0[0], machine1[1] - machine0[1]
        out["machine_busy_cores"] = busy / total * (os.cpu_count() or 1) if total else None
    if status_load is not None:
        out["status"] = summarize_load(status_load.load, status_load.parts, status_load.window_s)
    return out


def phase_names(rounds: int) -> list[tuple[str, bool]]:
    """baseline-1, load-1, baseline-2, ..., load-N, baseline-N+1: (name, under status load)."""
    names = [("baseline-1", False)]
    for i in range(1, rounds + 1):
        names += [(f"load-{i}", True), (f"baseline-{i + 1}", False)]
    return names


def compare(phases: list[dict[str, Any]], status: dict[str, Any]) -> dict[str, Any]:
    """Step time under the load against the baselines on either side, and whether the reward
    curves moved (every phase against the first)."""
    bases = [p for p in phases if not p["status_load"]]
    loads = [p for p in phases if p["status_load"]]

    def ratio(key: Any) -> float:  # mean over rounds of load_i / mean(baseline_i, baseline_i+1)
        return statistics.fmean(
            key(load) / statistics.fmean((key(bases[i]), key(bases[i + 1]))) for i, load in enumerate(loads)
        )

    per_job = {
        job: {
            "baseline_step_s": statistics.fmean(p["jobs"][job]["step_s_mean"] for p in bases),
            "load_step_s": statistics.fmean(p["jobs"][job]["step_s_mean"] for p in loads),
            "ratio": ratio(lambda p, job=job: p["jobs"][job]["step_s_mean"]),
        }
        for job in JOBS
    }
    base_times = [p["step_s_mean"] for p in bases]
    reference = {job: bases[0]["jobs"][job]["rewards"] for job in JOBS}
    curve_diff = {
        job: max(abs(a - b) for p in phases[1:] for a, b in zip(reference[job], p["jobs"][job]["rewards"]))
        for job in JOBS
    }
    out: dict[str, Any] = {
        "baseline_step_s": statistics.fmean(base_times),
        "load_step_s": statistics.fmean(p["step_s_mean"] for p in loads),
        "ratio": ratio(lambda p: p["step_s_mean"]),
        "median_ratio": ratio(lambda p: p["step_s_median"]),
        # the same ratio for a step's parts: what the load slows (an engine's compute, or the trips)
        "parts_ratio": {
            "generate": ratio(lambda p: p["generate_s_mean"]),
            "train": ratio(lambda p: p["train_s_mean"]),
            "rest": ratio(lambda p: p["rest_s_mean"]),
        },
        "control_ratio": max(base_times) / min(base_times),  # the baselines' spread: the noise floor
        "per_job": per_job,
        "same_rewards": all(p["jobs"][job]["rewards"] == reference[job] for p in phases for job in JOBS),
        "max_reward_curve_diff": curve_diff,
    }
    base_share = [p["daemon_core_share"] for p in bases if p.get("daemon_core_share") is not None]
    if base_share and all(p.get("daemon_cpu_s") is not None for p in loads) and status["ok"]:
        extra = sum(p["daemon_cpu_s"] - statistics.fmean(base_share) * p["wall_s"] for p in loads)
        out["daemon_cpu_us_per_status"] = max(0.0, extra) / status["ok"] * 1e6
        out["status_load_cores"] = (max(0.0, extra) + status["clients_cpu_s"]) / sum(p["wall_s"] for p in loads)
        cores = os.cpu_count() or 1
        daemon_cores = max(0.0, extra) / sum(p["wall_s"] for p in loads)
        out["cpu_bound"] = cores / max(cores - out["status_load_cores"], 1e-9)
        out["daemon_cpu_bound"] = cores / max(cores - daemon_cores, 1e-9)
    out["clients_cpu_us_per_status"] = status["clients_cpu_s"] / status["ok"] * 1e6 if status["ok"] else None
    return out


# ---------------------------------------------------------------- report


def print_report(
    phases: list[dict[str, Any]], status: dict[str, Any], summary: dict[str, Any], met: dict[str, bool]
) -> None:
    lat, svc = status["latency_ms"], status["service_ms"]
    st = Table(
        title=f"status calls while the jobs ran: {status['procs']} client processes, "
        f"target {status['target_per_s']:,.0f}/s, open-loop, CURVE"
    )
    for col in ("measure", "value", "target", "met"):
        st.add_column(col, justify="left" if col == "measure" else "right")
    st.add_row(
        "served per second",
        f"{status['achieved_per_s']:,.0f}",
        f">= {RATE_SLACK * status['target_per_s']:,.0f}",
        yes_no(met["rate"]),
    )
    st.add_row(f"offered / served in {status['window_s']:.1f} s", f"{status['offered']:,} / {status['ok']:,}", "", "")
    st.add_row("errors / timeouts", f"{status['errors']} / {status['timeouts']}", "0 / 0", yes_no(met["no_errors"]))
    for key in ("p50", "p90", "p99", "max"):
        if lat[key] is not None:
            st.add_row(f"latency {key} (from due; send to reply)", f"{lat[key]:.2f} ms; {svc[key]:.2f} ms", "", "")
    for call, stats in status["latency_ms_by_call"].items():
        if stats["p50"] is not None:
            st.add_row(f"  {call}: p50 / p99", f"{stats['p50']:.2f} / {stats['p99']:.2f} ms", "", "")
    if summary.get("daemon_cpu_us_per_status") is not None:
        st.add_row("daemon CPU per status call", f"{summary['daemon_cpu_us_per_status']:.0f} us", "", "")
    if summary.get("clients_cpu_us_per_status") is not None:
        st.add_row("client CPU per status call", f"{summary['clients_cpu_us_per_status']:.0f} us", "", "")
    if summary.get("status_load_cores") is not None:
        st.add_row(
            f"status load, daemon + clients (cores, of {os.cpu_count()})", f"{summary['status_load_cores']:.2f}", "", ""
        )
    console.print(st)
    jt = Table(
        title="the jobs' step time (mean step_s after warm-up), per phase; at its end, the jobs in the "
        "daemon's journal and the task spans it keeps"
    )
    for col in ("phase", *JOBS, "both", "wall s", "daemon core share", "machine busy cores", "jobs / task spans"):
        jt.add_column(col, justify="left" if col == "phase" else "right")
    for p in phases:
        share, busy = p.get("daemon_core_share"), p.get("machine_busy_cores")
        jt.add_row(
            p["phase"],
            *(f"{p['jobs'][job]['step_s_mean']:.4f}" for job in JOBS),
            f"{p['step_s_mean']:.4f}",
            f"{p['wall_s']:.1f}",
            "-" if share is None else f"{share:.0%}",
            "-" if busy is None else f"{busy:.2f}",
            f"{p['journal_jobs']} / {p['task_spans']}",
        )
    jt.add_row(
        "load / baselines beside it",
        *(f"{summary['per_job'][job]['ratio']:.3f}" for job in JOBS),
        f"{summary['ratio']:.3f}",
        "",
        "",
        "",
        "",
    )
    console.print(jt)
    pt = Table(title="a step's parts (both jobs' means): the generate call, the trainer's compute, the rest")
    for col in ("phase", "generate s", "train s", "rest s", "step s"):
        pt.add_column(col, justify="left" if col == "phase" else "right")
    for p in phases:
        pt.add_row(
            p["phase"], *(f"{p[key]:.4f}" for key in ("generate_s_mean", "train_s_mean", "rest_s_mean", "step_s_mean"))
        )
    parts = summary["parts_ratio"]
    pt.add_row(
        "load / baselines beside it",
        f"{parts['generate']:.3f}",
        f"{parts['train']:.3f}",
        f"{parts['rest']:.3f}",
        f"{summary['ratio']:.3f}",
    )
    console.print(pt)
    console.print(
        f"step time under load / without: {summary['ratio']:.3f}x (bound C/(C-L) <= "
        f"{summary.get('cpu_bound', float('nan')):.3f}x: {'met' if met['bound'] else 'not met'}; "
        f"<= {FIXED_BOUND:.2f}x: {'met' if met['fixed_bound'] else 'not met'}; the daemon's part alone "
        f"{summary.get('daemon_cpu_bound', float('nan')):.3f}x; medians {summary['median_ratio']:.3f}x); "
        f"slowest / fastest baseline (noise): {summary['control_ratio']:.3f}x; per-step rewards identical "
        f"in every phase: {summary['same_rewards']}"
    )


def yes_no(ok: bool) -> str:
    return "yes" if ok else "no"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few steps, one round: keeps the benchmark working")
    ap.add_argument("--steps", type=int, default=None, help="steps per job and phase (default 40, quick 6)")
    ap.add_argument("--warmup", type=int, default=None, help="steps of each job not timed (default 5, quick 2)")
    ap.add_argument(
        "--rounds", type=int, default=None, help="load phases, each between two baselines (default 2, quick 1)"
    )
    ap.add_argument("--rate", type=float, default=TARGET_RATE, help="status calls per second, all clients")
    ap.add_argument("--procs", type=int, default=8, help="status client processes (default 8)")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds a status call may take (default 2)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/status_load[-quick].json)")
    args = ap.parse_args(argv)
    steps = args.steps or (6 if args.quick else 40)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    rounds = args.rounds or (1 if args.quick else 2)
    if steps <= warmup or args.rate <= 0 or args.procs < 1 or args.timeout <= 0 or rounds < 1:
        ap.error("need --steps > --warmup, --rate > 0, --procs >= 1, --timeout > 0 and --rounds >= 1")
    load = Load(args.rate, args.procs, args.timeout)
    subprocess.run(
        [sys.executable, "-m", "plexctl.tiny_models", "--root", str(REPO / ".plexrl"), "--only", "tiny-arith"],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    overrides = [
        f"algo.steps={steps}",
        "algo.eval_every=0",
        "data.eval_path=null",
        "checkpoint.every=0",
        f"model.path={MODEL}",
    ]
    t0 = time.time()
    home = Path(tempfile.mkdtemp(prefix="plexrl-bench-status-"))
    with console.status("starting a local cluster"):
        up = plexctl(home, "up", "--local", "--model", str(MODEL))
    if up.returncode != 0:
        shutil.rmtree(home, ignore_errors=True)
        raise SystemExit(f"plexctl up failed: {up.stderr.strip()}")
    state_dir = home / "clusters" / "default"
    loads: list[StatusLoad] = []
    try:
        endpoint = read_endpoint(state_dir)
        client = Client(endpoint.address)
        phases = []
        for name, loaded in phase_names(rounds):
            status_load = StatusLoad(load, home, state_dir, list(JOBS)) if loaded else None
            loads += [status_load] if status_load is not None else []
            phases.append(run_phase(name, client, state_dir, overrides, warmup, status_load, endpoint.pid))
        client.close()
    finally:
        plexctl(home, "down", timeout=300)
        shutil.rmtree(home, ignore_errors=True)
    status = summarize_load(load, [part for sl in loads for part in sl.parts], sum(sl.window_s for sl in loads))
    summary = compare(phases, status)
    met = {
        "rate": status["achieved_per_s"] >= RATE_SLACK * load.rate,
        "no_errors": status["errors"] == 0 and status["timeouts"] == 0,
        "bound": summary["ratio"] <= summary.get("cpu_bound", FIXED_BOUND),
        "fixed_bound": summary["ratio"] <= FIXED_BOUND,
    }
    print_report(phases, status, summary, met)
    out = args.out or REPO / "bench" / "results" / ("status_load-quick.json" if args.quick else "status_load.json")
    write_json_atomic(
        out,
        {
            "benchmark": "status_load",
            "quick": args.quick,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": describe(),
            "load_avg": os.getloadavg(),
            "command": " ".join(["python", "bench/status_load.py", *(sys.argv[1:] if argv is None else argv)]),
            "jobs": {job: str(path.relative_to(REPO)) for job, path in JOBS.items()},
            "steps": steps,
            "warmup": warmup,
            "rounds": rounds,
            "targets": {
                "status_per_s": load.rate,
                "step_time_ratio_max": summary.get("cpu_bound", FIXED_BOUND),
                "step_time_ratio_fixed": FIXED_BOUND,
                "rate_slack": RATE_SLACK,
            },
            "met": met,
            "summary": summary,
            "status": status,
            "phases": phases,
            "wall_s": time.time() - t0,
        },
    )
    try:
        shown = out.resolve().relative_to(REPO)
    except ValueError:
        shown = out
    console.print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
