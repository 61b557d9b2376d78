"""A trainer engine's ranks on this node while its rank 0 runs on another: a trainer engine wider
than a node. ``daemon.node`` starts this in place of a trainer worker on the engine's other nodes.

It waits for the engine's rendezvous file (``TrainerGroup`` writes it on the shared filesystem
once its store serves), then starts one process per rank it hosts (``trainer_group.follow``: each
joins the group and builds its engine and, through ``worker.main.attach_rank``, its own state store
under this node's scratch). When they end (the group closed, or failed and its rank 0's worker
starts the engine again whole), or a newer group formed (a file of a new ``generation``: rank 0
started again), it starts that generation's ranks. SIGTERM stops its ranks and it.

Invariants. The ranks it starts are its children and die with it; it starts a generation's ranks
once; what the ranks serve comes from rank 0, never from here.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from plexctl.common.cluster_config import ConfigError, read_config
from worker.main import attach_rank
from worker.trainer_group import follow, rank_processes, rendezvous_spec

log = logging.getLogger("plexrl-ranks")

POLL_S = 0.5


def read_rendezvous(path: Path) -> dict[str, Any] | None:
    """The rendezvous file's record, None while there is none (or it is being replaced)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def start_ranks(record: dict[str, Any], ranks: list[int], config: Any, scratch: Path) -> list[BaseProcess]:
    """One process per rank of ``ranks`` for the group ``record`` names, its store under ``scratch``."""
    extra = record.get("extra", {})
    attach = functools.partial(
        attach_rank, config=config, nvme_dir=scratch, info=extra.get("info", {}), eid=extra.get("eid", "")
    )
    spec = rendezvous_spec(record, attach)
    context = rank_processes()
    procs: list[BaseProcess] = [
        context.Process(target=follow, args=(spec, rank, dict(os.environ)), name=f"trainer-rank-{rank}", daemon=True)
        for rank in ranks
    ]
    for proc in procs:
        proc.start()
    return procs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plexrl-ranks", description=__doc__.splitlines()[0])
    ap.add_argument("--rendezvous", required=True, type=Path, help="the engine's rendezvous file")
    ap.add_argument("--ranks", required=True, help="the ranks this node hosts, comma-separated")
    ap.add_argument("--cluster-config", required=True, type=Path)
    ap.add_argument("--scratch", required=True, type=Path, help="this node's directory for the ranks' NVMe tiers")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = read_config(args.cluster_config)
        ranks = [int(r) for r in args.ranks.split(",") if r]
    except (ConfigError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stopping.append(signum))
    seen: str | None = None
    procs: list[BaseProcess] = []
    try:
        while not stopping:
            record = read_rendezvous(args.rendezvous)
            newer = record is not None and record.get("generation") != seen
            if procs and any(p.is_alive() for p in procs) and not newer:
                time.sleep(POLL_S)
                continue
            if procs:  # they left the group (it closed or failed), or a newer one formed without them
                stop(procs)
                log.info("ranks %s left the group (exit codes %s)", args.ranks, [p.exitcode for p in procs])
                procs = []
            if record is None or not newer:
                time.sleep(POLL_S)
                continue
            seen = record["generation"]
            log.info("ranks %s join the trainer group at %s:%s (%s)", args.ranks, record["host"], record["port"], seen)
            procs = start_ranks(record, ranks, config, args.scratch)
    finally:
        stop(procs)
    return 0


def stop(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)


if __name__ == "__main__":
    sys.exit(main())
