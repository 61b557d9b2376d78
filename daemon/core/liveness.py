"""``WorkerLiveness``: the workers: registration, heartbeats, stalls and losses, and the
trainers' tier inventories and prefetches.

A worker that missed ``WORKER_LIVENESS`` heartbeats is suspect: its engines get no new calls, but
it keeps its jobs, calls and state until it answers (``_worker_back``) or is lost: silent past the
worker grace, gone from the cluster, or its process exited. A lost worker's tasks are queued again,
and the jobs whose trainer state lived on it roll back to their last checkpoint
(``JobLifecycle.roll_back``).
"""

from __future__ import annotations

import os
from typing import Any

from daemon import metrics as M
from daemon.core.lifecycle import JobLifecycle
from daemon.core.records import HEARTBEAT_S, WorkerState
from daemon.core.tables import JobTable, Settings, Turn, WorkerTable, log
from daemon.scheduler import Engine, Scheduler
from plexctl.common import protocol as P

WORKER_LIVENESS = 3  # heartbeats missed before a worker is suspect: its engines get no new calls


class WorkerLiveness:
    """The workers' state as their messages and silences tell it."""

    def __init__(
        self,
        settings: Settings,
        turn: Turn,
        jobs: JobTable,
        workers: WorkerTable,
        sched: Scheduler,
        telemetry: M.Telemetry,
        lifecycle: JobLifecycle,
    ) -> None:
        self.settings, self.turn, self.jobs, self.workers = settings, turn, jobs, workers
        self.sched, self.telemetry, self.lifecycle = sched, telemetry, lifecycle

    def worker_process_exited(self, worker_id: str, code: int) -> None:
        """The process of a worker the server started exited."""
        if worker_id in self.workers:
            self._worker_lost(worker_id, f"process exited with code {code}")

    def on_register(self, identity: bytes, header: P.Header, body: P.RegisterReq) -> None:
        now = self.turn.now
        old = self.workers.get(body.worker_id)
        if old is not None and old.identity != identity:
            self._worker_lost(body.worker_id, "re-registered")
        elif old is not None and old.suspect_since is not None:  # back from a stall: it keeps its jobs
            self._worker_back(old, now)
        self.workers.add(
            WorkerState(
                body.worker_id,
                identity,
                body.node,
                now,
                body.engines,
                body.ready,
                body.error,
                list(body.devices),
                pid=body.pid,
            )
        )
        self.jobs.resident.update(body.resident)
        if body.error:
            self.workers.problems.append(f"worker {body.worker_id}: {body.error}")
            log.error("worker %s failed: %s", body.worker_id, body.error)
        if body.ready:
            for decl in body.engines:
                if decl.engine_id not in self.sched.engines:
                    self.sched.engine_up(
                        Engine(
                            decl.engine_id,
                            body.worker_id,
                            decl.kind,
                            os.path.realpath(decl.model),
                            decl.capacity,
                            state_capacity_bytes=decl.state_capacity_bytes,
                            job_slots=decl.adapter_slots,
                            pass_tokens=decl.micro_batch_tokens,
                            state_room_bytes=decl.state_room_bytes,
                            # a worker's engines of one kind that take turns on its GPUs (one model at a time)
                            device=f"{body.worker_id}/{decl.kind}" if decl.sleeps else "",
                            holds=os.path.realpath(decl.model),  # a rollout engine starts on its base
                        ),
                        now=now,
                    )
                    self.workers.models.add(os.path.realpath(decl.model))
            log.info(
                "worker %s ready on %s: %s",
                body.worker_id,
                body.node,
                ", ".join(f"{e.engine_id}({e.model})" for e in body.engines),
            )
        self.turn.send(identity, P.Op.REPLY, {"ok": True}, header.msg_id)

    def on_heartbeat(self, identity: bytes, header: P.Header, body: P.HeartbeatBody) -> None:
        w = self.workers.get(body.worker_id)
        if w is not None and w.identity == identity:
            w.last_seen = self.turn.now
            if w.suspect_since is not None:
                self._worker_back(w, w.last_seen)

    def on_leave(self, identity: bytes, header: P.Header, body: P.HeartbeatBody) -> None:
        w = self.workers.get(body.worker_id)
        if w is not None and w.identity == identity:
            self._worker_lost(body.worker_id, "left the cluster (its allocation is ending)")

    def on_worker_exited(self, identity: bytes, header: P.Header, body: P.WorkerExited) -> None:
        """A Slurm node task saw the process of one of its workers exit: lost now, not after the grace."""
        w = self.workers.get(body.worker_id)
        if w is not None and w.pid in (0, body.pid):  # not a worker of that id registered since
            self._worker_lost(body.worker_id, f"its process exited with code {body.code} (its node task saw it)")
        self.turn.send(identity, P.Op.REPLY, {"ok": True}, header.msg_id)

    def heartbeat(self, now: float) -> None:
        """Heartbeat the workers and judge the silent ones: a worker that missed
        ``WORKER_LIVENESS`` heartbeats is suspect (``_suspect``), one silent past ``worker_grace``
        is lost; one whose process exited is lost at once (a local worker's, seen here; a Slurm
        worker's, told by its node task: ``on_worker_exited``)."""
        grace = self.settings.worker_grace
        for wid, w in list(self.workers.items()):
            silent = now - w.last_seen
            if silent > grace:
                self._worker_lost(wid, f"no heartbeat for {silent:.1f} s, past the worker grace of {grace:g} s")
                continue
            if silent > HEARTBEAT_S * WORKER_LIVENESS and w.suspect_since is None:
                self._suspect(w, now, f"no heartbeat for {silent:.1f} s")
            self.turn.send(w.identity, P.Op.HEARTBEAT, P.HeartbeatBody("plexd"))

    def _suspect(self, w: WorkerState, now: float, why: str) -> None:
        """A worker missed its heartbeats: stalled (a long GC pause, a swap storm, a file-system
        stall) or dead, not yet told apart. Its engines get no new calls; its calls in flight,
        its jobs and their state stay where they are until it answers (``_worker_back``) or is
        lost (``heartbeat``)."""
        w.suspect_since = now
        for decl in w.engines:
            self.sched.engine_suspect(decl.engine_id)
        log.warning(
            "worker %s suspect: %s; no new calls go to it, lost if still silent %g s after its last heartbeat",
            w.worker_id,
            why,
            self.settings.worker_grace,
        )
        for job_id in self.jobs.on_engines({d.engine_id for d in w.engines}):
            self.jobs.journal.event(job_id, "worker suspect", f"worker {w.worker_id}: {why}")

    def _worker_back(self, w: WorkerState, now: float) -> None:
        """A suspect worker answers again: its engines take calls again, its jobs go on where they were."""
        suspect_s = now - (w.suspect_since if w.suspect_since is not None else now)
        w.suspect_since = None
        for decl in w.engines:
            self.sched.engine_back(decl.engine_id)
        log.info("worker %s answers again after %.1f s suspect; its jobs go on", w.worker_id, suspect_s)
        for job_id in self.jobs.on_engines({d.engine_id for d in w.engines}):
            self.jobs.journal.event(job_id, "worker back", f"worker {w.worker_id} after {suspect_s:.1f} s suspect")

    def _worker_lost(self, worker_id: str, why: str) -> None:
        w = self.workers.pop(worker_id)
        if w is None:
            return
        log.error("worker %s lost: %s", worker_id, why)
        for decl in w.engines:
            for task in self.sched.engine_down(decl.engine_id):
                log.warning("re-queued %s of job %s", task.method, task.job_id)
            self.workers.engine_stats.pop(decl.engine_id, None)
        trainers = {d.engine_id for d in w.engines if d.kind == "trainer"}
        for rt in list(self.jobs.runtimes.values()):  # their adapter and optimizer state lived there
            if rt.engines & trainers and not rt.rolled_back and rt.cancel_requested_at is None:
                self.lifecycle.roll_back(rt, f"worker {worker_id} lost ({why})")

    def take_inventory(self, identity: bytes, info: dict[str, Any]) -> None:
        """A trainer's tier inventory and background moves, from a result or an INVENTORY message."""
        trainer = self.workers.trainer_of(identity, info.get("engine", ""))
        if trainer and "inventory" in info:
            self._record_inventory(trainer, info["inventory"])
            if info.get("moves"):
                self.telemetry.moved(trainer, info["moves"])

    def on_inventory(self, identity: bytes, header: P.Header, body: P.InventoryBody) -> None:
        self.take_inventory(identity, body.info)

    def _record_inventory(self, engine_id: str, inv: dict[str, Any]) -> None:
        """Keep a trainer's tier inventory for `status`, and tell the scheduler where state lives."""
        workers = self.workers
        tiers = {t: inv[t] for t in ("device", "host", "nvme") if t in inv}
        where = {job: tier for tier, info in tiers.items() for job in info.get("jobs", [])}
        if where != workers.engine_stats.get(engine_id, {}).get("where"):  # states moved: a prefetch may be asked again
            workers.prefetched.pop(engine_id, None)
        workers.engine_stats[engine_id] = {
            "tiers": tiers,
            "swaps": inv.get("swaps", {}),
            "swaps_by_kind": inv.get("swaps_by_kind", {}),
            "where": where,
        }
        for job, tier in where.items():
            if job in self.jobs.runtimes:
                self.sched.state_location(job, engine_id, tier)

    def prefetch(self, engine_id: str, worker: WorkerState, expected: list[str] | None = None) -> None:
        """Ask the trainer to bring the state of the job expected to need it next up from NVMe,
        while it serves another job or the jobs are busy elsewhere (the store moves it only if
        host memory has room for it without demoting a copy needed sooner). ``expected``: the
        engine's order, when the caller has it already."""
        expected = self.sched.expected(engine_id) if expected is None else expected
        where = self.workers.where(engine_id)
        job = next((j for j in expected if where.get(j) == "nvme"), None)
        if job is None or self.workers.prefetched.get(engine_id) == job:
            return
        self.workers.prefetched[engine_id] = job
        self.turn.send(worker.identity, P.Op.PREFETCH, P.PrefetchBody(job, engine_id, expected))

    def prefetch_for(self, job_id: str) -> None:
        """After one of the job's tasks ended: the prefetch of its trainer may change."""
        job = self.sched.jobs.get(job_id)
        engine_id = job.homes.get("trainer") if job is not None else None
        engine = self.sched.engines.get(engine_id) if engine_id else None
        worker = self.workers.get(engine.worker_id) if engine is not None else None
        if engine is not None and worker is not None:
            self.prefetch(engine.engine_id, worker)
