"""plexw: one worker per node — hosts the resident engines and executes the tasks it is given.

Threads:
- the **I/O thread** owns the DEALER socket to the daemon: it registers, heartbeats every second
  whatever the engines are doing (a long step never looks like a death), routes each task to the
  engine it names (releases too; prefetches to the prefetcher) and forwards the results the
  engine threads push to it over an inproc socket. When the daemon falls silent it registers
  again (naming the jobs whose state it holds), following ``--endpoint-file`` if the daemon moved;
  a local worker whose daemon died waits ``PLEXRL_ORPHAN_GRACE_S`` to be adopted, then exits;
- the **engine loops**: the rollout engine (vLLM) on the main thread (vLLM installs signal
  handlers), the trainer (torch + peft) on its own thread or, on CPU, on the main thread too
  (``shared_loop``: one OpenMP team, not two on the same cores).

Each engine serves the typed tasks of ``plexctl.common.calls``: the rollout engine ``generate`` by
continuous batching (tasks join the running batch between steps, whatever their job); the
trainer one task at a time from its handler table, after making the job's state resident. A
repeated trainer call (same ``call_key``) gets the last result, unapplied. A task sent ahead of
the task it follows (``TaskBody.after``) waits in ``Followers`` and starts the moment that task
ends (fails, if it failed). Engines are built once and stay resident; only jobs' state moves.

``WORKER_SPINCOUNT``: torch's OpenMP threads spin this long after each parallel region before
they sleep (unless the environment sets ``GOMP_SPINCOUNT``): long enough for the engines, short
enough that the I/O thread, the daemon and the drivers get the cores when a step ends.
"""

from __future__ import annotations

import os

WORKER_SPINCOUNT = "30000"
os.environ.setdefault(
    "GOMP_SPINCOUNT", WORKER_SPINCOUNT
)  # read once, when torch loads libgomp: before any import of it

import argparse
import logging
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, cast

import msgspec
import zmq

from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.cluster import endpoint_address, orphan_grace
from plexctl.common.cluster_config import ClusterConfig, ConfigError, min_lora_rank, read_config
from plexctl.common.frames import NOBLOCK, recv_frames, recv_message, send_frames
from plexctl.common.memplan import WorkerStep, worker_step
from plexctl.common.sizes import parse_bytes
from worker.engine_args import (
    MAX_CACHED_LORAS,
    Platform,
    adapter_slots,
    default_max_lora_rank,
    sleep_between_models,
)
from worker.engine_options import (
    DTYPES,
    EngineOptions,
    OptionError,
    engine_options,
    visible_device_ids,
)

log = logging.getLogger("plexw")

HEARTBEAT_S = 1.0
DAEMON_LIVENESS = 2.5  # heartbeats of silence before registering again
OUTBOX = "inproc://plexw-outbox"
PREFETCH = "prefetch"  # queue of state prefetches, served beside the trainer


class Followers:
    """Tasks the daemon sent ahead of the task they follow (``TaskBody.after``, a task of this
    worker), e.g. a job's next generate behind its ``train_step`` that publishes the adapter it
    samples from: held until that task ends, then routed to their engine by the thread that
    ended it, with no trip to the daemon in between (it succeeded), or failed (it failed)."""

    KEEP = 4096  # outcomes of the latest tasks kept, for followers that arrive after their task ended

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.route: Callable[[P.TaskBody], None] = lambda _t: None  # set by the I/O thread
        self.ended: dict[int, bool] = {}  # task id -> ok
        self.waiting: dict[int, list[P.TaskBody]] = {}  # task id -> the tasks that follow it

    def admit(self, t: P.TaskBody) -> bool | None:
        """For a task with ``after``: True, route it now; False, the task it follows failed;
        None, held until that task ends."""
        with self.lock:
            ok = self.ended.get(t.after)
            if ok is None:
                self.waiting.setdefault(t.after, []).append(t)
            return ok

    def task_ended(self, task_id: int, ok: bool) -> list[P.TaskBody]:
        """Record a task's outcome; the tasks that were waiting for it."""
        with self.lock:
            self.ended[task_id] = ok
            if len(self.ended) > self.KEEP:
                del self.ended[next(iter(self.ended))]
            return self.waiting.pop(task_id, [])

    @staticmethod
    def failed(t: P.TaskBody) -> P.ResultBody:
        """The result of a task whose predecessor failed: it never ran."""
        return P.ResultBody(t.task_id, False, error=f"{t.method} was to follow task {t.after}, which failed")


