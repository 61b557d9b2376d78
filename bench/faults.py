"""Inject faults into a running cluster, by hand or from the tests.

    python bench/faults.py kill-worker w1            # SIGKILL a worker (local cluster: w0 rollout, w1 trainer)
    python bench/faults.py stall-worker w1 --seconds 10   # SIGSTOP a worker, SIGCONT it 10 s later
    python bench/faults.py kill-driver j0003         # SIGKILL a job's driver
    python bench/faults.py kill-daemon               # SIGKILL the daemon (restart it with `plexctl up`)
    python bench/faults.py --state-dir DIR ...       # another cluster than $PLEXRL_HOME/clusters/default

Each prints the pid it killed. What the cluster promises after each fault is in
docs/guarantees.md; tests/test_faults.py and tests/test_slurm.py check it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plexctl.common.cluster import cluster_dir  # noqa: E402


def worker_pid(state_dir: Path, worker_id: str) -> int:
    """The pid of local worker ``worker_id`` of the cluster at ``state_dir`` (from /proc)."""
    needle = ["-m", "worker.main"]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (
            argv[1:3] == needle
            and "--worker-id" in argv
            and argv[argv.index("--worker-id") + 1] == worker_id
            and any(str(state_dir) in a for a in argv)
        ):
            return int(entry.name)
    raise LookupError(f"no worker {worker_id} of the cluster at {state_dir}")


def process_table() -> dict[int, tuple[int, str]]:
    """Every process this user can see: pid -> (its parent's pid, its argv joined by NULs)."""
    procs: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        procs[int(entry.name)] = (parent, argv)
    return procs


def rank_pids(worker: int) -> list[int]:
    """The pids of the trainer ranks past rank 0 that worker process ``worker`` started: the
    children of its rank fork server (``worker.trainer_group.rank_processes``)."""
    procs = process_table()
    servers = {pid for pid, (parent, argv) in procs.items() if parent == worker and "forkserver" in argv}
    return sorted(pid for pid, (parent, _) in procs.items() if parent in servers)


def driver_pid(state_dir: Path, job_id: str) -> int:
    """The pid of the job's current driver (the journal's last `started` event)."""
    with sqlite3.connect(state_dir / "journal.db") as db:
        rows = db.execute(
            "SELECT detail FROM events WHERE job_id = ? AND kind = 'started' ORDER BY id", (job_id,)
        ).fetchall()
    if not rows:
        raise LookupError(f"job {job_id} has not started")
    return int(rows[-1][0].split("driver pid ")[1])


def daemon_pid(state_dir: Path) -> int:
    return int(json.loads((state_dir / "endpoint.json").read_text())["pid"])


def kill(pid: int) -> int:
    os.kill(pid, signal.SIGKILL)
    return pid


def stall(pid: int, seconds: float) -> int:
    """Stop ``pid`` for ``seconds`` (SIGSTOP, then SIGCONT), as a long GC pause or a swap storm would."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    return pid


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", type=Path, default=None)
    ap.add_argument("fault", choices=["kill-worker", "stall-worker", "kill-driver", "kill-daemon"])
    ap.add_argument("target", nargs="?", help="worker id or job id")
    ap.add_argument("--seconds", type=float, default=10.0, help="stall-worker: how long the worker stays stopped")
    args = ap.parse_args(argv)
    state_dir = (args.state_dir or cluster_dir(None)).resolve()
    try:
        if args.fault == "stall-worker":
            pid = stall(worker_pid(state_dir, args.target or "w1"), args.seconds)
            print(f"stall-worker: stopped pid {pid} for {args.seconds:g} s")
            return 0
        if args.fault == "kill-worker":
            pid = kill(worker_pid(state_dir, args.target or "w1"))
        elif args.fault == "kill-driver":
            if not args.target:
                ap.error("kill-driver needs a job id")
            pid = kill(driver_pid(state_dir, args.target))
        else:
            pid = kill(daemon_pid(state_dir))
    except (LookupError, OSError) as exc:
        print(f"faults: {exc}", file=sys.stderr)
        return 1
    print(f"{args.fault}: killed pid {pid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
