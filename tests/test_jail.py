"""The daemon's side of isolated drivers (daemon/jail.py, daemon/procs.py): whom it can jail, and
that what a jailed driver leaves in its directory (a link, a FIFO) never makes the daemon read
another file or hang."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from daemon import jail, procs
from plexctl.common import auth


def test_a_daemon_that_cannot_jail_refuses_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jail, "mode", lambda: "")
    why = jail.refusal("bob")
    assert "'bob'" in why and "--trust-user-code bob" in why and "\n" not in why


def test_a_jail_that_cannot_be_set_up_exits_with_one_line_before_any_job_code() -> None:
    # run as the daemon runs it (by path, -I -S: the standard library alone, its configuration on
    # standard input); a config without its cgroups fails at the first stage, one not JSON before it
    run = [sys.executable, "-I", "-S", str(jail.BOOT)]
    done = subprocess.run(run, input="{}", capture_output=True, text=True, cwd="/", timeout=60)
    assert done.returncode == jail.SETUP_FAILED_EXIT == 121
    assert (done.stdout, done.stderr) == ("", "plexrl-jail: setup failed at cgroups: KeyError: 'cgroups'\n")
    done = subprocess.run(run, input="{", capture_output=True, text=True, cwd="/", timeout=60)
    assert done.returncode == 121 and done.stderr.startswith("plexrl-jail: setup failed at configuration: ")


def test_users_without_an_account_get_a_uid_per_job_that_no_account_has() -> None:
    import pwd

    uids = {jail.job_account("zoe", f"j{n:04d}").uid for n in range(1, 50)}
    assert len(uids) == 49 and min(uids) >= jail.JOB_UID_BASE
    assert not uids & {entry.pw_uid for entry in pwd.getpwall()}


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


def test_a_jailed_driver_gets_an_allow_listed_environment_and_its_users_limits(tmp_path: Path) -> None:
    from plexctl.common.errors import UsageError
    from plexctl.common.limits import JobLimits, limits_for, parse_limits, set_limits

    owner = {
        "PATH": "/usr/bin",
        "LC_ALL": "de_DE.UTF-8",
        "LC_TIME": "owner-locale",
        "LANG": "de_DE.UTF-8",
        "PLEXRL_DEBUG": "1",
        "HF_TOKEN": "t",
        "AWS_SECRET_ACCESS_KEY": "s",
        "PLEXRL_HOME": "/root/.p",
    }
    owner |= {"PLEXRL_CLUSTER_KEYS": "/state/keys", "PLEXRL_ORPHAN_GRACE_S": "5", "PYTHONPATH": "/root/lib"}
    env = jail.jailed_env(owner, jail.Account("bob", 1234, 1234, ()))
    assert env == {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "PLEXRL_ORPHAN_GRACE_S": "5",
        "TMPDIR": "/tmp",
        "HOME": "/mnt/job",
        "USER": "bob",
        "LOGNAME": "bob",
        "PLEXRL_DRIVER_KEYS": "/mnt/keys",
    }
    assert limits_for(tmp_path, "bob") == JobLimits()
    set_limits(tmp_path, parse_limits(["memory=2G", "processes=64"]))
    set_limits(tmp_path, parse_limits(["memory=16G", "tmp=0"]), "bob")
    assert limits_for(tmp_path, "bob") == JobLimits(memory_bytes=16 << 30, processes=64, tmp_bytes=0)
    assert limits_for(tmp_path, "carol") == JobLimits(memory_bytes=2 << 30, processes=64)
    assert parse_limits(["cpu=30"]) == {"cpu_seconds": 30}
    for bad in ("memory", "gpu=4", "memory=lots", "processes=-1", "cpu=1h"):
        with pytest.raises(UsageError, match="--limit"):
            parse_limits([bad])
