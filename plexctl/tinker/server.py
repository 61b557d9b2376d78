"""The Tinker API over HTTP for the unmodified SDK (0.38.0): its routes, its futures, the order of
each model's requests. ``create_app`` builds the FastAPI app on a ``Backend``; ``serve`` runs it.

Every submit answers at once with a request id; the work runs on threads (backend calls block) and
its outcome is fetched with ``retrieve_future``, which waits up to ``POLL_S`` for it and then answers
408 (the SDK polls again). Invariants:

* A model's requests run one at a time in seq_id order, the order its training client numbered
  them (1, 2, ...): the chunks of one forward_backward, sent together, may arrive out of order and
  are held until their turn. A repeated (model, seq_id) gets its first request id back.
* Samples run as they come, several at once, on one sampler too.
* A forward_backward datum of more tokens than its run's ``max_context_length`` is refused (a
  "user" error) before the backend sees it.
* A user reaches only the sessions, models, samplers and futures they created (else 403); the API
  key (``X-API-Key``) is checked on every request but ``healthz``.
* A session not heard from for ``session_ttl_s`` (the SDK heartbeats every 10 s) ends as if closed.

What the server knows is in memory; a restarted server takes back the runs the backend still
holds (``Backend.known_runs``) and their sessions, so an SDK client that outlived it goes on: a
model's count resumes at the first seq_id that comes after the restart, a request in flight at the
restart is answered as lost (a sample, 410: the SDK sends it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from tinker.proto import tinker_public_pb2 as pb

from plexctl.common.cluster_config import DEFAULTS
from plexctl.tinker import listen, openai_api, wire
from plexctl.tinker.backend import (
    ID_PATTERN,
    Backend,
    CheckpointInfo,
    Sampler,
    TrainingRun,
    UserError,
    check_name,
    parse_checkpoint_path,
    sdk_model_id,
    waits_told_to,
)

log = logging.getLogger(__name__)

OPENAI_URL = "openai_url"  # in the ready file: where the OpenAI API is served (its base_url, ending /v1)
PROTO = "application/x-protobuf"
JSON = "application/json"
SESSION_TTL_S = 120.0  # the SDK heartbeats every 10 s, and calls a session unreliable after 120 s without one
POLL_S = 25.0  # retrieve_future waits this long for a result: under the SDK's 45 s read timeout
GAP_S = 300.0  # requests held this long behind a seq_id that never came fail (the client is gone)
KEEP_RETRIEVED_S = 300.0  # a fetched result stays this long: a fetch whose answer was lost is retried
KEEP_SEQ_IDS = 256  # a model's latest seq_ids whose request ids a repeated submit gets back
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # no ':': a run's id is "<session>:..."
RESUMING = 0  # a taken-back model's next seq_id: the lowest that comes within RESUME_SETTLE_S
RESUME_SETTLE_S = 0.5  # requests sent together before a restart may arrive out of order
WAITING_CHECK_S = 0.5  # a long poll looks this often whether its request began to wait for capacity
WAITING_TOLD_EVERY_S = 60.0  # a waiting request's polls are answered "try_again" at most this often
SAMPLE_ID_PREFIX = "smp-"  # a sample's request id: the SDK sends a lost one again (410)
CLIENT_CONFIG = {  # the SDK's feature flags: none of the routes this server lacks, one fwd/bwd chunk per call
    "pjwt_auth_enabled": False,
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "fwdbwd_max_chunk_len": 1 << 20,
    "fwdbwd_max_chunk_bytes_count": 1 << 30,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}

Reply = bytes | dict[str, Any]  # protobuf (forward_backward, sample) or JSON
Job = Callable[[], Awaitable[Reply]]
T = TypeVar("T")


class ApiError(Exception):
    """An HTTP error answer: ``status`` and the one line the user sees."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Future:
    user: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    body: bytes = b""
    media_type: str = JSON
    done_at: float = 0.0
    retrieved_at: float = 0.0
    sample_key: tuple[str, int] | None = None  # (sampler, seq_id) under which a repeat finds it
    waiting: str | None = None  # why its work waits for the cluster's capacity (``say_waiting``)
    waiting_told: float = 0.0  # when a poll was last answered "try_again" for that (the SDK warns)

    def tell_waiting(self, reason: str | None) -> None:
        self.waiting = reason


@dataclass
class _Held:
    request_id: str
    job: Job
    since: float


@dataclass
class _ModelQueue:
    """A model's requests by seq_id: the next to run, those waiting for it, recent ids for repeats."""

    next_seq: int = 1
    held: dict[int, _Held] = field(default_factory=dict)
    ids: dict[int, str] = field(default_factory=dict)
    running: bool = False


@dataclass
class _Session:
    user: str
    last_seen: float
    ended: bool = False


@dataclass
class _Run:
    user: str
    run: TrainingRun
    last_request: float
    session_id: str
    queue: _ModelQueue = field(default_factory=_ModelQueue)


