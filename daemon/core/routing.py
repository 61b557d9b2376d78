"""``CallRouting``: the drivers' service calls: each becomes a task for the scheduler, is sent
to the engine it is placed on, and its result becomes the call's reply; and the drivers' reports.

Invariants: a call has one pending entry (``calls``) from its task's submission to its result;
a call that follows another (``CallReq.after``) waits in its job's runtime, keyed by the call it
follows, until that one's result (or goes ahead to the same worker: ``_send_ahead``). While
draining, each publish's reply carries the drain's reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import msgspec

from daemon import metrics as M
from daemon.core.lifecycle import JobLifecycle
from daemon.core.liveness import WorkerLiveness
from daemon.core.records import JobRuntime, PendingCall, Prune, WorkerState, _kept_adapter
from daemon.core.tables import CallTable, JobTable, Settings, Turn, WorkerTable
from daemon.scheduler import Scheduler, Task
from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.jobdir import JobDir, LatestCheckpoint
from plexctl.common.scheduling import can_share_pass


class _CallSite:
    """``calls.CallSite`` for one call of one job: the daemon's decisions, recorded in the call.
    ``adapter``/``version``: the policy a generate samples unless it names another."""

    def __init__(
        self,
        jobs: JobTable,
        trusted: bool,
        rt: JobRuntime,
        call: PendingCall,
        adapter: P.AdapterRef | None,
        version: int,
    ) -> None:
        self.jobs, self.rt, self.call = jobs, rt, call
        self.adapter, self.version = adapter, version
        self.job_id = rt.job_id
        self.trainer = C.TrainerContext(lora=rt.spec.lora, seed=rt.spec.seed)
        self.trusted = trusted

    def sample_from(self, version: int | None, of_job: str = "") -> P.AdapterRef | None:
        if of_job and of_job != self.job_id:
            return self._of_job(of_job, version)
        adapter = self.adapter
        if version is not None and version != self.version:  # an earlier version it kept (a Tinker sampler's)
            adapter = _kept_adapter(self.rt, version)
            if version and adapter is None:
                raise C.CallRefused("bad_request", f"policy version {version} is not kept")
            self.call.version = version
        else:
            self.call.version = self.version
        return adapter

    def _of_job(self, job_id: str, version: int | None) -> P.AdapterRef | None:
        """Job ``job_id``'s published policy ``version`` (None: its latest), for a job on the
        same base model sampling it (an OpenAI API request): a job of the same user, or a
        version its owner made readable by every user (``Journal.publish``)."""
        journal = self.jobs.journal
        info = journal.job(job_id)
        shared = version is not None and journal.is_published(job_id, version)
        if info is None or (info.user != self.rt.user and not shared):
            raise C.CallRefused("not_found", f"no job {job_id} of {self.rt.user or 'this user'}")
        other = self.jobs.runtimes.get(job_id)
        spec = other.spec if other is not None else self.jobs.journal.spec(job_id)
        if os.path.realpath(spec.model.path) != os.path.realpath(self.rt.spec.model.path):
            raise C.CallRefused("bad_request", f"job {job_id} trains {spec.model.path}, not {self.rt.spec.model.path}")
        latest = other.policy_version if other is not None else info.policy_version
        version = latest if version is None else version
        self.call.version = version
        if version <= 0:
            return None  # the base
        path = self.jobs.job_dir(job_id).adapter(version)
        if not path.is_dir():
            raise C.CallRefused("bad_request", f"policy version {version} of job {job_id} is not kept")
        return P.AdapterRef(job_id, version, str(path), full=spec.lora is None)

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
        if job_dir.root.parent == Path(os.path.realpath(self.jobs.jobs_dir)) and job_dir.is_checkpoint(path):
            journal, job_id = self.jobs.journal, job_dir.root.name
            owner = journal.job(job_id)
            if owner is not None and owner.user == rt.user:
                return str(path)
            if owner is not None and journal.is_published(job_id, JobDir.parse_step(path.name), checkpoint=True):
                model = journal.spec(job_id).model.path  # published to every user: theirs to restore, same base
                if os.path.realpath(model) != os.path.realpath(rt.spec.model.path):
                    raise C.CallRefused("bad_request", f"{ckpt_dir} trains {model}, not {rt.spec.model.path}")
                return str(path)
        raise C.CallRefused("bad_request", f"{ckpt_dir} is not a checkpoint of a job of {rt.user or 'this user'}")


class CallRouting:
    """Service calls from drivers to engines and back, and the drivers' reports."""

    def __init__(
        self,
        settings: Settings,
        turn: Turn,
        jobs: JobTable,
        workers: WorkerTable,
        calls: CallTable,
        sched: Scheduler,
        telemetry: M.Telemetry,
        liveness: WorkerLiveness,
        lifecycle: JobLifecycle,
    ) -> None:
        self.settings, self.turn, self.jobs, self.workers, self.calls = settings, turn, jobs, workers, calls
        self.sched, self.telemetry, self.liveness, self.lifecycle = sched, telemetry, liveness, lifecycle

    def _foreign_job(self, job_id: str) -> bool:
        """Whether the sender is an isolated driver of another job than ``job_id``."""
        return auth.job_of(self.turn.sender) not in (None, job_id)

    def on_call(self, identity: bytes, header: P.Header, body: P.CallReq) -> None:
        rt = self.jobs.runtimes.get(body.job_id)
        if self._foreign_job(body.job_id):
            self.turn.error(identity, header.msg_id, "forbidden", f"job {body.job_id} is not this driver's")
            return
        if rt is None:
            self.turn.error(identity, header.msg_id, "not_found", f"job {body.job_id} is not running")
            return
        seen = (header.sender_epoch, header.msg_id)
        if seen in rt.calls_seen:  # sent again by a driver that reconnected: already in hand
            return
        rt.calls_seen[seen] = None
        while len(rt.calls_seen) > 256:
            del rt.calls_seen[next(iter(rt.calls_seen))]
        if rt.cancel_requested_at is not None:
            self.turn.error(identity, header.msg_id, "cancelled", "the job was cancelled")
            return
        if body.after and self.calls.pending(rt.job_id, body.after):
            rt.held_calls.setdefault(body.after, []).append((identity, header, body))
            return  # started by on_result, the moment the call it follows is done
        self._start_call(rt, identity, header, body)

    def _start_call(self, rt: JobRuntime, identity: bytes, header: P.Header, body: P.CallReq) -> None:
        """Turn a service call into a task for the scheduler (or answer it here)."""
        task = self._call_task(rt, identity, header, body, rt.adapter, rt.policy_version)
        if task is None:
            return
        if rt.job_id in self.jobs.adopting and not self.lifecycle.place_adopted(rt.job_id, self.turn.now):
            self.jobs.held.setdefault(rt.job_id, []).append(task)  # submitted once the job has its homes again
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
        site = _CallSite(self.jobs, rt.user in self.settings.trusted_users, rt, call, adapter, version)
        if rt.pid:  # a repeated trainer call is applied once (worker.servers)
            site.trainer.call_key = f"{rt.pid}:{header.msg_id}"
        try:
            made = C.METHODS[req.method].task_of(req, site)
        except C.CallRefused as refused:
            self.turn.error(identity, header.msg_id, refused.code, refused.why)
            return None
        if isinstance(made, C.Reply):
            self.turn.send(identity, P.Op.REPLY, made, header.msg_id)
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
            self.calls.next_task_id(),
            rt.job_id,
            kind,
            req.method,
            rt.model,
            self.turn.now,
            spec.priority,
            weights,
            _pass_tokens(task),
            interactive=isinstance(req, C.GenerateReq) and req.interactive and spec.kind == "external",
        )
        self.calls.add(queued.task_id, call)
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
            self.turn.send(
                worker.identity, P.Op.TASK, P.TaskBody(task.task_id, rt.job_id, home, engine_task, after=task_id)
            )
        if held:
            rt.held_calls[call.msg_id] = held
        else:
            del rt.held_calls[call.msg_id]

    def on_partial(self, identity: bytes, header: P.Header, body: P.PartialBody) -> None:
        """A streamed generate's tokens so far, passed on to the call's sender as they come (its
        reply, with all of them, follows); nothing for a call that is gone."""
        call = self.calls.get(body.task_id)
        if call is not None:
            self.turn.send(call.identity, P.Op.PARTIAL, body, call.msg_id)

    def on_result(self, identity: bytes, header: P.Header, body: P.ResultBody) -> None:
        now = self.turn.now
        task = self.sched.done(
            body.task_id, now, body.seconds if body.ok else None, switch_seconds=body.switch_seconds or None
        )
        if task is not None:
            self.telemetry.task_done(task.method, body.ok, body.seconds, now - task.submitted_at)
            if isinstance(body.value, C.TrainStepResult) and body.value.metrics.get("swap_bytes"):
                self.telemetry.swapped(
                    self.workers.trainer_of(identity, body.info.get("engine", "")),
                    task.job_id,
                    now - body.seconds,
                    int(body.value.metrics["swap_bytes"]),
                    float(body.value.metrics.get("swap_seconds", 0.0)),
                )
        self.liveness.take_inventory(identity, body.info)
        call = self.calls.pop(body.task_id)
        if call is None:
            return  # a call whose job has gone
        rt = self.jobs.runtimes.get(call.job_id)
        if rt is None:
            return
        followers = rt.held_calls.pop(call.msg_id, [])
        ahead = rt.sent_ahead.pop(call.msg_id, [])
        if body.ok and rt.job_id in self.sched.jobs:  # the worker started them as this task ended
            for ahead_task, engine_id in ahead:
                if engine_id in self.sched.engines:
                    self.sched.claim(ahead_task, engine_id, now)
        if not body.ok:  # and the worker fails those it was sent ahead
            self.turn.error(call.identity, call.msg_id, "call_failed", f"{call.method} failed: {body.error}")
            for f_identity, f_header, f_body in followers:
                self.turn.error(
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
            prune = rt.driver.kept_adapters(rt)
        elif isinstance(body.value, C.CheckpointResult):
            rt.job_dir.write_latest(
                LatestCheckpoint(
                    dir=call.out_dir, step=call.step, policy_version=rt.policy_version, manifest=body.value.manifest
                )
            )
            self.jobs.journal.event(rt.job_id, "checkpoint", f"step {call.step}")
            prune = rt.driver.kept_checkpoints(rt)
        reply = self._reply(call, body.value)
        if followers:  # e.g. the next generate, sampled from the adapter just published: on its way before the reply
            for f_identity, f_header, f_body in followers:
                if rt.cancel_requested_at is not None:
                    self.turn.error(f_identity, f_header.msg_id, "cancelled", "the job was cancelled")
                else:
                    self._start_call(rt, f_identity, f_header, f_body)
            self.place(now)
        self.turn.send(call.identity, P.Op.REPLY, reply, call.msg_id)
        # after the reply: the job's next call need not wait for the journal or the pruning
        if call.publishes:
            self.jobs.journal.update(rt.job_id, policy_version=rt.policy_version)
        if prune is not None:
            self.turn.add(Prune(*prune))
        if task is not None:
            self.liveness.prefetch_for(task.job_id)

    def _reply(self, call: PendingCall, result: C.AnyResult | None) -> C.Reply:
        """The loop's reply to a call whose task succeeded with ``result``."""
        method = C.METHODS[call.method]
        if not isinstance(result, method.result):
            raise ValueError(f"{call.method}: its engine answered {type(result).__name__}")
        drain = self.jobs.drain_reason if self.jobs.draining else ""  # checkpoint at this step's end, exit
        return method.reply_of(result, call, drain)

    def on_report(self, identity: bytes, header: P.Header, body: P.ReportBody) -> None:
        rt = self.jobs.runtimes.get(body.job_id)
        if rt is None or self._foreign_job(body.job_id):
            return
        journal, m = self.jobs.journal, body.metrics
        if body.event == "step":
            fields: dict[str, Any] = {"step": body.step}
            if "reward_mean" in m:
                fields["reward"] = m["reward_mean"]
            journal.update(body.job_id, **fields)
        elif body.event == "eval":
            info = self.jobs.known(body.job_id)
            fields = {"eval_last": m["eval_reward"]}
            if info.eval_first is None:
                fields["eval_first"] = m["eval_reward"]
            journal.update(body.job_id, **fields)
            journal.event(body.job_id, "eval", f"step {body.step}: {m['eval_reward']:.4f}")
        elif body.event == "failed":
            rt.failure = body.message
        elif body.event == "note":
            journal.event(body.job_id, "note", body.message)

    def place(self, now: float) -> None:
        """Send the tasks the scheduler places now."""
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
            rt = self.jobs.runtimes.get(task.job_id)
            if rt is not None and placement.engine_id not in rt.engines:
                rt.engines.add(placement.engine_id)
                self.jobs.journal.update(task.job_id, engine=",".join(sorted(rt.engines)))
            engine_task = call.task
            assert engine_task is not None  # made with the call (_call_task)
            expected = self.sched.expected(placement.engine_id) if task.kind == "trainer" else None
            if expected is not None and not isinstance(engine_task, C.GenerateTask):
                trainer = msgspec.structs.replace(engine_task.trainer, upcoming=expected)
                engine_task = msgspec.structs.replace(engine_task, trainer=trainer)
                if self.workers.prefetched.get(placement.engine_id) == task.job_id:  # served: it may be asked again
                    del self.workers.prefetched[placement.engine_id]
            body = P.TaskBody(task.task_id, task.job_id, placement.engine_id, engine_task)
            if placement.lead or task.task_id in leads:  # sent with its pass, below
                passes.setdefault(placement.lead or task.task_id, (worker, []))[1].append(body)
            else:
                self.turn.send(worker.identity, P.Op.TASK, body)
            if expected is not None:
                self.liveness.prefetch(placement.engine_id, worker, expected)
            if rt is not None and rt.held_calls:
                self._send_ahead(rt, call, task.task_id, placement.engine_id)
        for worker, bodies in passes.values():
            if len(bodies) > 1:
                self.turn.send(worker.identity, P.Op.TASK_PASS, P.TaskPassBody(bodies[0].engine_id, bodies))
            else:
                self.turn.send(worker.identity, P.Op.TASK, bodies[0])


def _pass_tokens(task: C.AnyTask) -> int:
    """A train step's padded tokens if it may share a pass with other jobs' (``can_share_pass``), else 0."""
    if not isinstance(task, C.TrainStepTask) or not can_share_pass(task.trainer.lora):
        return 0
    rows = task.batch.input_ids
    return len(rows) * max((len(r) for r in rows), default=0)
