"""The Tinker front end as a user of the real SDK (tinker 0.38.0) meets it: a uvicorn server on a
free port, over an in-memory fake backend that computes toy numbers and records what it was asked.
Then the server alone over raw HTTP (ordering, futures, sessions, errors) and the wire conversions
alone, checked against the SDK's own encoders and decoders."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from conftest import json_file

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto import request_conv, response_conv  # noqa: E402

from plexctl.common import calls as C  # noqa: E402
from plexctl.tinker import server as S  # noqa: E402
from plexctl.tinker import wire  # noqa: E402
from plexctl.tinker.backend import (  # noqa: E402
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
from plexctl.tinker.client import full_training_client  # noqa: E402

MODEL = "fake/tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
VOCAB = {"[UNK]": 0, "hello": 1, "world": 2, "the": 3, "</s>": 4}


def f32(x: float) -> float:
    return float(np.float32(x))


class FakeBackend(Backend):
    """Toy numbers: a run has a "weight" w; every token's log-prob is -w - target/1000; each
    optim_step lowers w by learning_rate x the calls since the last step. Samples count up from the
    prompt's last token. Every call is recorded in ``log`` as (method, model or sampler, details)."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, Any]] = []
        self.runs: dict[str, TrainingRun] = {}
        self.weight: dict[str, float] = {}
        self.pending: dict[str, list[C.LossCall]] = {}
        self.saved: dict[str, tuple[CheckpointInfo, str, float]] = {}  # path -> info, model, weight
        self.samplers: dict[str, tuple[Sampler, float]] = {}
        self.ended: list[tuple[str, str]] = []
        self.sample_barrier: threading.Barrier | None = None
        self.capacity: threading.Event | None = None  # set: create_model waits for it, saying why

    def record(self, method: str, key: str, details: Any = None) -> None:
        with self.lock:
            self.log.append((method, key, details))

    def calls(self, method: str, key: str | None = None) -> list[Any]:
        with self.lock:
            return [d for m, k, d in self.log if m == method and key in (None, k)]

    def authenticate(self, api_key: str) -> str | None:
        return KEYS.get(api_key)

    def models(self) -> list[ServedModel]:
        return [ServedModel(MODEL, 128, self.tokenizer_dir)]

    def create_model(
        self, user: str, session_id: str, model_seq_id: int, base_model: str, rank: int | None, seed: int | None
    ) -> TrainingRun:
        if base_model != MODEL:
            raise UserError(f"base model {base_model!r} is not served here")
        if self.capacity is not None:
            say_waiting("its job is queued: every trainer engine holds 8 jobs")
            self.capacity.wait(10)
            say_waiting(None)
        run = TrainingRun(sdk_model_id(session_id, model_seq_id), base_model, rank, self.tokenizer_dir)
        with self.lock:
            self.runs[run.model_id], self.weight[run.model_id], self.pending[run.model_id] = run, 1.0, []
        self.record("create_model", run.model_id, (user, rank, seed))
        return run

    def capacity_note(self) -> str | None:
        if self.capacity is not None and not self.capacity.is_set():
            return "the cluster is full: 1 job(s) wait for room (every trainer engine holds 8 jobs)"
        return None

    def weights_info(self, user: str, path: str) -> TrainingRun:
        if path not in self.saved:
            raise UserError(f"no checkpoint at {path}")
        return self.runs[self.saved[path][1]]

    def forward_backward(self, user: str, model_id: str, call: C.LossCall, forward_only: bool) -> ForwardResult:
        w = self.weight[model_id]
        logprobs = [[-w - t / 1000 for t in d.target_tokens] for d in call.data]
        loss = 0.0
        for d, lp in zip(call.data, logprobs):
            if call.loss_fn == "cross_entropy":
                loss += sum(-x * wt for x, wt in zip(lp, d.weights or []))
            else:
                loss += -sum(math.exp(x - s) * a for x, s, a in zip(lp, d.logprobs or [], d.advantages or []))
        result = ForwardResult(logprobs, loss)
        if not forward_only:
            self.pending[model_id].append(call)
        self.record("forward_backward", model_id, (call, forward_only, result))
        return result

    def optim_step(self, user: str, model_id: str, adam: C.AdamStep) -> dict[str, float]:
        n = len(self.pending[model_id])
        self.weight[model_id] = max(0.01, self.weight[model_id] - adam.learning_rate * n)
        self.pending[model_id] = []
        self.record("optim_step", model_id, adam)
        return {"calls": float(n), "weight": self.weight[model_id]}

    def _save(self, model_id: str, kind: Any, name: str) -> str:
        path = checkpoint_path(model_id, kind, name)
        self.saved[path] = (CheckpointInfo(path, time.time(), 1234), model_id, self.weight[model_id])
        self.record(f"save_{kind}", model_id, path)
        return path

    def save_weights_for_sampler(self, user: str, model_id: str, name: str) -> str:
        return self._save(model_id, "sampler", name)

    def save_state(self, user: str, model_id: str, name: str) -> str:
        return self._save(model_id, "training", name)

    def load_state(self, user: str, model_id: str, path: str, optimizer: bool) -> None:
        if path not in self.saved:
            raise UserError(f"no checkpoint at {path}")
        self.weight[model_id] = self.saved[path][2]
        self.record("load_state", model_id, (path, optimizer))

    def _new_sampler(self, base_model: str, path: str | None, weight: float) -> Sampler:
        with self.lock:
            sampler = Sampler(f"smp-{len(self.samplers)}", base_model, path, self.tokenizer_dir)
            self.samplers[sampler.sampler_id] = (sampler, weight)
        return sampler

    def create_sampler(self, user: str, session_id: str, model_path: str | None, base_model: str | None) -> Sampler:
        if model_path is not None:
            if model_path not in self.saved:
                raise UserError(f"no checkpoint at {model_path}")
            info, model_id, weight = self.saved[model_path]
            return self._new_sampler(self.runs[model_id].base_model, model_path, weight)
        return self._new_sampler(base_model or MODEL, None, 1.0)

    def sampler_for_weights(self, user: str, model_id: str, seq: int) -> Sampler:
        self.record("sampler_for_weights", model_id, seq)
        return self._new_sampler(self.runs[model_id].base_model, None, self.weight[model_id])

    def sample(
        self,
        user: str,
        sampler_id: str,
        prompt_tokens: list[int],
        num_samples: int,
        params: SampleParams,
        lp: bool,
        topk: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> SampleResult:
        """Prompt log-probs count up from -1.5 by 0.25; the top k at position p are tokens p+1..p+k
        at log-probs -0.5, -1, ...; a sampled token's top k are itself and the next ones at -0.25, -0.5, ..."""
        self.record("sample", sampler_id, (prompt_tokens, num_samples, params, lp))
        if self.sample_barrier is not None:
            self.sample_barrier.wait()
        weight = self.samplers[sampler_id][1]
        n = params.max_tokens or 4
        seqs = []
        for i in range(num_samples):
            tokens = [prompt_tokens[-1] + i * 10 + k + 1 for k in range(n)]
            rows = [[(t + j, -0.25 * (j + 1)) for j in range(topk_sample_logprobs)] for t in tokens]
            seqs.append(SampledSequence(tokens, [-weight] * n, "length", rows if topk_sample_logprobs else None))
        prompt = [None, *[-1.5 + 0.25 * k for k in range(len(prompt_tokens) - 1)]] if lp else None
        rows: list[list[tuple[int, float]] | None] = [None]
        rows += [[(p + j + 1, -0.5 * (j + 1)) for j in range(topk)] for p in range(1, len(prompt_tokens))]
        return SampleResult(seqs, prompt, rows if topk else None)

    def list_checkpoints(self, user: str, model_id: str) -> list[CheckpointInfo]:
        return [info for info, mid, _ in self.saved.values() if mid == model_id]

    def end_session(self, user: str, session_id: str) -> None:
        with self.lock:
            self.ended.append((user, session_id))


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = tmp_path_factory.mktemp("tokenizer") / "fake-tiny"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def served(tokenizer_dir: Path) -> Iterator[tuple[str, FakeBackend]]:
    """The app on a free port, in a thread; the SDK's telemetry off, the hub offline."""
    backend = FakeBackend(str(tokenizer_dir))
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(
        S.create_app(backend, max_workers=16), log_level="warning", access_log=False, timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        mp.setenv("HF_HUB_OFFLINE", "1")
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", backend
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def alice(served: tuple[str, FakeBackend]) -> Iterator[Any]:
    client = tinker.ServiceClient(base_url=served[0], api_key="tml-alice")
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def trainer(alice: Any) -> Any:
    return alice.create_lora_training_client(base_model=MODEL, rank=8).result()


@pytest.fixture
def backend(served: tuple[str, FakeBackend]) -> FakeBackend:
    return served[1]


def datum(tokens: list[int], **inputs: Any) -> Any:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def ce_datum(start: int, n: int = 2) -> Any:
    return datum(list(range(start, start + n)), target_tokens=list(range(start + 1, start + n + 1)))


# ---------------------------------------------------------------- the SDK, end to end


def test_a_training_client_gets_its_model_and_an_offline_tokenizer(served: Any, trainer: Any) -> None:
    caps = tinker.RestClient(base_url=served[0], api_key="tml-alice").get_server_capabilities().result()
    assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [(MODEL, 128)]
    assert re.fullmatch(r"s-[0-9a-f]{16}:train:0", trainer.model_id)
    info = trainer.get_info()  # the model by its directory: the name its samplers load their tokenizer by
    assert (info.model_data.model_name, info.lora_rank, info.is_lora) == (served[1].tokenizer_dir, 8, True)
    assert trainer.get_tokenizer().encode("hello world the", add_special_tokens=False) == [1, 2, 3]


def test_a_client_without_lora_config_trains_every_weight(served: Any, alice: Any, backend: FakeBackend) -> None:
    training = full_training_client(alice, MODEL)
    assert backend.calls("create_model", training.model_id) == [("alice", None, None)]
    info = training.get_info()
    assert (info.model_data.model_name, info.lora_rank, info.is_lora) == (backend.tokenizer_dir, None, False)
    rest = tinker.RestClient(base_url=served[0], api_key="tml-alice")
    assert rest.get_training_run(training.model_id).result().is_lora is False
    fb = training.forward_backward([ce_datum(1)], "cross_entropy").result()
    assert len(fb.loss_fn_outputs) == 1


def test_cross_entropy_returns_the_backends_logprobs_and_loss(trainer: Any, backend: FakeBackend) -> None:
    out = trainer.forward_backward(
        [datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[0.0, 1.0, 0.3]), datum([5, 6], target_tokens=[6, 7])],
        "cross_entropy",
    ).result()
    call, forward_only, result = backend.calls("forward_backward", trainer.model_id)[-1]
    assert not forward_only and call.loss_fn == "cross_entropy" and call.loss_fn_config == {}
    assert call.data == [
        C.TokenDatum([1, 2, 3], [2, 3, 4], [0.0, 1.0, f32(0.3)]),
        C.TokenDatum([5, 6], [6, 7], [1.0, 1.0]),  # weights default to 1
    ]
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[f32(x) for x in r] for r in result.logprobs]
    assert out.metrics == {"loss:sum": result.loss}


