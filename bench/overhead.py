"""Benchmark: what the daemon costs one job. The same GRPO loop, on the same engines, run

- ``in-process``: the loop calls a vLLM ``RolloutEngine`` and a torch ``TrainerEngine`` built in
  its own process (no daemon, no sockets, no serialisation, no scheduler);
- ``daemon``: ``plexctl up --local --workers 1`` (both engines in one worker process, as
  in-process) and the job submitted through the CLI (driver process, ZeroMQ, msgpack, the
  scheduler, the state store).

Both modes run ``configs/tiny-arith.yaml`` with the same seed for ``--steps`` steps. A mode's
step time is the median interval between consecutive steps' metrics rows after ``--warmup``
steps: what a user waits per step, record and bookkeeping included; engine start-up and the
first compilations are excluded from both. The in-process loop generates when it waits for
the samples (a one-process script has nothing to overlap with), so each row's
``generate_s`` is comparable between the modes.

Shared machines are noisy (single runs of the same mode differ by 10-30 % here, in spells of
seconds to minutes), so both modes stay up and run ``--repeat`` times, alternating (``in,
daemon``, then ``daemon, in``, ...). Reported: each mode's step time, the median of its runs'
step times, and ``overhead = daemon / in-process - 1`` of those (target <= 5 %); each mode's
median generate, train and rest-of-step time; every pair's own ratio (a slow spell on one run
of a pair moves that ratio by as much as the spell: their median is shown beside, not used);
and whether every run's per-step rewards are identical (they should be: same samples, same
updates).

Usage: ``python bench/overhead.py [--quick] [--steps N] [--repeat N]``; writes
``bench/results/overhead.json`` (``overhead-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from plexctl import protocol as P  # noqa: E402
from plexctl.atomic import write_json_atomic  # noqa: E402
from plexctl.spec import load_spec  # noqa: E402

CONFIG = REPO / "configs" / "tiny-arith.yaml"
MODEL = REPO / ".plexrl" / "models" / "tiny-arith"
MODES = ("in-process", "daemon")


class InProcessClient:
    """``JobClient``'s calls served by engines in this process (what a one-job script does)."""

    def __init__(self, rollout: Any, trainer: Any, spec: Any, job_id: str, job_dir: Path) -> None:
        self.rollout, self.trainer, self.spec = rollout, trainer, spec
        self.job_id, self.job_dir = job_id, job_dir
        self.drain = ""
        self.version = 0
        self.adapter: P.AdapterRef | None = None
        self._requests: dict[int, tuple[P.GenRequest, int]] = {}
        self._ids = iter(range(1, 1 << 62))
        lora = P.LoraConfig(**msgspec.to_builtins(spec.lora))
        trainer.ensure_job(job_id, lora, spec.seed)

    def generate_async(self, prompts: list[str], sampling: P.Sampling) -> int:
        msg_id = next(self._ids)
        req = P.GenRequest(job_id=self.job_id, prompts=prompts, sampling=sampling, adapter=self.adapter)
        self._requests[msg_id] = (req, self.version)
        return msg_id

    def wait(self, msg_id: int) -> Any:
        """Generate now: one process does one thing at a time."""
        req, version = self._requests.pop(msg_id)
        return {"completions": self.rollout.generate([req])[0], "policy_version": version}

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


class InProcess:
    """Engines built once in this process; each ``run`` is a fresh job on them."""

    def __init__(self, work: Path) -> None:
        from worker.rollout import RolloutEngine
        from worker.trainer import TrainerEngine

        self.work = work
        self.trainer = TrainerEngine(str(MODEL), threads=os.cpu_count() or 1)
        self.rollout = RolloutEngine(str(MODEL), max_loras=4, max_cpu_loras=8)
        self.runs = 0

    def run(self, overrides: list[str]) -> list[dict]:
        from plexctl.algos import run_algorithm
        from plexctl.rl import Job

        self.runs += 1
        job_id = f"j{self.runs:04d}"
        spec = load_spec(CONFIG, overrides, "overhead")
        job_dir = self.work / "in-process" / job_id
        job_dir.mkdir(parents=True)
        job = Job(InProcessClient(self.rollout, self.trainer, spec, job_id, job_dir), spec, job_dir,
                  log=lambda _m: None)
        try:
            run_algorithm(job)
        finally:
            job.close()
            self.trainer.release(job_id)
            self.rollout.drop_job(job_id)
        return steps_of(job_dir / "metrics.jsonl")

    def close(self) -> None:
        self.rollout.close()


class Daemon:
    """``plexctl up --local --workers 1`` once; each ``run`` submits the job and waits for it."""

    def __init__(self, work: Path) -> None:
        self.home = work / "home"
        self.env = {**os.environ, "PLEXRL_HOME": str(self.home), "PYTHONPATH": str(REPO)}
        self.plexctl("up", "--local", "--workers", "1", "--model", str(MODEL))
        self.runs = 0

    def plexctl(self, *args: str) -> str:
        return subprocess.run([sys.executable, "-m", "plexctl.cli", *args], env=self.env, cwd=REPO,
                              capture_output=True, text=True, check=True).stdout

    def run(self, overrides: list[str]) -> list[dict]:
        self.runs += 1
        sets = [a for o in overrides for a in ("--set", o)]
        job = self.plexctl("submit", str(CONFIG), "-q", "--name", f"overhead-{self.runs}", *sets).strip()
        self.plexctl("wait", job, "--timeout", "1800")
        return steps_of(self.home / "clusters" / "default" / "jobs" / job / "metrics.jsonl")

    def close(self) -> None:
        subprocess.run([sys.executable, "-m", "plexctl.cli", "down"], env=self.env, cwd=REPO,
                       capture_output=True, timeout=300)


