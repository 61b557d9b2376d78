"""``python -m plexctl.tinker``: the API front end of a cluster, Tinker's and OpenAI's (started by its daemon).

It lives as long as the daemon that started it: once that process is gone (killed; the next
daemon starts a front end of its own), it stops as at SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

from plexctl.common.cluster import TINKER_FILE


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="plexrl-tinker", description=__doc__)
    ap.add_argument("--state-dir", required=True, type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=None, help="the Tinker API's (0: a free one; none: not served)")
    ap.add_argument("--openai-port", type=int, default=None, help="the OpenAI API's (0: a free one; none: not served)")
    ap.add_argument("--parent-pid", type=int, default=0, help="stop once this process (the daemon) is gone")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.parent_pid:
        threading.Thread(target=_stop_without, args=(args.parent_pid,), daemon=True, name="parent-watch").start()
    from plexctl.common.cluster_config import config_path, read_config
    from plexctl.tinker.cluster import ClusterBackend
    from plexctl.tinker.server import serve

    backend = ClusterBackend(args.state_dir)
    idle = read_config(config_path(args.state_dir)).openai_idle  # the cluster's settings, as the daemon's
    serve(
        backend,
        args.host,
        args.port,
        ready_file=args.state_dir / TINKER_FILE,
        openai_port=args.openai_port,
        sampler_idle_s=idle,
    )


def _stop_without(parent: int) -> None:
    """SIGTERM to this process once ``parent`` is no longer its parent (it exited or was killed)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    logging.getLogger("plexrl.tinker").warning("its daemon (pid %d) is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