@dataclass
class _SamplerEntry:
    user: str
    sampler: Sampler
    session_id: str = ""  # "": made before a restart of the front end


class FrontEnd:
    """The server's state and the work behind each route, on one event loop."""

    def __init__(
        self,
        backend: Backend,
        max_workers: int,
        session_ttl_s: float,
        result_ttl_s: float,
        poll_s: float,
        sampler_idle_s: float = DEFAULTS.openai_idle,
    ) -> None:
        self.backend = backend
        self.sampler_idle_s = sampler_idle_s
        self.session_ttl_s = session_ttl_s
        self.result_ttl_s = result_ttl_s
        self.poll_s = poll_s
        self.work_pool = ThreadPoolExecutor(max_workers, thread_name_prefix="tinker-work")
        self.quick_pool = ThreadPoolExecutor(8, thread_name_prefix="tinker-quick")  # auth, lookups
        self.futures: dict[str, _Future] = {}
        self.sessions: dict[str, _Session] = {}
        self.runs: dict[str, _Run] = {}
        self.samplers: dict[str, _SamplerEntry] = {}
        self.creates: dict[tuple[str, int], str] = {}  # (session, model_seq_id) -> request id
        self.sampler_creates: dict[tuple[str, int], asyncio.Task[Sampler]] = {}
        self.samples: dict[tuple[str, int], tuple[str, list[str]]] = {}  # -> request id, sequence ids
        self.tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------ threads, futures

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a work thread, in this task's context (``say_waiting`` reaches its request)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.work_pool, partial(context.run, fn, *args))

    async def quick(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a thread kept free of long work."""
        return await asyncio.get_running_loop().run_in_executor(self.quick_pool, partial(fn, *args))

    def in_thread(self, fn: Callable[[], Reply]) -> Job:
        return lambda: self.call(fn)

    def new_future(self, user: str, prefix: str = "") -> tuple[str, _Future]:
        request_id = prefix + uuid.uuid4().hex
        fut = self.futures[request_id] = _Future(user)
        return request_id, fut

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def start(self, user: str, job: Job, prefix: str = "") -> str:
        """A request id for ``job``, which starts now."""
        request_id, fut = self.new_future(user, prefix)
        self.spawn(self.execute(fut, job))
        return request_id

    async def execute(self, fut: _Future, job: Job) -> None:
        try:
            with waits_told_to(fut.tell_waiting):
                reply = await job()
        except (UserError, ApiError, wire.Malformed) as e:
            reply = {"error": str(e), "category": "user"}
        except Exception as e:
            log.exception("a Tinker request failed")
            reply = {"error": f"internal error: {type(e).__name__}: {e}", "category": "server"}
        self.finish(fut, reply)

    def finish(self, fut: _Future, reply: Reply) -> None:
        if isinstance(reply, bytes):
            fut.body, fut.media_type = reply, PROTO
        else:
            fut.body, fut.media_type = msgspec.json.encode(reply), JSON
        fut.done_at = time.time()
        fut.done.set()

    async def retrieve(self, user: str, request_id: str) -> Response:
        fut = self.futures.get(request_id)
        if fut is None and request_id.startswith(SAMPLE_ID_PREFIX):
            raise ApiError(410, f"unknown sample request {request_id!r} (lost in a restart, or expired): send it again")
        if fut is None:
            raise ApiError(
                404, f"unknown request {request_id!r}: its result expired, or the cluster restarted while it ran"
            )
        if fut.user != user:
            raise ApiError(403, f"request {request_id!r} belongs to another user")
        deadline = time.monotonic() + self.poll_s
        while not fut.done.is_set():
            if fut.waiting and time.monotonic() - fut.waiting_told >= WAITING_TOLD_EVERY_S:
                # the SDK warns of a "try_again" at its default log level (a 408 only after 15 min)
                fut.waiting_told = time.monotonic()
                log.info("request %s of %s waits: %s", request_id, user, fut.waiting)
                return JSONResponse({"type": "try_again", "request_id": request_id, **_paused(fut.waiting)})
            left = deadline - time.monotonic()
            if left <= 0:
                body = {"detail": "pending", **(_paused(fut.waiting) if fut.waiting else {"queue_state": "active"})}
                return JSONResponse(body, status_code=408)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut.done.wait(), min(left, WAITING_CHECK_S))
        fut.retrieved_at = fut.retrieved_at or time.time()
        return Response(fut.body, media_type=fut.media_type)

    # ------------------------------------------------------------ ordering of a model's requests

    def submit(self, user: str, model_id: str, seq_id: int, job: Job) -> str:
        """The request id of the model's ``seq_id``-th request; ``job`` runs in its turn."""
        entry = self.run_of(user, model_id)
        q = entry.queue
        entry.last_request = time.time()
        if seq_id in q.ids:
            return q.ids[seq_id]
        if seq_id < q.next_seq:
            raise ApiError(400, f"seq_id {seq_id} of model {model_id} was used before: a model's requests count up")
        request_id, _ = self.new_future(user)
        q.ids[seq_id] = request_id
        q.held[seq_id] = _Held(request_id, job, time.time())
        if not q.running:
            q.running = True
            self.spawn(self.resume(q) if q.next_seq == RESUMING else self.drain(q))
        return request_id

    async def resume(self, q: _ModelQueue) -> None:
        """A taken-back model's first requests: its count goes on from the lowest that came."""
        await asyncio.sleep(RESUME_SETTLE_S)
        q.next_seq = min(q.held)
        await self.drain(q)

    async def drain(self, q: _ModelQueue) -> None:
        """Run the model's held requests while the next one in order is there."""
        try:
            while q.next_seq in q.held:
                held = q.held.pop(q.next_seq)
                q.next_seq += 1
                for old in [s for s in q.ids if s < q.next_seq - KEEP_SEQ_IDS]:
                    del q.ids[old]
                await self.execute(self.futures[held.request_id], held.job)
        finally:
            q.running = False

    def fail_gaps(self, now: float) -> None:
        """Requests held too long behind a missing seq_id fail; the model's count goes on after them."""
        for model_id, entry in self.runs.items():
            q = entry.queue
            if q.running or not q.held or now - min(h.since for h in q.held.values()) < GAP_S:
                continue
            message = f"request seq_id {q.next_seq} of model {model_id} never came; the requests after it are dropped"
            for held in q.held.values():
                self.finish(self.futures[held.request_id], {"error": message, "category": "server"})
            q.next_seq = max(q.held) + 1
            q.held.clear()

    # ------------------------------------------------------------ who owns what

    def session_of(self, user: str, session_id: str) -> _Session:
        """The user's session; one this server does not know (made before it restarted) is the
        caller's from now on: what it held is the backend's, owned as before."""
        session = self.sessions.get(session_id)
        if session is None:
            if not SESSION_ID_PATTERN.fullmatch(session_id):
                raise ApiError(400, f"{session_id!r} is not a session id")
            log.info("taking back session %s of %s", session_id, user)
            session = self.sessions[session_id] = _Session(user, time.time())
        if session.user != user:
            raise ApiError(403, f"session {session_id!r} belongs to another user")
        return session

    def live_session(self, user: str, session_id: str) -> _Session:
        session = self.session_of(user, session_id)
        if session.ended:
            raise ApiError(400, f"session {session_id!r} has ended: make a new ServiceClient")
        session.last_seen = time.time()
        return session

    def run_of(self, user: str, model_id: str) -> _Run:
        entry = self.runs.get(model_id)
        if entry is None:
            raise ApiError(404, f"unknown model {model_id!r}")
        if entry.user != user:
            raise ApiError(403, f"model {model_id!r} belongs to another user")
        return entry

    def sampler_of(self, user: str, sampler_id: str) -> Sampler:
        entry = self.samplers.get(sampler_id)
        if entry is None and (known := self.backend.known_sampler(user, sampler_id)) is not None:
            self.add_sampler(user, known)
            entry = self.samplers[sampler_id]
        if entry is None:
            raise ApiError(404, f"unknown sampler {sampler_id!r}")
        if entry.user != user:
            raise ApiError(403, f"sampler {sampler_id!r} belongs to another user")
        return entry.sampler

    def check_path(self, user: str, path: str) -> str:
        """A checkpoint path the user may read (a run another user made here is refused)."""
        owner = self.runs.get(parse_checkpoint_path(path).model_id)
        if owner is not None and owner.user != user and not self.backend.is_public(path):
            raise ApiError(403, f"checkpoint {path} belongs to another user")
        return path

    def add_run(self, user: str, run: TrainingRun, session_id: str, model_seq_id: int) -> None:
        expected = sdk_model_id(session_id, model_seq_id)
        if run.model_id != expected:
            raise ValueError(f"the backend named the model {run.model_id!r}; the SDK expects {expected!r}")
        _check_tokenizer_dir(run.tokenizer_dir)
        self.runs.setdefault(run.model_id, _Run(user, run, time.time(), session_id))

    def take_back(self) -> None:
        """The runs the backend still holds, and their sessions, as before a restart."""
        now = time.time()
        for user, run in self.backend.known_runs():
            session_id = run.model_id.partition(":")[0]  # a run's id starts with its session's
            self.runs[run.model_id] = _Run(user, run, now, session_id, _ModelQueue(next_seq=RESUMING))
            self.sessions.setdefault(session_id, _Session(user, now))
            log.info("took back run %s of %s", run.model_id, user)

    def add_sampler(self, user: str, sampler: Sampler, session_id: str = "") -> None:
        if not ID_PATTERN.fullmatch(sampler.sampler_id):
            raise ValueError(f"the backend's sampler id {sampler.sampler_id!r} is not a plain id")
        _check_tokenizer_dir(sampler.tokenizer_dir)
        self.samplers[sampler.sampler_id] = _SamplerEntry(user, sampler, session_id)

    # ------------------------------------------------------------ sessions

    async def authenticate(self, api_key: str | None) -> str:
        if not api_key:
            raise ApiError(401, "no API key: pass api_key= or set TINKER_API_KEY")
        user = await self.quick(self.backend.authenticate, api_key)
        if user is None:
            raise ApiError(401, "API key refused")
        return user

    async def create_session(self, user: str) -> dict[str, Any]:
        """A new session; where a new run would wait for room now, a warning the SDK logs says so."""
        session_id = f"s-{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = _Session(user, time.time())
        reply: dict[str, Any] = {"session_id": session_id, "type": "create_session"}
        try:
            full = await self.quick(self.backend.capacity_note)
        except Exception:  # noqa: BLE001 - a note, not the session: it is made anyway
            log.warning("could not tell whether the cluster has room", exc_info=True)
            full = None
        if full:
            reply["warning_message"] = full
        return reply

    def heartbeat(self, user: str, session_id: str) -> dict[str, Any]:
        session = self.session_of(user, session_id)
        if session.ended:
            raise ApiError(410, f"session {session_id!r} has ended")
        session.last_seen = time.time()
        return {"type": "session_heartbeat"}

    async def end_session(self, session_id: str, session: _Session) -> None:
        if session.ended:
            return
        session.ended = True
        try:
            await self.call(self.backend.end_session, session.user, session_id)
        except Exception:
            log.exception("ending Tinker session %s failed", session_id)

    async def chores(self) -> None:
        """End silent sessions, drop old results, fail requests stuck behind a gap; forever."""
        while True:
            await asyncio.sleep(min(5.0, self.session_ttl_s / 4))
            now = time.time()
            for session_id, session in list(self.sessions.items()):
                if not session.ended and now - session.last_seen > self.session_ttl_s:
                    log.info("Tinker session %s silent for %.0f s: ending it", session_id, now - session.last_seen)
                    await self.end_session(session_id, session)
            for request_id, fut in list(self.futures.items()):
                retrieved = fut.retrieved_at and now - fut.retrieved_at > KEEP_RETRIEVED_S
                if retrieved or (fut.done_at and now - fut.done_at > self.result_ttl_s):
                    del self.futures[request_id]
                    if fut.sample_key is not None:
                        self.samples.pop(fut.sample_key, None)
            self.fail_gaps(now)
            try:
                for path in await self.call(self.backend.expire, now):
                    log.info("checkpoint %s reached its TTL: deleted", path)
            except Exception:  # noqa: BLE001 - tried again at the next round
                log.exception("deleting expired checkpoints failed")
            if isinstance(self.backend, openai_api.PolicyBackend):
                try:
                    for ended in await self.call(self.backend.end_idle, now, self.sampler_idle_s):
                        log.info("OpenAI sampler %s idle for %.0f s: ended", ended, self.sampler_idle_s)
                except Exception:  # noqa: BLE001 - tried again at the next round
                    log.exception("ending idle OpenAI samplers failed")

    # ------------------------------------------------------------ training

    def create_model(self, user: str, req: wire.CreateModelReq) -> dict[str, Any]:
        self.live_session(user, req.session_id)
        key = (req.session_id, req.model_seq_id)
        if key not in self.creates:

            async def job() -> Reply:
                wire.check_optimizer(req.optimizer_config)
                lora = req.lora_config
                rank, seed = (lora.rank, lora.seed) if lora is not None else (None, None)
                run = await self.call(
                    self.backend.create_model, user, req.session_id, req.model_seq_id, req.base_model, rank, seed
                )
                self.add_run(user, run, req.session_id, req.model_seq_id)
                return {"model_id": run.model_id, "type": "create_model"}

            self.creates[key] = self.start(user, job)
        return {"request_id": self.creates[key]}

    def create_from_checkpoint(self, user: str, req: wire.LoadWeightsReq, session_id: str, seq: int) -> str:
        """A new run made from the checkpoint at ``req.path`` (``create_training_client_from_state``)."""
        self.live_session(user, session_id)
        key = (session_id, seq)
        if key not in self.creates:

            async def job() -> Reply:
                wire.check_optimizer(req.optimizer_config)
                path = self.check_path(user, req.path)
                info = await self.call(self.backend.weights_info, user, path)
                base_model = req.base_model or info.base_model
                run = await self.call(
                    self.backend.create_model, user, session_id, seq, base_model, info.lora_rank, None
                )
                self.add_run(user, run, session_id, seq)
                await self.call(self.backend.load_state, user, run.model_id, path, req.optimizer)
                return {"model_id": run.model_id, "path": path, "type": "load_weights"}

            self.creates[key] = self.start(user, job)
        return self.creates[key]

    def get_info(self, user: str, model_id: str) -> dict[str, Any]:
        """The run's model under the name its tokenizer loads by (its directory, where the backend
        has one): the SDK gives that name to the samplers it makes of the run, which load their
        tokenizer by it, offline."""
        run = self.run_of(user, model_id).run
        name = run.tokenizer_dir or run.base_model
        model_data: dict[str, Any] = {"model_name": name}
        if run.tokenizer_dir:
            model_data["tokenizer_id"] = run.tokenizer_dir
        return {
            "type": "get_info",
            "model_id": run.model_id,
            "model_data": model_data,
            "model_name": name,
            "is_lora": run.is_lora,
            "lora_rank": run.lora_rank,
        }

    def forward_backward(self, user: str, msg: pb.ForwardBackwardRequest) -> str:
        model_id, forward_only = msg.model_id, msg.forward_only

        def work() -> Reply:
            call = wire.loss_call(msg, self.run_of(user, model_id).run.max_context_length)
            result = self.backend.forward_backward(user, model_id, call, forward_only)
            return wire.forward_backward_output(result, len(call.data))

        return self.submit(user, model_id, msg.seq_id, self.in_thread(work))

    def optim_step(self, user: str, req: wire.OptimStepReq) -> str:
        def work() -> Reply:
            metrics = self.backend.optim_step(user, req.model_id, wire.adam_step(req))
            return {"metrics": {k: float(v) for k, v in metrics.items()}, "type": "optim_step"}

        return self.submit(user, req.model_id, req.seq_id, self.in_thread(work))

    def save_weights(self, user: str, req: wire.SaveWeightsReq) -> str:
        def work() -> Reply:
            path = self.backend.save_state(user, req.model_id, check_name(req.path or ""))
            return {"path": path, "type": "save_weights"}

        return self.submit(user, req.model_id, req.seq_id, self.in_thread(work))

    def save_weights_for_sampler(self, user: str, req: wire.SaveWeightsForSamplerReq) -> str:
        name = req.path

        async def job() -> Reply:
            if name is not None:
                path = await self.call(self.backend.save_weights_for_sampler, user, req.model_id, check_name(name))
                return {"path": path, "type": "save_weights_for_sampler"}
            sampler = await self.call(self.backend.sampler_for_weights, user, req.model_id, req.seq_id)
            self.add_sampler(user, sampler, self.run_of(user, req.model_id).session_id)
            return {"sampling_session_id": sampler.sampler_id, "type": "save_weights_for_sampler"}

        return self.submit(user, req.model_id, req.seq_id, job)

    def load_weights(self, user: str, req: wire.LoadWeightsReq) -> dict[str, Any]:
        if req.session_id is not None and req.model_seq_id is not None:
            return {"request_id": self.create_from_checkpoint(user, req, req.session_id, req.model_seq_id)}
        if req.model_id is None or req.seq_id is None:
            raise wire.Malformed("load_weights needs model_id and seq_id, or session_id and model_seq_id")
        model_id = req.model_id

        async def job() -> Reply:
            path = self.check_path(user, req.path)
            await self.call(self.backend.load_state, user, model_id, path, req.optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return {"request_id": self.submit(user, model_id, req.seq_id, job), "model_id": model_id}

    # ------------------------------------------------------------ sampling

    async def create_sampling_session(self, user: str, req: wire.CreateSamplingSessionReq) -> dict[str, Any]:
        self.live_session(user, req.session_id)
        if req.model_path is None and req.base_model is None:
            raise ApiError(400, "create_sampling_session needs model_path or base_model")
        if req.model_path is not None:
            self.check_path(user, req.model_path)
        key = (req.session_id, req.sampling_session_seq_id)
        task = self.sampler_creates.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            args = (user, req.session_id, req.model_path, req.base_model)
            task = asyncio.ensure_future(self.call(self.backend.create_sampler, *args))
            self.sampler_creates[key] = task
        sampler = await asyncio.shield(task)
        self.add_sampler(user, sampler, req.session_id)
        return {"sampling_session_id": sampler.sampler_id, "type": "create_sampling_session"}

    def sample(self, user: str, req: wire.SampleReq) -> dict[str, Any]:
        if req.sampling_session_id is None:
            raise ApiError(400, "sample needs a sampling session: use ServiceClient.create_sampling_client")
        sampler = self.sampler_of(user, req.sampling_session_id)
        key = (sampler.sampler_id, req.seq_id) if req.seq_id is not None else None
        if key is not None and key in self.samples:
            request_id, sequence_ids = self.samples[key]
            return {"request_id": request_id, "sample_sequence_ids": sequence_ids}
        n = req.num_samples

        def work() -> Reply:
            tokens = wire.prompt_tokens(req.prompt)
            wire.check_sample_request(req, len(tokens))
            params = wire.sample_params(req.sampling_params)
            want_prompt, k, ks = bool(req.prompt_logprobs), req.topk_prompt_logprobs, req.topk_sample_logprobs
            result = self.backend.sample(
                user, sampler.sampler_id, tokens, n, params, want_prompt, k, topk_sample_logprobs=ks
            )
            last_n = req.prompt_logprobs_last_n
            return wire.sample_response(
                result, n, len(tokens), logprobs=want_prompt, topk=k, last_n=last_n, topk_sample=ks
            )

        request_id = self.start(user, self.in_thread(work), SAMPLE_ID_PREFIX)
        sequence_ids = [f"{request_id}-{i}" for i in range(max(n, 0))]
        if key is not None:
            self.samples[key] = (request_id, sequence_ids)
            self.futures[request_id].sample_key = key
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    # ------------------------------------------------------------ runs and checkpoints

    async def checkpoints(self, user: str, model_id: str) -> list[CheckpointInfo]:
        self.run_of(user, model_id)
        return await self.quick(self.backend.list_checkpoints, user, model_id)

    async def training_run(self, user: str, model_id: str) -> dict[str, Any]:
        entry = self.run_of(user, model_id)
        infos = await self.checkpoints(user, model_id)
        last = {kind: _latest(infos, kind) for kind in ("training", "sampler")}
        return {
            "training_run_id": model_id,
            "base_model": entry.run.base_model,
            "model_owner": entry.user,
            "is_lora": entry.run.is_lora,
            "corrupted": False,
            "lora_rank": entry.run.lora_rank,
            "last_request_time": _iso(entry.last_request),
            "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"],
        }

    def sessions_of(self, user: str) -> list[str]:
        """The user's sessions, newest first (a restarted front end knows those it took back)."""
        mine = [(s.last_seen, sid) for sid, s in self.sessions.items() if s.user == user]
        return [sid for _, sid in sorted(mine, reverse=True)]

    def session_json(self, user: str, session_id: str) -> dict[str, Any]:
        """The SDK's ``GetSessionResponse``: the session's runs and samplers."""
        self.session_of(user, session_id)
        runs = [m for m, e in self.runs.items() if e.user == user and e.session_id == session_id]
        samplers = [i for i, e in self.samplers.items() if e.user == user and e.session_id == session_id]
        return {"training_run_ids": runs, "sampler_ids": samplers}

    async def training_runs(self, user: str) -> list[dict[str, Any]]:
        """The user's runs, the most recently used first."""
        mine = sorted((e for e in self.runs.values() if e.user == user), key=lambda e: -e.last_request)
        return [await self.training_run(user, e.run.model_id) for e in mine]

    async def user_checkpoints(self, user: str) -> list[dict[str, Any]]:
        """Every checkpoint of the user's runs, the newest first."""
        infos: list[tuple[str, CheckpointInfo]] = []
        for model_id in [m for m, e in self.runs.items() if e.user == user]:
            infos += [(model_id, i) for i in await self.checkpoints(user, model_id)]
        infos.sort(key=lambda mi: -mi[1].time)
        return [{**checkpoint_json(info), "training_run_id": model_id} for model_id, info in infos]


def _paused(reason: str) -> dict[str, str]:
    return {"queue_state": "paused_capacity", "queue_state_reason": reason}


def page(items: list[Any], key: str, limit: int, offset: int) -> dict[str, Any]:
    """``items[offset:offset+limit]`` under ``key``, with the SDK's ``Cursor``."""
    if limit < 0 or offset < 0:
        raise ApiError(400, f"limit and offset must be 0 or more, not {limit} and {offset}")
    cursor = {"offset": offset, "limit": limit, "total_count": len(items)}
    return {key: items[offset : offset + limit], "cursor": cursor}


def _check_tokenizer_dir(tokenizer_dir: str) -> None:
    if ":" in tokenizer_dir:
        raise ValueError(f"tokenizer_dir {tokenizer_dir!r} holds ':', which the SDK cuts off")


def checkpoint_json(info: CheckpointInfo) -> dict[str, Any]:
    """The SDK's ``Checkpoint``; its id is the path after the run: ``weights/<name>``."""
    parsed = parse_checkpoint_path(info.tinker_path)
    return {
        "checkpoint_id": info.tinker_path.removeprefix(f"tinker://{parsed.model_id}/"),
        "checkpoint_type": parsed.kind,
        "time": _iso(info.time),
        "tinker_path": info.tinker_path,
        "size_bytes": info.size_bytes,
        "public": info.public,
        "expires_at": _iso(info.expires_at) if info.expires_at is not None else None,
    }


def _latest(infos: list[CheckpointInfo], kind: str) -> dict[str, Any] | None:
    of_kind = [i for i in infos if parse_checkpoint_path(i.tinker_path).kind == kind]
    return checkpoint_json(max(of_kind, key=lambda i: i.time)) if of_kind else None


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


async def _authenticated(request: Request) -> str:
    front: FrontEnd = request.app.state.front
    return await front.authenticate(request.headers.get("x-api-key"))


User = Annotated[str, Depends(_authenticated)]  # the caller's user, from their X-API-Key


def _error(status: int, message: str, category: str = "user") -> JSONResponse:
    return JSONResponse({"error": message, "category": category}, status_code=status)


def create_app(
    backend: Backend,
    *,
    max_workers: int = 128,
    session_ttl_s: float = SESSION_TTL_S,
    result_ttl_s: float = 3600.0,
    poll_s: float = POLL_S,
    max_body_bytes: int = wire.MAX_BODY_BYTES,
    sampler_idle_s: float = DEFAULTS.openai_idle,
) -> FastAPI:
    """The Tinker API on ``backend``. ``max_workers``: backend calls at once (samples run in
    parallel up to it); ``session_ttl_s``: a session not heard from this long ends;
    ``result_ttl_s``: an unfetched result is kept this long; ``max_body_bytes``: a request body
    (decompressed) larger than this is refused with 413; ``sampler_idle_s``: what serves a user's
    OpenAI requests ends once it served none this long (``PolicyBackend.end_idle``)."""
    front = FrontEnd(backend, max_workers, session_ttl_s, result_ttl_s, poll_s, sampler_idle_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await front.quick(front.take_back)
        chores = asyncio.create_task(front.chores())
        try:
            yield
        finally:
            chores.cancel()
            front.work_pool.shutdown(wait=False, cancel_futures=True)
            front.quick_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="PlexRL Tinker API", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, str(e))

    @app.exception_handler(wire.TooLarge)
    async def on_too_large(request: Request, e: wire.TooLarge) -> JSONResponse:
        return _error(413, str(e))

    @app.exception_handler(wire.Malformed)
    async def on_malformed(request: Request, e: wire.Malformed) -> JSONResponse:
        return _error(400, str(e))

    @app.exception_handler(UserError)
    async def on_user_error(request: Request, e: UserError) -> JSONResponse:
        return _error(400, str(e))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        return _error(400, f"malformed request: {where}")

    @app.exception_handler(Exception)
    async def on_error(request: Request, e: Exception) -> JSONResponse:  # the server logs its traceback
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server")

    async def read(request: Request) -> bytes:
        """The request's body, refused (413) past ``max_body_bytes``, announced or sent."""
        announced = request.headers.get("content-length", "")
        if announced.isdigit() and int(announced) > max_body_bytes:
            raise wire.TooLarge(f"request body of {announced} bytes: the limit is {max_body_bytes}")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > max_body_bytes:
                raise wire.TooLarge(f"request body over the limit of {max_body_bytes} bytes")
            parts.append(part)
        return b"".join(parts)

    async def body(request: Request, kind: type[T]) -> T:
        return wire.decode(await read(request), kind)

    api = "/api/v1"

    @app.get(f"{api}/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @app.post(f"{api}/client/config")
    async def client_config(user: User) -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post(f"{api}/client/dynamic_config")
    async def dynamic_config(user: User) -> JSONResponse:
        return _error(404, "no dynamic config here: the SDK's defaults apply")

    @app.post(f"{api}/create_session")
    async def create_session(request: Request, user: User) -> dict[str, Any]:
        await body(request, wire.CreateSessionReq)
        return await front.create_session(user)

    @app.post(f"{api}/session_heartbeat")
    async def session_heartbeat(request: Request, user: User) -> dict[str, Any]:
        return front.heartbeat(user, (await body(request, wire.SessionReq)).session_id)

    @app.post(f"{api}/telemetry")
    async def telemetry(user: User) -> dict[str, Any]:
        return {"status": "accepted"}

    @app.post(f"{api}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, user: User) -> dict[str, Any]:
        await front.end_session(session_id, front.session_of(user, session_id))
        return {}

    @app.get(f"{api}/get_server_capabilities")
    async def capabilities(user: User) -> dict[str, Any]:
        models = await front.quick(backend.models)
        supported = [
            {"model_name": m.name, "max_context_length": m.max_context_length, "trainable": True, "sampleable": True}
            for m in models
        ]
        return {"supported_models": supported}

    @app.post(f"{api}/create_model")
    async def create_model(request: Request, user: User) -> dict[str, Any]:
        return front.create_model(user, await body(request, wire.CreateModelReq))

    @app.post(f"{api}/get_info")
    async def get_info(request: Request, user: User) -> dict[str, Any]:
        return front.get_info(user, (await body(request, wire.ModelReq)).model_id)

    @app.post(f"{api}/forward_backward")
    async def forward_backward(request: Request, user: User) -> dict[str, Any]:
        raw = await read(request)
        msg = await front.quick(
            wire.parse_forward_backward, raw, request.headers.get("content-encoding"), max_body_bytes
        )
        return {"request_id": front.forward_backward(user, msg), "model_id": msg.model_id}

    @app.post(f"{api}/optim_step")
    async def optim_step(request: Request, user: User) -> dict[str, Any]:
        req = await body(request, wire.OptimStepReq)
        return {"request_id": front.optim_step(user, req), "model_id": req.model_id}

    @app.post(f"{api}/save_weights")
    async def save_weights(request: Request, user: User) -> dict[str, Any]:
        req = await body(request, wire.SaveWeightsReq)
        return {"request_id": front.save_weights(user, req), "model_id": req.model_id}

    @app.post(f"{api}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request, user: User) -> dict[str, Any]:
        req = await body(request, wire.SaveWeightsForSamplerReq)
        return {"request_id": front.save_weights_for_sampler(user, req), "model_id": req.model_id}

    @app.post(f"{api}/load_weights")
    async def load_weights(request: Request, user: User) -> dict[str, Any]:
        return front.load_weights(user, await body(request, wire.LoadWeightsReq))

    @app.post(f"{api}/create_sampling_session")
    async def create_sampling_session(request: Request, user: User) -> dict[str, Any]:
        return await front.create_sampling_session(user, await body(request, wire.CreateSamplingSessionReq))

    @app.get(f"{api}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, user: User) -> dict[str, Any]:
        """``base_model`` under the name its tokenizer loads by (see ``get_info``): the SDK makes a
        sampler of ``model_path`` with it."""
        s = front.sampler_of(user, sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.tokenizer_dir or s.base_model, "model_path": s.model_path}

    @app.post(f"{api}/asample")
    async def asample(request: Request, user: User) -> dict[str, Any]:
        return front.sample(user, await body(request, wire.SampleReq))

    @app.post(f"{api}/retrieve_future")
    async def retrieve_future(request: Request, user: User) -> Response:
        return await front.retrieve(user, (await body(request, wire.RetrieveFutureReq)).request_id)

    @app.get(f"{api}/training_runs")
    async def list_training_runs(user: User, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return page(await front.training_runs(user), "training_runs", limit, offset)

    @app.get(f"{api}/checkpoints")
    async def list_user_checkpoints(user: User, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return page(await front.user_checkpoints(user), "checkpoints", limit, offset)

    @app.get(f"{api}/sessions")
    async def list_sessions(user: User, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return {"sessions": page(front.sessions_of(user), "sessions", limit, offset)["sessions"]}

    @app.get(f"{api}/sessions/{{session_id}}")
    async def get_session(session_id: str, user: User) -> dict[str, Any]:
        return front.session_json(user, session_id)

    @app.get(f"{api}/training_runs/{{model_id}}/checkpoints")
    async def list_checkpoints(model_id: str, user: User) -> dict[str, Any]:
        return {"checkpoints": [checkpoint_json(i) for i in await front.checkpoints(user, model_id)]}

    @app.get(f"{api}/training_runs/{{model_id}}")
    async def training_run(model_id: str, user: User) -> dict[str, Any]:
        return await front.training_run(user, model_id)

    if isinstance(backend, openai_api.PolicyBackend):
        openai_api.add_routes(app, backend, front.call)

    def saved_path(user: str, model_id: str, checkpoint_id: str) -> str:
        return front.check_path(user, f"tinker://{model_id}/{checkpoint_id}")

    @app.post(f"{api}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def publish(model_id: str, checkpoint_id: str, user: User) -> None:
        await front.quick(backend.publish_checkpoint, user, saved_path(user, model_id, checkpoint_id), True)

    @app.delete(f"{api}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def unpublish(model_id: str, checkpoint_id: str, user: User) -> None:
        await front.quick(backend.publish_checkpoint, user, saved_path(user, model_id, checkpoint_id), False)

    @app.put(f"{api}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}/ttl")
    async def checkpoint_ttl(model_id: str, checkpoint_id: str, request: Request, user: User) -> None:
        ttl = (await body(request, wire.CheckpointTtlReq)).ttl_seconds
        path = saved_path(user, model_id, checkpoint_id)
        await front.quick(backend.set_checkpoint_ttl, user, path, ttl, time.time())

    @app.delete(f"{api}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, user: User) -> None:
        await front.quick(backend.delete_checkpoint, user, saved_path(user, model_id, checkpoint_id))

    @app.post(f"{api}/weights_info")
    async def weights_info(request: Request, user: User) -> dict[str, Any]:
        path = front.check_path(user, (await body(request, wire.WeightsInfoReq)).tinker_path)
        info = await front.quick(backend.weights_info, user, path)
        return {"base_model": info.base_model, "is_lora": info.is_lora, "lora_rank": info.lora_rank}

    return app


def serve(
    backend: Backend,
    host: str,
    port: int | None,
    ready_file: Path | None = None,
    openai_port: int | None = None,
    **app_options: Any,
) -> None:
    """Serve the Tinker API on ``host:port`` (0: any free port; None: not) in this process until
    SIGINT or SIGTERM, and the OpenAI API on ``openai_port`` (None: not). Once it listens,
    ``ready_file`` (if given) holds ``{"url", "openai_url", "pid"}`` (those served), written
    atomically and left behind at exit (a reader checks the pid). ``app_options`` go to ``create_app``."""
    also = {OPENAI_URL: (openai_port, "/v1")} if openai_port is not None else {}
    listen.run(partial(create_app, backend, **app_options), host, port, ready_file, also=also)
