"""One job's service calls in this process: the daemon's core and a worker's servers, minus the transport.

``InprocClient`` is the ``CallClient`` of a one-job script (and of ``bench/overhead.py``'s
in-process side): no daemon process, no socket, no serialisation, yet every call goes through the
code that serves it in a cluster. It holds a ``DaemonCore`` on a real journal in a state directory
of its own (a temporary one by default), registers a worker with it (the worker's ``REGISTER``
message, declaring the in-process engines), submits the job as ``plexctl submit`` does, and starts
its driver (this process). Each call is then a ``CALL`` message into ``DaemonCore.handle``; the
``TASK`` messages the core sends the worker are served by the worker's own ``RolloutServer`` and
``TrainerServer`` (over a ``StateStore``), whose results go back to the core as ``RESULT``
messages, until the core's ``REPLY`` (or ``ERROR``) to the driver comes out. So publishing,
checkpoints and ``latest.json``, restore, the policy version a generate samples from and the
errors a loop sees are the daemon's.

Order: a trainer task is served the moment the core sends it (calls run in the order they are
made); a generate task waits until its call is waited on (``before_generate`` runs first, e.g. a
benchmark's turn-taking), and samples from the adapter the core gave it when the call was sent.

The job's directory is the caller's ``job_dir``, laid out as the daemon lays out
``<state>/jobs/<job>`` (``JobDir``); the journal is the state directory's. A client owns its
job's state on the engines until ``close``, which releases it there.

Not here: scheduling several jobs, worker heartbeats, drains and cancellation (one job, one
process), a restore from another job's checkpoint (the core accepts only its jobs' directories).
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgspec

from daemon.core import DaemonCore, Effect, Prune, Send, StartDriver
from daemon.main import _prune
from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.client import current_user
from plexctl.common.jobdir import JobDir
from plexctl.common.spec import JobSpec, spec_to_wire
from plexctl.rl import CallClient, CallFailed, JobCancelled
from worker.io import Followers, Outbox
from worker.main import build_parser, engine_id
from worker.servers import RolloutServer, TrainerServer
from worker.state.store import StateStore

__all__ = ["InprocClient"]

WORKER_ID = "inproc"  # the in-process worker, as the core knows it
WORKER = f"wrk:{WORKER_ID}".encode()  # its identity, as a worker's socket names itself
SUBMITTER = b"inproc"  # who submits the job, as a CLI client would
ROLLOUT = engine_id(WORKER_ID, "rollout", 0)
TRAINER = engine_id(WORKER_ID, "trainer", 0)


class CollectedOutbox(Outbox):
    """A worker's outbox that keeps its messages for the client to hand to the core (no socket)."""

    def __init__(self) -> None:
        self.followers = None
        self.messages: list[tuple[bytes, Any]] = []

    def _send(self, op: bytes, body: Any) -> None:
        self.messages.append((op, body))

    def take(self) -> list[tuple[bytes, Any]]:
        out, self.messages = self.messages, []
        return out


def one_job_store(trainer: Any) -> StateStore:
    """A state store for one job's trainer: its state stays on the device (one slot), no host or
    NVMe tier to swap to."""
    return StateStore(trainer, device_slots=1, host_bytes=0, nvme_dir=None, transit_bytes=0)


def engine_declarations(rollout: Any, store: StateStore) -> list[P.EngineDecl]:
    """The engines as a worker declares them when it registers: what the core checks a job against."""
    kw = rollout.plan.llm_kwargs
    trainer = store.trainer
    return [
        P.EngineDecl(
            ROLLOUT,
            "rollout",
            rollout.model_path,
            build_parser().get_default("rollout_capacity"),
            adapter_slots=int(kw["max_cpu_loras"]),
            dtype=str(kw["dtype"]),
            device=rollout.plan.platform,
            max_lora_rank=int(rollout.max_lora_rank),
            max_model_len=int(kw["max_model_len"]),
        ),
        P.EngineDecl(
            TRAINER,
            "trainer",
            trainer.model_path,
            1,
            state_capacity_bytes=max(store.host_bytes, store.nvme_bytes),
            state_room_bytes=store.host_bytes + store.nvme_bytes,
            dtype=trainer.dtype,
            device=trainer.device.type,
        ),
    ]