class WorkerIO(threading.Thread):
    """Socket I/O, heartbeats and task routing, on its own thread."""

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        register: P.RegisterReq,
        queues: dict[str, queue.Queue[Any]],
        parent_pid: int | None,
        endpoint_file: Path | None = None,
        followers: Followers | None = None,
    ) -> None:
        super().__init__(name="plexw-io", daemon=True)
        self.followers = followers or Followers()
        self.dealer: zmq.Socket | None = None  # the socket to the daemon, made on this thread
        self.followers.route = self._route_task
        self.endpoint = endpoint
        self.endpoint_file = endpoint_file
        self.resident: Callable[[], dict[str, str]] = dict  # job -> trainer engine, for registering again
        self.worker_id = worker_id
        self.register = register
        self.queues = queues
        self.parent_pid = parent_pid
        self.ctx: zmq.Context = zmq.Context.instance()
        self.bound = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        dealer = self.dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, f"wrk:{self.worker_id}".encode())
        dealer.setsockopt(zmq.LINGER, 1000)
        keys = auth.internal_keys_from_env()  # the daemon (or the Slurm node task) names the cluster's keys
        if keys is not None:
            keys.apply(dealer)
        dealer.connect(self.endpoint)
        outbox = self.ctx.socket(zmq.PULL)
        outbox.bind(OUTBOX)
        self.bound.set()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        send_frames(dealer, P.encode(P.Op.REGISTER, self.register)[0])
        last_beat = last_daemon = heard = time.monotonic()
        while not self.stop.is_set():
            events = dict(poller.poll(200))
            if outbox in events:
                while True:
                    try:
                        frames = recv_frames(outbox, NOBLOCK)
                    except zmq.Again:
                        break
                    send_frames(dealer, frames)
            if dealer in events:
                while True:
                    try:
                        message = recv_message(dealer, NOBLOCK)
                    except zmq.Again:
                        break
                    last_daemon = heard = time.monotonic()
                    self._route(message)
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_S:
                last_beat = now
                send_frames(dealer, P.encode(P.Op.HEARTBEAT, P.HeartbeatBody(self.worker_id))[0])
                if now - last_daemon > HEARTBEAT_S * DAEMON_LIVENESS:
                    # the daemon went away (or restarted): register again until one answers
                    self._follow_endpoint(dealer)
                    register = msgspec.structs.replace(self.register, resident=self.resident())
                    send_frames(dealer, P.encode(P.Op.REGISTER, register)[0])
                    last_daemon = now
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning(
                    "the daemon (pid %d) is gone; waiting up to %.0f s for the next one",
                    self.parent_pid,
                    orphan_grace(),
                )
                self.parent_pid = 0  # a local worker: it leaves when no daemon is heard for the grace
            if self.parent_pid == 0 and now - heard > orphan_grace():
                log.error("no daemon heard for %.0f s; exiting", orphan_grace())
                logging.shutdown()
                os._exit(1)
        dealer.close()
        outbox.close()

    def _follow_endpoint(self, dealer: zmq.Socket) -> None:
        """Connect to the address a restarted daemon wrote, if it moved."""
        address = endpoint_address(self.endpoint_file) if self.endpoint_file else None
        if address and address != self.endpoint:
            log.info("the daemon moved to %s", address)
            dealer.disconnect(self.endpoint)
            dealer.connect(address)
            self.endpoint = address

    def _route(self, frames: list[bytes]) -> None:
        try:
            op, _header, body = P.decode(frames)
        except P.ProtocolError as exc:
            log.warning("dropped bad message from daemon: %s", exc)
            return
        if op == P.Op.TASK:
            if body.after:
                ok = self.followers.admit(body)
                if ok is None:
                    return  # routed when the task it follows ends
                if not ok:
                    assert self.dealer is not None  # made by run, the one caller
                    send_frames(self.dealer, P.encode(P.Op.RESULT, self.followers.failed(body))[0])
                    return
            self._route_task(body)
        elif op in (P.Op.RELEASE, P.Op.TASK_PASS):
            self._route_task(body)
        elif op == P.Op.PREFETCH:
            self.queues[PREFETCH].put(body)
        elif op == P.Op.SHUTDOWN:  # the daemon is stopping: its jobs have checkpointed
            log.info("the daemon is stopping; exiting")
            logging.shutdown()
            os._exit(0)

    def _route_task(self, body: P.TaskBody | P.TaskPassBody | P.ReleaseBody) -> None:
        """To the queue of the engine it is for."""
        q = self.queues.get(body.engine_id)
        if q is None:
            log.error("%s of job %s for unknown engine %s", type(body).__name__, body.job_id, body.engine_id)
            return
        q.put(body)


