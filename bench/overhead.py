"""Benchmark: what the daemon costs one job. The same GRPO loop, on the same engines, run

- ``in-process``: the loop's calls go through ``daemon.inproc.InprocClient``, the daemon's core and
  a worker's servers built in this process (no daemon process, no sockets, no serialisation);
- ``daemon``: ``plexctl up --local --workers 1`` and the job submitted through the CLI (driver
  process, ZeroMQ, msgpack, the scheduler, the state store).

Both modes run ``configs/tiny-arith.yaml`` with the same seed for ``--steps`` steps, as two jobs
that take turns of ``--block`` steps (the other one paused meanwhile), so both meet the machine's
slow and fast spells alike; a step counts from ``--settle`` seconds into its turn, after
``--warmup`` steps. Reported: each mode's median step time and
``overhead = daemon / in-process - 1`` (target <= 5 %); each mode's median generate, train and
rest-of-step time; adjacent turns' own ratios; and whether both jobs' per-step rewards are
identical (same samples, same updates). Method: ``docs/benchmarks.md``.

Usage: ``python bench/overhead.py [--quick] [--steps N] [--block N] [--set KEY=VALUE]``; writes
``bench/results/overhead.json`` (``overhead-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from plexctl.common.atomic import write_json_atomic  # noqa: E402
from plexctl.spec_files import load_spec  # noqa: E402

CONFIG = REPO / "configs" / "tiny-arith.yaml"
MODEL = REPO / ".plexrl" / "models" / "tiny-arith"
MODES = ("in-process", "daemon")


class Turnstile:
    """Lets the in-process loop generate ``n`` times per turn (a GRPO step generates once); the
    bench's thread waits for the turn's end without polling (the loop's process has nothing
    else to do)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.budget = 0
        self.waiting = False
        self.finished = False
        self.aborted = False

    def wait(self) -> None:
        """The loop, before each generation: go on while the turn lasts, else wait for the next."""
        with self.cond:
            while self.budget == 0:
                if self.aborted:
                    raise RuntimeError("the bench stopped")
                self.waiting = True
                self.cond.notify_all()
                self.cond.wait()
            self.waiting = False
            self.budget -= 1

    def abort(self) -> None:
        """The bench failed: the loop stops at its next generation."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def finish(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def turn(self, n: int) -> None:
        """Let ``n`` generations through; return when the loop waits for more, or ended."""
        with self.cond:
            self.budget, self.waiting = n, False
            self.cond.notify_all()
            self.cond.wait_for(lambda: (self.waiting and self.budget == 0) or self.finished)


def steps_of(metrics_path: Path) -> list[dict]:
    try:
        text = metrics_path.read_text()
    except FileNotFoundError:
        return []
    return [r for r in map(json.loads, text.splitlines()) if "reward_mean" in r]


class StepCounter:
    """Steps a job's ``metrics.jsonl`` holds, read incrementally (the bench polls it while the
    jobs run: a poll must cost next to nothing)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.count, self.tail = path, 0, 0, b""

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        self.offset += len(data)
        lines = (self.tail + data).split(b"\n")
        self.tail = lines.pop()
        self.count += sum(1 for line in lines if b'"reward_mean"' in line)
        return self.count


class InProcess:
    """Engines built once in this process; the job's loop runs on its main thread (``run``), as a
    one-job script's would, generating only while the bench's thread lets it (``turn``).

    The main thread, where the engines were built, not another: vLLM's CPU worker binds the
    OpenMP team of the thread that builds it to the cores, and torch ops on another thread get
    an unbound team of their own. Here, with the engine built, the trainer's step on another
    thread took 7-10 % longer than on the main thread; the worker runs both engines on its
    main thread."""

    def __init__(self, work: Path) -> None:
        from worker.rollout import RolloutEngine
        from worker.trainer import TrainerEngine

        self.work = work
        self.trainer = TrainerEngine(str(MODEL), threads=os.cpu_count() or 1)
        self.rollout = RolloutEngine(str(MODEL), max_loras=4, max_cpu_loras=8)
        self.gate = Turnstile()
        self.metrics = work / "in-process" / "metrics.jsonl"
        self.steps = StepCounter(self.metrics)
        self.error: BaseException | None = None
        self.finished = False

    def run(self, overrides: list[str]) -> None:
        """The job's loop, on the calling thread, to its end (or the bench's abort)."""
        from daemon.inproc import InprocClient
        from plexctl.algos import run_algorithm
        from plexctl.rl import Job

        spec = load_spec(CONFIG, overrides, "overhead")
        job_dir = self.metrics.parent
        job_dir.mkdir(parents=True)
        client = InprocClient(self.rollout, self.trainer, spec, job_dir, before_generate=self.gate.wait)
        job = Job(client, spec, job_dir, log=lambda _m: None)
        try:
            run_algorithm(job)
        except BaseException as exc:  # noqa: BLE001 - raised in the bench's thread by ``done``
            self.error = exc
        finally:
            job.close()
            client.close()
            self.finished = True
            self.gate.finish()

    def rows(self) -> list[dict]:
        return steps_of(self.metrics)

    def done(self) -> bool:
        if self.error is not None:
            raise RuntimeError(f"the in-process job failed: {self.error!r}") from self.error
        return self.finished

    def turn(self, n: int) -> None:
        self.gate.turn(n)
        self.done()  # raises if the loop failed

    def close(self) -> None:
        self.rollout.close()


