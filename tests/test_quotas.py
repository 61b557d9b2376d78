"""A shared user's counts (daemon/quotas.py): submits a minute and jobs at once, from the limits
the owner set (plexctl share --limit), read again when the owner changes them."""

from __future__ import annotations

import os
from pathlib import Path

from daemon.quotas import UserQuotas
from plexctl.common.limits import parse_limits, set_limits


def test_submits_past_the_users_minute_are_refused_until_the_minute_moves_on(tmp_path: Path) -> None:
    set_limits(tmp_path, parse_limits(["submits=3"]), "eve")
    quotas = UserQuotas(tmp_path)
    assert [quotas.submit("eve", t) for t in (0.0, 1.0, 2.0)] == ["", "", ""]
    refused = quotas.submit("eve", 3.0)
    assert "submitted 3 jobs in the last minute" in refused and "submits=3" in refused and "57 s" in refused
    assert quotas.submit("bob", 3.0) == ""  # each user their own minute (bob: the default 60)
    assert quotas.submit("eve", 60.5) == ""  # the first one is a minute old


def test_a_users_jobs_past_their_running_limit_wait_and_a_new_limit_holds_at_once(tmp_path: Path) -> None:
    quotas = UserQuotas(tmp_path)
    assert quotas.waits("eve", 7) == "" and "eve runs 8 jobs, their limit (running=8)" in quotas.waits("eve", 8)
    set_limits(tmp_path, parse_limits(["running=2"]), "eve")
    os.utime(tmp_path / "limits.json", (1, 1))  # a change within the file system's time resolution
    assert quotas.waits("eve", 2).endswith("(running=2)") and quotas.waits("eve", 1) == ""
    set_limits(tmp_path, parse_limits(["running=0"]), "eve")
    assert quotas.waits("eve", 500) == ""  # 0: no limit
