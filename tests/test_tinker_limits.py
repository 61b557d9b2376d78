"""What a Tinker user may not do, as the real SDK meets it: the server and the cluster's backend
(``plexctl.tinker.cluster.ClusterBackend``) as they run, over a stand-in of the daemon that writes
each save's directory where the engines do (``<state>/jobs/<job>/adapters/v*``, ``ckpt/step-*``).

Checked: a user's saves held to their ``tinker-saves`` and ``tinker-disk`` limits (the oldest not
in use pruned, none: the save refused with one "user" line), the owner's not held; a pruned or
vanished save no longer listed, and asking for it names its ``tinker://`` path, never a directory
of the cluster's; a datum past the model's context refused before the trainer; a LoRA rank out of
the spec's bounds refused as the user's error.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from test_tinker_server import VOCAB, datum, listening  # noqa: E402
from tinker import types  # noqa: E402

from plexctl.common import calls as C  # noqa: E402
from plexctl.common.auth import keys_dir  # noqa: E402
from plexctl.common.jobdir import JobDir  # noqa: E402
from plexctl.common.limits import set_limits  # noqa: E402
from plexctl.rl import CallFailed  # noqa: E402
from plexctl.tinker import cluster, keys  # noqa: E402
from plexctl.tinker import server as S  # noqa: E402
from plexctl.tinker.quota import Kept, Quota, QuotaFull, make_room  # noqa: E402

MODEL = "tiny-ctx64"
CONTEXT = 64  # the model's max_position_embeddings
WEIGHTS_BYTES = 1000  # what each published version (sampler weights) takes
STATE_BYTES = 3000  # what each checkpoint (a save_state) takes
USERS = ("alice", "owner")


class Daemon:
    """The daemon as the backend's clients see it: a job runs once submitted; a publish or a
    checkpoint writes its directory as the engines do; a restore or generate of a directory that
    is gone fails as the daemon's do, naming it."""

    def __init__(self, state_dir: Path, model: Path) -> None:
        self.state_dir, self.model = state_dir, model
        self.submitted: list[str] = []
        self.calls: list[Any] = []
        self.clients: dict[str, Any] = {}

    # the daemon's client (``plexctl.common.client.Client``)
    def status(self, job_id: str | None = None) -> Any:
        running = SimpleNamespace(job_id=job_id, state="running", error="", reason="", restarts=0)
        return SimpleNamespace(engines=[SimpleNamespace(model=str(self.model))], jobs=[running])

    def submit(self, spec: Any, submit_id: str, user: str) -> Any:
        self.submitted.append(user)
        return SimpleNamespace(job_id=f"job{len(self.submitted)}")

    def cancel(self, job_id: str) -> None:
        pass

    # a job's clients (``plexctl.rl.JobClient``): one for its training calls, others for its samples
    def job_client(self, job_id: str) -> Any:
        if job_id not in self.clients:
            self.clients[job_id] = self._job_client(job_id)
        return self.clients[job_id]

    def _job_client(self, job_id: str) -> Any:
        job_dir, versions = JobDir(self.state_dir / "jobs" / job_id), [0]

        def wait(request: Any) -> Any:
            self.calls.append(request)
            if isinstance(request, C.PublishReq):
                versions[0] += 1
                _write(job_dir.adapter(versions[0]), WEIGHTS_BYTES)
                return C.PublishRep(versions[0])
            if isinstance(request, C.CheckpointReq):
                assert not job_dir.checkpoint(request.step).exists()  # a new directory each time
                return C.CheckpointRep(str(_write(job_dir.checkpoint(request.step), STATE_BYTES)))
            if isinstance(request, C.RestoreReq):
                if not Path(request.ckpt_dir).is_dir():
                    raise CallFailed(f"{request.ckpt_dir} is not a checkpoint of a job of this user")
                return C.RestoreRep({})
            if isinstance(request, C.GenerateReq):
                if not job_dir.adapter(request.version or 0).is_dir():
                    raise CallFailed(f"policy version {request.version} is not kept")
                done = C.Completion(0, "", request.prompt_tokens[0], [1, 2], [-0.5, -0.5], "length")
                return C.GenerateRep([done], request.version or 0)
            if isinstance(request, C.ForwardBackwardReq):
                return C.ForwardBackwardRep([[-1.0] * len(d.tokens) for d in request.call.data], 1.0)
            if isinstance(request, C.OptimStepReq):
                return C.OptimStepRep({})
            raise AssertionError(f"unexpected call {request!r}")

        return SimpleNamespace(call_async=lambda r, **_: r, wait=wait, report=lambda *a, **k: None, close=lambda: None)


def _write(directory: Path, size: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "weights.bin").write_bytes(b"\0" * size)
    return directory


class Clock:
    """Wall time, moved on at will: what "lately" means for sampler weights in use."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead

    def idle(self) -> None:
        """Past the time a sampler's weights stay in use unsampled."""
        self.ahead += 2 * cluster.SAMPLER_IDLE_S


