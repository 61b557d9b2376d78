"""The job driver: one process per running job, started by the daemon.

It loads the job's spec from its directory, connects to the daemon as that job and runs the
job's algorithm (a built-in by ``algo.name``, or the user's ``algo.loop``) on the
``plexctl.rl`` library. Exit codes: 0 finished, 3 cancelled (stopped at a call boundary; its
last checkpoint is kept), 75 drained (the cluster is stopping: checkpointed at a step
boundary, resumes there), 74 stopped with the cluster but its checkpoint found no disk space
(resumes from its last good one), 70 failed (the reason is reported to the daemon and printed as
the log's last line; never restarted, unlike a crash). The code is also written to ``driver.exit``
in the job's directory: a driver outlives a daemon that dies, and the daemon that adopts it is not
its parent.
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

from daemon.procs import (
    DRIVER_EXIT_CANCELLED,
    DRIVER_EXIT_DRAIN_UNSAVED,
    DRIVER_EXIT_DRAINED,
    DRIVER_EXIT_FAILED,
    DRIVER_EXIT_OK,
    write_exit,
)
from plexctl.algos import run_algorithm
from plexctl.common.cluster import endpoint_path
from plexctl.common.jobdir import JobDir
from plexctl.common.spec import spec_from_wire
from plexctl.rl import DaemonLost, DrainCheckpointFailed, Job, JobCancelled, JobClient, JobDrained
from plexctl.sandbox import kill_live_runs

EXIT_OK, EXIT_FAILED, EXIT_CANCELLED = DRIVER_EXIT_OK, DRIVER_EXIT_FAILED, DRIVER_EXIT_CANCELLED
EXIT_DRAIN_UNSAVED, EXIT_DRAINED = DRIVER_EXIT_DRAIN_UNSAVED, DRIVER_EXIT_DRAINED


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plexrl-driver")
    ap.add_argument("--job-dir", required=True, type=Path)
    args, _ = ap.parse_known_args(argv)
    rc = run(argv)
    write_exit(JobDir(args.job_dir).driver_exit, rc)
    return rc


def _stop_now(signum: int, _frame: object) -> None:
    """Stop the sandboxed programs this driver runs (in sessions of their own: they would
    outlive it), then exit through the job's cleanup."""
    kill_live_runs()
    raise SystemExit(128 + signum)


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plexrl-driver")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--job-id", required=True)
    ap.add_argument("--job-dir", required=True, type=Path)
    ap.add_argument("--spec", type=Path, default=None, help="the job's spec (default: the job directory's)")
    ap.add_argument("--isolated", action="store_true", help="jailed (daemon.jail): the job's directory is all it sees")
    args = ap.parse_args(argv)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # an allocation's drain signal: the daemon tells us
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_now)  # the daemon stops the job (cancel past its grace, roll back)
    endpoint_file = None if args.isolated else endpoint_path(args.job_dir.resolve().parents[1])
    client = JobClient(args.endpoint, args.job_id, parent_pid=os.getppid(), endpoint_file=endpoint_file, log=log)
    try:
        spec = spec_from_wire(json.loads((args.spec or JobDir(args.job_dir).spec).read_text()))
        log(f"job {args.job_id} ({spec.name}) starting: {spec.algo.loop or spec.algo.name}, {spec.algo.steps} steps")
        job = Job(client, spec, args.job_dir, log)
        try:
            run_algorithm(job)
        finally:
            job.close()
        return EXIT_OK
    except DrainCheckpointFailed as failed:
        log(f"stopping with the cluster: {failed}")
        return EXIT_DRAIN_UNSAVED
    except JobDrained as drained:
        log(f"stopping with the cluster ({drained}): checkpointed, resumes from this step")
        return EXIT_DRAINED
    except JobCancelled:
        log("cancelled: stopping at a call boundary; the last checkpoint is kept")
        return EXIT_CANCELLED
    except DaemonLost as lost:
        log(f"stopping: {lost}; the job resumes from its last checkpoint when the cluster is up again")
        return EXIT_DRAINED
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
