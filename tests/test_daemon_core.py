"""The daemon's core driven directly: no socket, no process, no model, no monkeypatch.

Each test feeds ``DaemonCore`` the messages a CLI, a driver and a worker would send, at times it
chooses, and reads the effects it returns (``conftest.DrivenCore`` records them): admission,
placement, the typed replies of each call, calls held to follow another and sent ahead with it,
adoption after a daemon restart, and the drain.
"""

from __future__ import annotations

import json
from pathlib import Path

from daemon.core import Prune, StartDriver, StopDriver
from daemon.core.lifecycle import state_bytes
from daemon.procs import DRIVER_EXIT_FAILED
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.client import current_user
from plexctl.common.spec import spec_to_wire
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]
BATCH = P.TrainBatch([[1, 2]], [[0, 1]], [[0.0, -1.0]], [1.0])
GENERATE = C.GenerateReq(["1+1="], P.Sampling(max_tokens=4))


def register(d, worker: str, model: Path, kinds=("rollout", "trainer"), resident=None) -> None:
    engines = [P.EngineDecl(f"{worker}/{k}", k, str(model), 4 if k == "rollout" else 1) for k in kinds]
    d.send(worker.encode(), P.Op.REGISTER, P.RegisterReq(worker, "node", 1, engines, True, resident=resident or {}))


def submit(d, model: Path, name: str) -> str:
    spec = spec_to_wire(load_spec(REPO / "configs" / "tiny-arith.yaml", [f"model.path={model}"], name))
    d.send(b"cli", P.Op.SUBMIT, P.SubmitReq(f"sid-{name}", spec, current_user()), user=current_user())
    (reply,) = [body for to, op, body in d.sent if op == P.Op.REPLY and to == b"cli"]
    d.sent.clear()
    return reply.job_id


def running(d, model: Path, name: str, pid: int = 4242) -> str:
    """A submitted job, admitted and its driver started."""
    job = submit(d, model, name)
    assert StartDriver(job) in d.chores()
    d.driver_started(job, pid)
    return job


def call(d, job: str, request: C.Request, msg_id: int, after: int = 0) -> None:
    d.send(f"drv:{job}".encode(), P.Op.CALL, P.CallReq(job, request, after), msg_id)  # type: ignore[arg-type]


def tasks(d) -> list[P.TaskBody]:
    out = [body for _, op, body in d.sent if op == P.Op.TASK]
    d.sent[:] = [s for s in d.sent if s[1] != P.Op.TASK]
    return out


def answer(d, worker: str, task: P.TaskBody, result: C.Result) -> object:
    """The worker's result for ``task``; the reply the daemon sends the driver."""
    d.sent.clear()
    d.send(worker.encode(), P.Op.RESULT, P.ResultBody(task.task_id, True, result, seconds=0.1))  # type: ignore[arg-type]
    (reply,) = [body for to, op, body in d.sent if op == P.Op.REPLY and to == f"drv:{task.job_id}".encode()]
    return reply


def test_a_job_is_admitted_once_engines_for_its_model_are_up_and_runs_when_its_driver_started(core, tiny_model):
    d = core
    job = submit(d, tiny_model, "first")
    assert d.chores() == [] and d.journal.job(job).state == "queued"  # no engines yet
    register(d, "w0", tiny_model)
    assert d.chores() == [StartDriver(job)]
    assert d.chores() == []  # asked once: the server answers before the next pass
    d.driver_started(job, 4242)
    assert d.journal.job(job).state == "running" and d.jobs.runtimes[job].pid == 4242
    d.send(b"cli", P.Op.CANCEL, P.JobRef(job), msg_id=5, user=current_user())
    assert d.jobs.runtimes[job].cancel_requested_at is not None
    assert StopDriver(job, kill=True) in d.chores(d.jobs.runtimes[job].cancel_requested_at + 31)  # past its grace
    d.driver_exited(job, 3)
    assert d.journal.job(job).state == "cancelled" and job not in d.jobs.runtimes