class Backend(cluster.ClusterBackend):
    """The cluster's backend, its daemon the stand-in above."""

    def __init__(self, state_dir: Path, daemon: Daemon, clock: Clock) -> None:
        super().__init__(state_dir, clock)
        self.daemon = daemon

    def _client(self) -> Any:
        return self.daemon

    def _connect(self, run: cluster.Run, suffix: str) -> Any:
        return self.daemon.job_client(run.record.job_id)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base model's directory as the SDK and the backend read it: a tokenizer, its context."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = tmp_path_factory.mktemp("model") / MODEL
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT}))
    return out


@pytest.fixture
def cluster_of(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The server on the backend, on a free port; ``url``, ``backend``, ``daemon``, ``clock``,
    ``state`` and each user's ``key``. ``owner`` owns the cluster."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    state = tmp_path / "state"
    keys_dir(state).mkdir(parents=True)
    (keys_dir(state) / "owner").write_text("owner\n")
    api_keys = {}
    for user in USERS:
        api_keys[user] = keys.PREFIX + secrets.token_hex(24)
        keys.register(state, user, keys.digest(api_keys[user]))
    daemon, clock = Daemon(state, model), Clock()
    backend = Backend(state, daemon, clock)
    with listening(S.create_app(backend, max_workers=8)) as (url, _):
        yield SimpleNamespace(url=url, backend=backend, daemon=daemon, clock=clock, state=state, key=api_keys)


def service(c: Any, user: str) -> Any:
    return tinker.ServiceClient(base_url=c.url, api_key=c.key[user])


def listed(c: Any, user: str, model_id: str) -> set[str]:
    rest = tinker.RestClient(base_url=c.url, api_key=c.key[user])
    return {cp.checkpoint_id for cp in rest.list_checkpoints(model_id).result().checkpoints}


def user_error(future: Any) -> str:
    """The one line of a refusal that is the user's to fix: a failed request's (category "user"),
    or a request answered at once (400, the same category)."""
    with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError)) as refused:
        future.result()
    error = refused.value
    if isinstance(error, tinker.BadRequestError):
        assert isinstance(error.body, dict) and error.body["category"] == "user", error.body
        line = str(error.body["error"])
    else:
        assert error.category == types.RequestErrorCategory.User, error
        line = str(error)
    assert "\n" not in line
    return line


def test_saves_past_the_users_count_prune_the_oldest_not_in_use_and_then_are_refused(cluster_of: Any) -> None:
    c = cluster_of
    set_limits(c.state, {"tinker_saves": 3}, user="alice")
    alice = service(c, "alice")
    try:
        training = alice.create_lora_training_client(base_model=MODEL, rank=8).result()
        job_dir = JobDir(c.state / "jobs" / c.backend.runs[training.model_id].record.job_id)
        states = {name: training.save_state(name).result().path for name in ("s1", "s2", "s3")}
        assert listed(c, "alice", training.model_id) == {"weights/s1", "weights/s2", "weights/s3"}

        training.save_state("s4").result()  # the oldest, not in use, goes
        assert listed(c, "alice", training.model_id) == {"weights/s2", "weights/s3", "weights/s4"}
        assert not job_dir.checkpoint(1).exists() and job_dir.checkpoint(4).is_dir()
        gone = user_error(alice.create_training_client_from_state(states["s1"]))
        assert f"no saved state at {states['s1']}" in gone and str(c.state) not in gone

        w1 = training.save_weights_for_sampler("w1").result().path  # s2 goes
        training.save_weights_for_sampler("w2").result()  # s3 goes: s4 is the state the run resumes from
        assert listed(c, "alice", training.model_id) == {"weights/s4", "sampler_weights/w1", "sampler_weights/w2"}

        # all in use: s4 the run's latest state, w2 its newest weights, w1 made lately, then sampled
        full = user_error(training.save_weights_for_sampler("w3"))
        assert f"tinker://{training.model_id}/sampler_weights/w3 is not saved" in full
        assert "your limit of 3 saves (tinker-saves): all 3 of your saves" in full
        sampler = alice.create_sampling_client(model_path=w1).result()
        c.clock.idle()
        prompt, params = types.ModelInput.from_ints([1, 2]), types.SamplingParams(max_tokens=2)
        assert sampler.sample(prompt, 1, params).result().sequences[0].tokens == [1, 2]  # w1 in use again
        user_error(training.save_weights_for_sampler("w3"))
        assert listed(c, "alice", training.model_id) == {"weights/s4", "sampler_weights/w1", "sampler_weights/w2"}

        c.clock.idle()  # w1's sampler is idle: w1 goes
        training.save_weights_for_sampler("w3").result()
        assert listed(c, "alice", training.model_id) == {"weights/s4", "sampler_weights/w2", "sampler_weights/w3"}
        assert "its weights were pruned" in user_error(sampler.sample(prompt, 1, params))
        gone = user_error(alice.create_sampling_client(model_path=w1))
        assert f"no sampler weights at {w1}" in gone and str(c.state) not in gone
    finally:
        alice.close("success").result()