class Outbox:
    """Per-thread PUSH socket to the I/O thread. With ``followers``, a result also starts the
    tasks that were waiting for it (or fails them)."""

    def __init__(self, followers: Followers | None = None) -> None:
        self.sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.connect(OUTBOX)
        self.followers = followers

    def result(
        self,
        task_id: int,
        ok: bool,
        value: C.AnyResult | None = None,
        error: str = "",
        seconds: float = 0.0,
        info: dict[str, Any] | None = None,
        switch_seconds: float = 0.0,
    ) -> None:
        body = P.ResultBody(
            task_id=task_id,
            ok=ok,
            value=value,
            error=error,
            seconds=seconds,
            switch_seconds=switch_seconds,
            info=info or {},
        )
        waiting = self.followers.task_ended(task_id, ok) if self.followers is not None else []
        send_frames(self.sock, P.encode(P.Op.RESULT, body)[0])
        if self.followers is not None:  # after the result: the daemon hears of this task first
            for t in waiting:
                if ok:
                    self.followers.route(t)
                else:
                    self.result(t.task_id, False, error=self.followers.failed(t).error)

    def inventory(self, info: dict[str, Any]) -> None:
        send_frames(self.sock, P.encode(P.Op.INVENTORY, P.InventoryBody(info))[0])

    def register(self, req: P.RegisterReq) -> None:
        send_frames(self.sock, P.encode(P.Op.REGISTER, req)[0])


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class RolloutServer:
    """Serves generate tasks by continuous batching: a task's prompts join the engine's running
    batch at its next step, whatever jobs are in it (one adapter per job), and each task is
    answered as soon as its own prompts finished."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.started: dict[int, float] = {}  # task id -> start time, for the tasks in flight
        self.switched: dict[int, float] = {}  # task id -> seconds its engine switched weights (or woke) for it

    @property
    def busy(self) -> bool:
        return bool(self.started)

    def admit(self, batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody], out: Outbox, woke_s: float = 0.0) -> None:
        """Start the generate tasks of ``batch``; carry out a release (after failing that job's
        tasks in flight) and refuse other methods. A bad request fails its own task only.
        ``woke_s``: the engine just woke for this batch (reported with its first task)."""
        for t in batch:
            if isinstance(t, P.ReleaseBody):
                for key in self.engine.in_flight_of(t.job_id):
                    self.started.pop(key, None)
                    self.switched.pop(key, None)
                    out.result(key, False, error="the job was released")
                self.engine.drop_job(t.job_id)
            elif isinstance(t, P.TaskPassBody):
                for member in t.tasks:
                    out.result(member.task_id, False, error=f"rollout engine cannot {member.method!r}")
            elif not isinstance(t.task, C.GenerateTask):
                out.result(t.task_id, False, error=f"rollout engine cannot {t.method!r}")
            elif t.task_id not in self.started:  # a repeat of a task in flight is answered once
                loads, t0 = getattr(self.engine, "weight_loads", 0), time.perf_counter()
                try:
                    self.engine.start(t.task_id, t.task.request)
                except Exception as exc:  # noqa: BLE001 - reported to its job, the engine stays up
                    log.warning("generate task %s refused: %s", t.task_id, _error_text(exc))
                    out.result(t.task_id, False, error=_error_text(exc))
                    continue
                self.started[t.task_id] = time.perf_counter()
                loaded = self.started[t.task_id] - t0 if getattr(self.engine, "weight_loads", 0) != loads else 0.0
                if loaded or woke_s:
                    self.switched[t.task_id] = loaded + woke_s
                    woke_s = 0.0

    def step(self, out: Outbox) -> None:
        """One engine step; answer the tasks it finished. A failed step fails every task in flight."""
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - reported to each job, the engine stays up
            log.error("generate failed: %s", traceback.format_exc())
            keys = list(self.started)
            self.engine.abort(keys)
            self.started.clear()
            self.switched.clear()
            for key in keys:
                out.result(key, False, error=_error_text(exc))
            return
        now = time.perf_counter()
        for key, completions in finished:
            t0 = self.started.pop(key, now)
            switched = self.switched.pop(key, 0.0)
            out.result(key, True, C.GenerateResult(completions), seconds=now - t0, switch_seconds=switched)

    def serve(self, batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody], out: Outbox) -> None:
        """A fixed batch, run to the end."""
        self.admit(batch, out)
        while self.busy:
            self.step(out)


class TrainerServer:
    """Serves trainer tasks one at a time; before each, the store makes the job's state resident
    (swapping another job's state out to host or NVMe when the device tier is full).

    A task that carries the ``call_key`` of the job's last stateful call is a repeat (a driver
    sent its calls again after its daemon restarted): it gets that call's result, unapplied."""

    def __init__(self, store: Any, engine_id: str = "") -> None:
        self.store = store
        self.engine_id = engine_id  # named in what it reports: a worker may host a trainer per model
        engine = store.trainer
        self.handlers: dict[str, Callable[[str, Any], C.AnyResult]] = {
            "train_step": lambda job, t: self._train_step(engine, job, t),
            "publish": lambda job, t: self._publish(engine, job, t),
            "checkpoint": lambda job, t: C.CheckpointResult(engine.save_checkpoint(job, t.out_dir, t.extra)),
            "restore": lambda job, t: C.RestoreResult(
                engine.load_checkpoint(job, t.ckpt_dir, t.trainer.lora, t.trainer.seed, t.weights_only)
            ),
            "forward_backward": lambda job, t: engine.forward_backward(job, t.call),
            "optim_step": lambda job, t: self._optim_step(engine, job, t),
        }
        assert set(self.handlers) == {m.name for m in C.METHODS.values() if m.kind == "trainer"}
        self.done: dict[str, tuple[str, C.AnyResult]] = {}  # job -> (call key, result) of its last stateful call
        self._moves_sent = 0  # the store's background moves already reported

    def _info(self) -> dict[str, Any]:
        """What every result carries for the daemon: the store's tier inventory and the moves
        made off this thread (prefetches and their demotions, writes left behind by evictions)
        since the last result."""
        self._moves_sent, moves = self.store.background_moves(self._moves_sent)
        info: dict[str, Any] = {"inventory": self.store.inventory()}
        if self.engine_id:
            info["engine"] = self.engine_id
        if moves:
            info["moves"] = [list(move) for move in moves]
        return info

    @staticmethod
    def _train_step(engine: Any, job_id: str, t: C.TrainStepTask) -> C.TrainStepResult:
        """One optimizer step; with ``publish_dir``, the adapter is saved there after it."""
        metrics = engine.train_step(job_id, t.batch, t.hp)
        if t.publish_dir:
            engine.save_adapter(job_id, t.publish_dir)
        return C.TrainStepResult(metrics)

    @staticmethod
    def _optim_step(engine: Any, job_id: str, t: C.OptimStepTask) -> C.OptimStepResult:
        """One AdamW step on the summed gradient of the loss calls; with ``publish_dir``, the
        adapter is saved there after it."""
        result: C.OptimStepResult = engine.optim_step(job_id, t.calls, t.adam)
        if t.publish_dir:
            engine.save_adapter(job_id, t.publish_dir)
        return result

    @staticmethod
    def _publish(engine: Any, job_id: str, t: C.PublishTask) -> C.PublishResult:
        engine.save_adapter(job_id, t.out_dir)
        return C.PublishResult()

    def _publish_again(self, job_id: str, task: C.AnyTask) -> None:
        """A repeated call that publishes: the job's adapter is as that call left it (it was the
        job's last stateful call), so it is saved again where the repeat names, if not there yet."""
        out_dir = getattr(task, "publish_dir", "") or (task.out_dir if isinstance(task, C.PublishTask) else "")
        if not out_dir or (Path(out_dir) / "adapter_config.json").exists():
            return
        assert not isinstance(task, C.GenerateTask)
        self.store.ensure_resident(job_id, task.trainer.lora, task.trainer.seed, task.trainer.weight_decay)
        self.store.trainer.save_adapter(job_id, out_dir)

    def serve_pass(self, p: P.TaskPassBody, out: Outbox) -> None:
        """Several jobs' train steps in shared passes (``TrainingMath.train_group``), at most as
        many jobs at once as the device tier holds, each step reported on its own with the
        pass's seconds. A repeat, or a step that cannot share (no LoRA, LoRA dropout), runs
        alone as ``serve`` runs it; a pass that fails before its steps runs them one by one."""
        members: list[P.TaskBody] = []
        for t in p.tasks:
            task = t.task
            if not isinstance(task, C.TrainStepTask):
                self.serve(t, out)
                continue
            key, lora = task.trainer.call_key, task.trainer.lora
            if (key and self.done.get(t.job_id, ("", None))[0] == key) or lora is None or lora.dropout > 0:
                self.serve(t, out)
            else:
                members.append(t)
        size = max(1, int(getattr(self.store, "device_slots", len(members)) or 1))
        for i in range(0, len(members), size):
            chunk = members[i : i + size]
            if len(chunk) == 1:
                self.serve(chunk[0], out)
            else:
                self._serve_shared(chunk, out)

    def _serve_shared(self, chunk: list[P.TaskBody], out: Outbox) -> None:
        """One shared pass: the members' states made resident together (they come first in the
        store's order, so none evicts another), one ``train_group``, a result each."""
        store, engine, t0 = self.store, self.store.trainer, time.perf_counter()
        tasks = [cast(C.TrainStepTask, t.task) for t in chunk]
        ids = [t.job_id for t in chunk]
        try:
            store.set_upcoming(ids + [j for j in tasks[0].trainer.upcoming if j not in ids])
            moved = [
                store.ensure_resident(j, t.trainer.lora, t.trainer.seed, t.trainer.weight_decay)
                for j, t in zip(ids, tasks)
            ]
            if not set(ids) <= set(engine.jobs()):
                raise RuntimeError(f"the device tier did not hold {', '.join(ids)} at once")
            metrics = engine.train_group([(j, t.batch, t.hp) for j, t in zip(ids, tasks)])
        except Exception:  # noqa: BLE001 - each step runs again alone, and reports its own error
            log.warning("shared pass of %s failed; each runs alone: %s", ", ".join(ids), traceback.format_exc())
            for t in chunk:
                self.serve(t, out)
            return
        seconds = time.perf_counter() - t0
        for t, task, m, mv in zip(chunk, tasks, metrics, moved):
            try:
                if task.publish_dir:
                    engine.save_adapter(t.job_id, task.publish_dir)
            except Exception as exc:  # noqa: BLE001 - reported to the job, the engine stays up
                log.error("publish for %s failed: %s", t.job_id, traceback.format_exc())
                out.result(t.task_id, False, error=_error_text(exc), seconds=seconds, info=self._info())
                continue
            m.update(
                swap_bytes=float(mv.get("bytes", 0)),
                swap_seconds=float(mv.get("seconds", 0.0)),
                swap_evicted=float(len(mv.get("evicted", []))),
            )
            value = C.TrainStepResult(m)
            if task.trainer.call_key:
                self.done[t.job_id] = (task.trainer.call_key, value)
            out.result(t.task_id, True, value, seconds=seconds, info=self._info())

    def release(self, t: P.ReleaseBody, out: Outbox) -> None:
        """Drop the job's state; the daemon hears of the inventory it leaves."""
        try:
            self.store.drop(t.job_id)
        except Exception:  # noqa: BLE001 - the engine stays up
            log.error("release of %s failed: %s", t.job_id, traceback.format_exc())
        self.done.pop(t.job_id, None)
        out.inventory(self._info())

    def serve(self, t: P.TaskBody | P.ReleaseBody, out: Outbox) -> None:
        if isinstance(t, P.ReleaseBody):
            self.release(t, out)
            return
        store, task = self.store, t.task
        t0 = time.perf_counter()
        if isinstance(task, C.GenerateTask):
            out.result(t.task_id, False, error="trainer engine cannot 'generate'", info=self._info())
            return
        key = task.trainer.call_key
        if key and self.done.get(t.job_id, ("", None))[0] == key:
            try:  # a restarted daemon may name another directory for the adapter the call published
                self._publish_again(t.job_id, task)
            except Exception as exc:  # noqa: BLE001 - reported to the job, the engine stays up
                log.error("%s for %s failed: %s", t.method, t.job_id, traceback.format_exc())
                out.result(t.task_id, False, error=_error_text(exc), seconds=0.0, info=self._info())
                return
            out.result(t.task_id, True, self.done[t.job_id][1], seconds=0.0, info=self._info())
            return
        try:
            store.set_upcoming(list(task.trainer.upcoming))
            moved = store.ensure_resident(t.job_id, task.trainer.lora, task.trainer.seed, task.trainer.weight_decay)
            value = self.handlers[t.method](t.job_id, task)
            if isinstance(value, C.TrainStepResult):
                value.metrics.update(
                    swap_bytes=float(moved.get("bytes", 0)),
                    swap_seconds=float(moved.get("seconds", 0.0)),
                    swap_evicted=float(len(moved.get("evicted", []))),
                )
        except Exception as exc:  # noqa: BLE001 - reported to the job, the engine stays up
            log.error("%s for %s failed: %s", t.method, t.job_id, traceback.format_exc())
            out.result(t.task_id, False, error=_error_text(exc), seconds=time.perf_counter() - t0, info=self._info())
            return
        if key:
            self.done[t.job_id] = (key, value)
        out.result(t.task_id, True, value, seconds=time.perf_counter() - t0, info=self._info())


