"""Benchmark: the engine bubbles of a tool-latency job, alone and beside another job.

One local cluster (one rollout + one trainer engine, real vLLM on CPU and torch + peft) on the
tiny-tool model. The *tool-latency* job is configs/tiny-tool.yaml with its calculator behind a
configured latency per call (``LatentPythonToolEnv`` below: the real python_tool step in the
sandbox, then a sleep up to ``latency_s``, as a remote tool or a slow sandbox would take), so
its driver waits on tools between the turns of every step while the engines have nothing to do.
Two phases on the same engines, one after the other:

- ``alone``: the tool-latency job by itself;
- ``shared``: the same job (same seed, same steps) while a *neighbour* job, configs/tiny-tool.yaml
  without latency, runs on the same engines; the neighbour starts first and is cancelled when the
  tool-latency job ends.

The bubble ratio of a phase is the idle share of engine time over the tool-latency job's wall
time (from its submit to its end): 1 - sum of engine busy-seconds in that window / (engines x
window), busy-seconds from ``plexctl status --json`` (the daemon's union of task intervals per
engine). Also reported: per-engine busy shares, the job's step time and tool-wait time, and the
neighbour's steps done inside the window (the work that filled the gaps). Every generate call
stays under vLLM's 4,096-token prefill budget (``EPISODES_PER_STEP``; see ``docs/benchmarks.md``).

Usage: ``python bench/tools.py [--quick] [--out FILE] [--latency S] [--steps N]``; writes
``bench/results/tools.json`` (``tools-quick.json`` with ``--quick``).
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from plexctl.envs.base import StepResult  # noqa: E402
from plexctl.envs.python_tool import PythonToolEnv  # noqa: E402

CONFIG = REPO / "configs" / "tiny-tool.yaml"
BENCH = str(REPO / "bench")
TERMINAL = ("succeeded", "failed", "cancelled")


class LatentPythonToolEnv(PythonToolEnv):
    """``python_tool`` whose every tool call takes at least ``latency_s`` seconds (final answers
    are scored at once). The wait happens in the driver's pool, so the calls of concurrent
    episodes overlap, up to ``env.workers`` at a time."""

    def __init__(self, latency_s: float = 0.0, **config: Any) -> None:
        super().__init__(**config)
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self.latency_s = latency_s

    def step(self, completion_text: str) -> StepResult:
        t0 = time.perf_counter()
        result = super().step(completion_text)
        if result.info.get("tool_call"):
            time.sleep(max(0.0, self.latency_s - (time.perf_counter() - t0)))
        return result


EPISODES_PER_STEP = 4 * 8  # prompts_per_step x group_size, for both jobs


def latency_job(steps: int, latency_s: float) -> list[str]:
    """Overrides on configs/tiny-tool.yaml: the tool-latency job."""
    return [
        "env.name=null",
        "env.cls=tools:LatentPythonToolEnv",
        f"env.path={BENCH}",
        f"env.config.latency_s={latency_s}",
        f"env.workers={EPISODES_PER_STEP}",
        "algo.prompts_per_step=4",
        f"algo.steps={steps}",
        "data.eval_path=null",
        "checkpoint.every=0",
        "seed=0",
    ]


NEIGHBOUR = ["algo.prompts_per_step=4", "algo.steps=100000", "data.eval_path=null", "checkpoint.every=0", "seed=1"]


def plexctl(home: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PLEXRL_HOME": str(home), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "plexctl.cli", *args],
        check=False,
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def submit(client: Any, overrides: list[str], name: str) -> str:
    from plexctl.common.spec import spec_to_wire
    from plexctl.spec_files import load_spec

    return client.submit(spec_to_wire(load_spec(CONFIG, overrides, name=name)), submit_id=uuid.uuid4().hex).job_id


def busy_now(client: Any) -> tuple[float, dict[str, float]]:
    """(daemon clock, busy-seconds per engine) from one status reply."""
    rep = client.status()
    return rep.now, {e.engine_id: e.busy_seconds for e in rep.engines}


def wait_until(client: Any, job_id: str, pred: Any, what: str, timeout: float = 1800, on_poll: Any = None) -> Any:
    """Poll the job until ``pred(info)``; exit if it ends first or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.status(job_id).jobs[0]
        if on_poll is not None:
            on_poll(info)
        if pred(info):
            return info
        if info.state in TERMINAL:
            raise SystemExit(f"job {info.name} ended ({info.state}: {info.error}) before {what}")
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what}")


def metrics(state_dir: Path, job_id: str) -> list[dict[str, Any]]:
    path = state_dir / "jobs" / job_id / "metrics.jsonl"
    return [r for r in (json.loads(line) for line in path.open()) if "reward_mean" in r]