def test_a_users_saves_are_held_to_their_bytes_and_an_ended_sessions_go_first(cluster_of: Any) -> None:
    c = cluster_of
    set_limits(c.state, {"tinker_disk_bytes": 5 * WEIGHTS_BYTES // 2})  # the default: every user's but the owner's
    first = service(c, "alice")
    old = first.create_lora_training_client(base_model=MODEL, rank=8).result()
    old.save_weights_for_sampler("a1").result()
    old.save_weights_for_sampler("a2").result()
    full = user_error(old.save_weights_for_sampler("a3"))  # both in use: made lately, a live run's
    assert "your limit of 2.4 KiB (tinker-disk)" in full
    first.close("success").result()  # its run ended: nothing of it is in use any more

    second = service(c, "alice")
    owner = service(c, "owner")
    try:
        new = second.create_lora_training_client(base_model=MODEL, rank=8).result()
        samplers = [new.save_weights_and_get_sampling_client().result() for _ in range(2)]  # a1, then a2 go
        assert listed(c, "alice", old.model_id) == set()
        assert not list((c.state / "jobs" / c.backend.runs[old.model_id].record.job_id / "adapters").iterdir())
        for sampler in samplers:
            sampler.sample(types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=2)).result()

        owners = owner.create_lora_training_client(base_model=MODEL, rank=8).result()
        for i in range(4):  # the owner's own disk: no limit
            owners.save_weights_for_sampler(f"o{i}").result()
        assert len(listed(c, "owner", owners.model_id)) == 4
    finally:
        second.close("success").result()
        owner.close("success").result()


def test_a_state_gone_from_disk_is_no_longer_listed_and_loading_it_names_its_path(cluster_of: Any) -> None:
    """As when the daemon rotates a job's checkpoints, or the owner deletes one by hand."""
    c = cluster_of
    owner = service(c, "owner")
    try:
        training = owner.create_lora_training_client(base_model=MODEL, rank=8).result()
        early = training.save_state("early").result().path
        training.save_state("late").result()
        record = c.backend.runs[training.model_id].record
        shutil.rmtree(record.states["early"].ckpt_dir)
        assert listed(c, "owner", training.model_id) == {"weights/late"}
        with pytest.warns(FutureWarning, match="load_state"):
            gone = user_error(training.load_state(early))
        assert f"no saved state at {early} (" in gone and str(c.state) not in gone
        assert not any(isinstance(r, C.RestoreReq) for r in c.daemon.calls)  # refused before the trainer
        training.save_state("early").result()  # the name is free again, in a new directory
    finally:
        owner.close("success").result()


def test_a_datum_past_the_models_context_is_refused_before_the_trainer(cluster_of: Any) -> None:
    c = cluster_of
    owner = service(c, "owner")
    try:
        training = owner.create_lora_training_client(base_model=MODEL, rank=8).result()
        too_long = datum([1] * (CONTEXT + 1), target_tokens=[2] * (CONTEXT + 1))
        refused = user_error(training.forward_backward([too_long], "cross_entropy"))
        assert f"datum 0 has {CONTEXT + 1} tokens, more than the model's context of {CONTEXT}" in refused
        assert not any(isinstance(r, C.ForwardBackwardReq) for r in c.daemon.calls)
        fits = datum([1] * CONTEXT, target_tokens=[2] * CONTEXT)
        assert len(training.forward_backward([fits], "cross_entropy").result().loss_fn_outputs) == 1
    finally:
        owner.close("success").result()


def test_a_lora_rank_out_of_bounds_is_the_users_error(cluster_of: Any) -> None:
    c = cluster_of
    owner = service(c, "owner")
    try:
        for rank, bound in ((257, "<= 256"), (1024, "<= 256"), (0, ">= 1"), (-1, ">= 1")):
            refused = user_error(owner.create_lora_training_client(base_model=MODEL, rank=rank))
            assert f"lora.rank: Expected `int` {bound} (asked for rank {rank})" in refused, refused
        assert c.daemon.submitted == []  # no job was asked for
    finally:
        owner.close("success").result()


def test_room_is_made_from_the_oldest_saves_not_in_use_and_no_more() -> None:
    kept = [Kept("c", 3.0, 100, False), Kept("a", 1.0, 100, True), Kept("b", 2.0, 100, False)]
    assert make_room(kept, Quota(0, 4), 100) == []
    assert make_room(kept, Quota(0, 3), 100) == [kept[2]]  # b, the oldest not in use (a is)
    assert make_room(kept, Quota(250, 0), 100) == [kept[2], kept[0]]
    assert make_room(kept, Quota(0, 3), 0, new_saves=0) == []  # the new save is among the kept
    with pytest.raises(QuotaFull, match=r"limit of 1 saves \(tinker-saves\): 1 of your 3 saves \(300 B\) are in use"):
        make_room(kept, Quota(0, 1), 100)