class Daemon:
    """``plexctl up --local --workers 1`` once; the job submitted through the CLI; its driver
    stopped (``SIGSTOP``) while the other mode runs."""

    def __init__(self, work: Path) -> None:
        self.home = work / "home"
        self.env = {**os.environ, "PLEXRL_HOME": str(self.home), "PYTHONPATH": str(REPO)}
        self.plexctl("up", "--local", "--workers", "1", "--model", str(MODEL))
        self.job = ""
        self.pid = 0
        self.steps: Callable[[], int] = lambda: 0  # the job's StepCounter, once submitted

    def plexctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "plexctl.cli", *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            check=check,
        )

    @property
    def job_dir(self) -> Path:
        return self.home / "clusters" / "default" / "jobs" / self.job

    def start(self, overrides: list[str]) -> None:
        sets = [a for o in overrides for a in ("--set", o)]
        self.job = self.plexctl("submit", str(CONFIG), "-q", "--name", "overhead", *sets).stdout.strip()
        deadline = time.time() + 120
        while not self.pid:
            try:
                self.pid = int(json.loads((self.job_dir / "driver.pid").read_text())["pid"])
            except (OSError, ValueError, KeyError):
                if time.time() > deadline:
                    raise RuntimeError(f"job {self.job}: no driver started") from None
                time.sleep(0.05)
        self.steps = StepCounter(self.job_dir / "metrics.jsonl")

    def rows(self) -> list[dict]:
        return steps_of(self.job_dir / "metrics.jsonl")

    def done(self) -> bool:
        try:
            os.kill(self.pid, 0)
            return False
        except ProcessLookupError:
            return True

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def turn(self, n: int) -> None:
        """Let the driver run until its job recorded ``n`` more steps (or ended), then stop it."""
        goal = self.steps() + n
        self.resume()
        while self.steps() < goal and not self.done():
            time.sleep(0.01)
        self.pause()

    def finish(self) -> None:
        self.resume()
        done = self.plexctl("wait", self.job, "--timeout", "1800", check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"the daemon's job ended with exit code {done.returncode}: "
                f"{(self.job_dir / 'driver.log').read_text()[-2000:]}"
            )

    def close(self) -> None:
        self.resume()
        subprocess.run(
            [sys.executable, "-m", "plexctl.cli", "down"], env=self.env, cwd=REPO, capture_output=True, timeout=300
        )


def take_turns(
    modes: dict[str, Any], steps: int, block: int, log: Callable[[str], None]
) -> list[tuple[str, float, float]]:
    """Run the modes' jobs in turns of ``block`` steps (daemon first) until both finished;
    the turns as ``(mode, start, end)`` wall times."""
    turns: list[tuple[str, float, float]] = []
    order = list(modes)
    i = 0
    while True:
        live = [m for m in order if modes[m].steps() < steps and not modes[m].done()]
        if not live:
            return turns
        mode = order[i % len(order)] if order[i % len(order)] in live else live[0]
        i += 1
        t0 = time.time()
        modes[mode].turn(block)
        turns.append((mode, t0, time.time()))
        if len(turns) % 10 == 0:
            log(f"turn {len(turns)}: " + ", ".join(f"{m} {modes[m].steps()}/{steps}" for m in order))


def counted(
    rows: list[dict], turns: list[tuple[str, float, float]], mode: str, warmup: int, settle: float
) -> list[tuple[int, dict, float]]:
    """The steps of ``mode`` that count, as ``(turn index, row, step interval)``: past the
    warmup, started ``settle`` seconds or more into one of the mode's turns, ended in it."""
    out = []
    own = [(k, a, b) for k, (m, a, b) in enumerate(turns) if m == mode]
    for prev, row in zip(rows[warmup:], rows[warmup + 1 :]):
        for k, a, b in own:
            if a + settle <= prev["time"] and row["time"] <= b:
                out.append((k, row, row["time"] - prev["time"]))
                break
    return out


def phases(steps: list[tuple[int, dict, float]]) -> dict[str, float]:
    step = statistics.median(s for _, _, s in steps)
    gen = statistics.median(r["generate_s"] for _, r, _ in steps)
    train = statistics.median(r.get("train/seconds", 0.0) for _, r, _ in steps)
    return {
        "step_s": step,
        "generate_s": gen,
        "train_s": train,
        "rest_s": step - gen - train,
        "steps_timed": len(steps),
    }


