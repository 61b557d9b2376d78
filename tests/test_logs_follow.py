"""`plexctl logs` gives a job's whole log and metrics however long, and `-f` follows until the job ends.

The daemon answers a logs request with one chunk (whole lines, never a UTF-8 character cut in
two) from the offset asked; the CLI asks again until it has everything. A real plexd with no
workers (a queued job is enough: its directory is the daemon's to read), the real CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plexctl.common.client import Client
from tests.test_robustness import TINY, BareDaemon

REPO = Path(__file__).resolve().parents[1]


class BareCluster:
    """A bare daemon (no workers) and the CLI pointed at it, as its owner."""

    def __init__(self, root: Path, model: Path) -> None:
        self.daemon = BareDaemon(root / "state", model)
        self.env = {**os.environ, "PLEXRL_HOME": str(root / "home"), "PYTHONPATH": str(REPO)}
        self.state_dir = root / "state"

    def plexctl(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "plexctl.cli", "--state-dir", str(self.state_dir), *args]

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.plexctl(*args), cwd=REPO, env=self.env, capture_output=True, timeout=120)

    def client(self) -> Client:
        return Client(self.daemon.address, keys=self.daemon.keys)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = BareCluster(tmp_path_factory.mktemp("logs"), tiny_model)
    yield c
    c.daemon.stop()


def queued_job(c: BareCluster, name: str) -> tuple[str, Path]:
    out = c.run("submit", str(TINY), "--name", name, "-q")
    assert out.returncode == 0, out.stderr
    job = out.stdout.decode().strip()
    job_dir = c.state_dir / "jobs" / job
    job_dir.mkdir(parents=True)
    return job, job_dir


def metrics_lines(n: int, start: int = 0) -> bytes:
    """JSONL rows of varying length, some with characters of 2 and 3 UTF-8 bytes (a chunk's end may fall in one)."""
    return b"".join(
        json.dumps(
            {"step": i, "reward_mean": i / 7, "note": "é€" * (i % 13) + "x" * (i % 97)}, ensure_ascii=False
        ).encode()
        + b"\n"
        for i in range(start, start + n)
    )


def test_logs_gives_the_whole_metrics_file_and_driver_log_past_one_mib(cluster: BareCluster) -> None:
    job, job_dir = queued_job(cluster, "long")
    metrics = metrics_lines(12_000)
    assert len(metrics) > 1 << 20
    (job_dir / "metrics.jsonl").write_bytes(metrics)
    log = b"".join(f"{i:06d} driver line \u00e9\n".encode() for i in range(60_000))
    (job_dir / "driver.log").write_bytes(log)
    out = cluster.run("logs", job, "--metrics")
    assert out.returncode == 0, out.stderr
    assert out.stdout == metrics  # every line, whole, in order: not the first 256 KiB
    out = cluster.run("logs", "long")  # by name, the driver log
    assert out.returncode == 0 and out.stdout == log


def test_a_reply_ends_on_a_whole_line_or_where_the_job_has_written_to(cluster: BareCluster) -> None:
    job, job_dir = queued_job(cluster, "chunks")
    text = metrics_lines(4_000) + '{"step": "half a line, half a character: \u20ac'.encode()[:-1]
    (job_dir / "metrics.jsonl").write_bytes(text)
    client, offset, chunks = cluster.client(), 0, []
    while True:
        rep = client.logs(job, "metrics", offset)
        if not rep.data:
            break
        chunks.append(rep.data)
        offset = rep.offset
        assert not rep.finished  # queued: more may come
    assert len(chunks) > 2 and all(c.endswith("\n") for c in chunks[:-1])
    assert "".join(chunks).encode() == text[:-2]  # what is there, not the € of which 2 of 3 bytes are
    client.cancel(job)  # ended: nothing more will come, so the tail comes as it is
    rep = client.logs(job, "metrics", offset)
    assert rep.finished and len(rep.data) == 1


def test_follow_prints_what_is_written_and_stops_when_the_job_ends(cluster: BareCluster) -> None:
    job, job_dir = queued_job(cluster, "followed")
    first, second = metrics_lines(6_000), metrics_lines(6_000, start=6_000)
    (job_dir / "metrics.jsonl").write_bytes(first)
    follower = subprocess.Popen(
        cluster.plexctl("logs", job, "--metrics", "-f"),
        cwd=REPO,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        time.sleep(2.0)
        assert follower.poll() is None  # the job has not ended: it follows
        with open(job_dir / "metrics.jsonl", "ab") as f:
            f.write(second)
        time.sleep(1.5)
        cluster.client().cancel(job)
        out, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, err
    assert out == first + second
