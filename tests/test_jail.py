"""The daemon's side of isolated drivers (daemon/jail.py, daemon/procs.py): whom it can jail, and
that what a jailed driver leaves in its directory (a link, a FIFO) never makes the daemon read
another file or hang."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from daemon import jail, procs
from plexctl import auth


def test_a_user_without_a_local_account_is_refused_with_the_reason() -> None:
    why = jail.refusal("no-such-user-7f3a")
    assert why and "no-such-user-7f3a" in why
    assert "\n" not in why


@pytest.mark.skipif(os.geteuid() != 0, reason="root owns the files a driver must not reach")
def test_a_link_planted_by_the_driver_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("owner's")
    out = tmp_path / "driver"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(secret)
    with pytest.raises(OSError):
        jail.read_job_file(out / "metrics.jsonl")
    (out / "real.jsonl").write_text('{"step": 1}\n')
    assert jail.read_job_file(out / "real.jsonl", offset=1, limit=6) == b'"step"'


def test_a_fifo_for_an_exit_file_neither_blocks_nor_counts(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "driver.exit")
    procs.write_exit(tmp_path / "other.exit", 0)
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(procs.exited(tmp_path / "driver.pid")), daemon=True)
    (tmp_path / "driver.pid").write_text('{"pid": 1, "start_time": 0, "argv": []}')
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "reading a FIFO exit file blocked"
    assert result == [None]
    with pytest.raises(OSError):
        jail.read_job_file(tmp_path / "driver.exit")


def test_an_isolated_drivers_identity_names_its_job_only() -> None:
    assert auth.job_of("@job:j0007") == "j0007"
    for user in ("alice", auth.INTERNAL_USER, "job:j0007"):
        assert auth.job_of(user) is None
