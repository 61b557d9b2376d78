"""A Tinker training client's job in the daemon's core and its API keys (no socket, no process).

What the Tinker front end relies on: its job is ``external``, with no driver, running once
admitted; it ends between its client's calls (a cancel, a drain); ended by the front end (its client's session finished)
it succeeded, cancelled by its user it was cancelled; every policy version it publishes is kept
(saved sampler weights never move), and a generate may sample from any of them or from the base.
A key is ``tml-`` and random, kept 0600, and the cluster stores only its digest.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from test_daemon_core import call, register, tasks

from daemon.core import Prune, StartDriver, StopDriver
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.client import current_user
from plexctl.common.spec import spec_from_wire, spec_to_wire
from plexctl.tinker import keys


def tinker_job(d, model: Path, name: str = "run") -> str:
    spec = spec_from_wire(
        {
            "name": name,
            "model": {"path": str(model)},
            "lora": {"rank": 8},
            "kind": "external",
        }
    )
    d.send(b"front", P.Op.SUBMIT, P.SubmitReq(f"sid-{name}", spec_to_wire(spec), current_user()))
    (reply,) = [body for to, op, body in d.sent if op == P.Op.REPLY and to == b"front"]
    d.sent.clear()
    assert not [e for e in d.chores() if isinstance(e, StartDriver)]  # no driver: its client drives it
    assert d.journal.job(reply.job_id).state == "running"
    return reply.job_id


def publish(d, job: str, msg_id: int) -> str:
    call(d, job, C.PublishReq(), msg_id)
    d.place()
    (task,) = tasks(d)
    d.send(b"w0", P.Op.RESULT, P.ResultBody(task.task_id, True, C.PublishResult()))
    Path(task.task.out_dir).mkdir(parents=True)
    return task.task.out_dir


def test_a_session_that_ends_ends_its_job_at_once_and_it_succeeded(core, tiny_model):
    d = core
    register(d, "w0", tiny_model)
    job = tinker_job(d, tiny_model)
    d.send(b"front", P.Op.CANCEL, P.JobRef(job), msg_id=9)  # the front end: its session finished
    assert not [e for e in d.chores() if isinstance(e, StopDriver)]  # no driver to stop: it ends between calls
    assert d.journal.job(job).state == "succeeded"
    assert job not in d.jobs.runtimes


def test_its_user_cancelling_it_cancels_it(core, tiny_model):
    d = core
    register(d, "w0", tiny_model)
    job = tinker_job(d, tiny_model)
    d.send(b"cli", P.Op.CANCEL, P.JobRef(job), msg_id=9, user=current_user())
    d.chores()
    assert d.journal.job(job).state == "cancelled"


def test_every_version_is_kept_and_a_generate_samples_from_the_one_named(core, tiny_model):
    d = core
    register(d, "w0", tiny_model)
    job = tinker_job(d, tiny_model)
    dirs = [publish(d, job, msg_id) for msg_id in (1, 2, 3, 4, 5)]
    assert not [e for e in d.effects if isinstance(e, Prune)]  # sampler weights never go
    cases = ((2, P.AdapterRef(job, 2, dirs[1])), (0, None), (None, P.AdapterRef(job, 5, dirs[4])))
    for msg_id, (version, want) in enumerate(cases, start=10):
        call(d, job, C.GenerateReq([], C.Sampling(), [[1, 2, 3]], version=version), msg_id)
        d.place()
        (gen,) = tasks(d)
        assert gen.task.request.adapter == want and gen.task.request.prompt_tokens == [[1, 2, 3]]
        d.send(b"w0", P.Op.RESULT, P.ResultBody(gen.task_id, True, C.GenerateResult([])))
    call(d, job, C.GenerateReq([], C.Sampling(), [[1]], version=9), 30)
    (error,) = [body for _, op, body in d.sent if op == P.Op.ERROR]
    assert "version 9" in error.message


def test_token_loss_calls_become_trainer_tasks_with_their_data(core, tiny_model):
    d = core
    register(d, "w0", tiny_model)
    job = tinker_job(d, tiny_model)
    loss = C.LossCall([C.TokenDatum([1, 2], [2, 3], weights=[0.0, 1.0])], "cross_entropy")
    call(d, job, C.ForwardBackwardReq(loss), 1)
    d.place()
    (fb,) = tasks(d)
    assert isinstance(fb.task, C.ForwardBackwardTask) and fb.task.call == loss
    d.send(b"w0", P.Op.RESULT, P.ResultBody(fb.task_id, True, C.ForwardBackwardResult([[-0.5, -0.25]], 0.25)))
    assert C.ForwardBackwardRep([[-0.5, -0.25]], 0.25) in [body for _, op, body in d.sent if op == P.Op.REPLY]
    call(d, job, C.OptimStepReq([loss], C.AdamStep(learning_rate=0.5), publish=True), 2)
    d.place()
    (step,) = tasks(d)
    assert isinstance(step.task, C.OptimStepTask) and step.task.adam.learning_rate == 0.5
    assert step.task.publish_dir.endswith("v000001") and step.task.calls == [loss]
    d.send(b"w0", P.Op.RESULT, P.ResultBody(step.task_id, True, C.OptimStepResult({"loss:sum": 0.25})))
    assert C.OptimStepRep({"loss:sum": 0.25}, version=1) in [body for _, op, body in d.sent if op == P.Op.REPLY]


def test_a_key_is_kept_private_and_the_cluster_keeps_only_its_digest(tmp_path):
    state, home = tmp_path / "state", tmp_path / "home"
    state.mkdir()
    path = keys.ensure_key(state, "alice", user_home=home)
    key = path.read_text().strip()
    assert key.startswith("tml-") and len(key) == 52
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keys.ensure_key(state, "alice", user_home=home) == path and path.read_text().strip() == key  # kept
    assert keys.user_of(state, key) == "alice"
    assert keys.user_of(state, "tml-" + "0" * 48) is None and keys.user_of(state, key[4:]) is None
    assert key not in (state / "tinker-keys.json").read_text()


def test_every_service_call_travels_the_wire():
    """Each call of ``METHODS``, its task and its result decode on the far side (the wire's unions)."""
    import typing

    for union, part in ((C.AnyRequest, "request"), (C.AnyTask, "task"), (C.AnyResult, "result")):
        assert set(typing.get_args(union)) == {getattr(m, part) for m in C.METHODS.values()}, part


def test_the_runs_a_front_end_kept_are_read_back_as_it_wrote_them(tmp_path):
    """``runs.json`` round-trips through a restarted front end; records in the list form that
    saved states and loads had before (``[dir, time, step]``, ``loaded: []``) read as the same."""
    import json

    from plexctl.tinker.cluster import ClusterBackend, LoadedState, SavedState, _restore_point

    registry = tmp_path / "tinker" / "runs.json"
    registry.parent.mkdir()
    common = {"job_id": "j1", "user": "alice", "base_model": "tiny", "model_path": "/m/tiny", "steps": 5}
    registry.write_text(
        json.dumps(
            {
                "s-1:train:0": {
                    **common,
                    "model_id": "s-1:train:0",
                    "rank": 8,
                    "states": {"a": ["/c/1", 10.0, 2]},
                    "loaded": [],
                },
                "s-1:train:1": {
                    **common,
                    "model_id": "s-1:train:1",
                    "rank": None,
                    "states": {},
                    "loaded": ["tinker://s-1:train:0/weights/a", "/c/1", 20.0, 2, True],
                },
            }
        )
    )
    backend = ClusterBackend(tmp_path)
    lora, full = backend.runs["s-1:train:0"].record, backend.runs["s-1:train:1"].record
    assert (lora.rank, lora.states, lora.loaded) == (8, {"a": SavedState("/c/1", 10.0, 2)}, None)
    assert (full.rank, full.loaded) == (None, LoadedState("tinker://s-1:train:0/weights/a", "/c/1", 20.0, 2, True))
    assert _restore_point(lora) == LoadedState("tinker://s-1:train:0/weights/a", "/c/1", 10.0, 2, False)
    assert _restore_point(full) == full.loaded
    assert all(r.resuming for r in backend.runs.values())  # their sessions had not ended

    backend._save()
    again = ClusterBackend(tmp_path)
    assert {m: r.record for m, r in again.runs.items()} == {m: r.record for m, r in backend.runs.items()}


def test_runs_a_front_end_cannot_read_are_kept_aside_and_the_rest_taken_back(tmp_path, caplog):
    import json

    from plexctl.tinker.cluster import ClusterBackend

    registry = tmp_path / "tinker" / "runs.json"
    registry.parent.mkdir()
    good = {
        "model_id": "s-1:train:0",
        "job_id": "j1",
        "user": "alice",
        "base_model": "t",
        "model_path": "/m/t",
        "rank": 8,
    }
    registry.write_text(json.dumps({"s-1:train:0": good, "s-1:train:1": {**good, "rank": "eight"}}))
    backend = ClusterBackend(tmp_path)
    assert list(backend.runs) == ["s-1:train:0"]
    kept = list(registry.parent.glob("runs.json.unreadable-*"))
    assert len(kept) == 1 and "eight" in kept[0].read_text()  # nothing lost
    assert "s-1:train:1" in caplog.text and str(kept[0]) in caplog.text

    registry.write_text("{not json")
    assert ClusterBackend(tmp_path).runs == {}
    assert "unreadable" in caplog.text and registry.read_text() == "{not json"
    assert len(list(registry.parent.glob("runs.json.unreadable-*"))) == 2  # each kept, none overwritten


def test_an_external_job_stops_with_the_cluster_between_its_calls_and_is_interrupted(core, tiny_model):
    """No driver checkpoints it: a drain waits for the call in flight, then the job is interrupted
    (queued again at the next ``up``, where its client restores what it saved)."""
    d = core
    register(d, "w0", tiny_model)
    job = tinker_job(d, tiny_model)
    call(d, job, C.PublishReq(), 1)
    d.place()
    (task,) = tasks(d)
    d.drain("the allocation ends")
    d.chores()
    assert d.journal.job(job).state == "running"  # its publish is in flight
    d.send(b"w0", P.Op.RESULT, P.ResultBody(task.task_id, True, C.PublishResult()))
    d.chores()
    assert d.journal.job(job).state == "interrupted" and job not in d.jobs.runtimes
    assert not [e for e in d.effects if isinstance(e, (StartDriver, StopDriver))]


def test_a_run_whose_job_starts_at_once_tells_its_client_of_no_wait(monkeypatch) -> None:
    """A run's job that is queued only for the moment the scheduler takes to home it is not told to
    the client as waiting (the SDK would warn "Retrying request"); one queued past
    ``QUEUED_TOLD_AFTER_S`` is, with its reason, until it runs."""
    from types import SimpleNamespace

    from plexctl.tinker import cluster as T
    from plexctl.tinker.backend import waits_told_to

    def backend(states: list[str]) -> T.ClusterBackend:
        answers = iter(states)

        def status(job_id: str) -> SimpleNamespace:
            info = SimpleNamespace(state=next(answers), reason="every trainer engine is full", error="")
            return SimpleNamespace(jobs=[info])

        plain = object.__new__(T.ClusterBackend)
        plain._client = lambda: SimpleNamespace(status=status)  # type: ignore[method-assign]
        return plain

    monkeypatch.setattr(T.time, "sleep", lambda s: None)
    told: list[str | None] = []
    with waits_told_to(told.append):
        assert backend(["queued", "queued", "running"])._wait_running("j1").state == "running"
    assert told == [None]  # queued briefly: only "no longer waiting"
    monkeypatch.setattr(T, "QUEUED_TOLD_AFTER_S", 0.0)
    told.clear()
    with waits_told_to(told.append):
        backend(["queued", "running"])._wait_running("j2")
    assert told == ["its job j2 is queued: every trainer engine is full", None]


def test_a_run_whose_job_never_starts_has_its_job_cancelled_not_left_queued(monkeypatch, tmp_path) -> None:
    """A client that gave up (killed while waiting) leaves no queued job behind: the run is known
    while its job waits (so its session's end cancels it), and a job that did not start in time is
    cancelled, the run ended."""
    from types import SimpleNamespace

    from plexctl.tinker import cluster as T
    from plexctl.tinker.backend import UserError

    cancelled: list[str] = []
    daemon = SimpleNamespace(
        submit=lambda spec, submit_id, user: SimpleNamespace(job_id="j7"),
        status=lambda job_id: SimpleNamespace(jobs=[SimpleNamespace(state="queued", reason="full", error="")]),
        cancel=cancelled.append,
    )
    backend = T.ClusterBackend(tmp_path)
    backend._client = lambda: daemon  # type: ignore[method-assign]
    monkeypatch.setattr(T, "START_TIMEOUT_S", 0.0)
    with pytest.raises(UserError, match="did not start within"):
        backend._start_run("alice", "s-1:train:0", "/models/tiny", 8, 0)
    assert cancelled == ["j7"] and backend.runs["s-1:train:0"].record.ended
    assert json.loads((tmp_path / "tinker" / "runs.json").read_text())["s-1:train:0"]["ended"] is True


def test_a_checkpoint_past_its_ttl_is_deleted_with_its_files_and_the_rest_kept(tmp_path):
    """``ClusterBackend.expire`` (the front end's chores call it): saves past their TTL go, files
    and record; one without a TTL, and one whose TTL is still ahead, stay; a restarted front end
    keeps the TTLs."""
    import json

    from plexctl.tinker.cluster import ClusterBackend

    job = tmp_path / "jobs" / "j1"
    ckpt = job / "ckpt" / "step-000002"
    for d in (ckpt, job / "adapters" / "v000001", job / "adapters" / "v000002"):
        d.mkdir(parents=True)
        (d / "weights").write_bytes(b"x" * 10)
    registry = tmp_path / "tinker" / "runs.json"
    registry.parent.mkdir()
    record = {
        "model_id": "s-1:train:0",
        "job_id": "j1",
        "user": "alice",
        "base_model": "t",
        "model_path": "/m/t",
        "rank": 8,
        "states": {"a": [str(ckpt), 10.0, 2]},
        "samplers": {"first": 1, "second": 2},
    }
    registry.write_text(json.dumps({"s-1:train:0": record}))
    backend = ClusterBackend(tmp_path)
    state, first, second = (
        f"tinker://s-1:train:0/{k}" for k in ("weights/a", "sampler_weights/first", "sampler_weights/second")
    )
    backend.set_checkpoint_ttl("alice", state, 3600, now=1000.0)
    backend.set_checkpoint_ttl("alice", first, 7200, now=1000.0)
    expires = {i.tinker_path: i.expires_at for i in backend.list_checkpoints("alice", "s-1:train:0")}
    assert expires == {state: 4600.0, first: 8200.0, second: None}
    assert ClusterBackend(tmp_path).runs["s-1:train:0"].record.expires == {state: 4600.0, first: 8200.0}

    assert backend.expire(4599.0) == []
    assert backend.expire(4600.0) == [state]
    assert not ckpt.exists() and (job / "adapters" / "v000001").is_dir()
    assert {i.tinker_path for i in backend.list_checkpoints("alice", "s-1:train:0")} == {first, second}
    assert backend.expire(9000.0) == [first]
    assert not (job / "adapters" / "v000001").exists() and (job / "adapters" / "v000002").is_dir()
    assert ClusterBackend(tmp_path).runs["s-1:train:0"].record.expires == {}


def test_a_users_openai_sampler_run_is_served_again_after_a_restart_but_held_by_no_session(tmp_path):
    """A restarted front end takes back the runs of its clients' sessions, whose heartbeats keep
    them; a user's OpenAI sampler run is no session's (no heartbeat would come, and its session's
    end would close it under a request in flight): it serves that user again until idle."""
    import json

    from plexctl.tinker.cluster import OPENAI_RUN_PREFIX, ClusterBackend

    registry = tmp_path / "tinker" / "runs.json"
    registry.parent.mkdir()
    common = {"job_id": "j1", "user": "alice", "base_model": "t", "model_path": "/m/t", "rank": 8}
    served = f"{OPENAI_RUN_PREFIX}abc:1"
    runs = {"s-1:train:0": {**common, "model_id": "s-1:train:0"}, served: {**common, "model_id": served}}
    registry.write_text(json.dumps(runs))
    backend = ClusterBackend(tmp_path)
    assert [run.model_id for _, run in backend.known_runs()] == ["s-1:train:0"]
    assert backend._serving == {("alice", "/m/t"): served}


def test_a_sampler_of_published_weights_is_taken_back_after_a_restart_while_they_stay_published(tmp_path):
    """Another user's sampler of published weights ("<their OpenAI run>:of:<job>:v<version>") is
    known again to a restarted front end, for that user alone, and only while still published."""
    import json

    from plexctl.tinker.cluster import OF_JOB, OPENAI_RUN_PREFIX, ClusterBackend

    registry = tmp_path / "tinker" / "runs.json"
    registry.parent.mkdir()
    common = {"base_model": "t", "model_path": "/m/t", "rank": 8}
    theirs = {**common, "model_id": "s-1:train:0", "job_id": "j1", "user": "alice", "samplers": {"shared": 3}}
    served = f"{OPENAI_RUN_PREFIX}abc:1"
    runs = {
        "s-1:train:0": {**theirs, "public": ["shared"]},
        served: {**common, "model_id": served, "job_id": "j2", "user": "bob", "sampling": True},
    }
    registry.write_text(json.dumps(runs))
    sampler_id = f"{served}{OF_JOB}j1:v3"
    sampler = ClusterBackend(tmp_path).known_sampler("bob", sampler_id)
    assert sampler is not None and sampler.model_path == "tinker://s-1:train:0/sampler_weights/shared"
    assert ClusterBackend(tmp_path).known_sampler("carol", sampler_id) is None  # not carol's sampler
    registry.write_text(json.dumps({**runs, "s-1:train:0": theirs}))  # unpublished since
    assert ClusterBackend(tmp_path).known_sampler("bob", sampler_id) is None
