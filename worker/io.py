"""The worker's I/O: its one DEALER socket to the daemon, on a thread of its own.

``WorkerIO`` registers, heartbeats every second whatever the engines are doing (a long step never
looks like a death), routes each task to the engine it names (releases too; prefetches to the
prefetcher) and forwards what the engine threads push to it over an inproc socket (``Outbox``).
When the daemon falls silent it registers again, naming the jobs whose state it holds, and
follows ``--endpoint-file`` if the daemon moved; a local worker whose daemon died waits
``PLEXRL_ORPHAN_GRACE_S`` to be adopted, then exits. No engine code runs on this thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import zmq

from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.cluster import endpoint_address, orphan_grace
from plexctl.common.frames import NOBLOCK, recv_frames, recv_message, send_frames

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
        self._send(P.Op.RESULT, body)
        if self.followers is not None:  # after the result: the daemon hears of this task first
            for t in waiting:
                if ok:
                    self.followers.route(t)
                else:
                    self.result(t.task_id, False, error=self.followers.failed(t).error)

    def partial(self, task_id: int, samples: list[P.SampleTokens]) -> None:
        """A streamed generate task's tokens so far (``P.PartialBody``), for the daemon to pass on."""
        self._send(P.Op.PARTIAL, P.PartialBody(task_id, samples))

    def inventory(self, info: dict[str, Any]) -> None:
        self._send(P.Op.INVENTORY, P.InventoryBody(info))

    def register(self, req: P.RegisterReq) -> None:
        self._send(P.Op.REGISTER, req)

    def _send(self, op: bytes, body: Any) -> None:
        send_frames(self.sock, P.encode(op, body)[0])


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
