"""``ClientOps``: the clients' requests (``plexctl``, the Tinker front end, the cluster's own
processes): ping, submit, status, cancel, logs, uploads, exports, down.

A sender sees and acts on its own jobs only (the cluster's owner and its own processes: on all;
``_visible``, ``_find``); an isolated job's driver sends nothing but its job's calls and reports;
the cluster's own ops come from its own processes alone (``refusal``). A submit the engines can
never run is refused here; an isolated user's paths are never opened: their client uploads the
files, and a job's files are read without following links.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import msgspec

from daemon import jail
from daemon import metrics as M
from daemon.blobs import BlobError
from daemon.core.lifecycle import JobLifecycle, state_bytes
from daemon.core.records import VERSION, WorkerState
from daemon.core.tables import JobTable, Settings, Turn, WorkerTable, log
from daemon.journal import TERMINAL
from daemon.scheduler import Scheduler
from plexctl.common import auth, uploads
from plexctl.common import protocol as P
from plexctl.common.atomic import write_bytes_atomic
from plexctl.common.context_fit import context_problems
from plexctl.common.jobdir import JobDir
from plexctl.common.memplan import VLLM_LORA_RANKS, TrainerRoom, spec_step_problem
from plexctl.common.sizes import fmt_bytes
from plexctl.common.spec import JobSpec, spec_from_wire, wire_rule_problems

LOGS_CHUNK = 256 * 1024  # bytes of a job's log one reply carries; the client asks again from its offset
EXPORT_CHUNK = 8 << 20  # bytes of an exported file one reply carries
SHARDED_INDEX = "shards/.metadata"  # a sharded checkpoint's index of its shards (``worker.checkpoint_files``)
CONTEXT_CHECK_BYTES = 16 << 20  # a shared user's data the daemon measures against the context at submit

INTERNAL_OPS = {
    P.Op.REGISTER,
    P.Op.HEARTBEAT,
    P.Op.RESULT,
    P.Op.PARTIAL,
    P.Op.INVENTORY,
    P.Op.LEAVE,
    P.Op.WORKER_EXITED,
    P.Op.CALL,
    P.Op.REPORT,
}  # drivers, workers, Slurm node tasks


class ClientOps:
    """The requests of ``plexctl`` and other clients (``HANDLERS`` in ``DaemonCore``)."""

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

    def refusal(self, op: bytes, user: str) -> str:
        """Why ``user`` may not send ``op`` ("" if they may): asked before the body is decoded."""
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
        owner = self.settings.owner
        if op == P.Op.DOWN and user != owner:
            return f"only the cluster's owner ({owner}) may stop it"
        return ""

    def _visible(self, job_user: str) -> bool:
        """Whether the current sender may see and act on a job of ``job_user``."""
        return self.turn.sender in (job_user, self.settings.owner, auth.INTERNAL_USER)

    def on_ping(self, identity: bytes, header: P.Header, body: P.Empty) -> None:
        decls = self.workers.decls()
        ready = sum(1 for w in self.workers.values() if w.ready for _ in w.engines)
        total = max(len(decls), self.workers.local_workers)
        self.turn.send(
            identity,
            P.Op.REPLY,
            P.Pong(
                version=VERSION,
                pid=self.settings.pid,
                started_at=self.settings.started_at,
                workers=len(self.workers),
                engines_ready=ready,
                engines_total=total,
                problems=list(self.workers.problems),
                upload_inputs=self.settings.is_isolated(self.turn.sender),
            ),
            header.msg_id,
        )

    def on_submit(self, identity: bytes, header: P.Header, body: P.SubmitReq) -> None:
        sender, is_isolated, jobs = self.turn.sender, self.settings.is_isolated, self.jobs
        try:
            spec = spec_from_wire(body.spec)
            broken = wire_rule_problems(body.spec, from_tinker_front_end=sender == auth.INTERNAL_USER)
        except Exception as exc:  # noqa: BLE001
            self.turn.error(identity, header.msg_id, "bad_request", f"invalid job spec: {exc}")
            return
        if broken:  # the rules the CLI ran, run again: a client may skip them
            self.turn.error(identity, header.msg_id, "bad_request", f"invalid job spec: {'; '.join(broken)}")
            return
        models = self.workers.models
        if os.path.realpath(spec.model.path) not in models:
            self.turn.error(
                identity,
                header.msg_id,
                "refused",
                f"model.path {spec.model.path!r} is not served by this cluster "
                f"(it serves: {', '.join(sorted(models))})",
            )
            return
        refusal = self._engines_refuse(spec)
        if refusal:
            self.turn.error(identity, header.msg_id, "refused", refusal)
            return
        user = body.user if sender == auth.INTERNAL_USER else sender  # who the key says, not the body
        if spec.algo.loss_fn and user not in self.settings.trusted_users:
            self.turn.error(
                identity,
                header.msg_id,
                "untrusted",
                f"algo.loss_fn: user {user!r} may not run code in this cluster's trainer "
                f"(it would run beside other users' state); the cluster's owner can allow it "
                f"with `plexctl up --trust-user-code {user}`",
            )
            return
        refusal = jail.refusal(user) if is_isolated(user) else ""
        if refusal:
            self.turn.error(identity, header.msg_id, "untrusted", refusal)
            return
        if is_isolated(user):  # the daemon never opens their paths: their client sent the files
            missing = sorted(set(uploads.field_paths(body.spec)) - {f.field for f in body.inputs})
            problem = (
                (
                    f"{missing[0]}: its files were not uploaded (submit with plexctl or "
                    f"plexctl.inputs.submit, which send them)"
                )
                if missing
                else jobs.blobs.check(user, body.inputs)
            )
            if not problem:  # the CLI measured the prompts against the context; a raw submit did not
                problem = "; ".join(self._context_problems(spec, user, body.inputs))
            if problem:
                self.turn.error(identity, header.msg_id, "bad_request", problem)
                return
        known = jobs.journal.submitted(body.submit_id)
        if known is not None:  # a retried submit: the job it made, whatever has happened since
            if jobs.known(known).user != user:
                self.turn.error(identity, header.msg_id, "bad_request", f"submit id {body.submit_id!r} is taken")
            else:
                self.turn.send(identity, P.Op.REPLY, P.SubmitRep(job_id=known, created=False), header.msg_id)
            return
        holders = jobs.journal.holding(spec.name, user)
        if holders and not body.replace:
            held = holders[-1]
            self.turn.error(
                identity,
                header.msg_id,
                "bad_request",
                f"name: your job {held.job_id} ({held.state}) is named {spec.name!r}; cancel it, choose "
                f"another name (--name), or replace it (`plexctl submit --replace`)",
            )
            return
        refusal = jobs.quotas.submit(user, self.turn.now) if is_isolated(user) else ""
        if refusal:
            self.turn.error(identity, header.msg_id, "refused", refusal)
            return
        for old in holders:  # the older job is cancelled first: the name then means the new one alone
            self.lifecycle.cancel(old.job_id, f"replaced by a new submit of {spec.name!r}")
        job_id, created = jobs.journal.submit(body.submit_id, user, spec)
        if created and body.inputs:
            write_bytes_atomic(jobs.job_dir(job_id).inputs, msgspec.json.encode(body.inputs))
        if created:
            log.info("job %s (%s) submitted by %s", job_id, spec.name, user)
        self.turn.send(
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
        decls = [d for d in self.workers.decls() if os.path.realpath(d.model) == model]
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
        need = state_bytes(spec)
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
        return context_problems(spec, {f.relpath: self.jobs.blobs.path(user, f.sha256) for f in data})

    def on_status(self, identity: bytes, header: P.Header, body: P.StatusReq) -> None:
        if body.job_id:
            job_id = self._find(identity, header, body.job_id)
            if job_id is None:
                return
            jobs = [self.jobs.known(job_id)]
        else:
            jobs = [j for j in self.jobs.journal.jobs() if self._visible(j.user)]
        jobs = [self._with_live_fields(j) for j in jobs]
        now, started_at, journal = self.turn.now, self.settings.started_at, self.jobs.journal
        stats = self.workers.engine_stats

        def shown(job_ids: Iterable[str]) -> list[str]:  # others' jobs on a shared engine stay unnamed
            return sorted(j for j in job_ids if (info := journal.job(j)) is not None and self._visible(info.user))

        engines = []
        busy_total = span_total = 0.0
        for w in self.workers.values():
            for decl in w.engines:
                eng = self.sched.engines.get(decl.engine_id)
                busy = 0.0
                if eng is not None:
                    busy = eng.busy_seconds + (now - eng.busy_since if eng.busy_since else 0.0)
                    busy_total += busy
                    span_total += now - max(started_at, eng.up_at or started_at)
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
                        tiers=stats.get(decl.engine_id, {}).get("tiers", {}),
                        swaps=stats.get(decl.engine_id, {}).get("swaps", {}),
                        swaps_by_kind=stats.get(decl.engine_id, {}).get("swaps_by_kind", {}),
                        switches=eng.switches if eng else 0,
                        shared_passes=eng.shared_passes if eng else 0,
                        shared_tasks=eng.shared_tasks if eng else 0,
                        last_pass=eng.last_pass if eng else 0,
                        largest_pass=eng.largest_pass if eng else 0,
                        devices=w.devices,
                        dtype=decl.dtype,
                        device=decl.device,
                        ranks=decl.ranks,
                        suspect=w.suspect_since is not None,
                        silent_s=now - w.last_seen if w.suspect_since is not None else 0.0,
                        weights=self._weights_state(w, decl) if decl.kind == "rollout" else "",
                    )
                )
        # idle share of engine time since this daemon started (running totals: no scan of past tasks)
        bubble = max(0.0, 1.0 - busy_total / span_total) if span_total > 0 else None
        timeline = M.busy_spans(self.sched, now) if body.timeline else []
        marks = self.telemetry.marks_since(started_at) if body.timeline else []
        moves = self.telemetry.moves_since(started_at) if body.timeline else []
        share, queued = self.sched.interactive(now)
        self.turn.send(
            identity,
            P.Op.REPLY,
            P.StatusRep(
                jobs=jobs,
                engines=engines,
                now=now,
                policy=self.settings.policy,
                bubble_ratio=bubble,
                started_at=started_at,
                timeline=timeline,
                swap_marks=marks,
                moves=moves,
                interactive_share=share,
                interactive_queued=queued,
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
        for j in self.jobs.journal.jobs():
            by_state[j.state] = by_state.get(j.state, 0) + 1
        swaps = {e: st.get("swaps", {}) for e, st in self.workers.engine_stats.items()}
        engines = M.engine_gauges(self.sched, swaps, now)
        share, queued = self.sched.interactive(now)
        self.telemetry.set_gauges(
            M.Gauges(
                jobs_by_state=by_state,
                engines=engines,
                bubble_ratio=M.bubble_of(engines),
                uptime_s=now - self.settings.started_at,
                interactive_share=share,
                interactive_queued=queued,
            )
        )

    def _find(self, identity: bytes, header: P.Header, ref: str) -> str | None:
        """A job id the sender may see, from an id, ``USER/NAME`` or a bare name; a bare name is
        the sender's own newest job of that name, never another user's (the cluster's own
        processes name any job). What names nothing the sender may see gets its error reply."""
        journal = self.jobs.journal
        if (info := journal.job(ref)) is not None and self._visible(info.user):
            return ref
        user, _, name = ref.rpartition("/")
        if not user and self.turn.sender != auth.INTERNAL_USER:
            user = self.turn.sender
        named = [j for j in journal.jobs() if j.name == name and (j.user == user or not user)]
        named = [j for j in named if self._visible(j.user)]
        if named:
            return named[-1].job_id
        others = [j for j in journal.jobs() if j.name == name and self._visible(j.user) and j.user != user]
        if others and "/" not in ref:
            ids = ", ".join(f"{j.user}/{j.name} ({j.job_id})" for j in others[-5:])
            why = f"no job of yours named {ref!r}; other users' jobs of that name: {ids}: name one by USER/NAME or id"
        else:
            why = f"no job {ref!r}"
        self.turn.error(identity, header.msg_id, "not_found", why)
        return None

    def _with_live_fields(self, job: P.JobInfo) -> P.JobInfo:
        """Add what only the running daemon knows: why a job waits, where its state lives, and
        what it trains (from its spec)."""
        reason = self.jobs.reasons.get(job.job_id, "") if job.state == "queued" else ""
        tier = ""
        home = self.sched.home_of(job.job_id, "trainer")
        if home and job.state == "running":
            where = self.workers.where(home)
            tier = f"{home}:{where.get(job.job_id, 'device')}" if where else home
        trains, model = self._trains(job.job_id)
        return msgspec.structs.replace(job, reason=reason, state_tier=tier, trains=trains, model=model)

    def _trains(self, job_id: str) -> tuple[str, str]:
        """What the job trains (``JobInfo.trains``) and its model, from its spec; "" for a spec this
        daemon cannot read."""
        try:
            spec = self.jobs.journal.spec(job_id)
        except ValueError:  # a spec of another version: status still answers
            return "", ""
        return (P.TRAINS_ALL if spec.lora is None else P.TRAINS_ADAPTER), os.path.realpath(spec.model.path)

    def on_cancel(self, identity: bytes, header: P.Header, body: P.JobRef) -> None:
        job_id = self._find(identity, header, body.job_id)
        if job_id is None:
            return
        rt = self.jobs.runtimes.get(job_id)
        if rt is not None and rt.driver.ended_by(self.turn.sender):
            rt.ended_by_client = True
        self.lifecycle.cancel(job_id, "its Tinker session finished" if rt is not None and rt.ended_by_client else "")
        self.turn.send(identity, P.Op.REPLY, self.jobs.journal.job(job_id), header.msg_id)

    def on_publish(self, identity: bytes, header: P.Header, body: P.PublishReq) -> None:
        """A job's policy version made readable by every user (sampled by their own jobs, as
        ``of_job``), or a checkpoint of it (restored into their own jobs, ``restore_from``), or
        its owner's alone again: by the job's user (the front end for them) only."""
        job_id = self._find(identity, header, body.job_id)
        if job_id is None:
            return
        info = self.jobs.known(job_id)
        if self.turn.sender not in (info.user, auth.INTERNAL_USER):
            why = f"job {job_id} is {info.user}'s: only they publish it"
            self.turn.error(identity, header.msg_id, "forbidden", why)
            return
        job_dir, what = self.jobs.job_dir(job_id), _published_what(body)
        kept = job_dir.checkpoint(body.version) if body.checkpoint else job_dir.adapter(body.version)
        if body.public and not kept.is_dir():
            self.turn.error(identity, header.msg_id, "not_found", f"job {job_id} keeps no {what}")
            return
        changed = self.jobs.journal.publish(job_id, body.version, body.public, body.checkpoint)
        if changed:
            self.jobs.journal.event(job_id, "published" if body.public else "unpublished", what)
        rep = P.PublishRep(job_id, body.version, body.public, changed, body.checkpoint)
        self.turn.send(identity, P.Op.REPLY, rep, header.msg_id)

    def on_logs(self, identity: bytes, header: P.Header, body: P.LogsReq) -> None:
        job_id = self._find(identity, header, body.job_id)
        if job_id is None:
            return
        name = {"log": JobDir.DRIVER_LOG, "metrics": JobDir.METRICS}.get(body.kind)
        if name is None:
            self.turn.error(identity, header.msg_id, "bad_request", f"unknown log kind {body.kind!r}")
            return
        ended = self.jobs.known(job_id).state in TERMINAL  # before reading: all it wrote is there
        data, size = b"", 0
        info = self.jobs.known(job_id)
        path = self._job_output(job_id, info.user, name)
        if path.is_symlink() or path.exists():
            try:
                with jail.open_job_file(path) as f:  # a jailed driver's file: no link, no FIFO followed
                    size = os.fstat(f.fileno()).st_size
                    f.seek(body.offset)
                    data = f.read(LOGS_CHUNK)
            except OSError:  # a link or a FIFO the job put there: its own doing, said without the host path
                log.warning("job %s: its %s is not a regular file; not read", job_id, name)
                self.turn.error(identity, header.msg_id, "bad_request", f"job {job_id}'s {name} is not a regular file")
                return
            if not (ended and body.offset + len(data) >= size):  # more to come: never half a character
                data = data[: _chunk_end(data, whole_lines=len(data) == LOGS_CHUNK)]
        offset = body.offset + len(data)
        self.turn.send(
            identity,
            P.Op.REPLY,
            P.LogsRep(data=data.decode(errors="replace"), offset=offset, finished=ended and offset >= size),
            header.msg_id,
        )

    def _job_output(self, job_id: str, user: str, name: str) -> Path:
        """A file a job's driver writes (``metrics.jsonl``): in its own directory when jailed, in a
        copy of the daemon's once it ended. The driver's log is the daemon's (it holds the file
        open for the driver)."""
        job_dir = self.jobs.job_dir(job_id)
        kept = job_dir.root / name  # an ended jailed job's: the daemon's copy
        if self.settings.is_isolated(user) and name != JobDir.DRIVER_LOG and not kept.exists():
            return job_dir.driver_out / name
        return kept

    def on_blob(self, identity: bytes, header: P.Header, body: P.BlobReq) -> None:
        """A chunk of one of the sender's input files (or the question how much is held)."""
        try:
            have = self.jobs.blobs.put(self.turn.sender, body)
        except (BlobError, OSError) as exc:
            self.turn.error(identity, header.msg_id, "bad_request", str(exc))
            return
        self.turn.send(identity, P.Op.REPLY, P.BlobRep(have), header.msg_id)

    def on_export(self, identity: bytes, header: P.Header, body: P.ExportReq) -> None:
        """A job's latest adapter or checkpoint, for its user to copy out with their own rights:
        the listing, then each file in chunks. Nothing outside that directory is ever read."""
        job_id = self._find(identity, header, body.job_id)
        if job_id is None:
            return
        if body.what not in ("adapter", "checkpoint"):
            self.turn.error(
                identity, header.msg_id, "bad_request", f"export what: adapter or checkpoint, not {body.what!r}"
            )
            return
        source = self._export_dir(job_id, body.what)
        if source is None:
            self.turn.error(identity, header.msg_id, "not_found", f"job {job_id} has no {body.what} yet")
            return
        files = sorted(p for p in source.rglob("*") if p.is_file() and not p.is_symlink() and _exported(p, source))
        if not body.path:
            listing = [P.ExportFile(str(p.relative_to(source)), p.stat().st_size) for p in files]
            self.turn.send(identity, P.Op.REPLY, P.ExportRep(f"{body.what} {source.name}", listing), header.msg_id)
            return
        wanted = {str(p.relative_to(source)): p for p in files}.get(body.path)
        if wanted is None:
            why = f"{body.what} {source.name} has no file {body.path!r}"
            self.turn.error(identity, header.msg_id, "not_found", why)
            return
        with jail.open_job_file(wanted) as f:
            f.seek(body.offset)
            data = f.read(EXPORT_CHUNK)
        self.turn.send(identity, P.Op.REPLY, P.ExportRep(f"{body.what} {source.name}", data=data), header.msg_id)

    def _export_dir(self, job_id: str, what: str) -> Path | None:
        """The directory of the job's latest published adapter or latest checkpoint, if any."""
        job_dir = self.jobs.job_dir(job_id)
        if what == "checkpoint":
            try:
                latest = job_dir.latest_checkpoint()
            except (OSError, ValueError):
                return None
            return Path(latest.dir) if latest is not None and job_dir.is_checkpoint(Path(latest.dir)) else None
        versions = job_dir.published_adapters()
        return versions[-1] if versions else None

    def on_down(self, identity: bytes, header: P.Header, body: P.Empty) -> None:
        self.turn.send(identity, P.Op.REPLY, {"ok": True, "running": len(self.jobs.runtimes)}, header.msg_id)
        self.lifecycle.drain("plexctl down", urgent=True)


def _published_what(body: P.PublishReq) -> str:
    """``policy version 3`` or ``checkpoint step 12``, as events and errors name it."""
    return f"checkpoint step {body.version}" if body.checkpoint else f"policy version {body.version}"


def _exported(path: Path, source: Path) -> bool:
    """Whether export sends ``path``: not a hidden file (a writer's temp file), but DCP's index of a
    sharded checkpoint's shards (``shards/.metadata``, its fixed name)."""
    return not path.name.startswith(".") or path.relative_to(source).as_posix() == SHARDED_INDEX


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