def test_importance_sampling_and_ppo_get_the_clients_floats(trainer: Any, backend: FakeBackend) -> None:
    d = datum([1, 2], target_tokens=[2, 3], logprobs=[-1.1, -0.3], advantages=[0.7, -2.0])
    out = trainer.forward_backward([d], "importance_sampling").result()
    call, _, result = backend.calls("forward_backward", trainer.model_id)[-1]
    assert call.data == [C.TokenDatum([1, 2], [2, 3], None, [f32(-1.1), f32(-0.3)], [f32(0.7), -2.0])]
    assert out.metrics["loss:sum"] == result.loss
    trainer.forward_backward([d], "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.25}).result()
    call, _, _ = backend.calls("forward_backward", trainer.model_id)[-1]
    assert (call.loss_fn, call.loss_fn_config) == ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.25})


def test_optim_step_gets_the_adam_params_and_lowers_the_loss(trainer: Any, backend: FakeBackend) -> None:
    d = ce_datum(1)
    before = trainer.forward([d], "cross_entropy").result().metrics["loss:sum"]
    assert backend.calls("forward_backward", trainer.model_id)[-1][1]  # forward_only
    trainer.forward_backward([d], "cross_entropy").result()
    adam = types.AdamParams(learning_rate=0.05, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)
    step = trainer.optim_step(adam).result()
    assert backend.calls("optim_step", trainer.model_id)[-1] == C.AdamStep(0.05, 0.8, 0.99, 1e-8, 0.01, 1.0)
    assert step.metrics is not None and step.metrics["calls"] >= 1
    after = trainer.forward([d], "cross_entropy").result().metrics["loss:sum"]
    assert after < before


def test_requests_sent_without_waiting_run_in_their_order(trainer: Any, backend: FakeBackend) -> None:
    trainer.optim_step(types.AdamParams(learning_rate=0.0)).result()  # nothing pending from before
    seen = len(backend.log)
    futures = [trainer.forward_backward([ce_datum(10 * i)], "cross_entropy") for i in range(1, 6)]
    step = trainer.optim_step(types.AdamParams(learning_rate=0.01))
    assert [len(f.result().loss_fn_outputs) for f in futures] == [1] * 5
    assert step.result().metrics == {"calls": 5.0, "weight": pytest.approx(backend.weight[trainer.model_id])}
    mine = [(m, d) for m, k, d in backend.log[seen:] if k == trainer.model_id]
    assert [m for m, _ in mine] == ["forward_backward"] * 5 + ["optim_step"]
    assert [d[0].data[0].tokens[0] for _, d in mine[:5]] == [10, 20, 30, 40, 50]


