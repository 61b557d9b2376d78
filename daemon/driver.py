"""The job driver: one process per running job, started by the daemon.

It loads the job's spec from its directory, connects to the daemon as that job and runs the
job's algorithm (a built-in by ``algo.name``, or the user's ``algo.loop``) on the
``plexctl.rl`` library. Exit codes: 0 finished, 3 cancelled (stopped at a call boundary; its
last checkpoint is kept), 75 drained (the cluster is stopping: checkpointed at a step
boundary, resumes there), 1 failed (the reason is reported to the daemon and printed as the
log's last line).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from plexctl.algos import run_algorithm
from plexctl.rl import Job, JobCancelled, JobClient, JobDrained
from plexctl.spec import spec_from_wire

EXIT_OK, EXIT_FAILED, EXIT_CANCELLED, EXIT_DRAINED = 0, 1, 3, 75


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plexrl-driver")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--job-id", required=True)
    ap.add_argument("--job-dir", required=True, type=Path)
    args = ap.parse_args(argv)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # an allocation's drain signal: the daemon tells us
        signal.signal(sig, signal.SIG_IGN)
    client = JobClient(args.endpoint, args.job_id, parent_pid=os.getppid())
    try:
        spec = spec_from_wire(json.loads((args.job_dir / "spec.json").read_text()))
        log(f"job {args.job_id} ({spec.name}) starting: {spec.algo.loop or spec.algo.name}, "
            f"{spec.algo.steps} steps")
        job = Job(client, spec, args.job_dir, log)
        try:
            run_algorithm(job)
        finally:
            job.close()
        return EXIT_OK
    except JobDrained as drained:
        log(f"stopping with the cluster ({drained}): checkpointed, resumes from this step")
        return EXIT_DRAINED
    except JobCancelled:
        log("cancelled: stopping at a call boundary; the last checkpoint is kept")
        return EXIT_CANCELLED
    except Exception as exc:  # noqa: BLE001 - reported, then the process fails
        traceback.print_exc()
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        client.report("failed", 0, {}, reason)
        log(f"failed: {reason}")
        return EXIT_FAILED
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
