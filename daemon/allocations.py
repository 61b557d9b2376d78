"""An elastic Slurm allocation (``plexctl up --slurm --max-nodes M``): the daemon asks for joining
allocations of one node while jobs wait for engines, and gives back the ones whose engines hold
no job.

``ElasticAllocations`` keeps the joined allocations it asked for in ``slurm.json`` (Slurm job
id, state, when it came up and since when it is idle: ``plexctl status`` shows them, ``down``
ends them, and a daemon started again adopts the ones Slurm still runs). What to do is
``daemon.elastic.decide``'s, the rule the simulator charges by. A joined allocation's workers are
known by their ids (``daemon.node`` names them ``NODE-JOBID``).

Invariants: the base allocation is never given back; at most ``max_nodes - nodes`` joined
allocations are held or asked for at once; one is given back only while its engines hold no job
(none homed, none running), so no job's state is on it; a submission or a cancel that fails is
logged and tried again at a later step, never the daemon's end.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec

from daemon.elastic import ElasticRule, Unit, decide
from plexctl.common import slurm as S
from plexctl.common.cluster_config import ClusterConfig

log = logging.getLogger("plexd.elastic")

STEP_S = 2.0  # how often the rule is asked
SLURM_CHECK_S = 10.0  # how often Slurm is asked about allocations not up yet


class ElasticAllocations:
    def __init__(self, state_dir: Path, config: ClusterConfig, submit: Callable[..., S.Allocation] = S.submit_join):
        if config.max_nodes is None:
            raise ValueError("an elastic allocation needs max_nodes")
        self.state_dir, self.config, self._submit = state_dir, config, submit
        self.rule = ElasticRule(
            min_units=0,
            max_units=config.max_nodes - config.nodes,
            grow_after_s=config.grow_after,
            shrink_after_s=config.shrink_after,
        )
        self.last_step = 0.0
        self.last_slurm_check = 0.0
        self.units: dict[str, S.Allocation] = {}  # job id -> a joined allocation this daemon manages
        for alloc in S.read_allocations(state_dir):  # a daemon started again adopts the live ones
            if alloc.elastic and alloc.state in ("starting", "up", "releasing"):
                if S.job_state(alloc.job_id)[0] in ("GONE", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"):
                    self._ended(alloc, time.time(), "it had ended while the daemon was down")
                else:
                    self.units[alloc.job_id] = alloc
                    log.info("adopted joined allocation %s (%s)", alloc.job_id, alloc.state)

    @staticmethod
    def workers_of(job_id: str, worker_ids: list[str]) -> list[str]:
        """The workers of a joined allocation: ``daemon.node`` names them ``NODE-JOBID[-...]``."""
        pattern = re.compile(rf"-{re.escape(job_id)}(?:-|$)")
        return [w for w in worker_ids if pattern.search(w)]

    def due(self, now: float) -> bool:
        """Whether the rule is asked again now (every ``STEP_S``)."""
        return now - self.last_step >= STEP_S

    def step(self, now: float, waiting_since: float | None, workers: Mapping[str, bool]) -> None:
        """Ask the rule and act: ``waiting_since`` is when the oldest job waiting for engines
        began to (None: none waits); ``workers`` every registered worker -> whether its engines
        hold a job (homed or running)."""
        if not self.due(now):
            return
        self.last_step = now
        ids = list(workers)
        units, silent = [], set()
        for alloc in list(self.units.values()):
            mine = self.workers_of(alloc.job_id, ids)
            if alloc.state == "starting" and mine:
                alloc = self._set(alloc, state="up", up_at=now, idle_since=now)
                log.info("joined allocation %s is up: workers %s", alloc.job_id, ", ".join(mine))
            elif alloc.state == "up" and not mine:  # restarting, or gone: Slurm says which (``_check_slurm``)
                units.append(Unit(unit_id=alloc.job_id, ready=False))
                silent.add(alloc.job_id)
                continue
            elif alloc.state == "releasing" and not mine:
                self._ended(alloc, now, alloc.note)
                continue
            if alloc.state == "up":
                busy = any(workers[w] for w in mine)
                if busy and alloc.idle_since is not None:
                    alloc = self._set(alloc, idle_since=None)
                elif not busy and alloc.idle_since is None:
                    alloc = self._set(alloc, idle_since=now)
            if alloc.state != "releasing":
                units.append(Unit(unit_id=alloc.job_id, ready=alloc.state == "up", idle_since=alloc.idle_since))
        if now - self.last_slurm_check >= SLURM_CHECK_S:
            self.last_slurm_check = now
            self._check_slurm(now, silent)
        decision = decide(self.rule, now, waiting_since, 1, units)
        for job_id in decision.release:
            self._release(self.units[job_id], now)
        if decision.grow:
            self._grow(now, waiting_since)

    def _grow(self, now: float, waiting_since: float | None) -> None:
        waited = now - waiting_since if waiting_since is not None else 0.0
        note = f"jobs waited {waited:.0f} s for engines"
        try:
            alloc = self._submit(self.state_dir, self.config, note)
        except (S.SlurmUnavailable, OSError, ValueError) as exc:
            log.warning("could not ask for a joining allocation (tried again later): %s", exc)
            return
        self.units[alloc.job_id] = alloc
        log.info("asked for joining allocation %s: %s", alloc.job_id, note)

    def _release(self, alloc: S.Allocation, now: float) -> None:
        idle = now - alloc.idle_since if alloc.idle_since is not None else 0.0
        note = f"given back: its engines held no job for {idle:.0f} s"
        S.cancel(alloc.job_id)  # its workers are told to leave, the daemon forgets their engines
        self._set(alloc, state="releasing", note=note)
        log.info("joined allocation %s %s", alloc.job_id, note)

    def _check_slurm(self, now: float, silent: set[str]) -> None:
        """Forget allocations Slurm ended: before they came up (refused, failed, cancelled by
        hand), while given back, or up with no worker registered (``silent``), so the rule may ask
        again; one whose workers restart stays."""
        for alloc in list(self.units.values()):
            if alloc.state in ("starting", "releasing") or alloc.job_id in silent:
                state, _ = S.job_state(alloc.job_id)
                if state in ("GONE", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL"):
                    self._ended(alloc, now, alloc.note if alloc.state == "releasing" else f"Slurm ended it ({state})")

    def _ended(self, alloc: S.Allocation, now: float, note: str) -> None:
        self.units.pop(alloc.job_id, None)
        self._set(alloc, state="released", ended_at=now, idle_since=None, note=note)

    def _set(self, alloc: S.Allocation, **changes: object) -> S.Allocation:
        """Change a joined allocation's record, here and in ``slurm.json``; the new record."""
        new = msgspec.structs.replace(alloc, **changes)
        if alloc.job_id in self.units:
            self.units[alloc.job_id] = new
        S.update_allocations(self.state_dir, lambda allocs: [new if a.job_id == alloc.job_id else a for a in allocs])
        return new