def test_a_driver_that_failed_is_not_restarted_though_its_report_came_after_its_exit(core, tiny_model):
    """A driver that reports its job's failure and exits 70 fails the job with its reason, even
    when its exit is seen before its report (it is in its log): a crash (exit 1, a signal) is
    restarted from the checkpoint, a failure the job's own code raised is not."""
    d = core
    register(d, "w0", tiny_model)
    failed, crashed = running(d, tiny_model, "failed"), running(d, tiny_model, "crashed")
    driver_log = d.jobs.runtimes[failed].job_dir.driver_log
    driver_log.parent.mkdir(parents=True, exist_ok=True)
    with open(driver_log, "a") as log:
        log.write("12:00:00 failed: LoopRanNoStep: algo.loop m:run returned without running a training step\n")
    d.driver_exited(failed, DRIVER_EXIT_FAILED)
    info = d.journal.job(failed)
    assert info.state == "failed" and info.error.startswith("LoopRanNoStep: algo.loop m:run"), info.error
    d.driver_exited(crashed, 1)
    assert d.journal.job(crashed).state == "queued"  # a crash: restarted from its checkpoint
    assert "restarting" in [kind for _, kind, _ in d.journal.events(crashed)]


def test_each_call_becomes_its_typed_task_on_its_engine_and_its_result_the_typed_reply(core, tiny_model):
    d = core
    register(d, "w0", tiny_model)
    job = running(d, tiny_model, "calls")
    call(d, job, GENERATE, 1)
    d.place()
    (gen,) = tasks(d)
    assert (gen.engine_id, gen.method) == ("w0/rollout", "generate")
    assert isinstance(gen.task, C.GenerateTask) and gen.task.request.adapter is None  # the base model
    assert answer(d, "w0", gen, C.GenerateResult([])) == C.GenerateRep([], policy_version=0)

    call(d, job, C.TrainStepReq(BATCH, publish=True), 2)
    d.place()
    (step,) = tasks(d)
    assert isinstance(step.task, C.TrainStepTask) and step.engine_id == "w0/trainer"
    assert step.task.trainer.call_key == "4242:2"  # a repeat is applied once
    assert step.task.publish_dir == str(d.jobs_dir / job / "adapters" / "v000001")
    assert answer(d, "w0", step, C.TrainStepResult({"loss": 0.5})) == C.TrainStepRep({"loss": 0.5}, version=1)
    assert Prune(d.jobs_dir / job / "adapters", d.jobs.runtimes[job].spec.algo.max_staleness + 2) in d.effects

    call(d, job, GENERATE, 3)
    d.place()
    (gen,) = tasks(d)
    assert gen.task.request.adapter == P.AdapterRef(job, 1, step.task.publish_dir)  # the policy just published

    call(d, job, C.CheckpointReq(7, {"cursor": 3}), 4)
    d.place()
    (ckpt,) = tasks(d)
    assert isinstance(ckpt.task, C.CheckpointTask) and ckpt.task.extra == {"cursor": 3}
    assert answer(d, "w0", ckpt, C.CheckpointResult({"files": {}})) == C.CheckpointRep(ckpt.task.out_dir)
    latest = json.loads((d.jobs_dir / job / "ckpt" / "latest.json").read_text())
    assert latest == {"dir": ckpt.task.out_dir, "step": 7, "policy_version": 1, "manifest": {"files": {}}}

    call(d, job, C.RestoreReq(), 5)
    d.place()
    (restore,) = tasks(d)
    assert isinstance(restore.task, C.RestoreTask) and restore.task.ckpt_dir == ckpt.task.out_dir
    assert answer(d, "w0", restore, C.RestoreResult({"step": 7})) == C.RestoreRep({"step": 7})


def test_a_call_to_follow_another_is_held_or_sent_ahead_with_it(core, tiny_model):
    d = core
    register(d, "w0", tiny_model)
    job = running(d, tiny_model, "ahead")
    call(d, job, C.TrainStepReq(BATCH, publish=True), 1)
    call(d, job, GENERATE, 2, after=1)
    assert list(d.jobs.runtimes[job].held_calls) == [1]  # held: the call it follows is in flight
    d.place()
    step, gen = tasks(d)  # its rollout engine is on the trainer's worker and idle: on its way with it
    assert (step.method, gen.method, gen.after) == ("train_step", "generate", step.task_id)
    assert gen.task.request.adapter.version == 1
    assert answer(d, "w0", step, C.TrainStepResult({})).version == 1
    assert tasks(d) == [] and list(d.sched.engines["w0/rollout"].running) == [gen.task_id]  # started by the worker
    assert answer(d, "w0", gen, C.GenerateResult([])) == C.GenerateRep([], policy_version=1)