def test_chunks_sent_out_of_order_run_in_order(served: Any, backend: FakeBackend, monkeypatch: Any) -> None:
    monkeypatch.setitem(S.CLIENT_CONFIG, "fwdbwd_max_chunk_len", 2)  # the SDK splits, sends the first chunk last
    arrived: list[int] = []
    submit = S.FrontEnd.submit

    def recording_submit(self: S.FrontEnd, user: str, model_id: str, seq_id: int, job: Any) -> str:
        arrived.append(seq_id)
        return submit(self, user, model_id, seq_id, job)

    monkeypatch.setattr(S.FrontEnd, "submit", recording_submit)
    client = tinker.ServiceClient(base_url=served[0], api_key="tml-alice")
    try:
        tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
        out = tc.forward_backward([ce_datum(100 + 10 * i) for i in range(5)], "cross_entropy").result()
        assert sorted(arrived) == [1, 2, 3] and arrived[-1] == 1  # the first chunk came last
        chunks = [call.data for call, _, _ in backend.calls("forward_backward", tc.model_id)]
        assert [[d.tokens[0] for d in chunk] for chunk in chunks] == [[100, 110], [120, 130], [140]]
        assert [o["logprobs"].tolist()[0] for o in out.loss_fn_outputs] == [
            f32(-1 - (101 + 10 * i) / 1000) for i in range(5)
        ]
        assert out.metrics["loss:sum"] == pytest.approx(
            sum(r.loss for _, _, r in backend.calls("forward_backward", tc.model_id))
        )
    finally:
        client.close("success").result()


def test_sampling_from_saved_weights(alice: Any, trainer: Any, backend: FakeBackend) -> None:
    saved = trainer.save_weights_for_sampler("s1").result()
    assert saved.path == f"tinker://{trainer.model_id}/sampler_weights/s1"
    sampler = alice.create_sampling_client(model_path=saved.path).result()
    assert sampler.get_base_model() == backend.tokenizer_dir  # what it loads its tokenizer by
    params = types.SamplingParams(max_tokens=3, stop=["</s>"], temperature=0.7, seed=5)
    r = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, params, include_prompt_logprobs=True).result()
    weight = backend.saved[saved.path][2]
    assert [s.tokens for s in r.sequences] == [[4, 5, 6], [14, 15, 16]]
    assert [s.logprobs for s in r.sequences] == [[f32(-weight)] * 3] * 2
    assert [s.stop_reason for s in r.sequences] == ["length", "length"]
    assert len({s.sequence_id for s in r.sequences}) == 2
    assert r.prompt_logprobs == [None, -1.5, -1.25]
    tokens, n, got, lp = backend.calls("sample")[-1]
    assert (tokens, n, lp) == ([1, 2, 3], 2, True)
    assert got == SampleParams(max_tokens=3, temperature=0.7, seed=5, stop=["</s>"])
    stopless = sampler.sample(types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=1, stop=[])).result()
    assert stopless.prompt_logprobs is None and backend.calls("sample")[-1][2].ignore_eos


def test_save_weights_and_get_sampling_client(trainer: Any, backend: FakeBackend) -> None:
    sampler = trainer.save_weights_and_get_sampling_client().result()
    assert backend.calls("sampler_for_weights", trainer.model_id)
    r = sampler.sample(types.ModelInput.from_ints([7]), 1, types.SamplingParams(max_tokens=2)).result()
    assert r.sequences[0].tokens == [8, 9]
    assert r.sequences[0].logprobs == [f32(-backend.weight[trainer.model_id])] * 2


def test_samples_of_one_sampler_run_at_once(alice: Any, backend: FakeBackend) -> None:
    sampler = alice.create_sampling_client(base_model=MODEL).result()
    backend.sample_barrier = threading.Barrier(2, timeout=10)  # neither returns until both have started
    try:
        futures = [
            sampler.sample(types.ModelInput.from_ints([t]), 1, types.SamplingParams(max_tokens=1)) for t in (1, 2)
        ]
        assert [f.result().sequences[0].tokens for f in futures] == [[2], [3]]
    finally:
        backend.sample_barrier = None


def test_save_and_load_state_and_a_client_from_state(alice: Any, trainer: Any, backend: FakeBackend) -> None:
    path = trainer.save_state("ck1").result().path
    assert path == f"tinker://{trainer.model_id}/weights/ck1"
    with pytest.warns(FutureWarning, match="load_state"):  # the SDK's deprecation; it still works
        trainer.load_state(path).result()
        trainer.load_state_with_optimizer(path).result()
    assert backend.calls("load_state", trainer.model_id)[-2:] == [(path, False), (path, True)]
    restored = alice.create_training_client_from_state_with_optimizer(path).result()
    assert restored.model_id.split(":")[0] == trainer.model_id.split(":")[0] != restored.model_id
    assert backend.calls("load_state", restored.model_id) == [(path, True)]
    assert restored.get_info().lora_rank == 8
    restored.forward_backward([ce_datum(1)], "cross_entropy").result()


def test_checkpoints_and_runs_through_the_rest_client(served: Any, trainer: Any) -> None:
    trainer.save_state("listed").result()
    trainer.save_weights_for_sampler("listed-s").result()
    rest = tinker.RestClient(base_url=served[0], api_key="tml-alice")
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}
    assert listed["weights/listed"].checkpoint_type == "training"
    assert listed["weights/listed"].tinker_path == f"tinker://{trainer.model_id}/weights/listed"
    assert listed["sampler_weights/listed-s"].checkpoint_type == "sampler"
    assert listed["weights/listed"].size_bytes == 1234
    run = rest.get_training_run(trainer.model_id).result()
    assert (run.model_owner, run.base_model, run.lora_rank) == ("alice", MODEL, 8)
    assert run.last_checkpoint is not None and run.last_sampler_checkpoint is not None
    info = rest.get_weights_info_by_tinker_path(f"tinker://{trainer.model_id}/weights/listed").result()
    assert (info.base_model, info.lora_rank, info.is_lora) == (MODEL, 8, True)