def run_phase(client: Any, state_dir: Path, phase: str, steps: int, latency_s: float) -> dict[str, Any]:
    from rich.console import Console

    neighbour = None
    if phase == "shared":  # the neighbour is warm and stepping before the window opens
        neighbour = submit(client, NEIGHBOUR, "neighbour")
        wait_until(client, neighbour, lambda j: j.step >= 2, "the neighbour's first steps")
    t0, busy0 = busy_now(client)
    n0 = client.status(neighbour).jobs[0].step if neighbour else 0
    job = submit(client, latency_job(steps, latency_s), f"tool-latency-{phase}")
    with Console(stderr=True).status(f"{phase}: tool-latency job") as spinner:
        info = wait_until(
            client,
            job,
            lambda j: j.state in TERMINAL,
            "the end",
            on_poll=lambda j: spinner.update(f"{phase}: tool-latency job, step {j.step}/{steps}"),
        )
    t1, busy1 = busy_now(client)
    n1 = 0
    if neighbour:
        n1 = client.status(neighbour).jobs[0].step
        client.cancel(neighbour)
        wait_until(client, neighbour, lambda j: j.state in TERMINAL, "the neighbour's cancel")
    if info.state != "succeeded":
        raise SystemExit(f"{phase}: the tool-latency job {info.state}: {info.error}")
    window = t1 - t0
    busy = {e: busy1[e] - busy0.get(e, 0.0) for e in busy1}
    rows = metrics(state_dir, job)
    episodes = EPISODES_PER_STEP * len(rows)
    return {
        "phase": phase,
        "window_s": window,
        "engines": len(busy),
        "bubble_ratio": 1.0 - sum(busy.values()) / (len(busy) * window),
        "engine_busy_share": {e: b / window for e, b in busy.items()},
        "job": {
            "steps": info.step,
            "run_s": info.ended_at - info.started_at,
            "step_s": sum(r["step_s"] for r in rows) / len(rows),
            "episodes_s": sum(r["generate_s"] for r in rows) / len(rows),  # generation and tool waits
            "train_s": sum(r["train/seconds"] for r in rows) / len(rows),
            "tool_calls_per_episode": sum(r["env/tool_calls"] for r in rows) / episodes,
            "reward_first": rows[0]["reward_mean"],
            "reward_last": rows[-1]["reward_mean"],
        },
        "neighbour_steps_in_window": n1 - n0 if neighbour else None,
    }


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from plexctl.common.atomic import write_json_atomic
    from plexctl.common.client import Client
    from plexctl.common.cluster import read_endpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 steps, 0.5 s latency: keeps the benchmark working")
    ap.add_argument("--steps", type=int, default=20, help="steps of the tool-latency job")
    ap.add_argument("--latency", type=float, default=1.0, help="seconds per tool call")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: bench/results/...)")
    args = ap.parse_args(argv)
    steps, latency = (5, 0.5) if args.quick else (args.steps, args.latency)
    console = Console()
    subprocess.run(
        [sys.executable, "-m", "plexctl.tiny_models", "--root", str(REPO / ".plexrl"), "--only", "tiny-tool"],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    model = REPO / ".plexrl" / "models" / "tiny-tool"
    home = Path(tempfile.mkdtemp(prefix="plexrl-bench-tools-"))
    up = plexctl(home, "up", "--local", "--model", str(model))
    if up.returncode != 0:
        raise SystemExit(f"plexctl up failed: {up.stderr}")
    state_dir = home / "clusters" / "default"
    client = Client(read_endpoint(state_dir).address)
    try:
        phases = {p: run_phase(client, state_dir, p, steps, latency) for p in ("alone", "shared")}
        daemon_bubble = client.status().bubble_ratio
    finally:
        plexctl(home, "down")
    alone, shared = phases["alone"], phases["shared"]
    table = Table(
        title=f"tool-latency job, {steps} steps, {latency:g} s per tool call: bubble = idle share of "
        "1 rollout + 1 trainer engine over its run; nbr = neighbour job"
    )
    for col in ("phase", "bubble", "rollout busy", "trainer busy", "run s", "step s", "calls/ep", "nbr steps"):
        table.add_column(col, justify="right")
    for name, r in phases.items():
        share = r["engine_busy_share"]
        rollout = next((v for k, v in share.items() if "rollout" in k), 0.0)
        trainer = next((v for k, v in share.items() if "trainer" in k), 0.0)
        table.add_row(
            name,
            f"{r['bubble_ratio']:.1%}",
            f"{rollout:.1%}",
            f"{trainer:.1%}",
            f"{r['job']['run_s']:.1f}",
            f"{r['job']['step_s']:.2f}",
            f"{r['job']['tool_calls_per_episode']:.2f}",
            "-" if r["neighbour_steps_in_window"] is None else str(r["neighbour_steps_in_window"]),
        )
    console.print(table)
    summary = {
        "bubble_alone": alone["bubble_ratio"],
        "bubble_shared": shared["bubble_ratio"],
        "gaps_filled": (alone["bubble_ratio"] - shared["bubble_ratio"]) / alone["bubble_ratio"]
        if alone["bubble_ratio"] > 0
        else 0.0,
        "job_slowdown_shared": shared["job"]["run_s"] / alone["job"]["run_s"],
        "daemon_bubble_ratio_lifetime": daemon_bubble,
    }
    console.print(
        f"bubble alone {summary['bubble_alone']:.1%} -> shared {summary['bubble_shared']:.1%} "
        f"({summary['gaps_filled']:.0%} of the idle engine time filled); the tool-latency job ran "
        f"{summary['job_slowdown_shared']:.2f}x as long beside the neighbour"
    )
    out = args.out or REPO / "bench" / "results" / ("tools-quick.json" if args.quick else "tools.json")
    write_json_atomic(
        out,
        {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": describe(),
            "quick": args.quick,
            "steps": steps,
            "latency_s": latency,
            "summary": summary,
            "phases": phases,
        },
    )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