def test_an_adopted_job_waits_for_the_trainer_that_holds_its_state(core, tiny_model):
    d = core
    spec = load_spec(REPO / "configs" / "tiny-arith.yaml", [f"model.path={tiny_model}"], "adopted")
    job, _ = d.journal.submit("s", "alice", spec)
    d.journal.update(job, state="running", policy_version=3)
    d.adopt(job, pid=777)  # its driver outlived the last daemon
    assert d.journal.events(job)[-1][1] == "reattached"
    call(d, job, C.PublishReq(), 9)  # sent again by the driver
    d.place()
    assert tasks(d) == [] and job in d.jobs.held
    register(d, "w0", tiny_model)  # an empty trainer: not the one with its state
    register(d, "w1", tiny_model, resident={job: "w1/trainer"})
    d.chores()
    d.place()
    (publish,) = tasks(d)
    assert publish.engine_id == "w1/trainer" and publish.task.out_dir.endswith("v000004")  # after version 3
    assert answer(d, "w1", publish, C.PublishResult()) == C.PublishRep(4)


def test_a_drain_admits_nothing_tells_each_job_at_its_publish_and_stops_once_they_exited(core, tiny_model):
    d = core
    register(d, "w0", tiny_model)
    job = running(d, tiny_model, "drained")
    queued = submit(d, tiny_model, "waits")
    d.drain("SIGTERM")
    assert d.chores() == [] and d.journal.job(queued).state == "queued" and not d.stopping
    call(d, job, C.PublishReq(), 1)
    d.place()
    (publish,) = tasks(d)
    assert answer(d, "w0", publish, C.PublishResult()) == C.PublishRep(1, drain="SIGTERM")
    d.driver_exited(job, 75)  # checkpointed at its step's end
    assert d.journal.job(job).state == "interrupted"
    released = [body for _, op, body in d.sent if op == P.Op.RELEASE]
    assert {(r.job_id, r.engine_id) for r in released} == {(job, "w0/trainer")}
    d.chores()
    assert d.stopping
    d.take(d.core.interrupt_running())
    assert (b"w0", P.Op.SHUTDOWN, P.Empty()) in d.sent