def test_every_samplers_tokenizer_loads_offline_and_at_once(
    served: Any, alice: Any, trainer: Any, monkeypatch: Any
) -> None:
    """The SDK loads a sampler's tokenizer by the base model's name the server reports (get_info,
    get_sampler): the model's directory, so no sampler goes to the hub."""
    from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info

    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    saved = trainer.save_weights_for_sampler("for-tokenizer").result().path
    samplers = {
        "of the current weights": trainer.save_weights_and_get_sampling_client().result(),
        "of saved weights": alice.create_sampling_client(model_path=saved).result(),
        "of the base, by its path": alice.create_sampling_client(base_model=served[1].tokenizer_dir).result(),
    }
    for what, sampler in samplers.items():
        _load_tokenizer_from_model_info.cache_clear()  # the SDK's cache: each loads afresh
        t0 = time.monotonic()
        tokenizer = sampler.get_tokenizer()
        assert time.monotonic() - t0 < 5, what
        ids = tokenizer.encode("hello world", add_special_tokens=False)
        assert ids == [1, 2] and tokenizer.decode(ids) == "hello world", what


def test_rest_lists_each_users_own_runs_checkpoints_and_sessions(served: Any, alice: Any, trainer: Any) -> None:
    trainer.save_state("rest-listed").result()
    bob = tinker.ServiceClient(base_url=served[0], api_key="tml-bob")
    try:
        bobs = bob.create_lora_training_client(base_model=MODEL, rank=4).result()
        bobs.save_weights_for_sampler("bobs").result()
        bob_sampler = bobs.save_weights_and_get_sampling_client().result()
        rest = {who: tinker.RestClient(base_url=served[0], api_key=f"tml-{who}") for who in ("alice", "bob")}
        runs = {who: rest[who].list_training_runs(limit=100).result() for who in rest}
        assert {r.model_owner for r in runs["alice"].training_runs} == {"alice"}
        assert [r.training_run_id for r in runs["bob"].training_runs] == [bobs.model_id]
        assert trainer.model_id in {r.training_run_id for r in runs["alice"].training_runs}
        assert runs["alice"].cursor.total_count == len(runs["alice"].training_runs) > 1
        first = rest["alice"].list_training_runs(limit=1, offset=1).result()
        assert [r.training_run_id for r in first.training_runs] == [runs["alice"].training_runs[1].training_run_id]

        checkpoints = {who: rest[who].list_user_checkpoints().result().checkpoints for who in rest}
        assert [c.tinker_path for c in checkpoints["bob"]] == [f"tinker://{bobs.model_id}/sampler_weights/bobs"]
        mine = [c.tinker_path for c in checkpoints["alice"]]
        assert f"tinker://{trainer.model_id}/weights/rest-listed" in mine
        assert not any(bobs.model_id in p for p in mine)
        assert [c.time for c in checkpoints["alice"]] == sorted((c.time for c in checkpoints["alice"]), reverse=True)

        sessions = {who: rest[who].list_sessions(limit=100).result().sessions for who in rest}
        bob_session = bobs.model_id.split(":")[0]
        assert sessions["bob"] == [bob_session] and bob_session not in sessions["alice"]
        assert trainer.model_id.split(":")[0] in sessions["alice"]
        held = rest["bob"].get_session(bob_session).result()
        assert (held.training_run_ids, held.sampler_ids) == ([bobs.model_id], [bob_sampler._sampling_session_id])
        with pytest.raises(tinker.PermissionDeniedError):
            rest["alice"].get_session(bob_session).result()
    finally:
        bob.close("success").result()


def test_top_k_prompt_logprobs_of_the_last_n_prompt_tokens(alice: Any, backend: FakeBackend) -> None:
    sampler = alice.create_sampling_client(base_model=MODEL).result()
    prompt, params = types.ModelInput.from_ints([1, 2, 3, 4]), types.SamplingParams(max_tokens=1)
    full = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=2).result()
    assert full.prompt_logprobs == [None, -1.5, -1.25, -1.0]
    assert full.topk_prompt_logprobs == [None, [(2, -0.5), (3, -1.0)], [(3, -0.5), (4, -1.0)], [(4, -0.5), (5, -1.0)]]
    last = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3, prompt_logprobs_last_n=2
    ).result()
    assert last.prompt_logprobs == [None, None, -1.25, -1.0]
    assert last.topk_prompt_logprobs == [
        None,
        None,
        [(3, -0.5), (4, -1.0), (5, -1.5)],
        [(4, -0.5), (5, -1.0), (6, -1.5)],
    ]
    topk_only = sampler.sample(prompt, 1, params, topk_prompt_logprobs=1).result()
    assert topk_only.prompt_logprobs is None and topk_only.topk_prompt_logprobs[1] == [(2, -0.5)]
    assert sampler.compute_logprobs(prompt, prompt_logprobs_last_n=1).result() == [None, None, None, -1.0]
    with pytest.raises(tinker.RequestFailedError, match="between 1 and 3"):
        sampler.sample(
            types.ModelInput.from_ints([1, 2, 3, 4]), 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=4
        ).result()


def test_a_wrong_api_key_is_refused(served: Any) -> None:
    import httpx

    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=served[0], api_key="tml-nobody").create_lora_training_client(
            base_model=MODEL, rank=8
        ).result()
    reply = httpx.post(f"{served[0]}/api/v1/client/config", json={}, headers={"X-API-Key": "tml-nobody"})
    assert reply.status_code == 401 and reply.json()["error"] == "API key refused"


def test_another_users_model_is_refused(served: Any, trainer: Any) -> None:
    import httpx

    path = trainer.save_state("mine").result().path
    bob = tinker.ServiceClient(base_url=served[0], api_key="tml-bob")
    try:
        with pytest.raises(tinker.PermissionDeniedError):
            tinker.RestClient(base_url=served[0], api_key="tml-bob").list_checkpoints(trainer.model_id).result()
        with pytest.raises(tinker.PermissionDeniedError):
            bob.create_sampling_client(model_path=path).result()
    finally:
        bob.close("success").result()
    body = {"model_id": trainer.model_id, "seq_id": 10_000, "adam_params": {}}
    reply = httpx.post(f"{served[0]}/api/v1/optim_step", json=body, headers={"X-API-Key": "tml-bob"})
    assert reply.status_code == 403 and "another user" in reply.json()["error"]


def test_an_unsupported_loss_fails_with_its_name(trainer: Any) -> None:
    with pytest.raises(tinker.RequestFailedError) as failed:
        trainer.forward_backward([ce_datum(1)], "stable_reinforce").result()
    assert "'stable_reinforce' is not supported" in str(failed.value)
    assert failed.value.category == types.RequestErrorCategory.User
    assert trainer.forward([ce_datum(1)], "cross_entropy").result().loss_fn_outputs  # the client goes on


def test_a_backend_user_error_reaches_the_sdk(alice: Any) -> None:
    with pytest.raises(tinker.RequestFailedError) as failed:
        alice.create_lora_training_client(base_model="no/such-model", rank=8).result()
    assert "base model 'no/such-model' is not served here" in str(failed.value)
    assert failed.value.category == types.RequestErrorCategory.User


