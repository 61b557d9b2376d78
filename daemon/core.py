"""The daemon's core: jobs, workers and service calls, with no socket, no process and no clock.

``DaemonCore`` takes one event at a time, at a time ``now`` the caller gives: a decoded message
from a peer (``handle``), a driver that started, could not start or exited, a local worker's
process that exited, a drain, the periodic chores (``heartbeat``, ``chores``, ``place``). Each
returns the *effects* the server (``daemon.main``) carries out: messages to send (``Send``),
drivers to start or stop (``StartDriver``, ``StopDriver``), directories to prune (``Prune``).

It owns the journal (SQLite), the scheduler core, the jobs' runtimes, the pending calls and
the workers' state, and it reads and writes the files of a job's directory that the call logic
needs (its latest checkpoint, logs and exports, uploaded inputs; names from ``JobDir``).

Invariants: a call has one pending entry from its task's submission to its result (held calls
wait in their job's runtime, keyed by the call they follow); a running job has a runtime from
``StartDriver`` (or adoption) until its driver's exit is judged; a worker suspect of silence keeps
its jobs, calls and state until it answers or is lost; while draining, nothing is admitted and
each publish's reply carries the drain's reason.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, cast

import msgspec

from daemon import jail
from daemon import metrics as M
from daemon.blobs import BlobError, BlobStore
from daemon.journal import TERMINAL, Journal
from daemon.scheduler import Engine, Scheduler, Task
from plexctl import inputs
from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.atomic import write_bytes_atomic
from plexctl.common.cluster_config import DEFAULTS, drain_timeout_s
from plexctl.common.jobdir import JobDir, LatestCheckpoint
from plexctl.common.memplan import VLLM_LORA_RANKS, TrainerRoom, spec_step_problem
from plexctl.common.sizes import fmt_bytes
from plexctl.common.spec import EXTERNAL, JobSpec, SpecError, spec_from_wire, wire_rule_problems
from plexctl.common.state_size import full_state_bytes, job_state_bytes, model_config
from plexctl.spec_files import context_problems

log = logging.getLogger("plexd")

VERSION = "0.1.0"
HEARTBEAT_S = 1.0
LOGS_CHUNK = 256 * 1024  # bytes of a job's log one reply carries; the client asks again from its offset
EXPORT_CHUNK = 8 << 20  # bytes of an exported file one reply carries
WORKER_LIVENESS = 3  # heartbeats missed before a worker is suspect: its engines get no new calls
WORKER_GRACE_S = DEFAULTS.worker_grace  # silent this long, a worker is lost even if its process may live
CANCEL_GRACE_S = 30.0
DRIVER_EXIT_DRAINED = 75  # checkpointed at a step boundary on the daemon's request (EX_TEMPFAIL)
DRAIN_TIMEOUT_S = drain_timeout_s(DEFAULTS, slurm=False)  # a core built without a config: a local cluster's
PASS_WINDOW_S = DEFAULTS.group_window_ms / 1000  # a trainer waits this long at most for more steps to share a pass
MAX_RUNNING = 64  # job drivers at once (processes beside the daemon); the engines' room admits within it
ADOPT_TIMEOUT_S = 60.0  # an adopted job whose engines are not back by then restarts from its checkpoint
LIMIT_EXITS = {  # a jailed driver ended by one of its limits (daemon.jail_boot): that job fails, no restart
    jail.CPU_LIMIT_EXIT: "its driver used up its CPU-time limit (plexctl share --limit cpu=SECONDS)",
    -signal.SIGXFSZ: "its driver wrote a file past its job-dir limit (killed by SIGXFSZ)",
}
CONTEXT_CHECK_BYTES = 16 << 20  # a shared user's data the daemon measures against the context at submit
DRIVER_START_TRIES = 5  # a driver that cannot start is tried this often, waiting 1, 2, 4, 8 s; then its job fails

INTERNAL_OPS = {
    P.Op.REGISTER,
    P.Op.HEARTBEAT,
    P.Op.RESULT,
    P.Op.INVENTORY,
    P.Op.LEAVE,
    P.Op.WORKER_EXITED,
    P.Op.CALL,
    P.Op.REPORT,
}  # drivers, workers, Slurm node tasks


# ---------------------------------------------------------------- effects


@dataclass(frozen=True)
class Send:
    """Send ``body`` under ``op`` to the peer ``identity`` (a reply names the request's id)."""

    identity: bytes
    op: bytes
    body: Any
    in_reply_to: int = 0


@dataclass(frozen=True)
class StartDriver:
    """Start the job's driver; tell the core ``driver_started`` or ``driver_not_started``."""

    job_id: str


@dataclass(frozen=True)
class StopDriver:
    """Stop the job's driver: SIGTERM, or SIGKILL when ``kill``."""

    job_id: str
    kill: bool = False


@dataclass(frozen=True)
class Prune:
    """Remove all but the newest ``keep`` directories of ``parent`` (off the loop's thread)."""

    parent: Path
    keep: int


Effect = Send | StartDriver | StopDriver | Prune


@dataclass
class WorkerState:
    worker_id: str
    identity: bytes
    node: str
    last_seen: float
    engines: list[P.EngineDecl]
    ready: bool
    error: str = ""
    devices: list[str] = field(default_factory=list)  # its CUDA_VISIBLE_DEVICES ids
    pid: int = 0  # its process, on its node
    suspect_since: float | None = None  # when it was found silent (``_suspect``); None while it answers


@dataclass
class JobRuntime:
    """What the daemon keeps in memory for a running job."""

    job_id: str
    spec: JobSpec
    job_dir: JobDir
    pid: int = 0  # its driver's process (0: not started yet)
    policy_version: int = 0
    adapter: P.AdapterRef | None = None
    cancel_requested_at: float | None = None
    ended_by_client: bool = False  # a Tinker job whose client's session finished: it succeeded
    rolled_back: str = ""  # why the job's state was lost: its driver is stopped and the job resumes from its checkpoint
    failure: str = ""
    engines: set[str] = field(default_factory=set)
    user: str = ""  # who submitted it
    calls_seen: dict[int, None] = field(default_factory=dict)  # the driver's latest call ids, oldest first
    # calls held until the call they follow (``CallReq.after``, the key) has its result
    held_calls: dict[int, list[tuple[bytes, P.Header, P.CallReq]]] = field(default_factory=dict)
    # of those, the tasks sent ahead to the worker (``_send_ahead``), with their engine
    sent_ahead: dict[int, list[tuple[Task, str]]] = field(default_factory=dict)
    model: str = ""  # the model's resolved path, as its engines declare it


@dataclass
class PendingCall:
    """A service call whose task is queued or running: who to answer, and what the reply adds."""

    job_id: str
    identity: bytes
    msg_id: int
    method: str
    task: C.AnyTask | None = None  # what its engine is sent (set once made)
    version: int = 0  # generate: the policy it samples from; a publish: the version it makes
    publishes: bool = False  # a publish, or a train_step that publishes
    out_dir: str = ""  # where a publish or a checkpoint writes
    step: int = 0  # a checkpoint's


def _kept_adapter(rt: JobRuntime, version: int) -> P.AdapterRef | None:
    """The job's published ``version`` if its directory is still there (0: the base, None)."""
    if version <= 0:
        return None
    path = rt.job_dir.adapter(version)
    if not path.is_dir():
        return None
    return P.AdapterRef(rt.job_id, version, str(path), full=rt.spec.lora is None)


class _CallSite:
    """``calls.CallSite`` for one call of one job: the daemon's decisions, recorded in the call.
    ``adapter``/``version``: the policy a generate samples unless it names another."""

    def __init__(
        self, core: DaemonCore, rt: JobRuntime, call: PendingCall, adapter: P.AdapterRef | None, version: int
    ) -> None:
        self.core, self.rt, self.call = core, rt, call
        self.adapter, self.version = adapter, version
        self.job_id = rt.job_id
        self.trainer = C.TrainerContext(lora=rt.spec.lora, seed=rt.spec.seed)
        self.trusted = rt.user in core.trusted_users

    def sample_from(self, version: int | None) -> P.AdapterRef | None:
        adapter = self.adapter
        if version is not None and version != self.version:  # an earlier version it kept (a Tinker sampler's)
            adapter = _kept_adapter(self.rt, version)
            if version and adapter is None:
                raise C.CallRefused("bad_request", f"policy version {version} is not kept")
            self.call.version = version
        else:
            self.call.version = self.version
        return adapter

    def reserve(self) -> str:
        call = self.call
        call.publishes, call.version = True, self.rt.policy_version + 1
        call.out_dir = str(self.rt.job_dir.adapter(call.version))
        return call.out_dir

    def checkpoint_to(self, step: int) -> str:
        self.call.step, self.call.out_dir = step, str(self.rt.job_dir.checkpoint(step))
        return self.call.out_dir

    def restore_from(self, ckpt_dir: str) -> str | None:
        rt = self.rt
        if not ckpt_dir:
            latest = rt.job_dir.latest_checkpoint()
            if latest is None:
                return None
            rt.policy_version = max(rt.policy_version, latest.policy_version)
            return latest.dir
        path = Path(os.path.realpath(ckpt_dir))  # a checkpoint of a job of the user's: <jobs>/<job>/ckpt/step-N
        job_dir = JobDir(path.parent.parent)
        if job_dir.root.parent == Path(os.path.realpath(self.core.jobs_dir)) and job_dir.is_checkpoint(path):
            owner = self.core.journal.job(job_dir.root.name)
            if owner is not None and owner.user == rt.user:
                return str(path)
        raise C.CallRefused("bad_request", f"{ckpt_dir} is not a checkpoint of a job of {rt.user or 'this user'}")


class DaemonCore:
    """A cluster's jobs, workers and calls; see the module docstring. Every public method takes
    the time ``now`` and returns the effects for the server to carry out."""

    def __init__(
        self,
        state_dir: Path,
        models: Iterable[str],
        owner: str,
        max_running: int = MAX_RUNNING,
        policy: str = "spread+backfill",
        jobs_per_engine: int | None = None,
        pass_window: float | None = None,  # None: each train step in a pass of its own (plexd: PASS_WINDOW_S)
        drain_timeout: float = DRAIN_TIMEOUT_S,
        trusted_users: Iterable[str] = (),
        worker_grace: float = WORKER_GRACE_S,
        now: float | None = None,
    ) -> None:
        self.now = time.time() if now is None else now
        self.state_dir = state_dir
        self.jobs_dir = state_dir / "jobs"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(state_dir / "journal.db")
        self.blobs = BlobStore(state_dir / "blobs")  # jailed users' uploaded inputs
        self.telemetry = M.Telemetry()  # call latencies, swap marks; served on /metrics by the server
        self.models = {os.path.realpath(m) for m in models}
        self.owner = owner
        self.max_running = max_running
        self.policy = policy
        self.sched = Scheduler(policy=policy, jobs_per_engine=jobs_per_engine, pass_window=pass_window)
        self.drain_timeout = drain_timeout
        self.trusted_users = set(trusted_users)  # may run their own code in the trainer (algo.loss_fn)
        self.worker_grace = worker_grace  # a silent worker whose process may live is lost after this
        self.started_at = self.now
        self.pid = os.getpid()  # shown by ping
        self.local_workers = 0  # workers the server starts itself (ping counts their engines as expected)
        self.reasons: dict[str, str] = {}  # queued job -> why it is not running yet
        self.start_failures: dict[str, tuple[int, float]] = {}  # job -> (drivers that failed to start, next try)
        self.specs: dict[str, JobSpec] = {}  # parsed specs of queued jobs
        self.engine_stats: dict[str, dict[str, Any]] = {}  # engine -> its latest tier inventory
        self.prefetched: dict[str, str] = {}  # trainer engine -> job whose prefetch was last asked
        self.workers: dict[str, WorkerState] = {}
        self.runtimes: dict[str, JobRuntime] = {}
        self.calls: dict[int, PendingCall] = {}
        self.adopting: dict[str, float] = {}  # adopted job -> when to give up waiting for engines
        self.resident: dict[str, str] = {}  # job -> trainer engine that holds its state (workers' word)
        self.held: dict[str, list[Task]] = {}  # an adopted job's calls until it is placed again
        # task ids never repeat across daemon restarts: a late result for a task of the previous daemon
        # (its workers live on) cannot be taken for the reply to a new call
        self.task_ids = itertools.count(int(self.started_at * 1000) * 1000)
        self.stopping = False  # the server stops its loop and shuts down
        self.drain_deadline: float | None = None  # set once a drain starts
        self.drain_reason = ""
        self.problems: list[str] = []
        self.sender = ""  # the authenticated user of the message being handled (its User-Id)
        self._out: list[Effect] = []

    def close(self) -> None:
        self.journal.close()
        self.telemetry.close()

    def _effects(self) -> list[Effect]:
        out, self._out = self._out, []
        return out

    def _send(self, identity: bytes, op: bytes, body: Any, in_reply_to: int = 0) -> None:
        self._out.append(Send(identity, op, body, in_reply_to))

    # ------------------------------------------------------------------ events

    def handle(self, identity: bytes, user: str, op: bytes, header: P.Header, body: Any, now: float) -> list[Effect]:
        """A decoded message from ``identity``, sent by the authenticated ``user``."""
        self.now = now
        handler = self.HANDLERS.get(op)
        if handler is None:
            self._error(identity, header.msg_id, "bad_request", f"opcode {op!r} is not a request")
            return self._effects()
        refusal = self._refusal(op, user)
        if refusal:
            self._error(identity, header.msg_id, "forbidden", refusal)
            return self._effects()
        self.sender = user
        try:
            handler(self, identity, header, body)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the daemon
            log.exception("error handling %r", op)
            self._error(identity, header.msg_id, "internal", f"{type(exc).__name__}: {exc}")
        return self._effects()

    def heartbeat(self, now: float) -> list[Effect]:
        """Heartbeat the workers and judge the silent ones."""
        self.now = now
        self._heartbeat_workers(now)
        return self._effects()

    def chores(self, now: float) -> list[Effect]:
        """Stop drivers past their cancel grace, place adopted jobs, admit queued ones (or, while
        draining, decide when to stop)."""
        self.now = now
        for rt in list(self.runtimes.values()):
            if rt.spec.kind != EXTERNAL:
                if rt.cancel_requested_at is not None and now - rt.cancel_requested_at > CANCEL_GRACE_S:
                    self._out.append(StopDriver(rt.job_id, kill=True))
                continue
            if rt.cancel_requested_at is None and self.drain_deadline is None:
                continue
            busy = any(c.job_id == rt.job_id for c in self.calls.values())  # no driver: it ends between calls
            if rt.cancel_requested_at is not None and (not busy or now - rt.cancel_requested_at > CANCEL_GRACE_S):
                self._judge_exit(rt, 0, now)
            elif self.drain_deadline is not None and not busy:
                self._judge_exit(rt, DRIVER_EXIT_DRAINED, now)
        if self.adopting:
            self._admit_adopted(now)
        if self.drain_deadline is not None:
            if not self.runtimes or now > self.drain_deadline:
                self.stopping = True
        else:
            self._admit(now)
        return self._effects()

    def place(self, now: float) -> list[Effect]:
        """Send the tasks the scheduler places now."""
        self.now = now
        self._place(now)
        return self._effects()

    def drain(self, reason: str, now: float, urgent: bool = True) -> list[Effect]:
        """Stop admitting; running jobs checkpoint at their step's end and exit; then stop.

        A second urgent request (SIGTERM, SIGINT) while draining stops at once; repeated
        allocation signals (SIGUSR1/2 reach every process of a Slurm step) do not."""
        self.now = now
        self._drain(reason, urgent)
        return self._effects()

    def _drain(self, reason: str, urgent: bool) -> None:
        if self.drain_deadline is not None:
            if urgent:
                log.warning("%s while draining: stopping now", reason)
                self.stopping = True
            return
        self.drain_reason = reason
        self.drain_deadline = self.now + self.drain_timeout
        log.info("draining (%s): %d running jobs checkpoint and stop", reason, len(self.runtimes))
        for rt in self.runtimes.values():
            self.journal.event(rt.job_id, "draining", reason)

    def adopt(self, job_id: str, pid: int, now: float, alive: bool = True) -> list[Effect]:
        """A job the journal has running whose driver (``pid``) outlived the last daemon: it goes
        on where it was once engines for it are back. ``alive`` False: its driver ended while no
        daemon ran; its exit is judged by ``driver_exited``."""
        self.now = now
        info = self._known_job(job_id)
        spec = spec_from_wire(self.journal.spec(job_id))
        job_dir = self._job_dir(job_id)
        rt = self.runtimes[job_id] = JobRuntime(
            job_id, spec, job_dir, pid, policy_version=info.policy_version, user=info.user
        )
        adapter_dir = job_dir.adapter(info.policy_version)
        if info.policy_version and adapter_dir.is_dir():
            rt.adapter = P.AdapterRef(job_id, info.policy_version, str(adapter_dir), full=spec.lora is None)
        asked = [kind for _, kind, _ in self.journal.events(job_id) if kind in ("started", "cancel_requested")]
        if asked and asked[-1] == "cancel_requested":  # asked before the last daemon went: still asked
            rt.cancel_requested_at = now
        if alive:
            self.adopting[job_id] = now + ADOPT_TIMEOUT_S
            self.journal.event(
                job_id, "reattached", f"driver pid {pid} outlived the daemon" if pid else "its external client goes on"
            )
        return self._effects()

    def requeue(self, job_id: str, was: str) -> None:
        """A job that was running or interrupted when the last daemon stopped, with no driver
        left: queued again, it resumes from its last checkpoint."""
        info = self._known_job(job_id)
        self.journal.update(job_id, state="queued", restarts=info.restarts + 1)
        self.journal.event(job_id, "recovered", f"was {was}")

    def driver_started(self, job_id: str, pid: int, now: float) -> list[Effect]:
        self.now = now
        rt = self.runtimes[job_id]
        rt.pid = pid
        self.start_failures.pop(job_id, None)
        self._running(job_id, f"driver pid {pid}")
        return self._effects()

    def _running(self, job_id: str, how: str) -> None:
        info = self._known_job(job_id)
        self.journal.update(job_id, state="running", started_at=info.started_at or self.now)
        self.journal.event(job_id, "started", how)
        log.info("job %s started (%s)", job_id, how)

    def driver_not_started(self, job_id: str, why: str, now: float) -> list[Effect]:
        """The driver could not be started (no disk space, no more processes, inputs it cannot
        stage): the job waits, tried again after a wait that doubles; after ``DRIVER_START_TRIES``
        it fails with the reason."""
        self.now = now
        self.runtimes.pop(job_id, None)
        self.sched.release(job_id)
        why = f"cannot start its driver: {why}"
        tries = self.start_failures.get(job_id, (0, 0.0))[0] + 1
        if tries >= DRIVER_START_TRIES:
            self.start_failures.pop(job_id, None)
            self.reasons.pop(job_id, None)
            self.journal.update(job_id, state="failed", ended_at=now, error=f"{why} ({tries} tries)")
            self.journal.event(job_id, "failed", f"{why} ({tries} tries)")
            log.error("job %s failed: %s (%d tries)", job_id, why, tries)
            return self._effects()
        self.start_failures[job_id] = (tries, now + 2.0 ** (tries - 1))
        if self.reasons.get(job_id) != why:
            log.error("job %s %s", job_id, why)
        self.reasons[job_id] = why
        return self._effects()

    def limit_breached(self, job_id: str, why: str, now: float) -> list[Effect]:
        """A jailed job went past one of its limits (``daemon.jail.JobLimits``): it fails with that
        line, its driver killed; nothing else is touched."""
        self.now = now
        rt = self.runtimes.get(job_id)
        if rt is not None and not rt.failure:
            rt.failure = why
            self.journal.event(job_id, "limit", why)
            self._out.append(StopDriver(job_id, kill=True))
        return self._effects()

    def worker_process_exited(self, worker_id: str, code: int, now: float) -> list[Effect]:
        """The process of a worker the server started exited."""
        self.now = now
        if worker_id in self.workers:
            self._worker_lost(worker_id, f"process exited with code {code}")
        return self._effects()

    def interrupt_running(self) -> list[Effect]:
        """The cluster goes down now: jobs still running resume from their last periodic
        checkpoint; every worker is told to exit."""
        for rt in list(self.runtimes.values()):
            info = self.journal.job(rt.job_id)
            if info and info.state == "running":
                self.journal.update(rt.job_id, state="interrupted")
                self.journal.event(
                    rt.job_id,
                    "interrupted",
                    "cluster went down before the job checkpointed; it resumes from its last periodic checkpoint",
                )
        for w in self.workers.values():  # remote workers (another node, another allocation) exit too
            self._send(w.identity, P.Op.SHUTDOWN, P.Empty())
        return self._effects()

    def is_isolated(self, user: str) -> bool:
        """Whether ``user``'s jobs run isolated, held to their own rights (every user the cluster
        does not trust: not its owner, not named with ``--trust-user-code``)."""
        return user not in (self.owner, auth.INTERNAL_USER) and user not in self.trusted_users

    # ------------------------------------------------------------------ messaging

    def _error(self, identity: bytes, msg_id: int, code: str, message: str) -> None:
        self._send(identity, P.Op.ERROR, P.ErrorBody(code, message), msg_id)

    def _refusal(self, op: bytes, user: str) -> str:
        """Why ``user`` may not send ``op`` ("" if they may)."""
        if auth.job_of(user) is not None:  # an isolated driver: its job's calls and reports, nothing else
            return (
                ""
                if op in (P.Op.CALL, P.Op.REPORT)
                else "an isolated job's driver may only call and report for its job"
            )
        if op in INTERNAL_OPS and user != auth.INTERNAL_USER:
            return (
                f"{user or 'this client'} may not send {op.decode(errors='replace')}: "
                "it is for the cluster's own processes"
            )
        if op == P.Op.DOWN and user != self.owner:
            return f"only the cluster's owner ({self.owner}) may stop it"
        return ""

    def _foreign_job(self, job_id: str) -> bool:
        """Whether the sender is an isolated driver of another job than ``job_id``."""
        return auth.job_of(self.sender) not in (None, job_id)

    def _visible(self, job_user: str) -> bool:
        """Whether the current sender may see and act on a job of ``job_user``."""
        return self.sender in (job_user, self.owner, auth.INTERNAL_USER)

    # ------------------------------------------------------------------ client requests

    def on_ping(self, identity: bytes, header: P.Header, body: P.Empty) -> None:
        decls = [e for w in self.workers.values() for e in w.engines]
        ready = sum(1 for w in self.workers.values() if w.ready for _ in w.engines)
        total = max(len(decls), self.local_workers)
        self._send(
            identity,
            P.Op.REPLY,
            P.Pong(
                version=VERSION,
                pid=self.pid,
                started_at=self.started_at,
                workers=len(self.workers),
                engines_ready=ready,
                engines_total=total,
                problems=list(self.problems),
                upload_inputs=self.is_isolated(self.sender),
            ),
            header.msg_id,
        )

    def on_submit(self, identity: bytes, header: P.Header, body: P.SubmitReq) -> None:
        try:
            spec = spec_from_wire(body.spec)
            broken = wire_rule_problems(body.spec, from_tinker_front_end=self.sender == auth.INTERNAL_USER)
        except Exception as exc:  # noqa: BLE001
            self._error(identity, header.msg_id, "bad_request", f"invalid job spec: {exc}")
            return
        if broken:  # the rules the CLI ran, run again: a client may skip them
            self._error(identity, header.msg_id, "bad_request", f"invalid job spec: {'; '.join(broken)}")
            return
        if os.path.realpath(spec.model.path) not in self.models:
            self._error(
                identity,
                header.msg_id,
                "refused",
                f"model.path {spec.model.path!r} is not served by this cluster "
                f"(it serves: {', '.join(sorted(self.models))})",
            )
            return
        refusal = self._engines_refuse(spec)
        if refusal:
            self._error(identity, header.msg_id, "refused", refusal)
            return
        user = body.user if self.sender == auth.INTERNAL_USER else self.sender  # who the key says, not the body
        if spec.algo.loss_fn and user not in self.trusted_users:
            self._error(
                identity,
                header.msg_id,
                "untrusted",
                f"algo.loss_fn: user {user!r} may not run code in this cluster's trainer "
                f"(it would run beside other users' state); the cluster's owner can allow it "
                f"with `plexctl up --trust-user-code {user}`",
            )
            return
        refusal = jail.refusal(user) if self.is_isolated(user) else ""
        if refusal:
            self._error(identity, header.msg_id, "untrusted", refusal)
            return
        if self.is_isolated(user):  # the daemon never opens their paths: their client sent the files
            missing = sorted(set(inputs.field_paths(body.spec)) - {f.field for f in body.inputs})
            problem = (
                (
                    f"{missing[0]}: its files were not uploaded (submit with plexctl or "
                    f"plexctl.inputs.submit, which send them)"
                )
                if missing
                else self.blobs.check(user, body.inputs)
            )
            if not problem:  # the CLI measured the prompts against the context; a raw submit did not
                problem = "; ".join(self._context_problems(spec, user, body.inputs))
            if problem:
                self._error(identity, header.msg_id, "bad_request", problem)
                return
        known = self.journal.submitted(body.submit_id)
        if known is not None:  # a retried submit: the job it made, whatever has happened since
            if self._known_job(known).user != user:
                self._error(identity, header.msg_id, "bad_request", f"submit id {body.submit_id!r} is taken")
            else:
                self._send(identity, P.Op.REPLY, P.SubmitRep(job_id=known, created=False), header.msg_id)
            return
        holders = self.journal.holding(spec.name, user)
        if holders and not body.replace:
            held = holders[-1]
            self._error(
                identity,
                header.msg_id,
                "bad_request",
                f"name: your job {held.job_id} ({held.state}) is named {spec.name!r}; cancel it, choose "
                f"another name (--name), or replace it (`plexctl submit --replace`)",
            )
            return
        for old in holders:  # the older job is cancelled first: the name then means the new one alone
            self._cancel(old.job_id, f"replaced by a new submit of {spec.name!r}")
        job_id, created = self.journal.submit(
            body.submit_id, spec.name, user, body.spec, spec.algo.steps, spec.priority
        )
        if created and body.inputs:
            write_bytes_atomic(self._job_dir(job_id).inputs, msgspec.json.encode(body.inputs))
        if created:
            log.info("job %s (%s) submitted by %s", job_id, spec.name, user)
        self._send(
            identity,
            P.Op.REPLY,
            P.SubmitRep(job_id=job_id, created=created, replaced=[old.job_id for old in holders]),
            header.msg_id,
        )

    def _engines_refuse(self, spec: JobSpec) -> str:
        """Why the engines serving the job's model can never run it (its dtype, its LoRA rank, its
        max_tokens beside the sequences they hold, its state beside every trainer's capacity), or "".
        Judged by the engines registered so far."""
        model = os.path.realpath(spec.model.path)
        decls = [d for w in self.workers.values() for d in w.engines if os.path.realpath(d.model) == model]
        served = sorted({d.dtype for d in decls if d.dtype})
        if spec.model.dtype is not None and served and spec.model.dtype not in served:
            return (
                f"model.dtype {spec.model.dtype!r}: the engines of {spec.model.path} serve "
                f"{', '.join(served)} (`plexctl up --dtype`)"
            )
        ranks = [d.max_lora_rank for d in decls if d.kind == "rollout" and d.max_lora_rank]
        if spec.lora is not None and ranks and spec.lora.rank > max(ranks):
            fits = [r for r in VLLM_LORA_RANKS if r >= spec.lora.rank]
            if fits:
                fix = f"start the cluster with `plexctl up --max-lora-rank {fits[0]}`"
            else:
                fix = f"vLLM loads adapters up to rank {VLLM_LORA_RANKS[-1]}"
            return f"lora.rank {spec.lora.rank}: the rollout engines load adapters up to rank {max(ranks)}; {fix}"
        lengths = [d.max_model_len for d in decls if d.kind == "rollout" and d.max_model_len]
        if lengths and spec.sampling.max_tokens >= min(lengths):  # a prompt takes one token at least
            return (
                f"sampling.max_tokens {spec.sampling.max_tokens}: the rollout engines of {spec.model.path} "
                f"hold sequences of {min(lengths)} tokens, prompt included (`plexctl up --max-model-len`)"
            )
        capacities = [d.state_capacity_bytes for d in decls if d.kind == "trainer" and d.state_capacity_bytes]
        need = self._state_bytes(spec)
        if need and capacities and need > max(capacities):
            what = (
                "lora: the job's adapter and optimizer state"
                if spec.lora is not None
                else ("lora (none: full fine-tuning): the job's weights and optimizer state")
            )
            return (
                f"{what} takes {fmt_bytes(need)}, more than any "
                f"trainer's largest tier holds ({fmt_bytes(max(capacities))})"
            )
        rooms = [
            TrainerRoom(d.engine_id, d.step_room_bytes, d.gradient_checkpointing == "on", d.micro_batch_tokens)
            for d in decls
            if d.kind == "trainer" and d.step_room_bytes and d.micro_batch_tokens
        ]
        if rooms and spec.lora is not None:
            return spec_step_problem(spec, rooms, next((d.dtype for d in decls if d.dtype), "bfloat16"))
        return ""

    def _context_problems(self, spec: JobSpec, user: str, files: list[P.InputFile]) -> list[str]:
        """``sampling.max_tokens`` and the longest prompt of the uploaded data against the model's
        context (up to ``CONTEXT_CHECK_BYTES`` of data: more is left to the job's first generate)."""
        data = [f for f in files if f.field in ("data.path", "data.eval_path") and f.kind == "file"]
        if not data or sum(f.size for f in data) > CONTEXT_CHECK_BYTES:
            return []
        return context_problems(spec, {f.relpath: self.blobs.path(user, f.sha256) for f in data})

    def on_status(self, identity: bytes, header: P.Header, body: P.StatusReq) -> None:
        if body.job_id:
            job_id = self._find(identity, header, body.job_id)
            if job_id is None:
                return
            jobs = [self._known_job(job_id)]
        else:
            jobs = [j for j in self.journal.jobs() if self._visible(j.user)]
        jobs = [self._with_live_fields(j) for j in jobs]
        now = self.now

        def shown(job_ids: Iterable[str]) -> list[str]:  # others' jobs on a shared engine stay unnamed
            return sorted(j for j in job_ids if (info := self.journal.job(j)) is not None and self._visible(info.user))

        engines = []
        busy_total = span_total = 0.0
        for w in self.workers.values():
            for decl in w.engines:
                eng = self.sched.engines.get(decl.engine_id)
                busy = 0.0
                if eng is not None:
                    busy = eng.busy_seconds + (now - eng.busy_since if eng.busy_since else 0.0)
                    busy_total += busy
                    span_total += now - max(self.started_at, eng.up_at or self.started_at)
                engines.append(
                    P.EngineInfo(
                        engine_id=decl.engine_id,
                        worker_id=w.worker_id,
                        kind=decl.kind,
                        model=decl.model,
                        ready=w.ready,
                        running=shown({t.job_id for t in eng.running.values()}) if eng else [],
                        resident=shown(j for j, h in self.sched.home.items() if h == decl.engine_id),
                        busy_seconds=busy,
                        tasks_done=eng.tasks_done if eng else 0,
                        tiers=self.engine_stats.get(decl.engine_id, {}).get("tiers", {}),
                        swaps=self.engine_stats.get(decl.engine_id, {}).get("swaps", {}),
                        swaps_by_kind=self.engine_stats.get(decl.engine_id, {}).get("swaps_by_kind", {}),
                        switches=eng.switches if eng else 0,
                        shared_passes=eng.shared_passes if eng else 0,
                        shared_tasks=eng.shared_tasks if eng else 0,
                        last_pass=eng.last_pass if eng else 0,
                        largest_pass=eng.largest_pass if eng else 0,
                        devices=w.devices,
                        dtype=decl.dtype,
                        device=decl.device,
                        suspect=w.suspect_since is not None,
                        silent_s=now - w.last_seen if w.suspect_since is not None else 0.0,
                        weights=self._weights_state(w, decl) if decl.kind == "rollout" else "",
                    )
                )
        # idle share of engine time since this daemon started (running totals: no scan of past tasks)
        bubble = max(0.0, 1.0 - busy_total / span_total) if span_total > 0 else None
        timeline = M.busy_spans(self.sched, now) if body.timeline else []
        marks = self.telemetry.marks_since(self.started_at) if body.timeline else []
        moves = self.telemetry.moves_since(self.started_at) if body.timeline else []
        self._send(
            identity,
            P.Op.REPLY,
            P.StatusRep(
                jobs=jobs,
                engines=engines,
                now=now,
                policy=self.policy,
                bubble_ratio=bubble,
                started_at=self.started_at,
                timeline=timeline,
                swap_marks=marks,
                moves=moves,
            ),
            header.msg_id,
        )

    def _weights_state(self, w: WorkerState, decl: P.EngineDecl) -> str:
        """A rollout engine's model: ``resident``, or, when the worker's engines take turns,
        ``awake`` (the one serving now or last; before any, the one built last) or ``asleep``."""
        if not decl.sleeps:
            return "resident"
        turns = [d.engine_id for d in w.engines if d.kind == "rollout" and d.sleeps]
        engines = self.sched.engines

        def latest(engine_id: str) -> tuple[bool, float, int]:
            e = engines.get(engine_id)
            return (bool(e and e.running), e.last_done_at if e else 0.0, turns.index(engine_id))

        return "awake" if max(turns, key=latest) == decl.engine_id else "asleep"

    def snapshot_gauges(self, now: float) -> None:
        """Refresh what a Prometheus scrape sees (cheap sums; the HTTP thread only renders them)."""
        by_state: dict[str, int] = {}
        for j in self.journal.jobs():
            by_state[j.state] = by_state.get(j.state, 0) + 1
        swaps = {e: st.get("swaps", {}) for e, st in self.engine_stats.items()}
        engines = M.engine_gauges(self.sched, swaps, now)
        self.telemetry.set_gauges(
            M.Gauges(
                jobs_by_state=by_state,
                engines=engines,
                bubble_ratio=M.bubble_of(engines),
                uptime_s=now - self.started_at,
            )
        )

    def _known_job(self, job_id: str) -> P.JobInfo:
        """The journal's record of a job it holds (an id the journal or a running job gave)."""
        info = self.journal.job(job_id)
        assert info is not None
        return info

    def _find(self, identity: bytes, header: P.Header, ref: str) -> str | None:
        """A job id the sender may see, from an id, ``USER/NAME`` or a bare name; a bare name is
        the sender's own newest job of that name, never another user's (the cluster's own
        processes name any job). What names nothing the sender may see gets its error reply."""
        if (info := self.journal.job(ref)) is not None and self._visible(info.user):
            return ref
        user, _, name = ref.rpartition("/")
        if not user and self.sender != auth.INTERNAL_USER:
            user = self.sender
        named = [j for j in self.journal.jobs() if j.name == name and (j.user == user or not user)]
        named = [j for j in named if self._visible(j.user)]
        if named:
            return named[-1].job_id
        others = [j for j in self.journal.jobs() if j.name == name and self._visible(j.user) and j.user != user]
        if others and "/" not in ref:
            ids = ", ".join(f"{j.user}/{j.name} ({j.job_id})" for j in others[-5:])
            why = f"no job of yours named {ref!r}; other users' jobs of that name: {ids}: name one by USER/NAME or id"
        else:
            why = f"no job {ref!r}"
        self._error(identity, header.msg_id, "not_found", why)
        return None

    def _with_live_fields(self, job: P.JobInfo) -> P.JobInfo:
        """Add what only the running daemon knows: why a job waits, where its state lives, and
        what it trains (from its spec)."""
        reason = self.reasons.get(job.job_id, "") if job.state == "queued" else ""
        tier = ""
        home = self.sched.home_of(job.job_id, "trainer")
        if home and job.state == "running":
            where = self.engine_stats.get(home, {}).get("where", {})
            tier = f"{home}:{where.get(job.job_id, 'device')}" if where else home
        trains, model = self._trains(job.job_id)
        return msgspec.structs.replace(job, reason=reason, state_tier=tier, trains=trains, model=model)

    def _trains(self, job_id: str) -> tuple[str, str]:
        """What the job trains (``JobInfo.trains``) and its model, from its spec; "" for a spec this
        daemon cannot read."""
        spec = self.specs.get(job_id)
        if spec is None:
            try:
                spec = spec_from_wire(self.journal.spec(job_id))
            except (SpecError, TypeError, ValueError):  # a spec of another version: status still answers
                return "", ""
        return (P.TRAINS_ALL if spec.lora is None else P.TRAINS_ADAPTER), os.path.realpath(spec.model.path)

    def on_cancel(self, identity: bytes, header: P.Header, body: P.JobRef) -> None:
        job_id = self._find(identity, header, body.job_id)
        if job_id is None:
            return
        rt = self.runtimes.get(job_id)
        if rt is not None and rt.spec.kind == EXTERNAL and self.sender == auth.INTERNAL_USER:
            rt.ended_by_client = True  # the Tinker front end ends the job: its client's session finished
        self._cancel(job_id, "its Tinker session finished" if rt is not None and rt.ended_by_client else "")
        self._send(identity, P.Op.REPLY, self.journal.job(job_id), header.msg_id)

    def _cancel(self, job_id: str, why: str = "") -> None:
        """Cancel a job: a queued one at once, a running one at its next call boundary."""
        info = self._known_job(job_id)
        if info.state == "queued" or info.state == "interrupted":
            self.journal.update(job_id, state="cancelled", ended_at=self.now)
            self.specs.pop(job_id, None)
            self.reasons.pop(job_id, None)
            self.journal.event(job_id, "cancelled", why or "before it started")
        elif info.state == "running":
            rt = self.runtimes.get(job_id)
            if rt is not None and rt.cancel_requested_at is None:
                rt.cancel_requested_at = self.now
                self.journal.event(job_id, "cancel_requested", why)

    def on_logs(self, identity: bytes, header: P.Header, body: P.LogsReq) -> None:
        job_id = self._find(identity, header, body.job_id)
        if job_id is None:
            return
        name = {"log": JobDir.DRIVER_LOG, "metrics": JobDir.METRICS}.get(body.kind)
        if name is None:
            self._error(identity, header.msg_id, "bad_request", f"unknown log kind {body.kind!r}")
            return
        ended = self._known_job(job_id).state in TERMINAL  # before reading: all it wrote is there
        data, size = b"", 0
        info = self._known_job(job_id)
        path = self._job_output(job_id, info.user, name)
        if path.is_symlink() or path.exists():
            try:
                with jail.open_job_file(path) as f:  # a jailed driver's file: no link, no FIFO followed
                    size = os.fstat(f.fileno()).st_size
                    f.seek(body.offset)
                    data = f.read(LOGS_CHUNK)
            except OSError:  # a link or a FIFO the job put there: its own doing, said without the host path
                log.warning("job %s: its %s is not a regular file; not read", job_id, name)
                self._error(identity, header.msg_id, "bad_request", f"job {job_id}'s {name} is not a regular file")
                return
            if not (ended and body.offset + len(data) >= size):  # more to come: never half a character
                data = data[: _chunk_end(data, whole_lines=len(data) == LOGS_CHUNK)]
        offset = body.offset + len(data)
        self._send(
            identity,
            P.Op.REPLY,
            P.LogsRep(data=data.decode(errors="replace"), offset=offset, finished=ended and offset >= size),
            header.msg_id,
        )

    def on_blob(self, identity: bytes, header: P.Header, body: P.BlobReq) -> None:
        """A chunk of one of the sender's input files (or the question how much is held)."""
        try:
            have = self.blobs.put(self.sender, body)
        except (BlobError, OSError) as exc:
            self._error(identity, header.msg_id, "bad_request", str(exc))
            return
        self._send(identity, P.Op.REPLY, P.BlobRep(have), header.msg_id)

    def on_export(self, identity: bytes, header: P.Header, body: P.ExportReq) -> None:
        """A job's latest adapter or checkpoint, for its user to copy out with their own rights:
        the listing, then each file in chunks. Nothing outside that directory is ever read."""
        job_id = self._find(identity, header, body.job_id)
        if job_id is None:
            return
        if body.what not in ("adapter", "checkpoint"):
            self._error(
                identity, header.msg_id, "bad_request", f"export what: adapter or checkpoint, not {body.what!r}"
            )
            return
        source = self._export_dir(job_id, body.what)
        if source is None:
            self._error(identity, header.msg_id, "not_found", f"job {job_id} has no {body.what} yet")
            return
        files = sorted(
            p for p in source.rglob("*") if p.is_file() and not p.is_symlink() and not p.name.startswith(".")
        )
        if not body.path:
            listing = [P.ExportFile(str(p.relative_to(source)), p.stat().st_size) for p in files]
            self._send(identity, P.Op.REPLY, P.ExportRep(f"{body.what} {source.name}", listing), header.msg_id)
            return
        wanted = {str(p.relative_to(source)): p for p in files}.get(body.path)
        if wanted is None:
            self._error(identity, header.msg_id, "not_found", f"{body.what} {source.name} has no file {body.path!r}")
            return
        with jail.open_job_file(wanted) as f:
            f.seek(body.offset)
            data = f.read(EXPORT_CHUNK)
        self._send(identity, P.Op.REPLY, P.ExportRep(f"{body.what} {source.name}", data=data), header.msg_id)

    def _export_dir(self, job_id: str, what: str) -> Path | None:
        """The directory of the job's latest published adapter or latest checkpoint, if any."""
        job_dir = self._job_dir(job_id)
        if what == "checkpoint":
            try:
                latest = job_dir.latest_checkpoint()
            except (OSError, ValueError):
                return None
            return Path(latest.dir) if latest is not None and job_dir.is_checkpoint(Path(latest.dir)) else None
        versions = job_dir.published_adapters()
        return versions[-1] if versions else None

    def on_down(self, identity: bytes, header: P.Header, body: P.Empty) -> None:
        self._send(identity, P.Op.REPLY, {"ok": True, "running": len(self.runtimes)}, header.msg_id)
        self._drain("plexctl down", urgent=True)

    # ------------------------------------------------------------------ workers

    def on_register(self, identity: bytes, header: P.Header, body: P.RegisterReq) -> None:
        now = self.now
        old = self.workers.get(body.worker_id)
        if old is not None and old.identity != identity:
            self._worker_lost(body.worker_id, "re-registered")
        elif old is not None and old.suspect_since is not None:  # back from a stall: it keeps its jobs
            self._worker_back(old, now)
        self.workers[body.worker_id] = WorkerState(
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
        self.resident.update(body.resident)
        if body.error:
            self.problems.append(f"worker {body.worker_id}: {body.error}")
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
                    self.models.add(os.path.realpath(decl.model))
            log.info(
                "worker %s ready on %s: %s",
                body.worker_id,
                body.node,
                ", ".join(f"{e.engine_id}({e.model})" for e in body.engines),
            )
        self._send(identity, P.Op.REPLY, {"ok": True}, header.msg_id)

    def on_heartbeat(self, identity: bytes, header: P.Header, body: P.HeartbeatBody) -> None:
        w = self.workers.get(body.worker_id)
        if w is not None and w.identity == identity:
            w.last_seen = self.now
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
        self._send(identity, P.Op.REPLY, {"ok": True}, header.msg_id)

    def _heartbeat_workers(self, now: float) -> None:
        """Heartbeat the workers and judge the silent ones: a worker that missed
        ``WORKER_LIVENESS`` heartbeats is suspect (``_suspect``), one silent past ``worker_grace``
        is lost; one whose process exited is lost at once (a local worker's, seen here; a Slurm
        worker's, told by its node task: ``on_worker_exited``)."""
        for wid, w in list(self.workers.items()):
            silent = now - w.last_seen
            if silent > self.worker_grace:
                self._worker_lost(
                    wid, f"no heartbeat for {silent:.1f} s, past the worker grace of {self.worker_grace:g} s"
                )
                continue
            if silent > HEARTBEAT_S * WORKER_LIVENESS and w.suspect_since is None:
                self._suspect(w, now, f"no heartbeat for {silent:.1f} s")
            self._send(w.identity, P.Op.HEARTBEAT, P.HeartbeatBody("plexd"))

    def _suspect(self, w: WorkerState, now: float, why: str) -> None:
        """A worker missed its heartbeats: stalled (a long GC pause, a swap storm, a file-system
        stall) or dead, not yet told apart. Its engines get no new calls; its calls in flight,
        its jobs and their state stay where they are until it answers (``_worker_back``) or is
        lost (``_heartbeat_workers``)."""
        w.suspect_since = now
        for decl in w.engines:
            self.sched.engine_suspect(decl.engine_id)
        log.warning(
            "worker %s suspect: %s; no new calls go to it, lost if still silent %g s after its last heartbeat",
            w.worker_id,
            why,
            self.worker_grace,
        )
        for job_id in self._jobs_on(w):
            self.journal.event(job_id, "worker suspect", f"worker {w.worker_id}: {why}")

    def _worker_back(self, w: WorkerState, now: float) -> None:
        """A suspect worker answers again: its engines take calls again, its jobs go on where they were."""
        suspect_s = now - (w.suspect_since if w.suspect_since is not None else now)
        w.suspect_since = None
        for decl in w.engines:
            self.sched.engine_back(decl.engine_id)
        log.info("worker %s answers again after %.1f s suspect; its jobs go on", w.worker_id, suspect_s)
        for job_id in self._jobs_on(w):
            self.journal.event(job_id, "worker back", f"worker {w.worker_id} after {suspect_s:.1f} s suspect")

    def _jobs_on(self, w: WorkerState) -> list[str]:
        """The running jobs that have used an engine of the worker."""
        engines = {d.engine_id for d in w.engines}
        return [rt.job_id for rt in self.runtimes.values() if rt.engines & engines]

    def _worker_lost(self, worker_id: str, why: str) -> None:
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        log.error("worker %s lost: %s", worker_id, why)
        for decl in w.engines:
            for task in self.sched.engine_down(decl.engine_id):
                log.warning("re-queued %s of job %s", task.method, task.job_id)
            self.engine_stats.pop(decl.engine_id, None)
        trainers = {d.engine_id for d in w.engines if d.kind == "trainer"}
        for rt in list(self.runtimes.values()):  # their adapter and optimizer state lived there
            if rt.engines & trainers and not rt.rolled_back and rt.cancel_requested_at is None:
                self._roll_back(rt, f"worker {worker_id} lost ({why})")

    def _roll_back(self, rt: JobRuntime, why: str) -> None:
        """The job's trainer state is gone: stop its driver; it resumes from its last checkpoint."""
        rt.rolled_back = why
        self.held.pop(rt.job_id, None)
        rt.held_calls.clear()
        rt.sent_ahead.clear()
        for task in self.sched.release(rt.job_id):
            self.calls.pop(task.task_id, None)
        for tid in [t for t, c in self.calls.items() if c.job_id == rt.job_id]:
            del self.calls[tid]
        if rt.pid:
            self._out.append(StopDriver(rt.job_id))
        log.warning("job %s rolls back to its last checkpoint: %s", rt.job_id, why)

    def on_result(self, identity: bytes, header: P.Header, body: P.ResultBody) -> None:
        now = self.now
        task = self.sched.done(
            body.task_id, now, body.seconds if body.ok else None, switch_seconds=body.switch_seconds or None
        )
        if task is not None:
            self.telemetry.task_done(task.method, body.ok, body.seconds, now - task.submitted_at)
            if isinstance(body.value, C.TrainStepResult) and body.value.metrics.get("swap_bytes"):
                self.telemetry.swapped(
                    self._trainer_of(identity, body.info.get("engine", "")),
                    task.job_id,
                    now - body.seconds,
                    int(body.value.metrics["swap_bytes"]),
                    float(body.value.metrics.get("swap_seconds", 0.0)),
                )
        self._take_inventory(identity, body.info)
        call = self.calls.pop(body.task_id, None)
        if call is None:
            return  # a call whose job has gone
        rt = self.runtimes.get(call.job_id)
        if rt is None:
            return
        followers = rt.held_calls.pop(call.msg_id, [])
        ahead = rt.sent_ahead.pop(call.msg_id, [])
        if body.ok and rt.job_id in self.sched.jobs:  # the worker started them as this task ended
            for ahead_task, engine_id in ahead:
                if engine_id in self.sched.engines:
                    self.sched.claim(ahead_task, engine_id, now)
        if not body.ok:  # and the worker fails those it was sent ahead
            self._error(call.identity, call.msg_id, "call_failed", f"{call.method} failed: {body.error}")
            for f_identity, f_header, f_body in followers:
                self._error(
                    f_identity,
                    f_header.msg_id,
                    "call_failed",
                    f"{f_body.method} was to follow {call.method}, which failed",
                )
            return
        prune: tuple[Path, int] | None = None
        if call.publishes:
            rt.policy_version = call.version
            rt.adapter = P.AdapterRef(rt.job_id, rt.policy_version, call.out_dir, full=rt.spec.lora is None)
            if rt.spec.kind != EXTERNAL:  # a Tinker job's versions are its samplers' weights: kept
                prune = (rt.job_dir.adapters, rt.spec.algo.max_staleness + 2)
        elif isinstance(body.value, C.CheckpointResult):
            rt.job_dir.write_latest(
                LatestCheckpoint(
                    dir=call.out_dir, step=call.step, policy_version=rt.policy_version, manifest=body.value.manifest
                )
            )
            self.journal.event(rt.job_id, "checkpoint", f"step {call.step}")
            prune = (rt.job_dir.checkpoints, 2)
        reply = self._reply(call, body.value)
        if followers:  # e.g. the next generate, sampled from the adapter just published: on its way before the reply
            for f_identity, f_header, f_body in followers:
                if rt.cancel_requested_at is not None:
                    self._error(f_identity, f_header.msg_id, "cancelled", "the job was cancelled")
                else:
                    self._start_call(rt, f_identity, f_header, f_body)
            self._place(now)
        self._send(call.identity, P.Op.REPLY, reply, call.msg_id)
        # after the reply: the job's next call need not wait for the journal or the pruning
        if call.publishes:
            self.journal.update(rt.job_id, policy_version=rt.policy_version)
        if prune is not None:
            self._out.append(Prune(*prune))
        if task is not None:
            self._prefetch_for(task.job_id)

    def _reply(self, call: PendingCall, result: C.AnyResult | None) -> C.Reply:
        """The loop's reply to a call whose task succeeded with ``result``."""
        method = C.METHODS[call.method]
        if not isinstance(result, method.result):
            raise ValueError(f"{call.method}: its engine answered {type(result).__name__}")
        drain = self.drain_reason if self.drain_deadline is not None else ""  # checkpoint at this step's end, exit
        return method.reply_of(result, call, drain)

    def _take_inventory(self, identity: bytes, info: dict[str, Any]) -> None:
        """A trainer's tier inventory and background moves, from a result or an INVENTORY message."""
        trainer = self._trainer_of(identity, info.get("engine", ""))
        if trainer and "inventory" in info:
            self._record_inventory(trainer, info["inventory"])
            if info.get("moves"):
                self.telemetry.moved(trainer, info["moves"])

    def on_inventory(self, identity: bytes, header: P.Header, body: P.InventoryBody) -> None:
        self._take_inventory(identity, body.info)

    def _trainer_of(self, identity: bytes, named: str = "") -> str:
        """The trainer engine a worker's report is about: the one it names (a worker hosts a
        trainer per model), else its first; "" for a worker this daemon does not know."""
        for w in self.workers.values():
            if w.identity == identity:
                trainers = [d.engine_id for d in w.engines if d.kind == "trainer"]
                return named if named in trainers else next(iter(trainers), "")
        return ""

    def _record_inventory(self, engine_id: str, inv: dict[str, Any]) -> None:
        """Keep a trainer's tier inventory for `status`, and tell the scheduler where state lives."""
        tiers = {t: inv[t] for t in ("device", "host", "nvme") if t in inv}
        where = {job: tier for tier, info in tiers.items() for job in info.get("jobs", [])}
        if where != self.engine_stats.get(engine_id, {}).get("where"):  # states moved: a prefetch may be asked again
            self.prefetched.pop(engine_id, None)
        self.engine_stats[engine_id] = {
            "tiers": tiers,
            "swaps": inv.get("swaps", {}),
            "swaps_by_kind": inv.get("swaps_by_kind", {}),
            "where": where,
        }
        for job, tier in where.items():
            if job in self.runtimes:
                self.sched.state_location(job, engine_id, tier)

    def _prefetch(self, engine_id: str, worker: WorkerState, expected: list[str] | None = None) -> None:
        """Ask the trainer to bring the state of the job expected to need it next up from NVMe,
        while it serves another job or the jobs are busy elsewhere (the store moves it only if
        host memory has room for it without demoting a copy needed sooner). ``expected``: the
        engine's order, when the caller has it already."""
        expected = self.sched.expected(engine_id) if expected is None else expected
        where = self.engine_stats.get(engine_id, {}).get("where", {})
        job = next((j for j in expected if where.get(j) == "nvme"), None)
        if job is None or self.prefetched.get(engine_id) == job:
            return
        self.prefetched[engine_id] = job
        self._send(worker.identity, P.Op.PREFETCH, P.PrefetchBody(job, engine_id, expected))

    def _prefetch_for(self, job_id: str) -> None:
        """After one of the job's tasks ended: the prefetch of its trainer may change."""
        job = self.sched.jobs.get(job_id)
        engine_id = job.homes.get("trainer") if job is not None else None
        engine = self.sched.engines.get(engine_id) if engine_id else None
        worker = self.workers.get(engine.worker_id) if engine is not None else None
        if engine is not None and worker is not None:
            self._prefetch(engine.engine_id, worker)

    # ------------------------------------------------------------------ drivers

    def on_call(self, identity: bytes, header: P.Header, body: P.CallReq) -> None:
        rt = self.runtimes.get(body.job_id)
        if self._foreign_job(body.job_id):
            self._error(identity, header.msg_id, "forbidden", f"job {body.job_id} is not this driver's")
            return
        if rt is None:
            self._error(identity, header.msg_id, "not_found", f"job {body.job_id} is not running")
            return
        if header.msg_id in rt.calls_seen:  # sent again by a driver that reconnected: already in hand
            return
        rt.calls_seen[header.msg_id] = None
        while len(rt.calls_seen) > 256:
            del rt.calls_seen[next(iter(rt.calls_seen))]
        if rt.cancel_requested_at is not None:
            self._error(identity, header.msg_id, "cancelled", "the job was cancelled")
            return
        if body.after and any(c.job_id == rt.job_id and c.msg_id == body.after for c in self.calls.values()):
            rt.held_calls.setdefault(body.after, []).append((identity, header, body))
            return  # started by on_result, the moment the call it follows is done
        self._start_call(rt, identity, header, body)

    def _start_call(self, rt: JobRuntime, identity: bytes, header: P.Header, body: P.CallReq) -> None:
        """Turn a service call into a task for the scheduler (or answer it here)."""
        task = self._call_task(rt, identity, header, body, rt.adapter, rt.policy_version)
        if task is None:
            return
        if rt.job_id in self.adopting and not self._adopt(rt.job_id, self.now):
            self.held.setdefault(rt.job_id, []).append(task)  # submitted once the job has its homes again
            return
        self.sched.submit(task)

    def _call_task(
        self,
        rt: JobRuntime,
        identity: bytes,
        header: P.Header,
        body: P.CallReq,
        adapter: P.AdapterRef | None,
        version: int,
    ) -> Task | None:
        """The task of a service call, its pending call recorded; a generate samples from
        ``adapter``, policy ``version``. None: answered here."""
        spec, req = rt.spec, body.request
        call = PendingCall(rt.job_id, identity, header.msg_id, req.method)
        site = _CallSite(self, rt, call, adapter, version)
        if rt.pid:  # a repeated trainer call is applied once (worker.servers)
            site.trainer.call_key = f"{rt.pid}:{header.msg_id}"
        try:
            made = C.METHODS[req.method].task_of(req, site)
        except C.CallRefused as refused:
            self._error(identity, header.msg_id, refused.code, refused.why)
            return None
        if isinstance(made, C.Reply):
            self._send(identity, P.Op.REPLY, made, header.msg_id)
            return None
        task = cast(C.AnyTask, made)
        call.task = task
        if not rt.model:
            rt.model = os.path.realpath(spec.model.path)
        kind = C.METHODS[req.method].kind
        weights = ""  # a trainer holds every base it trains, and a job's full weights are its state
        if isinstance(task, C.GenerateTask):  # the base, or a full fine-tuning job's policy
            ref = task.request.adapter
            weights = f"{ref.job_id}@v{ref.version}" if ref is not None and ref.full else rt.model
        queued = Task(
            next(self.task_ids),
            rt.job_id,
            kind,
            req.method,
            rt.model,
            self.now,
            spec.priority,
            weights,
            _pass_tokens(task),
        )
        self.calls[queued.task_id] = call
        return queued

    def _send_ahead(self, rt: JobRuntime, call: PendingCall, task_id: int, engine_id: str) -> None:
        """The calls held to follow ``call``, whose task just went to ``engine_id``: when that
        task publishes an adapter and the job's home rollout engine is on the same worker and
        idle, a generate among them goes there now, marked to start the moment that task ends
        (``TaskBody.after``), from the adapter it publishes: no trip through the daemon between
        the two. The scheduler counts it started then (``on_result``)."""
        followers = rt.held_calls.get(call.msg_id)
        home = self.sched.home_of(rt.job_id, "rollout")
        if not followers or not call.publishes or home not in self.sched.engines:
            return
        engines = self.sched.engines
        worker = self.workers.get(engines[home].worker_id)
        if worker is None or engines[home].worker_id != engines[engine_id].worker_id or not self.sched.idle(home):
            return
        adapter = P.AdapterRef(rt.job_id, call.version, call.out_dir, full=rt.spec.lora is None)
        held = []
        for f_identity, f_header, f_body in followers:
            task = None
            if f_body.method == "generate" and not rt.sent_ahead.get(call.msg_id):
                task = self._call_task(rt, f_identity, f_header, f_body, adapter, call.version)
            if task is None:
                held.append((f_identity, f_header, f_body))
                continue
            rt.sent_ahead[call.msg_id] = [(task, home)]
            engine_task = self.calls[task.task_id].task
            assert engine_task is not None  # made with the call (_call_task)
            self._send(
                worker.identity, P.Op.TASK, P.TaskBody(task.task_id, rt.job_id, home, engine_task, after=task_id)
            )
        if held:
            rt.held_calls[call.msg_id] = held
        else:
            del rt.held_calls[call.msg_id]

    def on_report(self, identity: bytes, header: P.Header, body: P.ReportBody) -> None:
        rt = self.runtimes.get(body.job_id)
        if rt is None or self._foreign_job(body.job_id):
            return
        m = body.metrics
        if body.event == "step":
            fields: dict[str, Any] = {"step": body.step}
            if "reward_mean" in m:
                fields["reward"] = m["reward_mean"]
            self.journal.update(body.job_id, **fields)
        elif body.event == "eval":
            info = self._known_job(body.job_id)
            fields = {"eval_last": m["eval_reward"]}
            if info.eval_first is None:
                fields["eval_first"] = m["eval_reward"]
            self.journal.update(body.job_id, **fields)
            self.journal.event(body.job_id, "eval", f"step {body.step}: {m['eval_reward']:.4f}")
        elif body.event == "failed":
            rt.failure = body.message
        elif body.event == "note":
            self.journal.event(body.job_id, "note", body.message)

    def _place(self, now: float) -> None:
        placements = self.sched.tick(now)
        leads = {p.lead for p in placements if p.lead}
        passes: dict[int, tuple[WorkerState, list[P.TaskBody]]] = {}  # lead -> its pass's bodies, lead first
        for placement in placements:
            task = placement.task
            call = self.calls.get(task.task_id)
            if call is None:
                self.sched.done(task.task_id, now)
                continue
            engine = self.sched.engines[placement.engine_id]
            worker = self.workers.get(engine.worker_id)
            if worker is None:
                continue
            rt = self.runtimes.get(task.job_id)
            if rt is not None and placement.engine_id not in rt.engines:
                rt.engines.add(placement.engine_id)
                self.journal.update(task.job_id, engine=",".join(sorted(rt.engines)))
            engine_task = call.task
            assert engine_task is not None  # made with the call (_call_task)
            expected = self.sched.expected(placement.engine_id) if task.kind == "trainer" else None
            if expected is not None and not isinstance(engine_task, C.GenerateTask):
                trainer = msgspec.structs.replace(engine_task.trainer, upcoming=expected)
                engine_task = msgspec.structs.replace(engine_task, trainer=trainer)
                if self.prefetched.get(placement.engine_id) == task.job_id:  # served: it may be asked again
                    del self.prefetched[placement.engine_id]
            body = P.TaskBody(task.task_id, task.job_id, placement.engine_id, engine_task)
            if placement.lead or task.task_id in leads:  # sent with its pass, below
                passes.setdefault(placement.lead or task.task_id, (worker, []))[1].append(body)
            else:
                self._send(worker.identity, P.Op.TASK, body)
            if expected is not None:
                self._prefetch(placement.engine_id, worker, expected)
            if rt is not None and rt.held_calls:
                self._send_ahead(rt, call, task.task_id, placement.engine_id)
        for worker, bodies in passes.values():
            if len(bodies) > 1:
                self._send(worker.identity, P.Op.TASK_PASS, P.TaskPassBody(bodies[0].engine_id, bodies))
            else:
                self._send(worker.identity, P.Op.TASK, bodies[0])

    def _admit_adopted(self, now: float) -> None:
        """Give adopted jobs their homes once engines for them are back (``_adopt``). Past
        ``ADOPT_TIMEOUT_S`` the job restarts."""
        for job_id, deadline in list(self.adopting.items()):
            rt = self.runtimes.get(job_id)
            if rt is not None and not self._adopt(job_id, now) and now > deadline:
                del self.adopting[job_id]
                self._roll_back(
                    rt, f"its engines did not come back within {ADOPT_TIMEOUT_S:.0f} s of the daemon's restart"
                )

    def _adopt(self, job_id: str, now: float) -> bool:
        """Place an adopted job again, on the trainer that holds its state when a worker says
        so (its trainer calls stay there), then submit the calls its driver sent meanwhile.
        False while no engines for it are back."""
        rt = self.runtimes.get(job_id)
        if rt is None:
            self.adopting.pop(job_id, None)
            self.held.pop(job_id, None)
            return True
        holder = self.resident.get(job_id)
        holder = holder if holder in self.sched.engines else None
        adm = self.sched.admit(
            job_id,
            os.path.realpath(rt.spec.model.path),
            now,
            state_bytes=self._state_bytes(rt.spec),
            priority=rt.spec.priority,
            user=rt.user,
            trainer=holder,
        )
        if not adm.ok:
            return False
        del self.adopting[job_id]
        self.resident.pop(job_id, None)
        if holder is not None:  # on some tier of it: the trainer's next inventory says which
            self.sched.state_location(job_id, holder, "host")
        for task in self.held.pop(job_id, []):
            self.sched.submit(task)
        log.info("job %s placed again on %s, %s", job_id, adm.rollout, adm.trainer)
        return True

    def _admit(self, now: float) -> None:
        running = sum(1 for rt in self.runtimes.values())
        ready_models = {(e.kind, e.model) for e in self.sched.engines.values()}
        for info in self.journal.jobs(("queued",)):
            if running >= self.max_running:
                self.reasons[info.job_id] = (
                    f"waiting for room: {running} jobs run (the daemon's max_running: {self.max_running})"
                )
                continue
            if info.job_id in self.runtimes:  # its driver is being started
                continue
            if self.start_failures.get(info.job_id, (0, 0.0))[1] > now:  # its driver failed to start: later
                continue
            spec = self._spec(info.job_id)
            model = os.path.realpath(spec.model.path)
            if ("rollout", model) not in ready_models or ("trainer", model) not in ready_models:
                continue
            adm = self.sched.admit(
                info.job_id, model, now, state_bytes=self._state_bytes(spec), priority=spec.priority, user=info.user
            )
            if not adm.ok:
                self.reasons[info.job_id] = adm.reason
                continue
            # its runtime now; ``driver_started`` (or ``driver_not_started``) once the server tried
            rt = self.runtimes[info.job_id] = JobRuntime(
                info.job_id,
                spec,
                self._job_dir(info.job_id),
                policy_version=info.policy_version,
                user=info.user,
            )
            rt.adapter = _kept_adapter(rt, info.policy_version)  # a resumed job samples its latest policy
            if spec.kind == EXTERNAL:  # no driver: it runs, driven by its client's calls
                self._running(info.job_id, "driven by its external client")
            else:
                self._out.append(StartDriver(info.job_id))
            self.reasons.pop(info.job_id, None)
            self.specs.pop(info.job_id, None)
            running += 1

    def _spec(self, job_id: str) -> JobSpec:
        spec = self.specs.get(job_id)
        if spec is None:
            spec = self.specs[job_id] = spec_from_wire(self.journal.spec(job_id))
        return spec

    @staticmethod
    def _state_bytes(spec: JobSpec) -> int:
        lora = spec.lora
        try:
            config = model_config(spec.model.path)
            if lora is None:  # full fine-tuning: float32 weights (the trainer's masters) and AdamW moments
                return full_state_bytes(config, "float32")
            return job_state_bytes(lora.rank, list(lora.target_modules), config)
        except (OSError, KeyError, ValueError):
            return 0  # unknown architecture: admit, the worker's store enforces its tiers

    def _job_dir(self, job_id: str) -> JobDir:
        return JobDir(self.jobs_dir / job_id)

    def _job_output(self, job_id: str, user: str, name: str) -> Path:
        """A file a job's driver writes (``metrics.jsonl``): in its own directory when jailed.
        The driver's log is the daemon's (it holds the file open for the driver)."""
        job_dir = self._job_dir(job_id)
        if self.is_isolated(user) and name != JobDir.DRIVER_LOG:
            return job_dir.driver_out / name
        return job_dir.root / name

    def driver_exited(self, job_id: str, rc: int, now: float) -> list[Effect]:
        """A job's driver exited with code ``rc``: judge how the job ended (or why it runs again)."""
        self.now = now
        rt = self.runtimes.get(job_id)
        if rt is not None:
            self._judge_exit(rt, rc, now)
        return self._effects()

    def _judge_exit(self, rt: JobRuntime, rc: int, now: float) -> None:
        job_id = rt.job_id
        if rt.cancel_requested_at is not None:
            state, error = ("succeeded" if rt.ended_by_client else "cancelled"), ""
        elif rt.rolled_back and rc != 0:
            self.journal.update(job_id, state="queued")
            self.journal.event(job_id, "rolled back", f"{rt.rolled_back}; resumes from its last checkpoint")
            self._end_job(rt)
            return
        elif rc == 0:
            state, error = "succeeded", ""
        elif rc == DRIVER_EXIT_DRAINED and self.drain_deadline is None:  # it gave up on its daemon
            self.journal.update(job_id, state="queued")
            self.journal.event(
                job_id, "requeued", "the driver stopped, having lost its daemon; resumes from its last checkpoint"
            )
            log.warning("job %s: its driver lost the daemon; requeued", job_id)
            self._end_job(rt)
            return
        elif rc == DRIVER_EXIT_DRAINED or (self.drain_deadline is not None and not rt.failure):
            state, error = "interrupted", ""
            self.journal.update(job_id, state=state)
            self.journal.event(
                job_id,
                "interrupted",
                (
                    f"drained ({self.drain_reason}): checkpointed at a step boundary, resumes from there"
                    if rc == DRIVER_EXIT_DRAINED
                    else f"stopped with the cluster ({self.drain_reason}, driver exit {rc}): "
                    "resumes from its last checkpoint"
                ),
            )
            log.info("job %s drained", job_id)
            self._end_job(rt)
            return
        else:
            state = "failed"
            error = rt.failure or _last_line(rt.job_dir.driver_log) or f"driver exited with code {rc}"
            if not rt.failure and rc in LIMIT_EXITS and self.is_isolated(rt.user):  # a limit of its jail
                error = LIMIT_EXITS[rc]
            elif not rt.failure:  # the driver crashed (killed, out of memory) without reporting why
                how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                crashes = sum(1 for _, kind, _ in self.journal.events(job_id) if kind == "restarting")
                limit = rt.spec.checkpoint.max_restarts
                if crashes < limit:
                    self.journal.update(job_id, state="queued")
                    self.journal.event(
                        job_id,
                        "restarting",
                        f"driver crashed ({how}); restart {crashes + 1}/{limit} from the last checkpoint",
                    )
                    log.warning("job %s: driver crashed (%s); restarting from its checkpoint", job_id, how)
                    self._end_job(rt)
                    return
                error = f"driver crashed ({how}) {crashes + 1} times (checkpoint.max_restarts {limit}): {error}"
        self.journal.update(job_id, state=state, ended_at=now, error=error)
        self.journal.event(job_id, state, error)
        log.info("job %s %s%s", job_id, state, f": {error}" if error else "")
        self._end_job(rt)

    def _end_job(self, rt: JobRuntime) -> None:
        del self.runtimes[rt.job_id]
        self.adopting.pop(rt.job_id, None)
        self.held.pop(rt.job_id, None)
        for task in self.sched.release(rt.job_id):
            self.calls.pop(task.task_id, None)
        for tid in [t for t, c in self.calls.items() if c.job_id == rt.job_id]:
            del self.calls[tid]
        for engine_id in rt.engines:  # free the job's state on the engines that held it
            engine = self.sched.engines.get(engine_id)
            worker = self.workers.get(engine.worker_id) if engine else None
            if worker is not None:
                self._send(worker.identity, P.Op.RELEASE, P.ReleaseBody(rt.job_id, engine_id))

    HANDLERS: ClassVar[dict[bytes, Callable[[DaemonCore, bytes, P.Header, Any], None]]] = {
        P.Op.PING: on_ping,
        P.Op.SUBMIT: on_submit,
        P.Op.STATUS: on_status,
        P.Op.CANCEL: on_cancel,
        P.Op.LOGS: on_logs,
        P.Op.EXPORT: on_export,
        P.Op.BLOB: on_blob,
        P.Op.DOWN: on_down,
        P.Op.REGISTER: on_register,
        P.Op.HEARTBEAT: on_heartbeat,
        P.Op.LEAVE: on_leave,
        P.Op.WORKER_EXITED: on_worker_exited,
        P.Op.RESULT: on_result,
        P.Op.INVENTORY: on_inventory,
        P.Op.CALL: on_call,
        P.Op.REPORT: on_report,
    }


def _pass_tokens(task: C.AnyTask) -> int:
    """A train step's padded tokens if it may share a pass with other jobs' (a LoRA step without
    dropout: ``TrainingMath.groupable``), else 0."""
    if not isinstance(task, C.TrainStepTask) or task.trainer.lora is None or task.trainer.lora.dropout > 0:
        return 0
    rows = task.batch.input_ids
    return len(rows) * max((len(r) for r in rows), default=0)


def _chunk_end(data: bytes, whole_lines: bool) -> int:
    """Where a log chunk that more will follow should end: after its last whole line when
    ``whole_lines`` (the file goes on past it) and it has one, else before a UTF-8 character
    cut in two (the job writing it, or a line longer than a chunk)."""
    newline = data.rfind(b"\n") if whole_lines else -1
    if newline >= 0:
        return newline + 1
    try:
        data.decode()
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data":
            return exc.start
    return len(data)


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""
