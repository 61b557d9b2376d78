"""What a shared user's jobs may take, one by one and together, and where the cluster keeps it.

What it owns: ``JobLimits`` (a jailed job's memory, processes, CPU seconds, output-directory and
``/tmp`` bytes; what all of a user's Tinker saves keep on the cluster's disk; how many of a user's
jobs run at once and how many they submit a minute; 0: no limit), ``LIMITS_FILE`` in the state
directory (the cluster's defaults under "default", each user's under "users"), ``limits_for`` (the
limits a user's next job gets: read at each driver start, submit and Tinker save, so ``plexctl
share --limit`` holds from then on) and ``set_limits`` (an atomic update). ``daemon.jail`` and
``daemon.confine`` apply a job's, the daemon's core the per-user counts, the Tinker front end
(``plexctl.tinker.cluster``) the Tinker ones; ``docs/security.md`` says which mechanism holds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from plexctl.common.atomic import write_json_atomic
from plexctl.common.errors import UsageError
from plexctl.common.sizes import parse_bytes

LIMITS_FILE = "limits.json"
NAMES = {
    "memory": "memory_bytes",
    "processes": "processes",
    "job-dir": "job_dir_bytes",
    "tmp": "tmp_bytes",
    "cpu": "cpu_seconds",
    "tinker-disk": "tinker_disk_bytes",
    "tinker-saves": "tinker_saves",
    "running": "running_jobs",
    "submits": "submits_per_minute",
}
COUNTS = ("processes", "cpu", "tinker-saves", "running", "submits")  # the limits written as plain numbers, not sizes


@dataclass(frozen=True)
class JobLimits:
    memory_bytes: int = 8 << 30  # its processes together (a cgroup; each one's address space: RLIMIT_AS)
    processes: int = 256  # its processes together (a cgroup, and RLIMIT_NPROC of its own uid)
    job_dir_bytes: int = 2 << 30  # its output directory (a file system of this size; each file: RLIMIT_FSIZE)
    tmp_bytes: int = 1 << 30  # its own /tmp (the tmpfs's size)
    cpu_seconds: int = 0  # CPU seconds of its processes together; 0: the scheduler's fair share alone
    # per user, all of their Tinker runs together (not the owner's): saved weights and states kept
    tinker_disk_bytes: int = 20 << 30  # their bytes on the cluster's disk
    tinker_saves: int = 1000  # how many (a save_state, a save_weights_for_sampler, a sampling client's weights)
    # per user, all of their jobs together: more wait in the queue; more submits are refused
    running_jobs: int = 8
    submits_per_minute: int = 60

    def with_overrides(self, values: object) -> JobLimits:
        """These limits with the fields ``values`` (a dict read from the file) sets to integers."""
        if not isinstance(values, dict):
            return self
        known = {f.name for f in fields(self)}
        given = {k: v for k, v in values.items() if k in known and isinstance(v, int) and v >= 0}
        return JobLimits(**{**asdict(self), **given})


def parse_limits(items: list[str]) -> dict[str, int]:
    """``["memory=4G", "processes=512"]`` -> the file's fields; one clear error for a bad item."""
    parsed: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in NAMES:
            raise UsageError(f"--limit {item!r}: expected NAME=VALUE with NAME one of {', '.join(NAMES)}")
        try:
            parsed[NAMES[name]] = int(value) if name in COUNTS else parse_bytes(value)
        except ValueError:
            kind = "count" if name in COUNTS else "size"
            raise UsageError(f"--limit {item!r}: {value!r} is not a {kind}") from None
        if parsed[NAMES[name]] < 0:
            raise UsageError(f"--limit {item!r}: must be >= 0 (0: no limit)")
    return parsed


def _saved(state_dir: Path) -> dict:
    try:
        saved = json.loads((state_dir / LIMITS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def limits_for(state_dir: Path, user: str) -> JobLimits:
    """``user``'s limits: the defaults, then the cluster's, then the user's own."""
    saved = _saved(state_dir)
    users = saved.get("users")
    own = users.get(user) if isinstance(users, dict) else None
    return JobLimits().with_overrides(saved.get("default")).with_overrides(own)


def set_limits(state_dir: Path, values: dict[str, int], user: str | None = None) -> JobLimits:
    """Set the cluster's defaults (``user`` None) or one user's limits; what that user now gets."""
    saved = _saved(state_dir)
    if user is None:
        saved["default"] = {**(saved.get("default") or {}), **values}
    else:
        users = saved.setdefault("users", {})
        users[user] = {**(users.get(user) or {}), **values}
    write_json_atomic(state_dir / LIMITS_FILE, saved, mode=0o600)
    return limits_for(state_dir, user or "")