def test_a_restore_names_a_checkpoint_of_the_users_own_jobs_only(core, tiny_model, tmp_path):
    """A job restores a checkpoint of a job of its own user's, or one another user published
    (``PUBLISH`` of a checkpoint: a training state), until they unpublish it; nothing else."""
    from plexctl.common import auth

    d = core
    register(d, "w0", tiny_model)
    mine, other = running(d, tiny_model, "mine"), running(d, tiny_model, "other", pid=4243)
    spec = spec_to_wire(load_spec(REPO / "configs" / "tiny-arith.yaml", [f"model.path={tiny_model}"], "theirs"))
    d.send(b"fe", P.Op.SUBMIT, P.SubmitReq("sid-theirs", spec, "bob"), user=auth.INTERNAL_USER)
    assert [b for _, op, b in d.sent if op == P.Op.ERROR] == []
    theirs = next(j.job_id for j in d.journal.jobs() if j.user == "bob")
    for job in (other, theirs):
        (d.jobs_dir / job / "ckpt" / "step-000001").mkdir(parents=True)
    d.sent.clear()

    call(d, mine, C.RestoreReq(str(d.jobs_dir / other / "ckpt" / "step-000001"), weights_only=True), 1)
    d.place()
    (restore,) = tasks(d)
    assert restore.task.ckpt_dir == str(d.jobs_dir / other / "ckpt" / "step-000001") and restore.task.weights_only
    outside = tmp_path / "ckpt" / "step-000001"
    outside.mkdir(parents=True)
    refused = [
        d.jobs_dir / theirs / "ckpt" / "step-000001",  # another user's job
        d.jobs_dir / other / "ckpt" / ".." / ".." / theirs / "ckpt" / "step-000001",
        d.jobs_dir / other / "adapters",  # not a checkpoint
        outside,
    ]
    for msg_id, path in enumerate(refused, start=2):
        d.sent.clear()
        call(d, mine, C.RestoreReq(str(path)), msg_id)
        ((op, error),) = [(op, body) for to, op, body in d.sent if to == f"drv:{mine}".encode()]
        assert op == P.Op.ERROR and "is not a checkpoint of a job of" in error.message, path
    d.place()
    assert tasks(d) == []

    def publish(step: int, public: bool) -> object:  # bob's checkpoint, a training state, readable by every user
        d.sent.clear()
        d.send(b"bob", P.Op.PUBLISH, P.PublishReq(theirs, step, public, checkpoint=True), user="bob")
        ((op, body),) = [(op, body) for to, op, body in d.sent if to == b"bob"]
        return body if op == P.Op.REPLY else f"{body.code}: {body.message}"

    assert publish(2, True) == f"not_found: job {theirs} keeps no checkpoint step 2"
    assert publish(1, True) == P.PublishRep(theirs, 1, True, changed=True, checkpoint=True)
    assert not d.journal.is_published(theirs, 1)  # a checkpoint, not policy version 1
    published = d.jobs_dir / theirs / "ckpt" / "step-000001"
    answer(d, "w0", restore, C.RestoreResult({}))  # the trainer's one task in hand ends
    call(d, other, C.RestoreReq(str(published)), 20)
    d.place()
    (restore,) = tasks(d)
    assert restore.task.ckpt_dir == str(published)
    assert publish(1, False).changed
    d.sent.clear()
    call(d, mine, C.RestoreReq(str(published)), 21)
    ((op, error),) = [(op, body) for to, op, body in d.sent if to == f"drv:{mine}".encode()]
    assert op == P.Op.ERROR and "is not a checkpoint of a job of" in error.message


def test_a_generate_samples_another_job_of_the_same_user_only(core, tiny_model):
    """``GenerateReq.of_job`` (an OpenAI API request's): a job of the caller's user, running or
    ended, at a version it keeps; another user's job, or a version not kept, is refused."""
    from plexctl.common import auth

    d = core
    register(d, "w0", tiny_model)
    mine, other = running(d, tiny_model, "mine"), running(d, tiny_model, "other", pid=4243)
    spec = spec_to_wire(load_spec(REPO / "configs" / "tiny-arith.yaml", [f"model.path={tiny_model}"], "theirs"))
    d.send(b"fe", P.Op.SUBMIT, P.SubmitReq("sid-theirs", spec, "bob"), user=auth.INTERNAL_USER)
    theirs = next(j.job_id for j in d.journal.jobs() if j.user == "bob")
    for job in (other, theirs):
        (d.jobs_dir / job / "adapters" / "v000002").mkdir(parents=True)
    d.sent.clear()

    sampling = C.Sampling(max_tokens=2)
    call(d, mine, C.GenerateReq(["1+1="], sampling, version=2, of_job=other), 1)
    d.place()
    (generate,) = tasks(d)
    adapter = generate.task.request.adapter
    assert (adapter.job_id, adapter.version) == (other, 2) and adapter.path.endswith("v000002")
    for msg_id, (job, version, why) in enumerate(
        [(theirs, 2, f"no job {theirs} of"), (other, 5, "is not kept"), ("j9999", None, "no job j9999 of")], start=2
    ):
        d.sent.clear()
        call(d, mine, C.GenerateReq(["1+1="], sampling, version=version, of_job=job), msg_id)
        ((op, error),) = [(op, body) for to, op, body in d.sent if to == f"drv:{mine}".encode()]
        assert op == P.Op.ERROR and why in error.message, (job, error)


