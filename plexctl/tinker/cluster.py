"""The Tinker front end's ``Backend`` on a PlexRL cluster: each training client is a job.

A Tinker "model" (a training run: a LoRA adapter, or every weight) is an ``external`` job (no
driver, no data, no reward), submitted for the user its API key maps to and scheduled with every
other job; its calls are this process's typed service calls (``plexctl.rl.JobClient``, with
the cluster's internal key). ``forward_backward`` calls are kept, in order, until the
``optim_step`` that takes their gradient (``calls.OptimStepReq``), so no gradient outlives a call.
Saved sampler weights are the job's published policy versions (the daemon prunes none of a
Tinker job's: a ``tinker://`` path's weights never change), and sampling is a generate call of the
run's job at that version. What each run has saved, its step count and its job's restart count
are kept in ``<state>/tinker/runs.json``, and its forward_backward calls not yet stepped in
``<state>/tinker/pending/``, each written atomically, so a restarted front end takes its runs back.
A run whose job ran on meanwhile (its restarts unchanged) goes on from the trainer's live state,
losing nothing. A run whose trainer state was lost (its job restarted: a worker's death, the
cluster's down and up; the daemon answers its calls in flight ``rolled_back``) has its last saved
state restored (none: it starts afresh), and its next call fails with a ``UserError`` naming the
step it went back to, as does each ``optim_step`` until a forward_backward is sent again; the front
end's log and the job's events say it too.

Saves on the cluster's disk: every user's but the owner's are held to their ``tinker-disk`` and
``tinker-saves`` limits (``plexctl.common.limits``), counted from the directories their runs' jobs
hold (``adapters/v*``, ``ckpt/step-*``). Before a save, room is made by pruning that user's oldest
saves not in use (``plexctl.tinker.quota``); in use are a live run's latest state, the state it
would resume from, its newest weights, and sampler weights a live run made or sampled within
``SAMPLER_IDLE_S``. A save that finds no room is refused (a ``UserError``). A save whose directory
is gone (pruned) is no longer listed, and asking for it names its ``tinker://`` path, never a
directory of the cluster's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, NoReturn

import msgspec

from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.atomic import write_bytes_atomic, write_json_atomic
from plexctl.common.client import Client
from plexctl.common.cluster import endpoint_path, read_endpoint
from plexctl.common.errors import RemoteError
from plexctl.common.jobdir import JobDir
from plexctl.common.limits import limits_for
from plexctl.common.spec import EXTERNAL, SpecError, spec_from_wire, spec_to_wire
from plexctl.rl import CallFailed, JobClient
from plexctl.tinker import keys
from plexctl.tinker.backend import (
    MAX_TTL_S,
    MIN_TTL_S,
    Backend,
    CheckpointInfo,
    ForwardResult,
    SampledSequence,
    SampleParams,
    Sampler,
    SampleResult,
    ServedModel,
    TrainingRun,
    UserError,
    checkpoint_path,
    parse_checkpoint_path,
    say_waiting,
    sdk_model_id,
)
from plexctl.tinker.openai_api import NotFound, Policy, PolicyBackend, context_of
from plexctl.tinker.quota import Kept, Quota, QuotaFull, make_room

log = logging.getLogger("plexrl.tinker")

LORA_ALPHA = 32  # Tinker's LoRA scaling alpha
BASE_SAMPLER_RANK = 1  # a base model's sampler job holds the smallest adapter; it samples the base (version 0)
START_TIMEOUT_S = 600.0  # a run's job waits this long for engines before create_model fails
QUEUED_TOLD_AFTER_S = 5.0  # a run's job queued this long is told to the client as waiting (not a job just homed)
EPHEMERAL_PREFIX = "ephemeral-"  # tinker://<run>/sampler_weights/ephemeral-<version>: an unnamed sampler's weights
JOBS_DIR = "jobs"  # <state>/jobs/<job id>: the job directories the daemon lays out (``JobDir``)
BASE_PREFIX = "base:"  # an OpenAI model name "base:NAME": the base model, even where a job is named NAME
OPENAI_RUN_PREFIX = "openai-"  # the run (and sampler job) that serves a user's OpenAI requests on one base
MAX_IDLE_SAMPLER_CLIENTS = 32  # a run's idle clients kept for its generate calls (more are made, then closed)
OF_JOB = ":of:"  # a sampler of published weights: "<the user's OpenAI run>:of:<job id>:v<version>"
SAMPLER_IDLE_S = 600.0  # sampler weights no live run made or sampled for this long may be pruned for room


class SavedState(msgspec.Struct, array_like=True):
    """A ``save_state``: the job's checkpoint directory (``<state>/jobs/<job>/ckpt/step-N``), when
    it was made, the run's step then."""

    ckpt_dir: str
    at: float
    step: int = 0


class LoadedState(msgspec.Struct, array_like=True):
    """The last ``load_state``: its path, that state's directory, when, its step, whether weights only."""

    path: str
    ckpt_dir: str
    at: float
    step: int
    weights_only: bool


class RunRecord(msgspec.Struct):
    """What is kept of a run across restarts of the front end."""

    model_id: str
    job_id: str
    user: str
    base_model: str
    model_path: str
    rank: int | None  # None: full fine-tuning
    samplers: dict[str, int] = msgspec.field(default_factory=dict)  # name -> policy version
    sampler_times: dict[str, float] = msgspec.field(default_factory=dict)  # name -> when it was saved
    states: dict[str, SavedState] = msgspec.field(default_factory=dict)  # by name
    steps: int = 0  # optim_steps taken (as of the last one)
    restarts: int = 0  # its job's restarts when the run last knew its state live (more: the state was lost)
    expires: dict[str, float] = msgspec.field(default_factory=dict)  # checkpoint path -> when it is deleted
    public: list[str] = msgspec.field(default_factory=list)  # its sampler weights published to every user, by name
    public_states: list[str] = msgspec.field(default_factory=list)  # its saved states published, by name
    ended: bool = False  # its session ended: its job is over
    sampling: bool = False  # a base model's sampler (no training client): its job only samples
    loaded: LoadedState | None = None


