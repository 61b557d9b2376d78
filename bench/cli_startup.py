"""Benchmark: how long ``plexctl`` takes to start, beside a bare ``python -c pass``.

Each command runs as a fresh process, all of them in turn within each repetition (so a busy
spell of the machine touches every row alike); a row reports the median and the fastest of its
repetitions. The rows: the interpreter alone; importing ``plexctl.cli`` (the package) and
``plexctl.cli.app`` (every verb registered, none run); ``--help``; ``status`` against no cluster
(an empty ``PLEXRL_HOME``: it fails fast, exit 4); ``logs`` of a job on no cluster; ``validate``
of an example spec (its files are checked: exit 2 where the tiny model is not built). The CLI
runs as ``python -m plexctl.cli`` from ``--root`` (default: this checkout), so an older tree
(``git archive REV | tar -x -C DIR``) is timed the same way.

Usage: ``python bench/cli_startup.py [--quick] [--reps N] [--root DIR] [--out FILE]``; writes
``bench/results/cli_startup.json`` (``cli_startup-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from plexctl.common.atomic import write_json_atomic  # noqa: E402

TARGET_S = 0.2  # a verb typed many times a day starts well under this


def commands(root: Path) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "plexctl.cli"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "import plexctl.cli": [sys.executable, "-c", "import plexctl.cli"],
        "import plexctl.cli.app": [sys.executable, "-c", "import plexctl.cli.app"],
        "plexctl --help": [*cli, "--help"],
        "plexctl status (no cluster)": [*cli, "status"],
        "plexctl logs (no cluster)": [*cli, "logs", "j1"],
        "plexctl validate configs/tiny-arith.yaml": [*cli, "validate", str(root / "configs" / "tiny-arith.yaml")],
    }


def time_once(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0, proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions: keeps the benchmark working")
    ap.add_argument("--reps", type=int, help="repetitions of each command (default 21; 3 with --quick)")
    ap.add_argument("--root", type=Path, default=REPO, help="the tree whose plexctl is timed")
    ap.add_argument("--out", type=Path, help="JSON file (default bench/results/cli_startup[-quick].json)")
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 21)
    root = args.root.resolve()
    cmds = commands(root)
    with tempfile.TemporaryDirectory(prefix="plexrl-cli-startup-") as home:
        env = {**os.environ, "PLEXRL_HOME": home, "PYTHONPATH": str(root)}
        env.pop("PLEXRL_CLUSTER", None)
        samples: dict[str, list[float]] = {name: [] for name in cmds}
        codes: dict[str, int] = {}
        for cmd in cmds.values():  # one untimed run each: the bytecode caches are written
            time_once(cmd, env, root)
        for _ in range(reps):
            for name, cmd in cmds.items():
                seconds, codes[name] = time_once(cmd, env, root)
                samples[name].append(seconds)

    bare = statistics.median(samples["python -c pass"])
    rows = []
    print(f"{'command':<44} {'median s':>9} {'min s':>7} {'over python':>12} {'exit':>5}")
    for name, runs in samples.items():
        median = statistics.median(runs)
        rows.append(
            {
                "command": name,
                "argv": cmds[name][1:],
                "median_s": median,
                "min_s": min(runs),
                "over_python_s": median - bare,
                "exit_code": codes[name],
                "seconds": runs,
            }
        )
        print(f"{name:<44} {median:>9.3f} {min(runs):>7.3f} {median - bare:>12.3f} {codes[name]:>5}")

    out = args.out or REPO / "bench" / "results" / ("cli_startup-quick.json" if args.quick else "cli_startup.json")
    write_json_atomic(
        out,
        {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": {
                "cpu": describe(),
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_1m": os.getloadavg()[0],
            },
            "command": "python bench/cli_startup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "quick": args.quick,
            "root": str(root),
            "reps": reps,
            "target_s": TARGET_S,
            "rows": rows,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
