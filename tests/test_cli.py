"""What a user sees from `plexctl` when the command line or a path is wrong: one clear line,
the exit code the README lists, no traceback. No cluster is started here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def plexctl(tmp_path: Path):
    env = {**os.environ, "PLEXRL_HOME": str(tmp_path / "home")}
    env.pop("PLEXRL_DEBUG", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "plexctl.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run


def one_error(proc: subprocess.CompletedProcess, code: int, phrase: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    assert "Traceback" not in out and phrase in out, out


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["bogus"], "No such command 'bogus'"),
        (["validate", "--bogus"], "No such option: --bogus"),
        (["wait"], "Missing argument"),
        (["status", "--interval", "abc"], "Invalid value for '--interval'"),
        (["status", "--watch", "--interval", "-1"], "Invalid value for '--interval'"),
        (["up", "--workers", "0"], "Invalid value for '--workers'"),
        (["up", "--host-mem", "abc"], "--host-mem: not a size: 'abc'"),
        (["ls", "--state", "bogus"], "--state 'bogus': choose one of queued, running"),
        (["report", "--cluster", "--last", "-5"], "Invalid value for '--last'"),
    ],
)
def test_usage_errors_are_one_message_and_exit_2(plexctl, args: list[str], phrase: str) -> None:
    one_error(plexctl(*args), 2, phrase)


def test_a_state_dir_that_is_a_file_is_not_a_cluster(plexctl, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    one_error(plexctl("--state-dir", str(tmp_path / "afile"), "status"), 4, "is not a cluster directory")


def test_a_stale_endpoint_is_reported_at_once(plexctl, tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that was a daemon's and is no more
    state = tmp_path / "stale"
    state.mkdir()
    (state / "endpoint.json").write_text(
        json.dumps(
            {
                "address": "tcp://127.0.0.1:9",
                "pid": gone.pid,
                "started_at": 0,
                "mode": "local",
                "host": socket.gethostname(),
            }
        )
    )
    started = time.monotonic()
    proc = plexctl("--state-dir", str(state), "status")
    one_error(proc, 3, f"its daemon, pid {gone.pid}, has exited")
    assert time.monotonic() - started < 20  # not three 10 s tries at an address nobody serves


def test_a_home_that_is_a_file_gives_the_path(plexctl, tmp_path: Path) -> None:
    (tmp_path / "home").write_text("x")
    one_error(plexctl("keygen"), 2, str(tmp_path / "home"))


def test_simulate_reads_the_trace_where_the_user_is(plexctl, tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("{bad\n")
    one_error(plexctl("simulate", "bad.jsonl"), 2, f"{tmp_path / 'bad.jsonl'}: not JSON")
    one_error(plexctl("simulate", "absent.jsonl"), 2, "No such file or directory")