def test_a_call_sent_again_is_taken_once_but_another_process_may_reuse_its_number(core, tiny_model):
    """A driver that reconnected sends its calls in flight again: the daemon takes each once. A
    new process driving the same job (a restarted Tinker front end) numbers its calls afresh: its
    call of a number the old process used is a new call, not dropped as a repeat."""
    d = core
    register(d, "w0", tiny_model)
    job = running(d, tiny_model, "again")

    def generates(epoch: int, msg_id: int) -> int:
        d.send(f"drv:{job}".encode(), P.Op.CALL, P.CallReq(job, GENERATE, 0), msg_id, epoch=epoch)
        d.place()
        return len(tasks(d))

    assert generates(epoch=1, msg_id=7) == 1
    assert generates(epoch=1, msg_id=7) == 0  # the same process's call again: already in hand
    assert generates(epoch=2, msg_id=7) == 1  # another process's call 7


def test_a_version_its_owner_published_is_sampled_by_other_users_jobs_until_unpublished(core, tiny_model):
    """``PUBLISH``: a job's user (or the front end for them) makes one kept policy version readable
    by every user's jobs on that base (``of_job``, a named version only), and their own again; no
    other user may, and a version not kept is not published."""
    from plexctl.common import auth

    d = core
    register(d, "w0", tiny_model)
    mine = running(d, tiny_model, "mine")
    spec = spec_to_wire(load_spec(REPO / "configs" / "tiny-arith.yaml", [f"model.path={tiny_model}"], "theirs"))
    d.send(b"bob", P.Op.SUBMIT, P.SubmitReq("sid-theirs", spec, "bob"), user="bob")
    theirs = next(j.job_id for j in d.journal.jobs() if j.user == "bob")
    (d.jobs_dir / theirs / "adapters" / "v000002").mkdir(parents=True)

    def publish(user: str, version: int, public: bool = True):
        d.sent.clear()
        d.send(user.encode(), P.Op.PUBLISH, P.PublishReq(theirs, version, public), user=user)
        ((op, body),) = [(op, body) for to, op, body in d.sent if to == user.encode()]
        return body if op == P.Op.REPLY else f"{body.code}: {body.message}"

    def sample(msg_id: int, version: int | None = 2):
        d.sent.clear()
        call(d, mine, C.GenerateReq(["1+1="], C.Sampling(max_tokens=2), version=version, of_job=theirs), msg_id)
        refused = [body.message for to, op, body in d.sent if to == f"drv:{mine}".encode() and op == P.Op.ERROR]
        d.place()
        return refused[0] if refused else tasks(d)[0].task.request.adapter

    assert f"no job {theirs} of" in sample(1)  # bob's alone
    assert publish(current_user(), 2) == f"forbidden: job {theirs} is bob's: only they publish it"  # not the owner
    assert publish("carol", 2).startswith("not_found")  # carol sees none of bob's jobs
    assert publish("bob", 3).startswith("not_found: job") and not d.journal.is_published(theirs, 3)  # not kept
    assert publish("bob", 2) == P.PublishRep(theirs, 2, True, changed=True)
    assert publish(auth.INTERNAL_USER, 2) == P.PublishRep(theirs, 2, True, changed=False)  # the front end, for bob
    adapter = sample(2)
    assert (adapter.job_id, adapter.version) == (theirs, 2) and adapter.path.endswith("v000002")
    assert f"no job {theirs} of" in sample(3, version=None)  # a published version is named, never "the latest"
    assert ("published", "policy version 2") in [(kind, detail) for _, kind, detail in d.journal.events(theirs)]
    assert publish("bob", 2, public=False).changed
    assert f"no job {theirs} of" in sample(4)