def test_closing_the_service_client_ends_its_session(served: Any, backend: FakeBackend) -> None:
    client = tinker.ServiceClient(base_url=served[0], api_key="tml-alice")
    session_id = client.create_lora_training_client(base_model=MODEL, rank=2).result().model_id.split(":")[0]
    client.close("success").result()
    assert ("alice", session_id) in backend.ended


# ---------------------------------------------------------------- the server over raw HTTP


@pytest.fixture
def raw(tokenizer_dir: Path) -> Iterator[tuple[TestClient, FakeBackend]]:
    backend = FakeBackend(str(tokenizer_dir))
    with TestClient(S.create_app(backend, poll_s=0.2, session_ttl_s=1.0), headers={"X-API-Key": "tml-alice"}) as c:
        yield c, backend


def retrieve(client: TestClient, request_id: str) -> Any:
    for _ in range(50):
        reply = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if reply.status_code != 408:
            return reply
    raise AssertionError("never done")


def new_model(client: TestClient) -> str:
    session_id = client.post("/api/v1/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}}
    request_id = client.post("/api/v1/create_model", json=body).json()["request_id"]
    assert client.post("/api/v1/create_model", json=body).json()["request_id"] == request_id  # a repeat
    return str(retrieve(client, request_id).json()["model_id"])


def test_a_request_waits_for_the_seq_ids_before_it(raw: tuple[TestClient, FakeBackend]) -> None:
    client, backend = raw
    model_id = new_model(client)
    second = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.5}}
    first = {"model_id": model_id, "seq_id": 1, "path": "early"}
    second_id = client.post("/api/v1/optim_step", json=second).json()["request_id"]
    pending = client.post("/api/v1/retrieve_future", json={"request_id": second_id})
    assert pending.status_code == 408 and pending.json() == {"detail": "pending", "queue_state": "active"}
    assert not backend.calls("optim_step")
    assert client.post("/api/v1/optim_step", json=second).json()["request_id"] == second_id  # a retry
    first_id = client.post("/api/v1/save_weights", json=first).json()["request_id"]
    assert retrieve(client, second_id).json() == {"metrics": {"calls": 0.0, "weight": 1.0}, "type": "optim_step"}
    assert retrieve(client, first_id).json()["path"] == f"tinker://{model_id}/weights/early"
    assert [m for m, k, _ in backend.log if k == model_id] == ["create_model", "save_training", "optim_step"]
    assert retrieve(client, second_id).status_code == 200  # results stay
    reused = client.post("/api/v1/optim_step", json={**second, "seq_id": 1})
    assert reused.status_code == 200  # seq_id 1 is remembered: the repeat gets save_weights' id
    assert reused.json()["request_id"] == first_id


def test_a_run_waiting_for_capacity_says_why_until_it_runs(raw: tuple[TestClient, FakeBackend]) -> None:
    """The SDK logs the reason of a "paused_capacity" answer: the user sees why create_model waits."""
    client, backend = raw
    backend.capacity = threading.Event()
    session_id = client.post("/api/v1/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}}
    request_id = client.post("/api/v1/create_model", json=body).json()["request_id"]
    why = {
        "queue_state": "paused_capacity",
        "queue_state_reason": "its job is queued: every trainer engine holds 8 jobs",
    }
    for _ in range(50):
        pending = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if pending.status_code == 200:
            break
        assert pending.json() == {"detail": "pending", "queue_state": "active"}
    # once it waits, a poll is answered "try_again" (the SDK warns of it at its default log level) ...
    assert pending.json() == {"type": "try_again", "request_id": request_id, **why}
    # ... then, for a minute, 408 with the reason (the SDK's queue-state observers get it)
    again = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert again.status_code == 408 and again.json() == {"detail": "pending", **why}
    backend.capacity.set()
    assert retrieve(client, request_id).json()["model_id"] == f"{session_id}:train:0"


# once in many runs the SDK's client process, its session closed and "created" printed, was killed
# by SIGABRT in the interpreter's teardown with nothing on stderr (its own threads, not the server):
# a second run tells that apart from a client that is not told or not served
@pytest.mark.flaky(reruns=1)
def test_a_client_whose_run_waits_for_room_is_told_at_the_sdks_default_log_level(
    served: tuple[str, FakeBackend],
) -> None:
    """A script that configures no logging (the SDK's default: warnings to stderr) is told, as its
    session starts, that the cluster is full and why, and while its training client waits, that its
    request is retried; its run starts once there is room."""
    import subprocess
    import sys

    url, backend = served
    script = (
        "import sys, tinker\n"
        "service = tinker.ServiceClient(base_url=sys.argv[1], api_key='tml-alice')\n"
        "training = service.create_lora_training_client(base_model=sys.argv[2], rank=4).result()\n"
        "print('created', training.model_id, flush=True)\n"
        "service.close('success').result()\n"
    )
    backend.capacity = threading.Event()
    env = {**os.environ, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    env.pop("TINKER_LOG", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, url, MODEL], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while not any("because of try_again" in line for line in seen) and time.monotonic() < deadline:
            seen.append(proc.stderr.readline())
        backend.capacity.set()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        backend.capacity = None
    told = "".join(seen)
    assert "the cluster is full: 1 job(s) wait for room (every trainer engine holds 8 jobs)" in told, told
    assert "because of try_again" in told, told
    assert proc.returncode == 0 and out.startswith("created "), (out, err)


def test_http_errors_have_a_json_line(raw: tuple[TestClient, FakeBackend]) -> None:
    client, _ = raw
    assert client.post("/api/v1/client/config", json={}, headers={"X-API-Key": ""}).json() == {
        "error": "no API key: pass api_key= or set TINKER_API_KEY",
        "category": "user",
    }
    unknown = client.post("/api/v1/retrieve_future", json={"request_id": "nope"})
    assert unknown.status_code == 404 and "unknown request" in unknown.json()["error"]
    malformed = client.post("/api/v1/optim_step", json={"model_id": "m"})
    assert malformed.status_code == 400 and "seq_id" in malformed.json()["error"]
    garbage = client.post("/api/v1/forward_backward", content=b"\xff\xff", headers={"Content-Type": S.PROTO})
    assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["error"]
    assert client.post("/api/v1/client/dynamic_config", json={}).status_code == 404
    assert client.get("/api/v1/healthz", headers={"X-API-Key": ""}).json() == {"status": "ok"}


def test_a_silent_session_ends(raw: tuple[TestClient, FakeBackend]) -> None:
    client, backend = raw
    session_id = client.post("/api/v1/create_session", json={}).json()["session_id"]
    deadline = time.monotonic() + 5
    while ("alice", session_id) not in backend.ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ("alice", session_id) in backend.ended
    assert client.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 410


def test_serve_writes_its_ready_file(tmp_path: Path) -> None:
    import subprocess
    import sys

    import httpx

    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, 'tests')\n"
        "from test_tinker_server import FakeBackend\n"
        "from plexctl.tinker.server import serve\n"
        "serve(FakeBackend(''), '127.0.0.1', 0, Path(sys.argv[1]))\n"
    )
    ready = tmp_path / "tinker.json"
    proc = subprocess.Popen([sys.executable, "-c", code, str(ready)], cwd=Path(__file__).parents[1])
    try:
        deadline = time.monotonic() + 30
        while (written := json_file(ready)) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert written is not None, "the front end wrote no tinker.json"
        # where it listens is for every user of the cluster (PUBLIC_FILES), writable by the owner alone
        assert written["pid"] == proc.pid and ready.stat().st_mode & 0o777 == 0o644
        assert httpx.get(f"{written['url']}/api/v1/healthz").json() == {"status": "ok"}
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_front_end_stops_once_its_daemon_is_gone(tmp_path: Path) -> None:
    """A killed daemon leaves no front end holding the cluster's Tinker port for the next one."""
    import signal
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (  # a stand-in daemon: starts the front end as the daemon does, then waits
        "import os, subprocess, sys, time\n"
        "cmd = [sys.executable, '-m', 'plexctl.tinker', '--state-dir', sys.argv[1], '--port', sys.argv[2],"
        " '--parent-pid', str(os.getpid())]\n"
        "print(subprocess.Popen(cmd).pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    repo = Path(__file__).parents[1]
    daemon = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path), str(port)], cwd=repo, stdout=subprocess.PIPE, text=True
    )
    assert daemon.stdout is not None
    front = int(daemon.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while (written := json_file(tmp_path / "tinker.json")) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert written is not None and written["pid"] == front
        daemon.kill()  # SIGKILL: the daemon cannot stop its front end itself
        daemon.wait(10)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{front}").exists() and "Z" not in _proc_state(front) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{front}").exists() or "Z" in _proc_state(front), "the front end outlived its daemon"
    finally:
        daemon.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(front, signal.SIGKILL)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ---------------------------------------------------------------- wire conversions