class Rollouts:
    """The worker's rollout engines, one per model, behind ``RolloutServer``'s interface: a task
    goes to the engine its ``engine_id`` names. Resident engines (CPU) step in turn. Engines
    that take turns (``one_awake``: several models on a GPU) keep one awake: a task for a
    sleeping engine waits until the awake one has nothing in flight, then the longest-waiting
    model's engine wakes (the other sleeps) and takes every task waiting for it, so one wake
    serves a whole group."""

    def __init__(self, engines: dict[str, Any], one_awake: bool = False) -> None:
        self.servers = {engine_id: RolloutServer(engine) for engine_id, engine in engines.items()}
        self.one_awake = one_awake and len(engines) > 1
        self.waiting: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody] = []  # for an engine asleep, oldest first
        awake = [engine_id for engine_id, engine in engines.items() if getattr(engine, "awake", True)]
        self.awake = awake[-1] if awake else next(iter(engines))

    @property
    def started(self) -> dict[int, float]:
        return {key: t0 for server in self.servers.values() for key, t0 in server.started.items()}

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(server.busy for server in self.servers.values())

    def admit(self, batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody], out: Outbox) -> None:
        by_engine: dict[str, list[P.TaskBody | P.TaskPassBody | P.ReleaseBody]] = {}
        for t in batch:
            if t.engine_id not in self.servers:
                if isinstance(t, P.TaskBody):
                    out.result(t.task_id, False, error=f"no engine {t.engine_id!r} on this worker")
            elif self.one_awake and t.engine_id != self.awake and not isinstance(t, P.ReleaseBody):
                self.waiting.append(t)
            else:
                by_engine.setdefault(t.engine_id, []).append(t)
        for engine_id, tasks in by_engine.items():
            self.servers[engine_id].admit(tasks, out)

    def step(self, out: Outbox) -> None:
        for server in self.servers.values():
            if server.busy:
                server.step(out)
        if self.waiting and not self.servers[self.awake].busy:
            self._switch(out)

    def _switch(self, out: Outbox) -> None:
        """Wake the engine of the oldest waiting task, sleeping the awake one; admit its group."""
        to = next_awake(self.awake, [t.engine_id for t in self.waiting])
        woke_s = 0.0
        if to != self.awake:
            t0 = time.perf_counter()
            self.servers[self.awake].engine.sleep()
            self.servers[to].engine.wake()
            woke_s = time.perf_counter() - t0
            log.info("rollout engine %s awake (%s asleep) in %.2f s", to, self.awake, woke_s)
            self.awake = to
        group = [t for t in self.waiting if t.engine_id == to]
        self.waiting = [t for t in self.waiting if t.engine_id != to]
        self.servers[to].admit(group, out, woke_s)

    def serve(self, batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody], out: Outbox) -> None:
        self.admit(batch, out)
        while self.busy:
            self.step(out)