class Resumed(msgspec.Struct):
    """What a run whose trainer state was lost (its job restarted) lost: the steps since its last
    saved state."""

    state: str  # the tinker:// path it went on from ("": it started afresh)
    step: int
    lost_steps: int

    def line(self, model_id: str) -> str:
        origin = f"its last saved state {self.state}" if self.state else "the start (no state was saved)"
        return (
            f"run {model_id} lost its trainer state (its job restarted) and went back to {origin}, "
            f"step {self.step}: {self.lost_steps} optim_step(s) since then, and forward_backward calls "
            "not yet stepped, were lost"
        )


class Run:
    """A run's record with its live parts: the job's client and the loss calls since the last step."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record
        self.pending: list[C.LossCall] = []
        self.lock = threading.Lock()  # one call of the job's client at a time
        self.client: JobClient | None = None
        self.samplers: list[JobClient] = []  # idle clients of its generate calls, which run side by side
        self.resuming = False  # taken back after a restart: its first call finds its job again
        self.resumed: Resumed | None = None  # until its next forward_backward: what a rollback lost


class ClusterBackend(Backend, PolicyBackend):
    """``clock``: what "lately" is measured by, for sampler weights in use (Unix seconds)."""

    def __init__(self, state_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self.state_dir = state_dir
        self.clock = clock
        self.registry = state_dir / "tinker" / "runs.json"
        self.runs: dict[str, Run] = {}
        self._lock = threading.Lock()
        self._sampler_clients = 0  # clients made for runs' generate calls (each named by its number)
        self._starting: dict[str, threading.Lock] = {}  # a base model's sampler job, while it starts
        self._local = threading.local()
        self._room = threading.Lock()  # one save makes room at a time
        self._sizes: dict[str, int] = {}  # a save's key (``_key``) -> its bytes: a save never changes
        self._sampled: dict[str, float] = {}  # sampler weights' key -> when a sampler was made of them or sampled
        self._since = clock()  # what was sampled before this front end started counts as sampled then
        self._owner = _owner(state_dir)  # whose disk it is: their saves are not limited
        self._serving: dict[tuple[str, str], str] = {}  # (user, model path) -> its OpenAI sampler run's id
        self._served_at: dict[str, float] = {}  # OpenAI sampler run -> when it last served a request
        self._inflight: dict[str, int] = {}  # OpenAI sampler run -> requests it serves now
        for model_id, record in self._read_registry().items():
            run = self.runs[model_id] = Run(record)
            run.resuming = not record.ended
            if model_id.startswith(OPENAI_RUN_PREFIX) and not record.ended:  # serves the user's requests again
                self._serving[(record.user, record.model_path)] = model_id
                self._served_at[model_id] = clock()

    def _read_registry(self) -> dict[str, RunRecord]:
        """The runs ``runs.json`` keeps. What cannot be read is not taken back, and not lost: the
        file is kept beside (``runs.json.unreadable-<time>``) and the log says which runs."""
        try:
            saved = json.loads(self.registry.read_text())
            if not isinstance(saved, dict):
                raise ValueError(f"a JSON object of runs, not {type(saved).__name__}")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self._keep_aside(f"unreadable ({e}); no run is taken back")
            return {}
        records, bad = {}, []
        for model_id, record in saved.items():
            try:
                if isinstance(record, dict) and record.get("loaded") == []:  # "nothing loaded" before LoadedState
                    record["loaded"] = None
                records[model_id] = msgspec.convert(record, RunRecord)
            except msgspec.ValidationError as e:
                bad.append(f"{model_id} ({e})")
        if bad:
            self._keep_aside(f"has runs it cannot read, not taken back: {'; '.join(bad)}")
        return records

    def _keep_aside(self, why: str) -> None:
        aside = self.registry.with_name(f"{self.registry.name}.unreadable-{time.time_ns()}")
        shutil.copy2(self.registry, aside)
        log.error("%s %s: kept as %s", self.registry, why, aside)

    # ------------------------------------------------------------ the cluster

    def _client(self) -> Client:
        """This thread's client of the daemon, with the internal key (the front end submits and
        ends jobs for the users its keys name)."""
        client = getattr(self._local, "client", None)
        if client is None:
            address = read_endpoint(self.state_dir).address
            client = self._local.client = Client(address, timeout=30.0, keys=auth.internal_keys_from_env())
        return client

    def _job_client(self, run: Run) -> JobClient:
        """The client of the run's calls that go in order (its training calls)."""
        if run.client is None:
            run.client = self._connect(run, "")
        return run.client

    def _connect(self, run: Run, suffix: str) -> JobClient:
        """A new client of the run's job, its own socket at the daemon (named ``tinker:JOB:PID`` + ``suffix``)."""
        return JobClient(
            read_endpoint(self.state_dir).address,
            run.record.job_id,
            endpoint_file=endpoint_path(self.state_dir),
            log=log.info,
            identity=f"tinker:{run.record.job_id}:{os.getpid()}{suffix}",
        )

    def _save(self) -> None:
        with self._lock:
            records = {m: msgspec.to_builtins(r.record) for m, r in self.runs.items()}
            write_json_atomic(self.registry, records)

    def _run(self, user: str, model_id: str) -> Run:
        run = self.runs.get(model_id)
        if run is None or run.record.user != user:
            raise UserError(f"no training run {model_id!r} of yours")
        return run

    def _readable(self, user: str, path: str) -> Run:
        """The run of a checkpoint ``user`` may read: theirs, or one published to all."""
        where = parse_checkpoint_path(path)
        run = self.runs.get(where.model_id)
        if run is not None and run.record.user != user and self.is_public(path):
            return run
        return self._run(user, where.model_id)

    def is_public(self, path: str) -> bool:
        where = parse_checkpoint_path(path)
        run = self.runs.get(where.model_id)
        if run is None:
            return False
        return where.name in (run.record.public if where.kind == "sampler" else run.record.public_states)

    def publish_checkpoint(self, user: str, path: str, public: bool) -> None:
        """Sampler weights (sampled by others' samplers) or a saved state (loaded into others' runs)
        made readable by every user of the cluster, or the owner's alone again."""
        where = parse_checkpoint_path(path)
        run, saved = self._saved(user, path)
        record = run.record
        if self.is_public(path) == public:  # as asked already: done (a 409 would stall the SDK 5 minutes)
            return
        if where.kind == "sampler":
            self._client().publish(record.job_id, record.samplers[where.name], public)
            record.public = _listed(record.public, where.name, public)
        else:
            self._client().publish(record.job_id, JobDir.parse_step(saved.name), public, checkpoint=True)
            record.public_states = _listed(record.public_states, where.name, public)
        self._save()

    def _call(self, run: Run, request: C.Request, on_partial: Callable[[P.PartialBody], None] | None = None) -> Any:
        """The run's call; a ``UserError`` when it failed, or when the run's trainer state was
        lost since its last call (the error says which step it went back to). Its training calls
        go one at a time, in order; its generate calls side by side, each on a client of its own
        (``_sampler_client``), so the rollout engine batches them; ``on_partial`` gets a streamed
        generate's tokens as they come."""
        if isinstance(request, C.GenerateReq):
            with run.lock:
                if run.resuming and self._resume(run):
                    raise UserError(self._told(run))
            try:
                with self._sampler_client(run) as client:
                    return client.wait(client.call_async(request, on_partial=on_partial))
            except CallFailed as failed:
                with run.lock:
                    return self._failed(run, failed)
        with run.lock:
            if run.resuming and self._resume(run):
                raise UserError(self._told(run))
            if self._restarted(run) and self._resume(run):
                raise UserError(self._told(run))  # its trainer state was lost since its last call
            client = self._job_client(run)
            try:
                return client.wait(client.call_async(request))
            except CallFailed as failed:  # answered ``rolled_back``, or its job is not running: did it restart?
                return self._failed(run, failed)

    def _failed(self, run: Run, failed: CallFailed) -> NoReturn:
        """A ``UserError`` for a call that failed: its own error, or, where the run's job restarted
        under it, the step its trainer state went back to (under ``run.lock``)."""
        if not self._restarted(run):
            raise UserError(str(failed)) from None
        self._resume(run)  # its trainer state was lost under this call: the state it goes on from
        raise UserError(self._told(run))

    @contextlib.contextmanager
    def _sampler_client(self, run: Run) -> Iterator[JobClient]:
        """An idle client of the run's job for one generate call (a new one where all are busy),
        back among the idle ones after it, or closed if the run ended meanwhile."""
        with self._lock:
            client = run.samplers.pop() if run.samplers else None
            self._sampler_clients += client is None
            serial = self._sampler_clients
        if client is None:
            client = self._connect(run, f":s{serial}")
        try:
            yield client
        finally:
            with self._lock:
                kept = not run.record.ended and len(run.samplers) < MAX_IDLE_SAMPLER_CLIENTS
                if kept:
                    run.samplers.append(client)
            if not kept:
                client.close()

    def _restarted(self, run: Run) -> bool:
        """Whether the run's job restarted since the run last knew its state live (a sampler's
        job holds no state: never)."""
        if run.record.sampling:
            return False
        return bool(self._client().status(run.record.job_id).jobs[0].restarts != run.record.restarts)

    def _told(self, run: Run) -> str:
        assert run.resumed is not None
        return f"{run.resumed.line(run.record.model_id)}; send them again"

    def _resume(self, run: Run) -> bool:
        """Find the run's job again (after a restart of this front end, or a rollback of the
        job). Its job ran on all along (its restarts unchanged): the trainer holds its live
        state, and the forward_backward calls not yet stepped are taken back from disk; nothing
        was lost. Its job restarted: once it runs again, the run's last saved state is restored
        (none: it starts afresh); True: the caller fails its call with what was lost."""
        record = run.record
        info = self._wait_running(record.job_id)
        run.resuming = False
        if record.sampling:  # a base model's sampler: nothing saved, nothing lost
            return False
        if info.restarts == record.restarts:
            run.pending = self._read_pending(record)
            log.info(
                "run %s found its job %s live: %d forward_backward call(s) not yet stepped kept",
                record.model_id,
                record.job_id,
                len(run.pending),
            )
            return False
        client = self._job_client(run)
        latest = _restore_point(record)
        path, step = (latest.path, latest.step) if latest else ("", 0)  # none: the run starts afresh
        if latest is not None:
            client.wait(client.call_async(C.RestoreReq(latest.ckpt_dir, weights_only=latest.weights_only)))
        run.resumed = Resumed(path, step, max(0, record.steps - step))
        line = run.resumed.line(record.model_id)
        log.warning("%s", line)
        client.report("note", step, {}, line)
        record.steps, record.restarts = step, info.restarts
        self._keep_pending(run, [])
        self._save()
        return True

    def _pending_file(self, record: RunRecord) -> Path:
        return self.state_dir / "tinker" / "pending" / f"{hashlib.sha256(record.model_id.encode()).hexdigest()[:16]}"

    def _keep_pending(self, run: Run, pending: list[C.LossCall]) -> None:
        """The run's forward_backward calls not yet stepped, kept on disk (atomically) so a
        restart of this front end loses none; none: the file is removed."""
        run.pending = pending
        where = self._pending_file(run.record)
        if pending:
            write_bytes_atomic(where, msgspec.msgpack.encode(pending))
        else:
            where.unlink(missing_ok=True)

    def _read_pending(self, record: RunRecord) -> list[C.LossCall]:
        try:
            return msgspec.msgpack.decode(self._pending_file(record).read_bytes(), type=list[C.LossCall])
        except FileNotFoundError:
            return []

    # ------------------------------------------------------------ saves and the room they take

    def _job_dir(self, record: RunRecord) -> JobDir:
        return JobDir(self.state_dir / JOBS_DIR / record.job_id)

    def _key(self, save: Path) -> str:
        """A save's name here: ``<job>/adapters/v000003`` or ``<job>/ckpt/step-000002``."""
        return "/".join(save.parts[-3:])

    def _bytes(self, save: Path) -> int:
        key = self._key(save)
        if key not in self._sizes:
            self._sizes[key] = _dir_bytes(save)
        return self._sizes[key]

    def _newest_bytes(self, parent: Path, parse: Callable[[str], int]) -> int:
        """The bytes of the newest save under ``parent``: what the next one there will take (0: none yet)."""
        saves = _numbered_dirs(parent, parse)
        return self._bytes(saves[-1]) if saves else 0

    def _kept_version(self, record: RunRecord, name: str) -> int | None:
        """The version of the run's sampler weights ``name`` (a saved name or ``ephemeral-<v>``),
        if they are still on disk."""
        version = _sampler_version(record, name)
        if version is None or not self._job_dir(record).adapter(version).is_dir():
            return None
        return version

    def _forget_gone(self, run: Run) -> bool:
        """Forget the run's saves whose directories are gone (pruned); whether there were any."""
        record, job_dir = run.record, self._job_dir(run.record)
        with self._lock:
            states = [n for n, s in record.states.items() if not os.path.isdir(s.ckpt_dir)]
            samplers = [n for n, v in record.samplers.items() if not job_dir.adapter(v).is_dir()]
            for name in states:
                del record.states[name]
            for name in samplers:
                del record.samplers[name]
                record.sampler_times.pop(name, None)
        if states or samplers:
            log.info("run %s: forgot its saves that are gone: %s", record.model_id, ", ".join(states + samplers))
            self._save()
        return bool(states or samplers)

    def _quota(self, user: str) -> Quota | None:
        """What ``user``'s saves may take (None: no limit: the owner's, or set to 0)."""
        if user == self._owner:
            return None
        limits = limits_for(self.state_dir, user)
        quota = Quota(limits.tinker_disk_bytes, limits.tinker_saves)
        return quota if quota.disk_bytes or quota.saves else None

    def _kept(self, user: str) -> list[Kept]:
        """Every save on disk of the user's runs, each saying whether it is in use."""
        now = self.clock()
        runs = [r for r in list(self.runs.values()) if r.record.user == user and not r.record.sampling]
        live = [r for r in runs if not r.record.ended]
        resume_from = {self._key(Path(p.ckpt_dir)) for r in live if (p := _restore_point(r.record)) is not None}
        kept = []
        for run in runs:
            job_dir = self._job_dir(run.record)
            states = _numbered_dirs(job_dir.checkpoints, JobDir.parse_step)
            weights = _numbered_dirs(job_dir.adapters, JobDir.parse_version)
            newest = {self._key(d) for d in states[-1:] + weights[-1:]} if not run.record.ended else set()
            for save, is_weights in [(d, False) for d in states] + [(d, True) for d in weights]:
                try:
                    made = save.stat().st_mtime
                except FileNotFoundError:  # pruned meanwhile
                    continue
                key = self._key(save)
                sampled = max(made, self._since, self._sampled.get(key, 0.0)) if is_weights else 0.0
                lately = not run.record.ended and now - sampled < SAMPLER_IDLE_S
                kept.append(Kept(key, made, self._bytes(save), key in newest or key in resume_from or lately))
        return kept

    def _make_room(self, run: Run, what: str, new_bytes: int) -> None:
        """Prune the user's oldest saves not in use until a new one of ``new_bytes`` fits their
        limits; none fit: refused, a ``UserError`` that names ``what`` is saved."""
        quota = self._quota(run.record.user)
        if quota is None:
            return
        with self._room:
            try:
                doomed = make_room(self._kept(run.record.user), quota, new_bytes)
            except QuotaFull as full:
                raise UserError(f"{what} is not saved: {full}") from None
            self._prune(run.record.user, [k.key for k in doomed])

    def _settle(self, run: Run, what: str) -> None:
        """After a save: if it took more than was made room for, prune for the difference (the
        save stands either way; the next one is refused if there is still no room)."""
        quota = self._quota(run.record.user)
        if quota is None:
            return
        with self._room:
            try:
                doomed = make_room(self._kept(run.record.user), quota, 0, new_saves=0)
            except QuotaFull:
                log.info("%s of %s was saved past their limit: their next save needs room", what, run.record.user)
                return
            self._prune(run.record.user, [k.key for k in doomed])

    def _prune(self, user: str, keys: list[str], why: str = "to make room for a newer save") -> None:
        """Delete these saves of the user's and forget them (no list shows them any more)."""
        jobs = self.state_dir / JOBS_DIR
        for key in keys:
            try:
                shutil.rmtree(jobs / key)
            except OSError as e:
                log.warning("pruning %s of %s: %s", key, user, e)
            self._sizes.pop(key, None)
            self._sampled.pop(key, None)
            log.info("pruned %s of %s %s", key, user, why)
        for run in [r for r in list(self.runs.values()) if r.record.user == user]:
            self._forget_gone(run)

    # ------------------------------------------------------------ Backend

    def authenticate(self, api_key: str) -> str | None:
        return keys.user_of(self.state_dir, api_key)

    def models(self) -> list[ServedModel]:
        paths = sorted({e.model for e in self._client().status().engines})
        return [ServedModel(os.path.basename(p), context_of(p), tokenizer_dir=p) for p in paths]

    def _model_path(self, base_model: str) -> str:
        served = {m.name: m.tokenizer_dir for m in self.models()}
        path = served.get(base_model) or served.get(os.path.basename(base_model.rstrip("/")))
        if path is None:
            raise UserError(f"base model {base_model!r} is not served here (served: {', '.join(sorted(served))})")
        return path

    def create_model(
        self, user: str, session_id: str, model_seq_id: int, base_model: str, rank: int | None, seed: int | None
    ) -> TrainingRun:
        model_id = sdk_model_id(session_id, model_seq_id)
        known = self.runs.get(model_id)
        if known is not None and known.record.user == user:
            return _training_run(known.record)
        return _training_run(self._start_run(user, model_id, self._model_path(base_model), rank, seed or 0))

    def _start_run(
        self, user: str, model_id: str, path: str, rank: int | None, seed: int, sampling: bool = False
    ) -> RunRecord:
        """Submit the run's job for ``user`` and wait until it runs; its record, saved."""
        digest = hashlib.sha256(model_id.encode()).hexdigest()[:12]
        name = f"tinker-sample-{digest}" if sampling else f"tinker-{digest}"
        doc: dict[str, Any] = {
            "name": name,
            "kind": EXTERNAL,
            "model": {"path": path},
            "checkpoint": {"every": 0},
            "seed": seed,
        }
        if rank is not None:  # no lora section: the job trains every weight
            doc["lora"] = {"rank": rank, "alpha": LORA_ALPHA}
        try:
            spec = spec_from_wire(doc)
        except SpecError as e:  # a LoRA rank out of the spec's bounds (1 to 256)
            asked = f" (asked for rank {rank})" if rank is not None else ""
            raise UserError("; ".join(f"{i.path}: {i.message}" for i in e.issues) + asked) from None
        try:
            rep = self._client().submit(spec_to_wire(spec), submit_id=f"tinker:{model_id}", user=user)
        except RemoteError as refused:  # the daemon refused the run's job (a rank above the engines', ...)
            raise UserError(str(refused)) from None
        record = RunRecord(model_id, rep.job_id, user, os.path.basename(path), path, rank, sampling=sampling)
        self.runs[model_id] = Run(record)  # known while its job waits: a session that ends meanwhile cancels it
        self._save()
        try:
            record.restarts = self._wait_running(rep.job_id).restarts
        except UserError:  # it never ran (timed out, cancelled): its job goes, not left queued
            if not record.ended:
                record.ended = True
                self._save()
                try:
                    self._client().cancel(rep.job_id)
                except Exception:  # noqa: BLE001 - the client is told its run did not start anyway
                    log.warning("cancelling job %s failed", rep.job_id, exc_info=True)
            raise
        self._save()
        log.info("%s %s of %s: job %s on %s", "sampler" if sampling else "run", model_id, user, rep.job_id, path)
        return record

    def _wait_running(self, job_id: str) -> P.JobInfo:
        started = time.monotonic()
        deadline = started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            info = self._client().status(job_id).jobs[0]
            if info.state == "running":
                say_waiting(None)
                return info
            if info.state in ("failed", "cancelled", "succeeded"):
                raise UserError(f"its job {job_id} {info.state}: {info.error or info.reason}")
            if info.state == "queued" and time.monotonic() - started >= QUEUED_TOLD_AFTER_S:
                say_waiting(f"its job {job_id} is queued: {info.reason or 'waiting for engines'}")
            time.sleep(0.2)
        raise UserError(f"its job {job_id} did not start within {START_TIMEOUT_S:.0f} s")

    def capacity_note(self) -> str | None:
        waiting = [j for j in self._client().status().jobs if j.state == "queued" and j.reason]
        if not waiting:
            return None
        return (
            f"the cluster is full: {len(waiting)} job(s) wait for room ({waiting[0].reason}); a training "
            "client made now waits in the queue behind them (`plexctl status` shows the queue)"
        )

    def weights_info(self, user: str, path: str) -> TrainingRun:
        where = parse_checkpoint_path(path)
        run = self._readable(user, path)
        self._forget_gone(run)
        if where.kind == "training" and where.name not in run.record.states:
            raise UserError(f"no saved state at {path} {_GONE}")
        if where.kind == "sampler" and self._kept_version(run.record, where.name) is None:
            raise UserError(f"no sampler weights at {path} {_GONE}")
        return _training_run(run.record)

    def forward_backward(self, user: str, model_id: str, call: C.LossCall, forward_only: bool) -> ForwardResult:
        run = self._run(user, model_id)
        rep: C.ForwardBackwardRep = self._call(run, C.ForwardBackwardReq(call))
        if not forward_only:
            self._keep_pending(run, [*run.pending, call])
            run.resumed = None
        return ForwardResult(rep.logprobs, rep.loss)

    def optim_step(self, user: str, model_id: str, adam: C.AdamStep) -> dict[str, float]:
        run = self._run(user, model_id)
        with run.lock:  # its calls not yet stepped are known once its job is found again
            if run.resuming and self._resume(run):
                raise UserError(self._told(run))
        if run.resumed is not None:  # what the rollback lost was not sent again
            raise UserError(self._told(run))
        rep: C.OptimStepRep = self._call(run, C.OptimStepReq(list(run.pending), adam))
        self._keep_pending(run, [])
        run.record.steps += 1
        self._save()
        if run.client is not None:  # status shows the run's step
            run.client.report("step", run.record.steps, {})
        return {k: float(v) for k, v in rep.metrics.items() if k.count(":") == 1}

    def _publish(self, run: Run) -> int:
        rep: C.PublishRep = self._call(run, C.PublishReq())
        return rep.version

    def save_weights_for_sampler(self, user: str, model_id: str, name: str) -> str:
        run = self._run(user, model_id)
        path = checkpoint_path(model_id, "sampler", name)
        self._forget_gone(run)
        if name in run.record.samplers:
            raise UserError(f"{path} exists (a saved checkpoint does not change)")
        if name.startswith(EPHEMERAL_PREFIX):
            raise UserError(f"checkpoint names starting with {EPHEMERAL_PREFIX!r} are the server's: choose another")
        self._make_room(run, path, self._newest_bytes(self._job_dir(run.record).adapters, JobDir.parse_version))
        run.record.samplers[name] = self._publish(run)
        run.record.sampler_times[name] = time.time()
        self._save()
        self._settle(run, path)
        return path

    def save_state(self, user: str, model_id: str, name: str) -> str:
        run = self._run(user, model_id)
        path = checkpoint_path(model_id, "training", name)
        self._forget_gone(run)
        if name in run.record.states:
            raise UserError(f"{path} exists (a saved checkpoint does not change)")
        checkpoints = self._job_dir(run.record).checkpoints
        self._make_room(run, path, self._newest_bytes(checkpoints, JobDir.parse_step))
        step = _next_checkpoint_step(run.record, checkpoints)
        rep: C.CheckpointRep = self._call(run, C.CheckpointReq(step, {"tinker": name}))
        run.record.states[name] = SavedState(rep.path, time.time(), run.record.steps)
        self._save()
        self._settle(run, path)
        return path

    def load_state(self, user: str, model_id: str, path: str, optimizer: bool) -> None:
        run = self._run(user, model_id)
        where = parse_checkpoint_path(path)
        source_run = self._readable(user, path)
        self._forget_gone(source_run)
        source = source_run.record
        saved = source.states.get(where.name) if where.kind == "training" else None
        if saved is None:
            raise UserError(f"no saved state at {path} {_GONE}")
        if (source.model_path, source.rank) != (run.record.model_path, run.record.rank):
            raise UserError(
                f"{path} is a state of {source.base_model} {_trains(source.rank)}; "
                f"run {model_id} trains {run.record.base_model} {_trains(run.record.rank)}"
            )
        try:
            self._call(run, C.RestoreReq(saved.ckpt_dir, weights_only=not optimizer))
        except UserError as failed:  # said with the path the user knows, not the directory it names
            if self._forget_gone(source_run):
                raise UserError(f"no saved state at {path} {_GONE}") from None
            raise UserError(str(failed).replace(saved.ckpt_dir, path)) from None
        self._keep_pending(run, [])
        run.resumed = None
        run.record.steps = saved.step
        run.record.loaded = LoadedState(path, saved.ckpt_dir, time.time(), saved.step, not optimizer)
        self._save()

    def create_sampler(self, user: str, session_id: str, model_path: str | None, base_model: str | None) -> Sampler:
        if model_path:
            where = parse_checkpoint_path(model_path)
            run = self._readable(user, model_path)
            if run.record.user != user:  # published to all: sampled by the user's own sampler job
                policy = self.policy(user, model_path)
                served = self._server_run(user, policy.model_path).record.model_id
                sampler_id = f"{served}{OF_JOB}{policy.job_id}:v{policy.version}"
                return Sampler(sampler_id, run.record.base_model, model_path, tokenizer_dir=run.record.model_path)
            version = self._kept_version(run.record, where.name) if where.kind == "sampler" else None
            if version is None:
                raise UserError(f"no sampler weights at {model_path} {_GONE}")
            self._sampled[self._key(self._job_dir(run.record).adapter(version))] = self.clock()
            return _sampler(run.record, version, model_path)
        assert base_model is not None
        path = self._model_path(base_model)
        model_id = f"{session_id}:base:{re.sub(r'[^A-Za-z0-9_.-]', '_', os.path.basename(path))}"
        with self._lock:
            starting = self._starting.setdefault(model_id, threading.Lock())
        with starting:  # one sampler job per session and base: its samplers share it
            held = self.runs.get(model_id)
            if held is None or held.record.ended:
                self._start_run(user, model_id, path, BASE_SAMPLER_RANK, 0, sampling=True)
            elif held.record.user != user:
                raise UserError(f"session {session_id} is another user's")
        return Sampler(f"{model_id}:v0", os.path.basename(path), tokenizer_dir=path)

    def sampler_for_weights(self, user: str, model_id: str, seq: int) -> Sampler:
        run = self._run(user, model_id)
        what = f"the sampler weights of {model_id}"
        self._make_room(run, what, self._newest_bytes(self._job_dir(run.record).adapters, JobDir.parse_version))
        version = self._publish(run)
        self._sampled[self._key(self._job_dir(run.record).adapter(version))] = self.clock()
        self._settle(run, what)
        return _sampler(run.record, version, checkpoint_path(model_id, "sampler", f"{EPHEMERAL_PREFIX}{version}"))

    def sample(
        self,
        user: str,
        sampler_id: str,
        prompt_tokens: list[int],
        num_samples: int,
        params: SampleParams,
        prompt_logprobs: bool,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> SampleResult:
        model_id, _, version = sampler_id.rpartition(":v")
        model_id, of, of_job = model_id.partition(OF_JOB)
        run = self._run(user, model_id)
        if not of and not run.record.sampling:  # a run's weights, not the base's
            weights = self._job_dir(run.record).adapter(int(version))
            if not weights.is_dir():
                raise UserError(f"sampler {sampler_id}: its weights were pruned to make room for newer saves")
            self._sampled[self._key(weights)] = self.clock()
        max_tokens = params.max_tokens or max(1, context_of(run.record.model_path) - len(prompt_tokens))
        sampling = C.Sampling(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=max_tokens,
            n=num_samples,
            seed=params.seed,
            top_k=params.top_k,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_logprobs=topk_sample_logprobs,
        )
        if of:  # another user's published weights, by the user's own sampler job (the daemon checks they still are)
            policy = Policy(sampler_id, run.record.model_path, 0, of_job, int(version))
            completions = self.generate(user, policy, prompt_tokens, sampling)
        else:
            request = C.GenerateReq([], sampling, [prompt_tokens], version=int(version), interactive=True)
            completions = self._call(run, request).completions
        first = completions[0] if completions else None
        topk = None
        if first is not None and topk_prompt_logprobs:
            topk = [None if row is None else [(t.token, t.logprob) for t in row] for row in first.topk_prompt_logprobs]
        return SampleResult(
            [
                SampledSequence(
                    c.token_ids,
                    c.logprobs,
                    "length" if c.finish_reason == "length" else "stop",
                    [[(t.token, t.logprob) for t in row] for row in c.topk_logprobs] if topk_sample_logprobs else None,
                )
                for c in completions
            ],
            first.prompt_logprobs if first is not None and prompt_logprobs else None,
            topk,
        )

    def list_checkpoints(self, user: str, model_id: str) -> list[CheckpointInfo]:
        run = self._run(user, model_id)
        self._forget_gone(run)
        record, job_dir = run.record, self._job_dir(run.record)
        out = [
            CheckpointInfo(checkpoint_path(model_id, "training", name), saved.at, self._bytes(Path(saved.ckpt_dir)))
            for name, saved in record.states.items()
        ]
        out += [
            CheckpointInfo(
                checkpoint_path(model_id, "sampler", name),
                record.sampler_times.get(name, 0.0),
                self._bytes(job_dir.adapter(version)),
            )
            for name, version in record.samplers.items()
        ]
        return [
            msgspec.structs.replace(i, expires_at=record.expires.get(p), public=self.is_public(p))
            for i in out
            for p in (i.tinker_path,)
        ]

    def _saved(self, user: str, path: str) -> tuple[Run, Path]:
        """The user's run holding the checkpoint at ``path``, and its directory; a ``UserError``
        naming the path where the user has none there."""
        where = parse_checkpoint_path(path)
        run = self._run(user, where.model_id)
        self._forget_gone(run)
        record = run.record
        if where.kind == "training" and where.name in record.states:
            return run, Path(record.states[where.name].ckpt_dir)
        if where.kind == "sampler" and where.name in record.samplers:
            return run, self._job_dir(record).adapter(record.samplers[where.name])
        raise UserError(f"no checkpoint {path} of yours {_GONE}")

    def delete_checkpoint(self, user: str, path: str) -> None:
        run, saved = self._saved(user, path)
        if self.is_public(path):
            self.publish_checkpoint(user, path, False)
        with self._room:
            self._prune(user, [self._key(saved)], why="deleted by its owner")
        run.record.expires.pop(path, None)
        self._save()

    def set_checkpoint_ttl(self, user: str, path: str, ttl_s: int | None, now: float) -> None:
        run, _ = self._saved(user, path)
        if ttl_s is None:
            run.record.expires.pop(path, None)
        elif not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise UserError(
                f"ttl_seconds must be between {MIN_TTL_S} (an hour) and {MAX_TTL_S} (ten years), not {ttl_s}"
            )
        else:
            run.record.expires[path] = now + ttl_s
        self._save()

    def expire(self, now: float) -> list[str]:
        gone = []
        for run in list(self.runs.values()):
            for path, when in list(run.record.expires.items()):
                if when <= now:
                    try:
                        self.delete_checkpoint(run.record.user, path)
                    except UserError:  # already gone
                        run.record.expires.pop(path, None)
                        self._save()
                    gone.append(path)
        return gone

    def known_runs(self) -> list[tuple[str, TrainingRun]]:
        """The runs of the clients' sessions; not a user's OpenAI sampler run, which no session
        holds (no heartbeat keeps it: ``end_idle`` ends it, with no request in flight)."""
        return [
            (r.record.user, _training_run(r.record))
            for r in self.runs.values()
            if not r.record.ended and not r.record.model_id.startswith(OPENAI_RUN_PREFIX)
        ]

    def known_sampler(self, user: str, sampler_id: str) -> Sampler | None:
        model_id, _, version = sampler_id.rpartition(":v")
        if OF_JOB in model_id:  # another user's published weights, while they still are
            return self._published_sampler(user, sampler_id)
        run = self.runs.get(model_id)
        if run is None or run.record.user != user or not version.isdigit():
            return None
        paths = {v: checkpoint_path(model_id, "sampler", n) for n, v in run.record.samplers.items()}
        ephemeral = checkpoint_path(model_id, "sampler", f"{EPHEMERAL_PREFIX}{version}")
        if run.record.sampling:  # a base model's sampler
            return Sampler(sampler_id, run.record.base_model, tokenizer_dir=run.record.model_path)
        if not self._job_dir(run.record).adapter(int(version)).is_dir():
            return None  # its weights were pruned
        return _sampler(run.record, int(version), paths.get(int(version), ephemeral))

    def _published_sampler(self, user: str, sampler_id: str) -> Sampler | None:
        """A sampler of ``user``'s of weights another user published ("<own run>:of:<job>:v<version>")."""
        head, _, version = sampler_id.rpartition(":v")
        served, _, job_id = head.partition(OF_JOB)
        own = self.runs.get(served)
        if own is None or own.record.user != user or not version.isdigit():
            return None
        for run in list(self.runs.values()):
            record = run.record
            for name in record.public if record.job_id == job_id else ():
                if record.samplers.get(name) == int(version):
                    path = checkpoint_path(record.model_id, "sampler", name)
                    return Sampler(sampler_id, record.base_model, path, tokenizer_dir=record.model_path)
        return None

    # ------------------------------------------------------------ the OpenAI API's policies

    def policies(self, user: str) -> list[Policy]:
        out = [
            Policy(n, m.tokenizer_dir, m.max_context_length)
            for m in self.models()
            for n in (m.name, BASE_PREFIX + m.name)
        ]
        jobs = sorted(self._client().status().jobs, key=lambda j: j.submitted_at)
        named: dict[str, P.JobInfo] = {}
        for job in jobs:
            if job.user == user and job.policy_version > 0 and not job.name.startswith("tinker-sample-"):
                out.append(_job_policy(job, job.job_id, None))
                named[job.name] = job  # a name: its newest job
        out += [_job_policy(job, name, None) for name, job in named.items()]
        for run in list(self.runs.values()):  # sampler weights other users published to all
            record = run.record
            for name in record.public if record.user != user else ():
                version = self._kept_version(record, name)
                if version is not None:
                    path = checkpoint_path(record.model_id, "sampler", name)
                    out.append(Policy(path, record.model_path, context_of(record.model_path), record.job_id, version))
        return out

    def policy(self, user: str, model: str) -> Policy:
        if model.startswith("tinker://"):
            where = parse_checkpoint_path(model)
            run = self.runs.get(where.model_id)
            version = None
            if run is not None and (run.record.user == user or self.is_public(model)) and where.kind == "sampler":
                version = self._kept_version(run.record, where.name)
            if run is None or version is None:
                raise NotFound(f"no sampler weights of yours at {model}")
            path = run.record.model_path
            return Policy(model, path, context_of(path), run.record.job_id, version)
        name, at, number = model.partition("@")
        if at and not number.isdigit():
            raise UserError(f"model {model!r}: JOB@VERSION takes a version number")
        served = {m.name: m for m in self.models()}
        base = name.removeprefix(BASE_PREFIX)
        jobs = [j for j in self._client().status().jobs if j.user == user and name in (j.job_id, j.name)]
        if base in served and not at and (not jobs or name.startswith(BASE_PREFIX)):  # a job's name comes first
            return Policy(model, served[base].tokenizer_dir, served[base].max_context_length)
        if not jobs:
            raise NotFound(
                f"no model {model!r} of yours: name a job of yours (its name or id, JOB@VERSION), a tinker:// "
                f"sampler path, or a base model ({', '.join(sorted(served))})"
            )
        job = max(jobs, key=lambda j: (j.state == "running", j.submitted_at))  # a name: its running, else newest, job
        return _job_policy(job, model, int(number) if at else None)

    def generate(
        self,
        user: str,
        policy: Policy,
        prompt_tokens: list[int],
        sampling: C.Sampling,
        on_tokens: Callable[[C.SampleTokens], None] | None = None,
    ) -> list[C.Completion]:
        version = None if policy.latest else policy.version if policy.job_id else 0
        request = C.GenerateReq([], sampling, [prompt_tokens], version=version, of_job=policy.job_id, interactive=True)
        while True:  # a run ended idle (``end_idle``) just now is made again
            run = self._server_run(user, policy.model_path)
            model_id = run.record.model_id
            with self._lock:
                if not run.record.ended:
                    self._inflight[model_id] = self._inflight.get(model_id, 0) + 1
                    break
        try:
            rep: C.GenerateRep = self._call(run, request, None if on_tokens is None else _tokens_to(on_tokens))
        finally:
            with self._lock:
                self._inflight[model_id] -= 1
                self._served_at[model_id] = self.clock()
        return rep.completions

    def end_idle(self, now: float, idle_s: float) -> list[str]:
        """End the users' OpenAI sampler jobs that have served no request for ``idle_s`` and serve
        none now (their next request starts one again)."""
        idle = []
        with self._lock:  # a run marked ended here is taken by no request after (``generate``)
            for model_id in list(self._serving.values()):
                run = self.runs.get(model_id)
                if run is None or run.record.ended or self._inflight.get(model_id, 0):
                    continue
                if now - self._served_at.get(model_id, now) >= idle_s:
                    run.record.ended = True
                    idle.append(run)
        for run in idle:
            self._end_run(run)
            self._served_at.pop(run.record.model_id, None)
        return [run.record.model_id for run in idle]

    def _server_run(self, user: str, model_path: str) -> Run:
        """The user's sampler job on ``model_path`` that serves their OpenAI requests (made at
        the first): it holds no state, and samples the policies of their other jobs."""
        key = (user, model_path)
        with self._lock:
            starting = self._starting.setdefault(f"openai:{user}:{model_path}", threading.Lock())
        with starting:
            model_id = self._serving.get(key)
            run = self.runs.get(model_id) if model_id else None
            if run is None or run.record.ended:
                digest = hashlib.sha256(f"{user}:{model_path}".encode()).hexdigest()[:12]
                model_id = f"{OPENAI_RUN_PREFIX}{digest}:{os.urandom(4).hex()}"
                self._start_run(user, model_id, model_path, BASE_SAMPLER_RANK, 0, sampling=True)
                self._serving[key] = model_id
                run = self.runs[model_id]
        return run

    def end_session(self, user: str, session_id: str) -> None:
        for model_id, run in list(self.runs.items()):
            if run.record.user == user and model_id.startswith(f"{session_id}:") and not run.record.ended:
                self._end_run(run)

    def _end_run(self, run: Run) -> None:
        """End a run and its job (ended by its client, or idle: the job succeeded)."""
        run.record.ended = True
        self._save()
        self._pending_file(run.record).unlink(missing_ok=True)
        try:
            self._client().cancel(run.record.job_id)
        except Exception:  # noqa: BLE001 - the run ends anyway
            log.warning("ending job %s failed", run.record.job_id, exc_info=True)
        if run.client is not None:
            run.client.close()
            run.client = None
        with self._lock:
            idle, run.samplers = run.samplers, []
        for client in idle:
            client.close()


def _job_policy(job: P.JobInfo, model: str, version: int | None) -> Policy:
    latest, named = job.policy_version, version is not None
    version = latest if version is None else version
    if version > latest:
        raise NotFound(f"job {job.job_id} ({job.name}) has published policy versions up to {latest}, not {version}")
    return Policy(model, job.model, context_of(job.model), job.job_id, version, int(job.submitted_at), latest=not named)


def _tokens_to(on_tokens: Callable[[C.SampleTokens], None]) -> Callable[[P.PartialBody], None]:
    """A streamed call's partials handed on as the tokens of its one prompt's sample."""

    def told(part: P.PartialBody) -> None:
        for sample in part.samples:
            on_tokens(sample)

    return told


def _listed(names: list[str], name: str, present: bool) -> list[str]:
    """``names`` with ``name`` in it (``present``) or not, in the order they came."""
    return [n for n in names if n != name] + ([name] if present else [])


def _restore_point(record: RunRecord) -> LoadedState | None:
    """Where a run taken back after a restart goes on from: its latest saved state, or the state
    it loaded after that (None: nothing saved or loaded, it starts afresh)."""
    latest = max(record.states.items(), key=lambda kv: kv[1].at, default=None)
    saved = None
    if latest is not None:
        name, state = latest
        path = checkpoint_path(record.model_id, "training", name)
        saved = LoadedState(path, state.ckpt_dir, state.at, state.step, weights_only=False)
    if record.loaded is not None and (saved is None or record.loaded.at > saved.at):
        return record.loaded
    return saved


def _sampler_version(record: RunRecord, name: str) -> int | None:
    """The policy version the run's sampler weights ``name`` are: a saved name, or
    ``ephemeral-<version>`` (the path of a ``save_weights_and_get_sampling_client`` sampler)."""
    if name in record.samplers:
        return record.samplers[name]
    version = name.removeprefix(EPHEMERAL_PREFIX)
    return int(version) if name.startswith(EPHEMERAL_PREFIX) and version.isdigit() else None


def _sampler(record: RunRecord, version: int, path: str) -> Sampler:
    return Sampler(f"{record.model_id}:v{version}", record.base_model, path, tokenizer_dir=record.model_path)


def _trains(rank: int | None) -> str:
    return "with every weight" if rank is None else f"at LoRA rank {rank}"


def _training_run(record: RunRecord) -> TrainingRun:
    return TrainingRun(
        record.model_id,
        record.base_model,
        record.rank,
        tokenizer_dir=record.model_path,
        max_context_length=context_of(record.model_path),
    )


_GONE = "(never saved, or pruned to make room for newer saves)"


def _owner(state_dir: Path) -> str | None:
    try:
        return auth.owner_of(state_dir)
    except OSError:  # no cluster keys here: every user is limited
        return None


def _numbered_dirs(parent: Path, parse: Callable[[str], int]) -> list[Path]:
    """The saves under ``parent`` (``adapters`` or ``ckpt``), by their number, oldest first; names
    ``parse`` refuses (a temporary one, ``latest.json``) are not saves."""
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return []
    numbered = []
    for entry in entries:
        try:
            number = parse(entry.name)
        except ValueError:
            continue
        if entry.is_dir(follow_symlinks=False):
            numbered.append((number, Path(entry.path)))
    return [path for _, path in sorted(numbered)]


def _next_checkpoint_step(record: RunRecord, checkpoints: Path) -> int:
    """The step the run's next ``save_state`` is written at: past every checkpoint of its job on
    disk (a new directory, never one kept) and every state it saved before any was pruned."""
    on_disk = [JobDir.parse_step(d.name) for d in _numbered_dirs(checkpoints, JobDir.parse_step)]
    return max([len(record.states), *on_disk]) + 1


def _dir_bytes(root: Path) -> int:
    """The bytes of the regular files under ``root`` (links not followed)."""
    total = 0
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # gone meanwhile
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total