def test_a_name_resolves_among_the_callers_own_jobs(core, tiny_model):
    """A shared user's job of the same name never captures the owner's `status/cancel NAME`; another
    user's job is named `USER/NAME` or by id, and a name only others hold is refused with their ids."""
    d = core
    owner = current_user()
    spec = spec_to_wire(load_spec(REPO / "configs" / "tiny-arith.yaml", [f"model.path={tiny_model}"], "fault"))
    mine = submit(d, tiny_model, "fault")
    d.send(b"bob", P.Op.SUBMIT, P.SubmitReq("sid-bob", spec, "bob"), user="bob")
    d.send(b"bob", P.Op.SUBMIT, P.SubmitReq("sid-bob-only", {**spec, "name": "solo"}, "bob"), user="bob")
    bobs, solo = [j.job_id for j in d.journal.jobs() if j.user == "bob"]
    d.sent.clear()

    def ask(user: str, op: bytes, ref: str):
        d.sent.clear()
        body = P.StatusReq(ref) if op == P.Op.STATUS else P.JobRef(ref)
        d.send(user.encode(), op, body, user=user)
        ((reply_op, reply),) = [(o, b) for to, o, b in d.sent if to == user.encode()]
        if reply_op == P.Op.ERROR:
            return reply.message
        return reply.jobs[0].job_id if op == P.Op.STATUS else reply.job_id

    assert ask(owner, P.Op.STATUS, "fault") == mine  # bob's is newer: it does not capture the name
    assert ask(owner, P.Op.STATUS, "bob/fault") == bobs
    assert ask(owner, P.Op.STATUS, bobs) == bobs
    assert ask("bob", P.Op.STATUS, "fault") == bobs
    assert ask("bob", P.Op.STATUS, f"{owner}/fault") == f"no job '{owner}/fault'"  # not his to see
    assert ask("bob", P.Op.STATUS, mine) == f"no job '{mine}'"
    refused = ask(owner, P.Op.STATUS, "solo")
    assert f"bob/solo ({solo})" in refused and "USER/NAME" in refused
    assert ask(owner, P.Op.CANCEL, "fault") == mine
    assert {j.job_id: j.state for j in d.journal.jobs()}[bobs] == "queued"  # bob's job untouched


def register_with_room(d, worker: str, model: Path, adapter_slots: int, state_room_bytes: int) -> None:
    """One engine pair that declares its room: the rollout engine's adapter slots, the trainer's tiers."""
    engines = [
        P.EngineDecl(f"{worker}/rollout", "rollout", str(model), 4, adapter_slots=adapter_slots),
        P.EngineDecl(f"{worker}/trainer", "trainer", str(model), 1, state_room_bytes=state_room_bytes),
    ]
    d.send(worker.encode(), P.Op.REGISTER, P.RegisterReq(worker, "node", 1, engines, True))


def status_reason(d, job: str) -> str:
    d.sent.clear()
    d.send(b"cli", P.Op.STATUS, P.StatusReq(job), user=current_user())
    ((reply,),) = [[b for to, o, b in d.sent if to == b"cli" and o == P.Op.REPLY]]
    return reply.jobs[0].reason


def test_as_many_jobs_as_the_engines_declare_room_for_are_admitted_on_one_pair(core, tiny_model):
    d = core
    register_with_room(d, "w0", tiny_model, adapter_slots=64, state_room_bytes=72 << 30)
    jobs = [submit(d, tiny_model, f"j{i}") for i in range(32)]
    assert sorted(e.job_id for e in d.chores() if isinstance(e, StartDriver)) == sorted(jobs)  # all 32 at once
    assert {d.sched.home_of(j, "trainer") for j in jobs} == {"w0/trainer"}


def test_the_rollout_engines_adapter_slots_bound_its_jobs_and_status_names_the_limit(core, tiny_model):
    d = core
    register_with_room(d, "w0", tiny_model, adapter_slots=5, state_room_bytes=72 << 30)
    jobs = [submit(d, tiny_model, f"j{i}") for i in range(7)]
    assert len([e for e in d.chores() if isinstance(e, StartDriver)]) == 5
    assert "the rollout engine of" in status_reason(d, jobs[-1])
    assert "holds 5 jobs (its adapter slots: 5)" in status_reason(d, jobs[-1])


def test_the_trainers_tiers_bound_its_jobs_by_their_state_bytes(core, tiny_model):
    d = core
    one = state_bytes(core.journal.spec(submit(d, tiny_model, "probe")))
    assert one > 0
    register_with_room(d, "w0", tiny_model, adapter_slots=64, state_room_bytes=3 * one)
    jobs = [submit(d, tiny_model, f"j{i}") for i in range(4)]
    assert len([e for e in d.chores() if isinstance(e, StartDriver)]) == 3  # the probe and two more
    assert "whose state" in status_reason(d, jobs[-1]) and "its tiers hold" in status_reason(d, jobs[-1])