def next_awake(awake: str, waiting: list[str]) -> str:
    """The engine to wake when the awake one is idle: that of the oldest waiting task (``waiting``
    holds the engine of each waiting task, oldest first); the awake one if nothing waits."""
    return waiting[0] if waiting else awake


class Trainers:
    """The worker's trainer engines, one per model, each behind its ``TrainerServer``: a task
    goes to the one its ``engine_id`` names; one task at a time, whichever model (one device).
    ``stores``: engine id -> store, or one store, which serves every task. Engines that take
    turns (``one_awake``: several bases on a GPU) keep one base on the device: before a task of
    another model's engine, the awake one's base sleeps to host memory and the task's wakes,
    the seconds reported with that task (``switch_seconds``)."""

    def __init__(self, stores: dict[str, Any] | Any, one_awake: bool = False) -> None:
        stores = stores if isinstance(stores, dict) else {"": stores}
        self.servers = {engine_id: TrainerServer(store, engine_id) for engine_id, store in stores.items()}
        self.one_awake = one_awake and len(self.servers) > 1
        self.awake = next(reversed(self.servers))  # the one built last, until a task names another
        if self.one_awake:
            for engine_id, server in self.servers.items():
                if engine_id != self.awake:
                    server.store.trainer.sleep()

    def serve(self, t: P.TaskBody | P.TaskPassBody | P.ReleaseBody, out: Outbox) -> None:
        one = next(iter(self.servers.values())) if len(self.servers) == 1 else None
        server = one or self.servers.get(t.engine_id)
        if server is None:
            for task in t.tasks if isinstance(t, P.TaskPassBody) else [t] if isinstance(t, P.TaskBody) else []:
                out.result(task.task_id, False, error=f"no engine {t.engine_id!r} on this worker")
            return
        if self.one_awake and t.engine_id != self.awake and not isinstance(t, P.ReleaseBody):
            t0 = time.perf_counter()
            self.servers[self.awake].store.trainer.sleep()
            server.store.trainer.wake()
            switched = time.perf_counter() - t0
            log.info("trainer %s awake (%s asleep) in %.2f s", t.engine_id, self.awake, switched)
            self.awake = t.engine_id
            first = t.tasks[0].task_id if isinstance(t, P.TaskPassBody) else t.task_id
            out = _WithSwitch(out, first, switched)  # type: ignore[assignment]
        if isinstance(t, P.TaskPassBody):
            server.serve_pass(t, out)
        else:
            server.serve(t, out)


class _WithSwitch:
    """An outbox that reports ``seconds`` of switching with the result of ``task_id``."""

    def __init__(self, out: Outbox, task_id: int, seconds: float) -> None:
        self.out, self.task_id, self.seconds = out, task_id, seconds

    def result(self, task_id: int, ok: bool, *args: Any, **kwargs: Any) -> None:
        if task_id == self.task_id:
            kwargs["switch_seconds"] = self.seconds
        self.out.result(task_id, ok, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


def _take(
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]", limit: int
) -> list[P.TaskBody | P.TaskPassBody | P.ReleaseBody]:
    """The next task (waiting for it) and those already queued behind it, up to ``limit``."""
    first = tasks.get()
    return [first, *_take_waiting(tasks, limit - 1)]


def rollout_loop(
    server: Rollouts,
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]",
    capacity: int,
    followers: Followers | None = None,
) -> None:
    """Continuous batching: between engine steps, tasks that arrived join the running batch
    (up to ``capacity`` generate tasks in flight); with nothing in flight, wait for one."""
    out = Outbox(followers)
    while True:
        if not server.busy:
            server.admit(_take(tasks, capacity), out)
        room = capacity - len(server.started)
        if room > 0:
            server.admit(_take_waiting(tasks, room), out)
        server.step(out)


def _take_waiting(
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]", limit: int
) -> list[P.TaskBody | P.TaskPassBody | P.ReleaseBody]:
    """The tasks already queued, up to ``limit``, without waiting."""
    batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody] = []
    while len(batch) < limit:
        try:
            batch.append(tasks.get_nowait())
        except queue.Empty:
            break
    return batch


def trainer_loop(
    stores: dict[str, Any] | Any,
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]",
    followers: Followers | None = None,
    one_awake: bool = False,
) -> None:
    """Trainer tasks one at a time; ``stores`` and ``one_awake`` as ``Trainers`` takes them."""
    server, out = Trainers(stores, one_awake), Outbox(followers)
    while True:
        server.serve(tasks.get(), out)


