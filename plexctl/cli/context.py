"""What every verb shares: the cluster it talks to (``Ctx``, from ``--cluster`` / ``--state-dir``),
the terminal console (made on first use: rich costs ~40 ms to import) and job states' exit codes."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from plexctl.common.errors import DaemonUnreachable, ExitCode, PlexError

if TYPE_CHECKING:
    from rich.console import Console

    from plexctl.common.client import Client

TERMINAL = ("succeeded", "failed", "cancelled", "interrupted")  # interrupted: it resumes at the next `up`
WAIT_EXIT = {
    "succeeded": ExitCode.OK,
    "failed": ExitCode.JOB_FAILED,
    "cancelled": ExitCode.JOB_CANCELLED,
    "interrupted": ExitCode.INTERRUPTED,
}


@functools.cache
def console() -> Console:
    from rich.console import Console

    return Console()


class Ctx:
    """The cluster a verb talks to: its state directory, and a client of its daemon."""

    def __init__(self, cluster: str | None, state_dir: Path | None) -> None:
        from plexctl.common.cluster import cluster_dir

        self.named = cluster is not None or state_dir is not None
        self.state_dir = state_dir or cluster_dir(cluster or _only_cluster())

    def client(self, timeout: float = 10.0, retries: int = 2) -> Client:
        from plexctl.common.client import Client
        from plexctl.common.cluster import pid_alive, read_endpoint

        ep = read_endpoint(self.state_dir)
        if ep.mode == "local" and ep.host == socket.gethostname() and not pid_alive(ep.pid):
            raise DaemonUnreachable(
                f"cluster at {self.state_dir} is not running (its daemon, pid {ep.pid}, "
                "has exited; start it with `plexctl up --local`)"
            )
        return Client(ep.address, timeout=timeout, retries=retries)

    def uptime(self) -> float:
        """Seconds since the cluster's daemon started (0 when it is not known)."""
        import time

        from plexctl.common.cluster import read_endpoint

        try:
            return time.time() - read_endpoint(self.state_dir).started_at
        except PlexError:
            return 0.0


def _only_cluster() -> str | None:
    """With no --cluster: the one cluster that exists, if the default one does not."""
    from plexctl.common.cluster import cluster_dir, plexrl_home

    if os.environ.get("PLEXRL_CLUSTER") or cluster_dir(None).exists():
        return None
    clusters = [d.name for d in (plexrl_home() / "clusters").glob("*") if d.is_dir()]
    return clusters[0] if len(clusters) == 1 else None
