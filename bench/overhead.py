"""Benchmark: what the daemon costs one job. The same GRPO loop, on the same engines, run

- ``in-process``: the loop calls a vLLM ``RolloutEngine`` and a torch ``TrainerEngine`` built in
  its own process (no daemon, no sockets, no serialisation, no scheduler);
- ``daemon``: ``plexctl up --local --workers 1`` (both engines in one worker process, as
  in-process) and the job submitted through the CLI (driver process, ZeroMQ, msgpack, the
  scheduler, the state store).

Both modes run ``configs/tiny-arith.yaml`` with the same seed for ``--steps`` steps; the step
time is the mean of the job's own ``step_s`` after ``--warmup`` steps (engine start-up and
the first compilations are excluded from both). Reported: each mode's step time, the overhead
``daemon / in-process - 1`` (target <= 5 %), and whether the two runs' per-step rewards are
identical (they should be: same samples, same updates).

Usage: ``python bench/overhead.py [--quick] [--steps N]``; writes
``bench/results/overhead.json`` (``overhead-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plexctl import protocol as P  # noqa: E402
from plexctl.atomic import write_json_atomic  # noqa: E402
from plexctl.spec import load_spec  # noqa: E402

CONFIG = REPO / "configs" / "tiny-arith.yaml"
MODEL = REPO / ".plexrl" / "models" / "tiny-arith"


class InProcessClient:
    """``JobClient``'s calls served by engines in this process (what a one-job script does)."""

    def __init__(self, rollout: Any, trainer: Any, spec: Any, job_id: str, job_dir: Path) -> None:
        self.rollout, self.trainer, self.spec = rollout, trainer, spec
        self.job_id, self.job_dir = job_id, job_dir
        self.drain = ""
        self.version = 0
        self.adapter: P.AdapterRef | None = None
        self._replies: dict[int, Any] = {}
        self._ids = iter(range(1, 1 << 62))
        lora = P.LoraConfig(**msgspec.to_builtins(spec.lora))
        trainer.ensure_job(job_id, lora, spec.seed)

    def generate_async(self, prompts: list[str], sampling: P.Sampling) -> int:
        req = P.GenRequest(job_id=self.job_id, prompts=prompts, sampling=sampling, adapter=self.adapter)
        msg_id = next(self._ids)
        self._replies[msg_id] = {"completions": self.rollout.generate([req])[0], "policy_version": self.version}
        return msg_id

    def wait(self, msg_id: int) -> Any:
        return self._replies.pop(msg_id)

    def completions(self, reply: Any) -> list[P.Completion]:
        return reply["completions"]

    def generate(self, prompts: list[str], sampling: P.Sampling) -> list[P.Completion]:
        return self.completions(self.wait(self.generate_async(prompts, sampling)))

    def train_step(self, batch: P.TrainBatch, hp: P.TrainHParams | None = None, **changes: Any) -> dict[str, float]:
        hp = msgspec.structs.replace(hp or P.TrainHParams(), **changes)
        return self.trainer.train_step(self.job_id, batch, hp)

    def train_and_publish(self, batch: P.TrainBatch, hp: P.TrainHParams | None = None) -> tuple[dict[str, float], int]:
        return self.train_step(batch, hp), self.publish()

    def publish(self) -> int:
        self.version += 1
        out = self.job_dir / "adapters" / f"v{self.version:06d}"
        self.trainer.save_adapter(self.job_id, str(out))
        self.adapter = P.AdapterRef(self.job_id, self.version, str(out))
        return self.version

    def checkpoint(self, step: int, extra: dict[str, Any]) -> str:
        out = self.job_dir / "ckpt" / f"step-{step:06d}"
        self.trainer.save_checkpoint(self.job_id, str(out), extra)
        return str(out)

    def restore(self) -> None:
        return None

    def report(self, event: str, step: int, metrics: dict[str, float], message: str = "") -> None:
        pass


def steps_of(metrics_path: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics_path.read_text().splitlines()) if "reward_mean" in r]


def run_in_process(overrides: list[str], work: Path) -> list[dict]:
    from plexctl.algos import run_algorithm
    from plexctl.rl import Job
    from worker.rollout import RolloutEngine
    from worker.trainer import TrainerEngine

    spec = load_spec(CONFIG, overrides, "overhead")
    trainer = TrainerEngine(str(MODEL), threads=os.cpu_count() or 1)
    rollout = RolloutEngine(str(MODEL), max_loras=4, max_cpu_loras=8)
    try:
        job_dir = work / "in-process"
        job_dir.mkdir(parents=True)
        job = Job(InProcessClient(rollout, trainer, spec, "j0001", job_dir), spec, job_dir, log=lambda _m: None)
        try:
            run_algorithm(job)
        finally:
            job.close()
        return steps_of(job_dir / "metrics.jsonl")
    finally:
        rollout.close()


def run_daemon(overrides: list[str], work: Path) -> list[dict]:
    env = {**os.environ, "PLEXRL_HOME": str(work / "home"), "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "plexctl.cli"]

    def plexctl(*args: str) -> str:
        return subprocess.run([*cli, *args], env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout

    plexctl("up", "--local", "--workers", "1", "--model", str(MODEL))
    try:
        sets = [a for o in overrides for a in ("--set", o)]
        job = plexctl("submit", str(CONFIG), "-q", "--name", "overhead", *sets).strip()
        plexctl("wait", job, "--timeout", "1800")
        return steps_of(work / "home" / "clusters" / "default" / "jobs" / job / "metrics.jsonl")
    finally:
        subprocess.run([*cli, "down"], env=env, cwd=REPO, capture_output=True, timeout=300)


def mean_step(rows: list[dict], warmup: int) -> float:
    times = [r["step_s"] for r in rows[warmup:]]
    return sum(times) / len(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few steps, to keep the benchmark working")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/overhead[-quick].json)")
    args = ap.parse_args(argv)
    steps = args.steps or (6 if args.quick else 80)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    subprocess.run([sys.executable, "-m", "worker.tiny", "--root", str(REPO / ".plexrl")], cwd=REPO, check=True,
                   capture_output=True)
    overrides = [f"algo.steps={steps}", "algo.eval_every=0", "checkpoint.every=0", f"model.path={MODEL}"]
    if args.quick:
        overrides += ["data.eval_path=null"]
    with tempfile.TemporaryDirectory(prefix="plexrl-overhead-") as tmp:
        t0 = time.time()
        inproc = run_in_process(overrides, Path(tmp))
        daemon = run_daemon(overrides, Path(tmp))
    a, b = mean_step(inproc, warmup), mean_step(daemon, warmup)
    same = [r["reward_mean"] for r in inproc] == [r["reward_mean"] for r in daemon]
    result = {
        "benchmark": "overhead", "quick": args.quick, "steps": steps, "warmup": warmup,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/overhead.py" + (" --quick" if args.quick else ""),
        "in_process_step_s": a, "daemon_step_s": b, "overhead": b / a - 1.0, "target": 0.05,
        "same_rewards": same, "wall_s": time.time() - t0,
    }
    table = Table(title="one job: through the daemon vs in one process (same engines, same loop)")
    for col in ("mode", "mean step s", "steps timed"):
        table.add_column(col)
    table.add_row("in-process", f"{a:.4f}", str(len(inproc) - warmup))
    table.add_row("daemon", f"{b:.4f}", str(len(daemon) - warmup))
    Console().print(table)
    print(f"overhead {result['overhead']:+.1%} (target <= +5%); per-step rewards identical: {same}")
    out = args.out or REPO / "bench" / "results" / ("overhead-quick.json" if args.quick else "overhead.json")
    write_json_atomic(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