def shared_loop(
    rollout: Rollouts,
    stores: dict[str, Any],
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]",
    capacity: int,
    followers: Followers | None = None,
    one_awake: bool = False,
) -> None:
    """Both engines of this worker served from one thread, from one queue: the generates
    waiting are one batch, trainer tasks run in the order they came, whichever kind came first
    goes first. On CPU the engines share the cores anyway, and torch's OpenMP thread team is
    per calling thread: two engine threads mean two teams spinning on the same cores."""
    trainer, out = Trainers(stores, one_awake), Outbox(followers)
    while True:
        batch = _take(tasks, 1 << 10)
        gens = [t for t in batch if t.engine_id.endswith("/rollout")]
        train = [t for t in batch if not t.engine_id.endswith("/rollout")]
        first, then = (train, []) if train and batch[0] is train[0] else ([], train)
        for t in first:
            trainer.serve(t, out)
        for i in range(0, len(gens), capacity):
            rollout.serve(gens[i : i + capacity], out)
        for t in then:
            trainer.serve(t, out)


def prefetch_loop(stores: dict[str, Any] | Any, tasks: "queue.Queue[P.PrefetchBody]") -> None:
    """Bring jobs' state from NVMe to host memory ahead of need, overlapping other jobs' steps
    (``stores``: engine id -> store, or one store)."""
    while True:
        t = tasks.get()
        store = stores.get(t.engine_id) if isinstance(stores, dict) else stores
        if store is None:
            continue
        try:
            if t.upcoming:  # the daemon's newest order (the trainer's calls bring it too)
                store.set_upcoming(list(t.upcoming))
            store.prefetch(t.job_id)
        except Exception:  # noqa: BLE001 - a failed prefetch only means a slower swap-in later
            log.warning("prefetch of %s failed: %s", t.job_id, traceback.format_exc())


def write_behind_bytes(asked: int | None, host_mem: int) -> int:
    """The trainer's write-behind allowance: as asked, else a quarter of its host tier, at least 1 GiB."""
    return asked if asked is not None else max(host_mem // 4, 1 << 30)


def build_parser(config: ClusterConfig | None = None) -> argparse.ArgumentParser:
    """The worker's command line: what identifies it (endpoint, id, node, its engines and models,
    scratch), and the cluster settings its engines are built with, whose defaults are ``config``'s
    (the cluster config the worker was pointed at, every default without one): a flag here
    overrides one setting for this worker (benchmarks and checks build engines so)."""
    ap = argparse.ArgumentParser(prog="plexw", description="PlexRL worker (started by the daemon or srun).")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--worker-id", default=socket.gethostname())
    ap.add_argument("--node", default=socket.gethostname(), help="node name shown in status")
    ap.add_argument("--engines", default="rollout,trainer")
    ap.add_argument(
        "--model",
        action="append",
        required=True,
        help="a base model the engines serve; repeat for several (an engine of each kind per model)",
    )
    ap.add_argument(
        "--cluster-config", type=Path, default=None, help="the cluster's settings (cluster.json; none: every default)"
    )
    ap.add_argument("--scratch", type=Path, default=None, help="node-local directory for state")
    ap.add_argument("--rollout-capacity", type=int, default=16, help="generate calls batched together")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the trainer")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs of one rollout engine")
    ap.add_argument("--max-cpu-loras", type=int, default=None, help="adapters cached in host memory by vLLM")
    ap.add_argument(
        "--min-lora-rank",
        type=int,
        help="without --max-lora-rank, the default covers at least this rank (with tinker_port: the SDK's default)",
    )
    ap.add_argument(
        "--exit-with-parent",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exit when the daemon that started this worker is gone and no other adopts it",
    )
    ap.add_argument(
        "--engine-threads",
        choices=["auto", "one", "own"],
        default="auto",
        help="a worker with both engines serves them from one thread or each from its own "
        "(auto: one on CPU, own with CUDA)",
    )
    ap.add_argument(
        "--endpoint-file", type=Path, default=None, help="the cluster's endpoint.json: where a restarted daemon is"
    )
    settings = ap.add_argument_group("cluster settings", "defaults: the cluster config's (docs/cluster-reference.md)")
    settings.add_argument("--device", help="where the engines run: auto, cpu or cuda")
    settings.add_argument("--dtype", choices=["auto", *DTYPES], help="weight dtype of the engines")
    settings.add_argument("--max-loras", type=int, help="adapter slots in the rollout engine")
    settings.add_argument("--jobs-per-engine", type=int, help="jobs the rollout engine keeps adapters loaded for")
    settings.add_argument("--max-lora-rank", type=int, help="highest LoRA rank the rollout engine loads")
    settings.add_argument(
        "--gpu-memory-utilization", type=float, help="share of its GPUs' memory the rollout engine takes"
    )
    settings.add_argument("--micro-batch-tokens", type=int, help="padded tokens of one trainer micro-batch")
    settings.add_argument("--gradient-checkpointing", choices=["auto", "on", "off"], help="recompute activations")
    settings.add_argument("--max-model-len", type=int, help="tokens of a sequence the rollout engine holds")
    settings.add_argument("--device-slots", type=int, help="jobs whose trainer state stays on device")
    settings.add_argument("--host-mem", type=parse_bytes, help="host tier for swapped-out state")
    settings.add_argument("--nvme-dir", type=Path, help="NVMe tier (none: SCRATCH/nvme)")
    settings.add_argument("--nvme-bytes", type=parse_bytes, help="capacity of the NVMe tier")
    settings.add_argument("--write-behind", type=parse_bytes, help="host memory for states on their way to NVMe")
    ap.set_defaults(**worker_settings(config or ClusterConfig()))
    return ap


