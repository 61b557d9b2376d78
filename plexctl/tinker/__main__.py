"""``python -m plexctl.tinker``: the Tinker API front end of a cluster (started by its daemon)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from plexctl.common.cluster import TINKER_FILE


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="plexrl-tinker", description=__doc__)
    ap.add_argument("--state-dir", required=True, type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: a free one")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from plexctl.tinker.cluster import ClusterBackend
    from plexctl.tinker.server import serve

    serve(ClusterBackend(args.state_dir), args.host, args.port, ready_file=args.state_dir / TINKER_FILE)


if __name__ == "__main__":
    main()