def timing(rows: list[dict], warmup: int) -> dict[str, float]:
    """Median step interval (from the rows' wall times), mean ``step_s``; median generate time,
    the trainer's own time in its step (``train/seconds``) and the rest (scoring, publishing,
    calls and bookkeeping)."""
    timed = rows[warmup:]
    intervals = [b["time"] - a["time"] for a, b in zip(rows[warmup - 1:], timed)] if warmup else \
        [r["step_s"] for r in timed]
    gen = statistics.median(r["generate_s"] for r in timed)
    train = statistics.median(r.get("train/seconds", 0.0) for r in timed)
    step = statistics.median(intervals)
    return {"step_s": step, "step_s_mean": statistics.fmean(r["step_s"] for r in timed),
            "generate_s": gen, "train_s": train, "rest_s": step - gen - train, "steps_timed": len(timed)}


def alternate(runners: dict[str, Callable[[], list[dict]]], repeat: int, warmup: int,
              log: Callable[[str], None]) -> tuple[list[dict[str, dict]], list[list[float]]]:
    """``repeat`` pairs of runs, the order alternating; each run's timing and reward curve."""
    pairs, curves = [], []
    for i in range(repeat):
        order = MODES if i % 2 == 0 else MODES[::-1]
        pair = {}
        for mode in order:
            rows = runners[mode]()
            pair[mode] = timing(rows, warmup)
            curves.append([r["reward_mean"] for r in rows])
            log(f"pair {i + 1}/{repeat} {mode}: {pair[mode]['step_s']:.4f} s/step")
        pairs.append(pair)
    return pairs, curves


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few steps, to keep the benchmark working")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=None, help="pairs of runs, alternating (default 7; --quick 1)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/overhead[-quick].json)")
    args = ap.parse_args(argv)
    steps = args.steps or (6 if args.quick else 60)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    repeat = args.repeat or (1 if args.quick else 7)
    if steps <= warmup + 1 or repeat < 1:
        ap.error("--steps must exceed --warmup + 1 and --repeat must be >= 1")
    subprocess.run([sys.executable, "-m", "worker.tiny", "--root", str(REPO / ".plexrl"), "--only", "tiny-arith"],
                   cwd=REPO, check=True, capture_output=True)
    overrides = [f"algo.steps={steps}", "algo.eval_every=0", "checkpoint.every=0", f"model.path={MODEL}"]
    if args.quick:
        overrides += ["data.eval_path=null"]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="plexrl-overhead-") as tmp:
        inproc, daemon = InProcess(Path(tmp)), Daemon(Path(tmp))
        try:
            pairs, curves = alternate({"in-process": lambda: inproc.run(overrides),
                                       "daemon": lambda: daemon.run(overrides)}, repeat, warmup,
                                      lambda m: print(m, flush=True))
        finally:
            daemon.close()
            inproc.close()
    ratios = [p["daemon"]["step_s"] / p["in-process"]["step_s"] for p in pairs]
    same = all(c == curves[0] for c in curves)
    phases = {m: {k: statistics.median(p[m][k] for p in pairs) for k in ("step_s", "generate_s", "train_s", "rest_s")}
              for m in MODES}
    a, b = phases["in-process"]["step_s"], phases["daemon"]["step_s"]
    result = {
        "benchmark": "overhead", "quick": args.quick, "steps": steps, "warmup": warmup, "repeat": repeat,
        "machine": describe(), "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/overhead.py" + (" --quick" if args.quick else ""),
        "in_process_step_s": a, "daemon_step_s": b, "overhead": b / a - 1.0, "target": 0.05,
        "pairs": [{**p, "overhead": r - 1.0} for p, r in zip(pairs, ratios)], "phases_median": phases,
        "pair_overhead_median": statistics.median(ratios) - 1.0,
        "same_rewards": same, "wall_s": time.time() - t0,
    }
    table = Table(title="one job: through the daemon vs in one process (same engines, same loop)")
    for col in ("pair", "in-process s/step", "daemon s/step", "overhead"):
        table.add_column(col)
    for i, (p, r) in enumerate(zip(pairs, ratios)):
        table.add_row(str(i + 1), f"{p['in-process']['step_s']:.4f}", f"{p['daemon']['step_s']:.4f}", f"{r - 1:+.1%}")
    table.add_row("median", f"{a:.4f}", f"{b:.4f}", f"{b / a - 1:+.1%}")
    Console().print(table)
    for m in MODES:
        ph = phases[m]
        print(f"{m}: median step {ph['step_s']:.4f} s = generate {ph['generate_s']:.4f} + train "
              f"{ph['train_s']:.4f} + rest {ph['rest_s']:.4f}")
    print(f"overhead {result['overhead']:+.1%} (each mode's median of {repeat} runs; target <= +5%; median of the "
          f"pairs' own ratios {result['pair_overhead_median']:+.1%}); "
          f"per-step rewards identical in every run: {same}")
    out = args.out or REPO / "bench" / "results" / ("overhead-quick.json" if args.quick else "overhead.json")
    write_json_atomic(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