def worker_settings(config: ClusterConfig) -> dict[str, Any]:
    """The cluster settings a worker builds its engines with, as its parser's defaults."""
    return {
        "device": config.device,
        "dtype": config.dtype,
        "max_loras": config.max_loras,
        "jobs_per_engine": config.jobs_per_engine,
        "max_lora_rank": config.max_lora_rank,
        "min_lora_rank": min_lora_rank(config),
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "micro_batch_tokens": config.micro_batch_tokens,
        "gradient_checkpointing": config.gradient_checkpointing,
        "max_model_len": config.max_model_len,
        "device_slots": config.device_slots,
        "host_mem": parse_bytes(config.host_mem),
        "nvme_dir": None if config.nvme_dir is None else Path(config.nvme_dir),
        "nvme_bytes": parse_bytes(config.nvme_bytes),
        "write_behind": None if config.write_behind is None else parse_bytes(config.write_behind),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's arguments: its ``--cluster-config`` read first, its settings the defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--cluster-config", type=Path, default=None)
    try:
        config = read_config(pre.parse_known_args(argv)[0].cluster_config)
    except ConfigError as exc:
        build_parser().error(str(exc))
    return build_parser(config).parse_args(argv)


def build_engines(
    args: argparse.Namespace,
    kinds: list[str],
    options: EngineOptions,
    model: str,
    sleep_mode: bool = False,
    nvme_dir: Path | None = None,
) -> dict[str, Any]:
    """One model's resident engines, as the worker's options say: ``trainer`` (a ``StateStore``
    around the ``TrainerEngine``) and/or ``rollout`` (a ``RolloutEngine``; ``sleep_mode``: it
    takes turns with other models' engines)."""
    engines: dict[str, Any] = {}
    if "trainer" in kinds:
        from worker.state.store import StateStore
        from worker.trainer import TrainerEngine

        nvme_dir = nvme_dir or args.nvme_dir or (args.scratch or Path(tempfile.gettempdir()) / "plexw") / "nvme"
        step = trainer_step(args, kinds, options, model)
        cap_memory(step.memory_fraction, options.device)
        trainer = TrainerEngine(
            model,
            dtype=options.dtype,
            device=options.device,
            threads=args.threads,
            micro_batch_tokens=options.micro_batch_tokens,
            gradient_checkpointing=step.gradient_checkpointing,
        )
        trainer.step_info = step_info(step, options.micro_batch_tokens)
        engines["trainer"] = StateStore(
            trainer,
            device_slots=args.device_slots,
            host_bytes=args.host_mem,
            nvme_dir=nvme_dir,
            nvme_bytes=args.nvme_bytes,
            write_behind_bytes=write_behind_bytes(args.write_behind, args.host_mem),
        )
    if "rollout" in kinds:
        from worker.rollout import RolloutEngine, default_max_model_len

        max_loras, max_cpu_loras = _adapter_slots(args, options.device)
        engines["rollout"] = RolloutEngine(
            model,
            dtype=options.dtype,
            max_lora_rank=_max_lora_rank(args, options.device),
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            max_model_len=args.max_model_len or default_max_model_len(model),
            platform=options.device,
            tensor_parallel_size=args.tensor_parallel_size,
            sleep_mode=sleep_mode,
            **(
                {"gpu_memory_utilization": args.gpu_memory_utilization}
                if args.gpu_memory_utilization is not None
                else {}
            ),
        )
    return engines


def _max_lora_rank(args: argparse.Namespace, device: Platform) -> int:
    """``--max-lora-rank``, else the platform's default raised to cover ``--min-lora-rank``."""
    return int(args.max_lora_rank or default_max_lora_rank(device, [args.min_lora_rank] if args.min_lora_rank else []))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.umask(0o077)  # checkpoints, adapters and scratch copies are the cluster owner's alone
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # an allocation's drain signal is the daemon's to act on
        signal.signal(sig, signal.SIG_IGN)

    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    unknown = set(kinds) - {"rollout", "trainer"}
    if unknown or not kinds:
        build_parser().error(f"--engines: unknown engine kinds {sorted(unknown)}")
    models = list(dict.fromkeys(os.path.realpath(m) for m in args.model))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        options = engine_options(args.device, args.dtype, args.micro_batch_tokens, _cuda(), visible)
    except OptionError as exc:
        options, option_error = None, str(exc)
    else:
        option_error = ""
    device = options.device if options else "cpu"
    max_lora_rank = _max_lora_rank(args, device)
    sleep_mode = sleep_between_models(device, len(models))
    decls = [
        P.EngineDecl(
            engine_id(args.worker_id, k, m),
            k,
            model,
            args.rollout_capacity if k == "rollout" else 1,
            state_capacity_bytes=max(args.host_mem, args.nvme_bytes) if k == "trainer" else 0,
            state_room_bytes=args.host_mem + args.nvme_bytes if k == "trainer" else 0,
            adapter_slots=_adapter_slots(args, device)[1] if k == "rollout" else 0,
            dtype=options.dtype if options else "",
            device=device,
            max_lora_rank=max_lora_rank if k == "rollout" else 0,
            sleeps=sleep_mode,  # its worker's engines of its kind take turns on the GPU
        )
        for m, model in enumerate(models)
        for k in kinds
    ]
    register = P.RegisterReq(
        worker_id=args.worker_id,
        node=args.node,
        pid=os.getpid(),
        engines=decls,
        ready=False,
        mem_bytes=_mem_bytes(),
        devices=visible_device_ids(visible),
    )
    log.info(
        "worker %s on %s: engines %s of %s, device %s, CUDA_VISIBLE_DEVICES=%s, scratch %s",
        args.worker_id,
        args.node,
        ",".join(kinds),
        ", ".join(models),
        device,
        visible if visible is not None else "(unset)",
        args.scratch,
    )
    shared = args.engine_threads == "one" or (args.engine_threads == "auto" and device != "cuda")
    per_thread: dict[str, queue.Queue] = {}  # one queue per engine thread: all engines (shared), else per kind
    queues = {d.engine_id: per_thread.setdefault("all" if shared else d.kind, queue.Queue()) for d in decls}
    queues[PREFETCH] = queue.Queue()
    followers = Followers()
    io = WorkerIO(
        args.endpoint,
        args.worker_id,
        register,
        queues,
        os.getppid() if args.exit_with_parent else None,
        args.endpoint_file,
        followers,
    )
    io.start()
    io.bound.wait()
    outbox = Outbox()

    t0 = time.perf_counter()
    rollouts: dict[str, Any] = {}
    stores: dict[str, Any] = {}
    try:
        if options is None:
            raise OptionError(option_error)
        for m, model in enumerate(models):
            if sleep_mode and rollouts:  # the engine built last is awake; the others sleep
                list(rollouts.values())[-1].sleep()
            nvme = args.nvme_dir or (args.scratch or Path(tempfile.gettempdir()) / "plexw") / "nvme"
            nvme = nvme if m == 0 else nvme / f"m{m}"  # each model's store has its own files
            built = build_engines(args, kinds, options, model, sleep_mode=sleep_mode, nvme_dir=nvme)
            if "rollout" in built:
                rollouts[engine_id(args.worker_id, "rollout", m)] = built["rollout"]
            if "trainer" in built:
                stores[engine_id(args.worker_id, "trainer", m)] = built["trainer"]
    except Exception as exc:  # noqa: BLE001 - told to the daemon, then exit
        log.error("engine start failed: %s", traceback.format_exc())
        outbox.register(msgspec.structs.replace(register, error=f"engine start failed: {_error_text(exc)}"))
        time.sleep(1.0)
        sys.exit(1)
    log.info("engines %s ready in %.1f s", ",".join(kinds), time.perf_counter() - t0)
    if stores:
        io.resident = lambda: {
            job: trainer_engine
            for trainer_engine, store in stores.items()
            for tier in ("device", "host", "nvme")
            for job in store.inventory().get(tier, {}).get("jobs", [])
        }
    if rollouts:  # the sequences each holds: the daemon refuses jobs whose max_tokens cannot fit
        held = {eid: int(engine.plan.llm_kwargs["max_model_len"]) for eid, engine in rollouts.items()}
        register = msgspec.structs.replace(
            register,
            engines=[
                msgspec.structs.replace(d, max_model_len=held[d.engine_id]) if d.engine_id in held else d
                for d in register.engines
            ],
        )
    if stores:  # the step each trainer runs: the daemon refuses jobs whose step fits none
        steps = {eid: store.trainer.step_info for eid, store in stores.items()}
        register = msgspec.structs.replace(
            register,
            engines=[
                msgspec.structs.replace(
                    d,
                    gradient_checkpointing="on" if steps[d.engine_id]["gradient_checkpointing"] else "off",
                    micro_batch_tokens=steps[d.engine_id]["micro_batch_tokens"],
                    step_room_bytes=steps[d.engine_id]["room_bytes"],
                )
                if d.engine_id in steps and steps[d.engine_id]
                else d
                for d in register.engines
            ],
        )
    io.register = msgspec.structs.replace(register, ready=True)
    outbox.register(io.register)

    signal.signal(signal.SIGTERM, lambda *_: _leave(args.worker_id))
    if stores:
        threading.Thread(
            target=prefetch_loop, args=(stores, queues[PREFETCH]), name="plexw-prefetch", daemon=True
        ).start()
    rollout = Rollouts(rollouts, one_awake=sleep_mode) if rollouts else None
    if rollout is not None and stores and shared:
        shared_loop(rollout, stores, queues[decls[0].engine_id], args.rollout_capacity, followers, sleep_mode)
    elif rollout is not None:
        if stores:
            threading.Thread(
                target=trainer_loop,
                args=(stores, queues[next(iter(stores))], followers, sleep_mode),
                name="plexw-trainer",
                daemon=True,
            ).start()
        rollout_loop(rollout, queues[next(iter(rollouts))], args.rollout_capacity, followers)
    else:
        trainer_loop(stores, queues[next(iter(stores))], followers, sleep_mode)


def engine_id(worker_id: str, kind: str, model_index: int) -> str:
    """``w0/rollout`` for the first model's engines, ``w0/m1/rollout`` for the second's."""
    return f"{worker_id}/{kind}" if model_index == 0 else f"{worker_id}/m{model_index}/{kind}"


def _leave(worker_id: str) -> None:
    """SIGTERM: tell the daemon this worker leaves (its calls run again elsewhere), then exit."""
    log.info("leaving the cluster")
    try:
        send_frames(Outbox().sock, P.encode(P.Op.LEAVE, P.HeartbeatBody(worker_id))[0])
        time.sleep(0.5)  # the I/O thread forwards it
    finally:
        logging.shutdown()
        os._exit(0)


def _adapter_slots(args: argparse.Namespace, device: Platform) -> tuple[int, int]:
    """(GPU slots, host-cached adapters) of the rollout engine: as asked, else sized for the jobs.
    The cached adapters are the jobs it holds at once (``EngineDecl.adapter_slots``)."""
    expected_jobs = args.jobs_per_engine or MAX_CACHED_LORAS  # no cap: as many as the cache holds
    if args.max_loras is not None:
        cached = args.max_cpu_loras or max(2 * args.max_loras, expected_jobs)
        return args.max_loras, max(cached, args.max_loras)
    return adapter_slots(expected_jobs, device)


def trainer_step(args: argparse.Namespace, kinds: list[str], options: EngineOptions, model: str) -> WorkerStep:
    """The memory plan's decision for this worker's trainer (``memplan.worker_step``): its GPU's
    memory, the rollout engine beside it on the same GPU and its share, its device slots. On the
    CPU: checkpointing only when asked (``on``)."""
    if options.device != "cuda":
        return WorkerStep(args.gradient_checkpointing == "on", 0, 0, None)
    import torch

    from plexctl.common.state_size import model_config
    from worker.engine_args import GPU_MEMORY_UTILIZATION

    shared = "rollout" in kinds
    return worker_step(
        model_config(model),
        options.dtype,
        options.micro_batch_tokens,
        args.gradient_checkpointing,
        int(torch.cuda.mem_get_info()[1]),
        (args.gpu_memory_utilization or GPU_MEMORY_UTILIZATION) if shared else None,
        args.device_slots,
        _max_lora_rank(args, options.device),
        cuda=True,
    )


def cap_memory(fraction: float | None, device: str) -> None:
    """Hold the process to the trainer's share of a GPU it shares (CUDA only; None: no cap)."""
    if fraction is None or device != "cuda":
        return
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction)


def step_info(step: WorkerStep, micro_batch_tokens: int) -> dict[str, Any]:
    """What ``status`` shows of a trainer's step (the device tier's ``step``)."""
    return {
        "gradient_checkpointing": step.gradient_checkpointing,
        "micro_batch_tokens": micro_batch_tokens,
        "peak_bytes": step.step_peak_bytes,
        "room_bytes": step.room_bytes,
        "memory_fraction": step.memory_fraction,
    }


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _mem_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


if __name__ == "__main__":
    main()
