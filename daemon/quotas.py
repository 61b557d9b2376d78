"""What a shared user may have of the cluster at once: jobs running, and submits a minute.

It owns ``UserQuotas``: each user's recent submits (in memory: a restarted daemon starts its
minute afresh) and their limits (``plexctl.common.limits``, read again when the file changes).
It decides; the core asks it before a submit is journaled and before a queued job is admitted.
Only users the cluster does not trust are counted (the core asks for those alone).
"""

from __future__ import annotations

import collections
from pathlib import Path

from plexctl.common.limits import LIMITS_FILE, JobLimits, limits_for

WINDOW_S = 60.0  # submits are counted over the last minute


class UserQuotas:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._submits: dict[str, collections.deque[float]] = {}
        self._limits: dict[str, JobLimits] = {}
        self._read_at: float | None = None  # the limits file's mtime when ``_limits`` was filled

    def limits(self, user: str) -> JobLimits:
        """``user``'s limits, from the file as it is now."""
        try:
            mtime: float | None = (self.state_dir / LIMITS_FILE).stat().st_mtime
        except OSError:
            mtime = None
        if mtime != self._read_at:
            self._limits.clear()
            self._read_at = mtime
        if user not in self._limits:
            self._limits[user] = limits_for(self.state_dir, user)
        return self._limits[user]

    def submit(self, user: str, now: float) -> str:
        """Count a submit of ``user``'s, or say in one line why it is refused ("" if it is not)."""
        allowed = self.limits(user).submits_per_minute
        recent = self._submits.setdefault(user, collections.deque())
        while recent and recent[0] <= now - WINDOW_S:
            recent.popleft()
        if allowed and len(recent) >= allowed:
            return (
                f"user {user!r} submitted {len(recent)} jobs in the last minute, their limit (submits={allowed}; "
                f"the cluster's owner sets it: plexctl share {user} --limit submits=N); try again in "
                f"{recent[0] + WINDOW_S - now:.0f} s"
            )
        recent.append(now)
        return ""

    def waits(self, user: str, running: int) -> str:
        """Why another job of ``user``'s, who runs ``running``, waits in the queue ("" if it need not)."""
        allowed = self.limits(user).running_jobs
        if allowed and running >= allowed:
            return f"waiting: {user} runs {running} jobs, their limit (running={allowed})"
        return ""