def proto_body(data: list[Any], loss_fn: str = "cross_entropy", config: dict[str, Any] | None = None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="m",
        seq_id=1,
    )
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def call_of(body: bytes, encoding: str | None = None) -> C.LossCall:
    return wire.loss_call(wire.parse_forward_backward(body, encoding))


def test_a_zstd_request_with_sparse_inputs_and_config() -> None:
    import zstandard

    weights = types.TensorData(
        data=np.array([0.5, 2.0], np.float32),
        dtype="float32",
        shape=[4, 1],
        sparse_crow_indices=[0, 1, 1, 2, 2],
        sparse_col_indices=[0, 0],
    )
    chunks = [types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3, 4])]
    d = types.Datum(
        model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": weights}
    )
    body = zstandard.ZstdCompressor().compress(proto_body([d], "cross_entropy"))
    assert call_of(body, "zstd") == C.LossCall([C.TokenDatum([1, 2, 3, 4], [2, 3, 4, 5], [0.5, 0.0, 2.0, 0.0])])
    ppo = datum([1], target_tokens=[2], logprobs=[-1.0], advantages=[1.0])
    assert call_of(proto_body([ppo], "cispo", {"clip_high_threshold": 4})).loss_fn_config == {
        "clip_high_threshold": 4.0
    }


@pytest.mark.parametrize(
    ("data", "loss_fn", "config", "error"),
    [
        (
            [ce_datum(1)],
            "stable_reinforce",
            None,
            "loss 'stable_reinforce' is not supported (supported: cross_entropy, importance_sampling",
        ),
        ([ce_datum(1)], "cross_entropy", {"beta": 1.0}, "'beta' is not used by cross_entropy (it takes none)"),
        ([ce_datum(1)], "dro", {"beta": "x"}, "loss_fn_config 'beta' must be a number"),
        (
            [ce_datum(1)],
            "importance_sampling",
            None,
            "datum 0: importance_sampling needs loss input(s) logprobs, advantages",
        ),
        ([datum([1, 2], target_tokens=[2])], "cross_entropy", None, "has 1 values for 2 tokens"),
        (
            [datum([1], target_tokens=[2], clip_low_threshold=[0.5])],
            "cross_entropy",
            None,
            "loss input 'clip_low_threshold' is not supported",
        ),
        ([datum([1, 2], target_tokens=np.array([[2, 3], [3, 4]]))], "cross_entropy", None, "no top-k targets"),
        (
            [
                types.Datum(
                    model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"x", format="png")]), loss_fn_inputs={}
                )
            ],
            "cross_entropy",
            None,
            "datum 0: image inputs are not supported",
        ),
    ],
)
def test_requests_refused_with_one_line(data: list[Any], loss_fn: str, config: Any, error: str) -> None:
    with pytest.raises(UserError, match=re.escape(error)):
        call_of(proto_body(data, loss_fn, config))


def test_outputs_decode_in_the_sdk() -> None:
    out = response_conv.deserialize_forward_backward_output(
        wire.forward_backward_output(ForwardResult([[-0.5, -1.25], [-2.0]], 3.75), 2)
    )
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-0.5, -1.25], [-2.0]]
    assert out.metrics == {"loss:sum": 3.75}
    sample = SampleResult([SampledSequence([5, 6], [-0.5, -0.25], "stop")], [None, -1.5])
    resp = response_conv.deserialize_sample_response(wire.sample_response(sample, 1, 2, logprobs=True))
    assert (resp.sequences[0].tokens, resp.sequences[0].logprobs, resp.sequences[0].stop_reason) == (
        [5, 6],
        [-0.5, -0.25],
        "stop",
    )
    assert resp.prompt_logprobs == [None, -1.5]
    with pytest.raises(ValueError, match="2 log-prob rows for 3 data"):
        wire.forward_backward_output(ForwardResult([[0.0], [0.0]], 0.0), 3)