def test_a_cluster_cap_on_jobs_per_engine_holds_and_status_names_it(tiny_model, tmp_path):
    from conftest import SIMULATED_USERS, DrivenCore

    from daemon.core import DaemonCore

    c = DaemonCore(
        tmp_path / "state", [str(tiny_model)], current_user(), jobs_per_engine=6, trusted_users=SIMULATED_USERS
    )
    d = DrivenCore(c)
    try:
        register_with_room(d, "w0", tiny_model, adapter_slots=64, state_room_bytes=72 << 30)
        jobs = [submit(d, tiny_model, f"j{i}") for i in range(32)]
        assert len([e for e in d.chores() if isinstance(e, StartDriver)]) == 6
        assert "holds 6 jobs (jobs_per_engine cap: 6)" in status_reason(d, jobs[-1])
    finally:
        c.close()


def test_engines_that_declare_no_room_hold_the_undeclared_default(core, tiny_model):
    from daemon.scheduler import UNDECLARED_JOBS_PER_ENGINE

    d = core
    register(d, "w0", tiny_model)
    jobs = [submit(d, tiny_model, f"j{i}") for i in range(UNDECLARED_JOBS_PER_ENGINE + 2)]
    assert len([e for e in d.chores() if isinstance(e, StartDriver)]) == UNDECLARED_JOBS_PER_ENGINE
    assert f"undeclared room: {UNDECLARED_JOBS_PER_ENGINE}" in status_reason(d, jobs[-1])


def test_train_steps_of_several_jobs_go_to_the_trainer_as_one_pass_each_answered_alone(tiny_model, tmp_path):
    from conftest import SIMULATED_USERS, DrivenCore

    from daemon.core import DaemonCore

    c = DaemonCore(
        tmp_path / "state", [str(tiny_model)], current_user(), pass_window=0.005, trusted_users=SIMULATED_USERS
    )
    d = DrivenCore(c)
    try:
        register(d, "w0", tiny_model)
        jobs = [running(d, tiny_model, f"j{i}", pid=100 + i) for i in range(3)]
        t0 = 1000.0
        call(d, jobs[0], C.TrainStepReq(BATCH), 1)
        d.place(t0)
        assert not [s for s in d.sent if s[1] in (P.Op.TASK, P.Op.TASK_PASS)]  # waits for the others' steps
        for i, job in enumerate(jobs[1:], 2):
            call(d, job, C.TrainStepReq(BATCH), i)
        d.place(t0 + 0.001)
        ((to, op, body),) = [s for s in d.sent if s[1] in (P.Op.TASK, P.Op.TASK_PASS)]
        assert to == b"w0" and op == P.Op.TASK_PASS and body.engine_id == "w0/trainer"
        assert sorted(t.job_id for t in body.tasks) == sorted(jobs)
        d.sent.clear()
        for t in body.tasks:
            reply = answer(d, "w0", t, C.TrainStepResult({"loss": 0.5, "group": 3.0}))
            assert reply == C.TrainStepRep({"loss": 0.5, "group": 3.0}, version=0)
        d.sent.clear()
        d.send(b"cli", P.Op.STATUS, P.StatusReq(), user=current_user())
        ((rep,),) = [[b for to, o, b in d.sent if to == b"cli" and o == P.Op.REPLY]]
        trainer = next(e for e in rep.engines if e.kind == "trainer")
        assert (trainer.shared_passes, trainer.shared_tasks, trainer.largest_pass) == (1, 3, 3)
    finally:
        c.close()


def test_only_the_api_front_ends_jobs_make_interactive_calls(core, tiny_model):
    """A loop job's driver that marks its generate calls interactive is batch work all the same:
    the interactive class is for the requests of the jobs the API front end makes (kind external)."""
    d = core
    register(d, "w0", tiny_model)
    mine = running(d, tiny_model, "mine")
    d.sent.clear()
    call(d, mine, C.GenerateReq(["1+1="], C.Sampling(max_tokens=2), interactive=True), 1)
    (queued,) = d.sched.queue.values()
    assert queued.job_id == mine and not queued.interactive