class InprocClient(CallClient):
    """The service calls of one job, served in this process by the daemon's core and a worker's
    servers around ``rollout`` (a ``RolloutEngine``) and ``trainer`` (a ``TrainerEngine``, or a
    ``StateStore`` around one); see the module docstring. ``spec``: the job (its model the
    engines'); ``job_dir``: where its adapters and checkpoints go; ``state_dir``: the core's (None:
    a temporary directory, removed by ``close``)."""

    def __init__(
        self,
        rollout: Any,
        trainer: Any,
        spec: JobSpec,
        job_dir: Path,
        before_generate: Callable[[], None] | None = None,
        state_dir: Path | None = None,
    ) -> None:
        super().__init__()
        job_dir = job_dir.absolute()  # as the daemon names its job directories (latest.json keeps it)
        self.before_generate = before_generate or (lambda: None)
        self.store = trainer if isinstance(trainer, StateStore) else one_job_store(trainer)
        self.rollout_server = RolloutServer(rollout)
        self.trainer_server = TrainerServer(self.store, TRAINER)
        self.out = CollectedOutbox()
        self._temporary = state_dir is None
        self._closed = False
        self.state_dir = Path(tempfile.mkdtemp(prefix="plexrl-inproc-")) if state_dir is None else state_dir
        self._ids = itertools.count(1)  # message ids, one sequence for everything this process sends
        self._answers: dict[int, tuple[bytes, Any]] = {}  # message id -> the core's reply or error
        self._calls: dict[int, str] = {}  # call id -> its method, until waited on
        self._failed: dict[int, str] = {}  # failed call id -> its method (a call to follow it fails too)
        self._generates: collections.deque[P.TaskBody] = collections.deque()  # sent, served when waited on
        self._failed_tasks: set[int] = set()  # tasks whose result was a failure (a task sent after one fails)
        owner = current_user()
        now = time.time()
        # the job's own code runs in its own process: the user is trusted with it (algo.loss_fn)
        self.core = DaemonCore(self.state_dir, [rollout.model_path], owner, trusted_users=[owner], now=now)
        try:
            self.job_id = self._start(spec, owner, engine_declarations(rollout, self.store), job_dir)
        except BaseException:
            self.close()
            raise
        self.job_dir = job_dir
        self.driver = f"drv:{self.job_id}".encode()

    def _start(self, spec: JobSpec, owner: str, engines: list[P.EngineDecl], job_dir: Path) -> str:
        """Register the worker, submit the job, admit it and start its driver; the job's id."""
        register = P.RegisterReq(WORKER_ID, os.uname().nodename, os.getpid(), engines, ready=True)
        self._send(WORKER, auth.INTERNAL_USER, P.Op.REGISTER, register)
        submit = P.SubmitReq(f"inproc-{os.getpid()}-{time.time_ns()}", spec_to_wire(spec), owner)
        op, reply = self._answers.pop(self._send(SUBMITTER, owner, P.Op.SUBMIT, submit))
        if op == P.Op.ERROR:
            raise ValueError(f"the job cannot run on these engines: {reply.message}")
        job_id: str = reply.job_id
        effects = self.core.chores(time.time())
        if StartDriver(job_id) not in effects:
            why = self.core.jobs.reasons.get(job_id) or "not admitted"
            raise ValueError(f"the job cannot run on these engines: {why}")
        # its adapters and checkpoints: the caller's directory, laid out as <state>/jobs/<job> is
        self.core.jobs.runtimes[job_id].job_dir = JobDir(job_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        self._carry_out(self.core.driver_started(job_id, os.getpid(), time.time()))
        return job_id

    # -- the transport's part

    def call_async(self, request: C.Request, after: int | None = None) -> int:
        """The call goes to the core now; a trainer task it makes is served now, a generate when
        waited on. ``after``: a call made earlier (its trainer task done already): if it failed,
        this one fails too, as the daemon fails a call held to follow a failed one."""
        call_id = next(self._ids)
        self._calls[call_id] = request.method
        self.train_calls += request.method == "train_step"
        if after and after in self._failed:
            message = f"{request.method} was to follow {self._failed[after]}, which failed"
            self._answer(call_id, P.Op.ERROR, P.ErrorBody("call_failed", message))
            return call_id
        self._send(self.driver, auth.INTERNAL_USER, P.Op.CALL, P.CallReq(self.job_id, request, after or 0), call_id)  # type: ignore[arg-type]
        return call_id

    def wait(self, call_id: int) -> Any:
        while call_id not in self._answers:
            if not self._generates:
                raise RuntimeError(f"call {call_id}: the core answered nothing and sent no task to serve")
            self._carry_out(self._serve_generate(self._generates.popleft()))
        op, body = self._answers.pop(call_id)
        reply_type = C.METHODS[self._calls.pop(call_id)].reply
        if op == P.Op.ERROR:
            if body.code == "cancelled":
                raise JobCancelled(body.message)
            raise CallFailed(f"{body.code}: {body.message}")
        return body if isinstance(body, reply_type) else msgspec.convert(body, reply_type)

    def report(self, event: str, step: int, metrics: dict[str, float], message: str = "") -> None:
        self._send(
            self.driver, auth.INTERNAL_USER, P.Op.REPORT, P.ReportBody(self.job_id, event, step, metrics, message)
        )

    def close(self) -> None:
        """The driver exits: the core ends the job and the engines release its state; the
        temporary state directory goes."""
        if self._closed:
            return
        self._closed = True
        try:
            job_id = getattr(self, "job_id", "")  # unset when the job could not start
            if job_id in self.core.jobs.runtimes:
                self._carry_out(self.core.driver_exited(job_id, 0, time.time()))
        finally:
            self.core.close()
            if self._temporary:
                shutil.rmtree(self.state_dir, ignore_errors=True)

    # -- the messages between the core and the worker

    def _send(self, identity: bytes, user: str, op: bytes, body: Any, msg_id: int | None = None) -> int:
        """A message into the core from ``identity``, its effects carried out; its message id."""
        msg_id = next(self._ids) if msg_id is None else msg_id
        now = time.time()
        effects = self.core.handle(identity, user, op, P.Header(msg_id=msg_id), body, now)
        self._carry_out(effects + self.core.place(now))
        return msg_id

    def _carry_out(self, effects: list[Effect]) -> None:
        """The core's effects, and those of the worker's results they lead to, until none is left."""
        pending = collections.deque(effects)
        while pending:
            effect = pending.popleft()
            if isinstance(effect, Send) and effect.identity == WORKER:
                self._to_worker(effect.op, effect.body)
                pending.extend(self._results())
            elif isinstance(effect, Send):
                self._answer(effect.in_reply_to, effect.op, effect.body)
            elif isinstance(effect, Prune):
                _prune(effect.parent, effect.keep)
            # StartDriver / StopDriver: this process is the driver (started once; a cancel, a
            # lost worker or a jail's limit, the reasons to stop one, do not arise here)

    def _answer(self, msg_id: int, op: bytes, body: Any) -> None:
        self._answers[msg_id] = (op, body)
        if op == P.Op.ERROR and msg_id in self._calls:
            self._failed[msg_id] = self._calls[msg_id]

    def _to_worker(self, op: bytes, body: Any) -> None:
        """What the worker's I/O thread routes: a trainer task or a release to its server now, a
        generate task kept until its call is waited on; heartbeats and prefetches need nothing."""
        if op == P.Op.TASK and body.engine_id == ROLLOUT:
            self._generates.append(body)
        elif op == P.Op.TASK:
            self.trainer_server.serve(body, self.out)
        elif op == P.Op.TASK_PASS:
            self.trainer_server.serve_pass(body, self.out)
        elif op == P.Op.RELEASE and body.engine_id == ROLLOUT:
            self.rollout_server.admit([body], self.out)
        elif op == P.Op.RELEASE:
            self.trainer_server.serve(body, self.out)

    def _serve_generate(self, task: P.TaskBody) -> list[Effect]:
        """One generate task, to its end (after ``before_generate``); the core's effects of its result."""
        if task.after in self._failed_tasks:  # sent ahead of a task that failed: it never runs
            self.out.messages.append((P.Op.RESULT, Followers.failed(task)))
        else:
            self.before_generate()
            self.rollout_server.serve([task], self.out)
        return self._results()

    def _results(self) -> list[Effect]:
        """The worker's messages handed to the core; the effects they make."""
        effects: list[Effect] = []
        for op, body in self.out.take():
            if op == P.Op.RESULT and not body.ok:
                self._failed_tasks.add(body.task_id)
            now = time.time()
            effects += self.core.handle(WORKER, auth.INTERNAL_USER, op, P.Header(msg_id=next(self._ids)), body, now)
            effects += self.core.place(now)
        return effects