def test_sampling_params_and_checkpoint_paths() -> None:
    assert wire.sample_params(wire.SamplingParamsWire(stop="\n")).stop == ["\n"]
    assert wire.sample_params(wire.SamplingParamsWire(stop=[7, 8])).stop_token_ids == [7, 8]
    assert not wire.sample_params(wire.SamplingParamsWire()).ignore_eos
    with pytest.raises(UserError, match="mixes strings and token ids"):
        wire.sample_params(wire.SamplingParamsWire(stop=["a", 1]))
    req = msgspec.json.decode(
        b'{"prompt":{"chunks":[]},"sampling_params":{},"prompt_alt_tokens_k":3}', type=wire.SampleReq
    )
    with pytest.raises(UserError, match="not supported: prompt_alt_tokens_k"):
        wire.check_sample_request(req, 4)
    for extra, error in (
        ('"topk_prompt_logprobs":21', "topk_prompt_logprobs must be between 0 and 20, not 21"),
        ('"topk_sample_logprobs":-1', "topk_sample_logprobs must be between 0 and 20, not -1"),
        ('"prompt_logprobs_last_n":2', "set include_prompt_logprobs"),
        ('"prompt_logprobs":true,"prompt_logprobs_last_n":4', "between 1 and 3 (the prompt's length - 1)"),
    ):
        body = b'{"prompt":{"chunks":[]},"sampling_params":{},' + extra.encode() + b"}"
        with pytest.raises(UserError, match=re.escape(error)):
            wire.check_sample_request(msgspec.json.decode(body, type=wire.SampleReq), 4)
    parsed = parse_checkpoint_path("tinker://s-1:train:0/sampler_weights/step-3")
    assert (parsed.model_id, parsed.kind, parsed.name) == ("s-1:train:0", "sampler", "step-3")
    for bad in ("tinker://m/weights", "tinker://m/other/x", "file://m/weights/x"):
        with pytest.raises(UserError, match="not a checkpoint path"):
            parse_checkpoint_path(bad)
    with pytest.raises(UserError, match="must be non-empty, without '/'"):
        checkpoint_path("m", "training", "a/b")


# ---------------------------------------------------------------- hostile input


def test_hostile_bodies_on_every_route_get_a_json_error_and_the_server_goes_on(tokenizer_dir: Path) -> None:
    import random

    backend = FakeBackend(str(tokenizer_dir))
    app = S.create_app(backend, poll_s=0.2, session_ttl_s=60.0, max_body_bytes=64 << 10)
    routes = sorted(r.path for r in app.routes if "POST" in getattr(r, "methods", ()))
    assert len(routes) > 15
    rng = random.Random(0)
    bodies = [
        b"",
        b"{",
        b"null",
        b"[]",
        b"42",
        b'"x"',
        b"[" * 5000 + b"]" * 5000,
        json.dumps({"model_id": 7, "seq_id": "one", "session_id": [], "request_id": {"a": 1}}).encode(),
        json.dumps({"model_id": "tml-alice", "seq_id": -1, "path": "tinker://someone-else/weights/x"}).encode(),
        bytes(rng.randrange(256) for _ in range(512)),
        b'{"a": "' + b"x" * (70 << 10) + b'"}',  # over the limit
    ]
    with TestClient(app, headers={"X-API-Key": "tml-alice"}) as client:
        for route in routes:
            for body in bodies:
                for content_type in ("application/json", S.PROTO):
                    reply = client.post(route, content=body, headers={"Content-Type": content_type})
                    assert 400 <= reply.status_code < 500 or reply.status_code == 200, (route, body[:40], reply.text)
                    if reply.status_code != 200:
                        assert set(reply.json()) >= {"error"} or reply.status_code == 408, (route, reply.text)
        big = client.post("/api/v1/optim_step", content=b'{"a": "' + b"x" * (70 << 10) + b'"}')
        assert big.status_code == 413 and "limit" in big.json()["error"]
        assert client.post("/api/v1/no_such_route", json={}).status_code == 404
        assert new_model(client)  # still serving


def test_a_zstd_bomb_is_refused_without_inflating_it() -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (8 << 20))  # 8 MiB of zeros in a few hundred bytes
    assert len(bomb) < 4096
    with pytest.raises(wire.TooLarge, match="once decompressed"):
        wire.parse_forward_backward(bomb, "zstd", max_bytes=1 << 20)


def test_another_users_future_is_not_theirs(raw: tuple[TestClient, FakeBackend]) -> None:
    client, _ = raw
    model_id = new_model(client)
    request_id = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1}).json()["request_id"]
    as_bob = client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": "tml-bob"})
    assert as_bob.status_code in (403, 404) and "error" in as_bob.json()
    assert retrieve(client, request_id).status_code == 200  # alice's is still hers


def test_a_restarted_server_takes_back_the_runs_its_backend_holds(tokenizer_dir: Path) -> None:
    """After a restart the SDK's clients go on: their runs and sessions are taken back, a model's
    count resumes at the first seq_ids that come (in any order), lost requests are said."""
    backend = FakeBackend(str(tokenizer_dir))
    session_id = "s-0123456789abcdef"
    run = backend.create_model("alice", session_id, 0, MODEL, 4, None)
    backend.known_runs = lambda: [("alice", run)]  # type: ignore[method-assign]
    with TestClient(S.create_app(backend, poll_s=0.2), headers={"X-API-Key": "tml-alice"}) as client:
        later = {"model_id": run.model_id, "seq_id": 42, "adam_params": {"learning_rate": 0.5}}
        earlier = {"model_id": run.model_id, "seq_id": 41, "path": "after-restart"}
        later_id = client.post("/api/v1/optim_step", json=later).json()["request_id"]
        earlier_id = client.post("/api/v1/save_weights", json=earlier).json()["request_id"]
        assert retrieve(client, later_id).json()["type"] == "optim_step"
        assert retrieve(client, earlier_id).json()["path"] == f"tinker://{run.model_id}/weights/after-restart"
        assert [m for m, k, _ in backend.log if k == run.model_id] == ["create_model", "save_training", "optim_step"]
        assert client.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
        bob = {"X-API-Key": "tml-bob"}
        assert client.post("/api/v1/session_heartbeat", json={"session_id": session_id}, headers=bob).status_code == 403
        assert client.post("/api/v1/optim_step", json={**later, "seq_id": 43}, headers=bob).status_code == 403
        lost_sample = client.post("/api/v1/retrieve_future", json={"request_id": f"{S.SAMPLE_ID_PREFIX}{'0' * 32}"})
        assert lost_sample.status_code == 410  # the SDK's sampler sends it again
        lost = client.post("/api/v1/retrieve_future", json={"request_id": "0" * 32})
        assert lost.status_code == 404 and "restarted" in lost.json()["error"]


