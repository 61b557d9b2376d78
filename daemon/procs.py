"""Processes a daemon started, and adopts again after it was restarted.

A job's driver and a local worker are the daemon's children, but they outlive it: when the
daemon is killed they wait for a daemon on the same state directory (``plexctl.common.cluster.orphan_grace``),
and the next daemon adopts them instead of starting new ones, so engines stay loaded and jobs
go on from where they were instead of from their last checkpoint.

The daemon records each child in a pid file (pid, kernel start time, argv) when it starts it;
an adopting daemon trusts a pid only if the process still runs with the same start time and
argv (pids are reused). An adopted process is not its child, so its exit status is unknown to
the kernel's ``wait``: a driver writes its exit code to ``driver.exit`` before it exits
(``write_exit``), which ``Adopted.poll`` reads.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import TypeAlias

from plexctl.common.atomic import write_json_atomic
from plexctl.common.cluster import pid_alive

# A job driver's own exit codes (``daemon.driver``); any other is a crash, restarted from its checkpoint.
DRIVER_EXIT_OK, DRIVER_EXIT_CANCELLED = 0, 3
DRIVER_EXIT_FAILED = 70  # the job failed and its driver said why (EX_SOFTWARE): never restarted
DRIVER_EXIT_DRAIN_UNSAVED = 74  # stopped with the cluster, its checkpoint found no disk space
DRIVER_EXIT_DRAINED = 75  # checkpointed at a step boundary on the daemon's request (EX_TEMPFAIL)

KILLED = -signal.SIGKILL  # the exit code of an adopted process that left no exit file
Handle: TypeAlias = "subprocess.Popen | Adopted"  # a process this daemon started, or one it adopted


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def record(path: Path, proc: subprocess.Popen, argv: list[str]) -> None:
    write_json_atomic(path, {"pid": proc.pid, "start_time": start_time(proc.pid), "argv": argv})


def find(path: Path, argv: list[str], exit_file: Path | None = None) -> "Adopted | None":
    """The process recorded at ``path`` if it still runs with this ``argv``, else None (a
    process recorded there that runs with another ``argv`` is killed). Its exit code is read
    from ``exit_file`` (default: beside ``path``, suffix ``.exit``)."""
    exit_file = exit_file or path.with_suffix(".exit")
    try:
        rec = json.loads(path.read_text())
        pid, started = int(rec["pid"]), rec["start_time"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not pid_alive(pid) or start_time(pid) != started:
        return None
    if rec.get("argv") != argv:  # ours, but started for another layout: it goes
        Adopted(pid, exit_file, started).kill()
        return None
    return Adopted(pid, exit_file, started)


def exited(path: Path, exit_file: Path | None = None) -> "Adopted | None":
    """The process recorded at ``path`` as a finished handle, if it exited leaving its exit code
    (``write_exit``: a driver that ended while no daemon ran); else None."""
    exit_file = exit_file or path.with_suffix(".exit")
    try:
        pid = int(json.loads(path.read_text())["pid"])
        rec = _read_exit(exit_file)
        rc = int(rec["rc"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if rec.get("pid") != pid:
        return None  # an earlier process's code
    handle = Adopted(pid, exit_file)
    handle.returncode = rc
    return handle


def write_exit(path: Path, rc: int) -> None:
    """``rc`` under the pid the daemon knows this process by (a jailed driver's supervisor's)."""
    write_json_atomic(path, {"pid": int(os.environ.get("PLEXRL_DRIVER_PID", os.getpid())), "rc": rc})


def _read_exit(path: Path) -> dict:
    """An exit file, read without following a link or blocking on a FIFO (an isolated driver
    writes it in a directory of its own)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        rec = json.loads(os.read(fd, 4096))
    finally:
        os.close(fd)
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: not an exit record")
    return rec


class Adopted:
    """A ``subprocess.Popen``-like handle on a process this daemon did not start."""

    def __init__(self, pid: int, exit_file: Path, started: int | None = None) -> None:
        self.pid = pid
        self.exit_file = exit_file
        self.started = started  # its kernel start time: a pid reused by another process is not it
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and (not pid_alive(self.pid) or start_time(self.pid) != self.started):
            try:
                rec = _read_exit(self.exit_file)
                self.returncode = int(rec["rc"]) if rec.get("pid") == self.pid else KILLED
            except (OSError, ValueError, KeyError, TypeError):
                self.returncode = KILLED
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (returncode := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