def block_pairs(timed: dict[str, list[tuple[int, dict, float]]]) -> list[dict[str, Any]]:
    """Adjacent turns of the two modes, each turn's median step: the daemon's turn ``k`` with
    the in-process turn after it."""
    per_turn = {m: {} for m in timed}
    for m, steps in timed.items():
        for k, _, s in steps:
            per_turn[m].setdefault(k, []).append(s)
    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in per_turn.items()}
    pairs = []
    for k, d in sorted(med["daemon"].items()):
        nxt = [j for j in med["in-process"] if j > k]
        if nxt:
            i = min(nxt)
            pairs.append(
                {
                    "daemon_step_s": d,
                    "in_process_step_s": med["in-process"][i],
                    "overhead": d / med["in-process"][i] - 1.0,
                }
            )
    return pairs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few steps, to keep the benchmark working")
    ap.add_argument("--steps", type=int, default=None, help="steps of each mode's job (default 250; --quick 12)")
    ap.add_argument("--block", type=int, default=None, help="steps per turn (default 12; --quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="first steps of each job not counted (default 10)")
    ap.add_argument("--settle", type=float, default=0.3, help="seconds into a turn before a step counts")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a job spec override for both modes (e.g. algo.prompts_per_step=64: longer steps)",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/overhead[-quick].json)")
    args = ap.parse_args(argv)
    steps = args.steps or (12 if args.quick else 250)
    block = args.block or (4 if args.quick else 12)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    if steps <= warmup + 1 or block < 2:
        ap.error("--steps must exceed --warmup + 1 and --block must be >= 2")
    subprocess.run(
        [sys.executable, "-m", "plexctl.tiny_models", "--root", str(REPO / ".plexrl"), "--only", "tiny-arith"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    overrides = [
        f"algo.steps={steps}",
        "algo.eval_every=0",
        "checkpoint.every=0",
        f"model.path={MODEL}",
        "data.eval_path=null",
        *args.sets,
    ]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="plexrl-overhead-") as tmp:
        inproc, daemon = InProcess(Path(tmp)), Daemon(Path(tmp))
        modes = {"daemon": daemon, "in-process": inproc}
        turns: list[tuple[str, float, float]] = []
        failed: list[BaseException] = []

        def control() -> None:
            """The bench's thread: the turns, then the daemon's job to its end."""
            try:
                turns.extend(take_turns(modes, steps, block, lambda m: print(m, flush=True)))
                daemon.finish()
            except BaseException as exc:  # noqa: BLE001 - raised below, on the main thread
                failed.append(exc)
                inproc.gate.abort()

        try:
            daemon.start(overrides)
            daemon.pause()
            controller = threading.Thread(target=control, name="bench-turns", daemon=True)
            controller.start()
            inproc.run(overrides)  # the in-process job, on this thread, while the controller lets it
            controller.join()
            if failed:
                raise failed[0]
            inproc.done()  # raises if the in-process job failed
            rows = {m: modes[m].rows() for m in MODES}
        finally:
            daemon.close()
            inproc.close()
    timed = {m: counted(rows[m], turns, m, warmup, args.settle) for m in MODES}
    for m in MODES:
        if not timed[m]:  # a short run: every step of the mode's own turns
            timed[m] = counted(rows[m], turns, m, warmup, 0.0)
    ph = {m: phases(timed[m]) for m in MODES}
    pairs = block_pairs(timed)
    a, b = ph["in-process"]["step_s"], ph["daemon"]["step_s"]
    curves = {m: [r["reward_mean"] for r in rows[m]] for m in MODES}
    same = curves["daemon"] == curves["in-process"] and len(curves["daemon"]) == steps
    result = {
        "benchmark": "overhead",
        "quick": args.quick,
        "steps": steps,
        "warmup": warmup,
        "block": block,
        "settle_s": args.settle,
        "turns": len(turns),
        "machine": describe(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/overhead.py"
        + (" --quick" if args.quick else "")
        + "".join(f" --set {o}" for o in args.sets),
        "overrides": args.sets,
        "in_process_step_s": a,
        "daemon_step_s": b,
        "overhead": b / a - 1.0,
        "target": 0.05,
        "phases_median": ph,
        "pairs": pairs,
        "pair_overhead_median": statistics.median(p["overhead"] for p in pairs) if pairs else None,
        "same_rewards": same,
        "wall_s": time.time() - t0,
    }
    table = Table(
        title=f"one job: through the daemon vs in one process (same engines, same loop; "
        f"{len(turns)} turns of {block} steps)"
    )
    for col in ("mode", "steps timed", "s/step", "generate", "train", "rest"):
        table.add_column(col)
    for m in MODES:
        p = ph[m]
        table.add_row(
            m,
            str(p["steps_timed"]),
            f"{p['step_s']:.4f}",
            f"{p['generate_s']:.4f}",
            f"{p['train_s']:.4f}",
            f"{p['rest_s']:.4f}",
        )
    Console().print(table)
    if pairs:
        spread = sorted(p["overhead"] for p in pairs)
        print(
            f"adjacent turns' own ratios: median {result['pair_overhead_median']:+.1%}, "
            f"{spread[0]:+.1%} to {spread[-1]:+.1%} over {len(pairs)} pairs"
        )
    print(f"overhead {result['overhead']:+.1%} (target <= +5%); per-step rewards identical: {same}")
    out = args.out or REPO / "bench" / "results" / ("overhead-quick.json" if args.quick else "overhead.json")
    write_json_atomic(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