def test_sixteen_sdk_clients_at_once_each_get_exactly_their_own_updates(served: Any, backend: FakeBackend) -> None:
    """The HTTP counterpart of the socket's load test: 16 users' SDK clients, each training and
    sampling with requests in flight together; every update lands once, in order, on its own run."""
    url, _ = served
    rounds, lr = 6, 0.01
    errors: list[BaseException] = []
    runs: dict[int, tuple[str, list[float]]] = {}

    def client(i: int) -> None:
        try:
            service = tinker.ServiceClient(base_url=url, api_key="tml-alice" if i % 2 else "tml-bob")
            training = service.create_lora_training_client(base_model=MODEL, rank=8).result()
            losses = []
            for r in range(rounds):
                fbs = [training.forward_backward([ce_datum(100 * i + 10 * r + k)], "cross_entropy") for k in range(3)]
                step = training.optim_step(types.AdamParams(learning_rate=lr))
                assert [len(f.result().loss_fn_outputs) for f in fbs] == [1, 1, 1]
                assert step.result().metrics["calls"] == 3.0
                losses.append(training.forward([ce_datum(0)], "cross_entropy").result().metrics["loss:sum"])
                sampler = training.save_weights_and_get_sampling_client().result()
                prompt = types.ModelInput.from_ints([i, r])
                out = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=2))
                assert len(out.result().sequences) == 2
            runs[i] = (training.model_id, losses)
            service.close("success").result()
        except BaseException as e:  # noqa: BLE001 - reported below, with the others
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(runs) == 16 and len({m for m, _ in runs.values()}) == 16
    for i, (model_id, losses) in runs.items():
        # each optim_step lowered the run's weight by lr x its 3 calls, once: no other run's, no repeat
        weights = [1.0 - lr * 3 * (r + 1) for r in range(rounds)]
        assert losses == pytest.approx([2 * w + 0.003 for w in weights]), i  # datum 0: targets 1 and 2
        mine = [(m, d) for m, k, d in backend.log if k == model_id and m in ("forward_backward", "optim_step")]
        trained = [m for m, d in mine if m == "optim_step" or not d[1]]  # forward_only calls left out
        assert trained == (["forward_backward"] * 3 + ["optim_step"]) * rounds
        starts = [d[0].data[0].tokens[0] for m, d in mine if m == "forward_backward" and not d[1]]
        assert starts == [100 * i + 10 * r + k for r in range(rounds) for k in range(3)]  # in the order sent


def test_forward_backward_custom_sends_the_gradient_of_the_clients_loss(trainer: Any, backend: FakeBackend) -> None:
    """The SDK computes a custom loss on the client: a forward, then a cross-entropy backward
    whose weights are -dLoss/dlogprob; the server runs both in order and the step uses them."""
    import torch

    trainer.optim_step(types.AdamParams(learning_rate=0.0)).result()  # nothing pending from before
    seen = len(backend.log)
    d = ce_datum(20, 3)

    def squared(data: list[Any], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        loss = sum((lp**2).sum() for lp in logprobs)
        return loss, {"squared": float(loss.detach())}

    out = trainer.forward_backward_custom([d], squared).result()
    mine = [(m, det) for m, k, det in backend.log[seen:] if k == trainer.model_id]
    assert [m for m, _ in mine] == ["forward_backward", "forward_backward"]
    (_, forward_only, result), (backward, backward_only, _) = mine[0][1], mine[1][1]
    assert forward_only and not backward_only and backward.loss_fn == "cross_entropy"
    logprobs = torch.tensor(result.logprobs[0])
    assert backward.data[0].weights == pytest.approx((-2 * logprobs).tolist())  # -d(sum lp^2)/d lp
    assert out.metrics["squared"] == pytest.approx(float((logprobs**2).sum()))
    assert trainer.optim_step(types.AdamParams(learning_rate=0.01)).result().metrics["calls"] == 1.0


# ---------------------------------------------------------------- the proxy: an address that stays


@contextlib.contextmanager
def listening(app: Any) -> Iterator[tuple[str, Any]]:
    """``app`` served by uvicorn on a free port, in a thread, until the block ends."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_the_proxy_follows_the_front_end_to_its_new_address(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A client of the proxy's fixed address goes on when the front end moves (a requeue onto
    another node): while none is listed it is told to retry (503), then its calls reach the new one."""
    import httpx

    from plexctl.tinker import proxy

    backend = FakeBackend(str(tokenizer_dir))
    made: list[tuple[str, TrainingRun]] = []
    original = backend.create_model

    def create_model(user: str, *args: Any) -> TrainingRun:
        made.append((user, original(user, *args)))
        return made[-1][1]

    backend.create_model = create_model  # type: ignore[method-assign]
    backend.known_runs = lambda: list(made)  # type: ignore[method-assign]
    ready = tmp_path / "tinker.json"
    with pytest.MonkeyPatch.context() as mp, listening(proxy.create_app(tmp_path, max_body_bytes=1 << 20)) as (url, _):
        mp.setenv("TINKER_TELEMETRY", "0")
        mp.setenv("HF_HUB_OFFLINE", "1")
        away = httpx.post(f"{url}/api/v1/healthz", json={})
        assert away.status_code == 503 and away.headers["x-should-retry"] == "true"
        assert "tinker.json" in away.json()["error"]
        big = httpx.post(f"{url}/api/v1/forward", content=b"x" * (2 << 20), headers={"X-API-Key": "tml-alice"})
        assert big.status_code == 413

        with listening(S.create_app(backend)) as (first, server):
            ready.write_text(json.dumps({"url": first, "pid": os.getpid()}))
            service = tinker.ServiceClient(base_url=url, api_key="tml-alice")
            training = service.create_lora_training_client(base_model=MODEL, rank=8).result()
            training.forward_backward([ce_datum(1)], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=0.5)).result()
        ready.unlink()  # the old front end is gone, the new one not up yet
        assert httpx.post(f"{url}/api/v1/healthz", json={}).status_code == 503
        sent_while_away = training.forward_backward([ce_datum(3)], "cross_entropy")
        time.sleep(1.0)
        with listening(S.create_app(backend)) as (second, _):
            assert second != first
            ready.write_text(json.dumps({"url": second, "pid": os.getpid()}))
            out = sent_while_away.result()
            training.optim_step(types.AdamParams(learning_rate=0.5)).result()
            assert len(out.loss_fn_outputs) == 1
            service.close("success").result()
    assert [m for m, k, _ in backend.log if k == training.model_id] == [
        "create_model",
        "forward_backward",
        "optim_step",
        "forward_backward",
        "optim_step",
    ]


def test_top_k_logprobs_of_each_sampled_token_reach_the_sdk(alice: Any) -> None:
    sampler = alice.create_sampling_client(base_model=MODEL).result()
    prompt, params = types.ModelInput.from_ints([1, 2, 3, 4]), types.SamplingParams(max_tokens=2)
    out = sampler.sample(prompt, 2, params, topk_sample_logprobs=3).result()
    for seq in out.sequences:
        assert seq.topk_logprobs == [[(t + j, -0.25 * (j + 1)) for j in range(3)] for t in seq.tokens]
    plain = sampler.sample(prompt, 1, params).result()
    assert plain.sequences[0].topk_logprobs is None
    with pytest.raises(tinker.RequestFailedError, match="topk_sample_logprobs must be between 0 and 20, not 21"):
        sampler.sample(prompt, 1, params, topk_sample_logprobs=21).result()
