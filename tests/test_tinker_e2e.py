"""The real ``tinker`` SDK (from PyPI) against a local cluster started with ``--tinker-port``.

What a researcher with Tinker code checks: only ``base_url`` and the API key change; a training
client is a PlexRL job of theirs (in ``status``, scheduled with the YAML jobs); cross-entropy
steps lower the loss on a small supervised set; sampling from saved weights gives tokens with
their log-probs; an update made through the Tinker API is bit-identical to the same update made
through ``plexctl.rl``; a wrong key is refused; closing the session ends the job.
"""

from __future__ import annotations

import json
import math
import os
import random
import shlex
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from conftest import Cluster, json_file

tinker = pytest.importorskip("tinker")

from plexctl.common import auth  # noqa: E402
from plexctl.common import calls as C  # noqa: E402
from plexctl.common import protocol as P  # noqa: E402
from plexctl.common.client import current_user  # noqa: E402
from plexctl.common.cluster import read_endpoint  # noqa: E402
from plexctl.rl import JobClient  # noqa: E402
from plexctl.tinker.client import full_training_client  # noqa: E402
from plexctl.tiny_models import all_problems, train_problems  # noqa: E402

STEPS = 6
RL_STEPS = 50
RL_LR = 2e-3
RL_GAIN = 0.005  # the exact expected accuracy's rise; docs/tinker.md has the measured ones


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("plexrl-tinker"), env={"TINKER_TELEMETRY": "0"}).up(
        tiny_model, "--tinker-port", "0"
    )
    yield c
    c.run("down", timeout=120)


@pytest.fixture
def service(cluster: Cluster, monkeypatch_module):
    """A session of the test's own: closed after it, so its runs' jobs end and free the engines'
    places (a trainer engine holds ``jobs_per_engine`` jobs; more wait in the queue)."""
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    key = (cluster.home / "tinker-api-key").read_text().strip()
    monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
    client = tinker.ServiceClient(base_url=url, api_key=key)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def supervised_data(tokenizer, n: int = 32, problems: list | None = None) -> list:
    """'a+b=' -> 'c<eos>': the answer's tokens are the targets, the prompt's weigh 0."""
    out = []
    for p in (problems or train_problems())[:n]:
        prompt = tokenizer(p.prompt)["input_ids"]
        answer = tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        out.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return out


def test_cross_entropy_steps_lower_the_loss_and_the_run_is_a_job(service, cluster: Cluster):
    training = service.create_lora_training_client(base_model="tiny-arith", rank=8).result()
    tokenizer = training.get_tokenizer()
    data = supervised_data(tokenizer)
    losses = []
    for _ in range(STEPS):
        fb = training.forward_backward(data, "cross_entropy").result()
        losses.append(fb.metrics["loss:sum"])
        training.optim_step(tinker.AdamParams(learning_rate=3e-3)).result()
        assert len(fb.loss_fn_outputs) == len(data)
    assert losses[-1] < losses[0] * 0.95, losses
    status = cluster.status()
    jobs = [j for j in status["jobs"] if j["name"].startswith("tinker-")]
    assert [j["state"] for j in jobs] == ["running"] and jobs[0]["user"] == current_user()
    # its client decides how many steps it runs: the steps so far, no invented total
    assert jobs[0]["step"] == STEPS and jobs[0]["steps"] == 0
    row = next(line for line in cluster.run("status", check=True).stdout.splitlines() if jobs[0]["job_id"] in line)
    assert f" {STEPS} " in row and f"{STEPS}/" not in row, row
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    assert status["tinker_url"] == url  # status says where the API is
    assert f"Tinker API: base_url={url}" in cluster.run("status", check=True).stdout

    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tinker.ModelInput.from_ints(tokenizer("3+4=")["input_ids"])
    out = sampler.sample(prompt, num_samples=4, sampling_params=tinker.SamplingParams(max_tokens=3, seed=1)).result()
    assert len(out.sequences) == 4
    for seq in out.sequences:
        assert 1 <= len(seq.tokens) <= 3 and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs)


def test_prompt_logprobs_of_saved_weights_are_those_the_trainer_computes(service, cluster: Cluster):
    training = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=3).result()
    tokenizer = training.get_tokenizer()
    data = supervised_data(tokenizer, 4)
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    tokens = data[0].model_input.to_ints() + [int(data[0].loss_fn_inputs["target_tokens"].tolist()[-1])]
    got = sampler.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result()
    assert len(got) == len(tokens) and got[0] is None
    # the trainer's log-probs of the same tokens under the same weights (forward changes nothing)
    trained = training.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert len(trained) == len(tokens) - 1
    assert max(abs(a - b) for a, b in zip(got[1:], trained)) < 1e-3


def test_an_update_through_the_tinker_api_equals_the_same_update_through_plexctl_rl(service, cluster: Cluster):
    tinker_run = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=5).result()
    other = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=5).result()
    tokenizer = tinker_run.get_tokenizer()
    data = supervised_data(tokenizer, 8)
    probe = supervised_data(tokenizer, 12)[8:]
    tinker_run.forward_backward(data, "cross_entropy").result()
    tinker_run.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    via_tinker = tinker_run.forward(probe, "cross_entropy").result()

    # the second run's job (same seed: the same adapter), driven through plexctl.rl with the same data
    call = C.LossCall([_token_datum(d) for d in data], "cross_entropy")
    endpoint = read_endpoint(cluster.state_dir)  # calls come from the cluster's processes: its internal key
    keys = auth.internal_keys(auth.keys_dir(cluster.state_dir))
    client = JobClient(endpoint.address, _job_of(cluster, other), keys=keys, identity="test:plexctl.rl")
    client.forward_backward(call)
    client.optim_step([call], C.AdamStep(learning_rate=1e-2))
    via_rl = client.forward_backward(C.LossCall([_token_datum(d) for d in probe], "cross_entropy"))
    client.close()
    assert [list(o["logprobs"].tolist()) for o in via_tinker.loss_fn_outputs] == via_rl.logprobs


def _token_datum(d) -> C.TokenDatum:
    return C.TokenDatum(
        tokens=d.model_input.to_ints(),
        target_tokens=[int(x) for x in d.loss_fn_inputs["target_tokens"].tolist()],
        weights=[float(x) for x in d.loss_fn_inputs["weights"].tolist()],
    )


def _job_of(cluster: Cluster, training) -> str:
    runs = json.loads((cluster.state_dir / "tinker" / "runs.json").read_text())
    return runs[training.model_id]["job_id"]


def test_a_base_model_is_sampled_without_a_training_client(cluster: Cluster):
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    key = (cluster.home / "tinker-api-key").read_text().strip()
    service = tinker.ServiceClient(base_url=url, api_key=key)
    # by its path: the SDK loads a sampling client's tokenizer by the name it was given
    path = cluster.status()["engines"][0]["model"]
    base = service.create_sampling_client(base_model=path).result()
    sampler_jobs = [j for j in cluster.status()["jobs"] if j["name"].startswith("tinker-sample-")]
    assert [j["state"] for j in sampler_jobs] == ["running"]  # the user's job that samples the base
    tokenizer = base.get_tokenizer()
    datum = supervised_data(tokenizer, 1)[0]
    tokens = datum.model_input.to_ints() + [int(datum.loss_fn_inputs["target_tokens"].tolist()[-1])]
    got = base.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result()
    out = base.sample(
        tinker.ModelInput.from_ints(tokens[:4]), num_samples=2, sampling_params=tinker.SamplingParams(max_tokens=3)
    ).result()
    assert len(out.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) for s in out.sequences)
    # a fresh adapter changes nothing: the base's log-probs are a new training client's
    fresh = service.create_lora_training_client(base_model="tiny-arith", rank=4).result()
    trained = fresh.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert max(abs(a - b) for a, b in zip(got[1:], trained)) < 1e-3
    service.close("success").result()
    for job in sampler_jobs:
        cluster.wait_for(job["job_id"], lambda j: j["state"] == "succeeded", timeout=60, what="ended with its session")


def test_saved_states_load_into_any_run_of_the_user_with_or_without_the_optimizer(service, cluster: Cluster):
    run = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=11).result()
    data = supervised_data(run.get_tokenizer(), 8)
    adam = tinker.AdamParams(learning_rate=1e-2)

    def step(training) -> float:
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam).result()
        return training.forward(data, "cross_entropy").result().metrics["loss:sum"]

    step(run)
    early = run.save_state("early").result().path
    at_early = run.forward(data, "cross_entropy").result().metrics["loss:sum"]
    after_early = step(run)  # with early's AdamW moments
    step(run)
    run.save_state("late").result()
    rest = service.create_rest_client()
    listed = {c.checkpoint_id for c in rest.list_checkpoints(run.model_id).result().checkpoints}
    assert listed == {"weights/early", "weights/late"}

    # an earlier state of the run, with its optimizer: the same next step as the first time
    run.load_state_with_optimizer(early).result()
    assert run.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_early, rel=1e-6)
    assert step(run) == pytest.approx(after_early, rel=1e-6)
    # weights only: the optimizer starts afresh, so the next step differs
    run.load_state(early).result()
    assert step(run) != pytest.approx(after_early, rel=1e-4)
    # another run of the user's, made from the state (the SDK's create_training_client_from_state)
    other = service.create_training_client_from_state_with_optimizer(early).result()
    assert other.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_early, rel=1e-6)
    assert step(other) == pytest.approx(after_early, rel=1e-6)
    # a state of another rank does not fit: said, nothing changed
    narrow = service.create_lora_training_client(base_model="tiny-arith", rank=4).result()
    before = narrow.forward(data, "cross_entropy").result().metrics["loss:sum"]
    with pytest.raises(Exception, match="rank 8"):
        narrow.load_state(early).result()
    assert narrow.forward(data, "cross_entropy").result().metrics["loss:sum"] == before


def test_a_custom_loss_computed_by_the_sdk_makes_the_update_its_builtin_twin_makes(service):
    """``forward_backward_custom`` with cross-entropy written by hand: the same step as the
    built-in ``cross_entropy`` on a run of the same seed."""
    builtin = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=13).result()
    custom = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=13).result()
    data = supervised_data(builtin.get_tokenizer(), 8)

    def cross_entropy(batch, logprobs):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(batch, logprobs))
        return loss, {}

    adam = tinker.AdamParams(learning_rate=1e-2)
    builtin.forward_backward(data, "cross_entropy").result()
    builtin.optim_step(adam).result()
    custom.forward_backward_custom(data, cross_entropy).result()
    custom.optim_step(adam).result()
    after = [c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (builtin, custom)]
    assert after[1] == pytest.approx(after[0], rel=1e-5)


def test_gspo_makes_the_update_the_documented_formula_makes_through_forward_backward_custom(service):
    """The built-in ``gspo`` (GSPO-token, over ``sequence_ratio_mask``) and the same loss written by
    hand as Tinker documents it, through ``forward_backward_custom``: the same step on runs of one seed."""
    builtin = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=17).result()
    custom = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=17).result()
    plain = supervised_data(builtin.get_tokenizer(), 8)
    forward = builtin.forward(plain, "cross_entropy").result()
    before, sampled = forward.metrics["loss:sum"], forward.loss_fn_outputs
    rng = random.Random(5)
    data = []
    for d, out in zip(plain, sampled):
        weights = d.loss_fn_inputs["weights"].tolist()
        advantage = rng.choice([-1.0, 1.0])
        data.append(
            tinker.Datum(
                model_input=d.model_input,
                loss_fn_inputs={
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "logprobs": [lp + rng.uniform(-0.05, 0.05) for lp in out["logprobs"].tolist()],  # a sampler's
                    "advantages": [advantage * w for w in weights],
                    "sequence_ratio_mask": weights,
                },
            )
        )
    low, high = 0.98, 1.02

    def gspo(batch, logprobs):
        loss = 0.0
        for d, lp in zip(batch, logprobs):
            slp, adv = d.loss_fn_inputs["logprobs"].to_torch(), d.loss_fn_inputs["advantages"].to_torch()
            mask = d.loss_fn_inputs["sequence_ratio_mask"].to_torch() != 0
            token = torch.exp((lp.detach() - slp)[mask].mean()) * torch.exp(lp - lp.detach())
            loss = loss - torch.min(token * adv, torch.clamp(token, low, high) * adv).sum()
        return loss, {}

    adam = tinker.AdamParams(learning_rate=1e-2)
    config = {"clip_low_threshold": low, "clip_high_threshold": high}
    builtin.forward_backward(data, "gspo", loss_fn_config=config).result()
    builtin.optim_step(adam).result()
    custom.forward_backward_custom(data, gspo).result()
    custom.optim_step(adam).result()
    after = [c.forward(plain, "cross_entropy").result().metrics["loss:sum"] for c in (builtin, custom)]
    assert after[0] != pytest.approx(before, rel=1e-6)  # a step was taken: the clip did not drop every token
    # The same step up to summation order. Adam's first step is about lr times each gradient's sign,
    # so a weight whose gradient is near zero may step either way with the kernels a CPU picks
    # (an AVX2 machine: the two losses 7e-5 of the step's change apart); a wrong formula moves many.
    assert abs(after[1] - after[0]) <= 1e-3 * abs(after[0] - before), (before, after)


def test_a_full_fine_tuning_client_trains_every_weight_and_samples_what_it_trained(service, cluster: Cluster):
    """A training client without a LoRA config (``plexctl.tinker.client.full_training_client``):
    its job trains every weight, cross-entropy steps lower the loss, and the sampler of its saved
    weights computes the log-probs the trainer computes for them (the engine serves those weights,
    not the base's)."""
    training = full_training_client(service, "tiny-arith")
    assert training.get_info().lora_rank is None
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    rest = tinker.RestClient(base_url=url, api_key=(cluster.home / "tinker-api-key").read_text().strip())
    assert rest.get_training_run(training.model_id).result().is_lora is False
    jobs = [j for j in cluster.status()["jobs"] if j["name"].startswith("tinker-") and j["state"] == "running"]
    assert any(j["trains"] == P.TRAINS_ALL for j in jobs), jobs
    tokenizer = training.get_tokenizer()
    data = supervised_data(tokenizer, 16)
    losses = []
    for _ in range(4):
        losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(tinker.AdamParams(learning_rate=1e-4)).result()
    assert losses[-1] < losses[0] * 0.95, losses

    sampler = training.save_weights_and_get_sampling_client().result()
    tokens = data[0].model_input.to_ints() + [int(data[0].loss_fn_inputs["target_tokens"].tolist()[-1])]
    got = sampler.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result()
    trained = training.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert max(abs(a - b) for a, b in zip(got[1:], trained)) < 1e-3
    base = service.create_sampling_client(base_model=cluster.status()["engines"][0]["model"]).result()
    untrained = base.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result()
    assert max(abs(a - b) for a, b in zip(got[1:], untrained[1:])) > 1e-2  # not the base's weights

    saved = training.save_state("full").result().path  # every weight and AdamW's moments
    copy = service.create_training_client_from_state_with_optimizer(saved).result()
    assert copy.get_info().lora_rank is None
    loss = [c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (training, copy)]
    assert loss[1] == pytest.approx(loss[0], rel=1e-6)


def test_a_model_or_rank_the_cluster_does_not_serve_is_refused_with_the_reason(service, cluster: Cluster):
    before = {j["job_id"] for j in cluster.status()["jobs"]}
    log = cluster.state_dir / "tinker.log"
    log_at = log.stat().st_size
    with pytest.raises(tinker.TinkerError, match=r"base model 'no/such-model' is not served here \(served: tiny-arith"):
        service.create_lora_training_client(base_model="no/such-model", rank=8).result()
    with pytest.raises(tinker.RequestFailedError) as refused:  # the user's error: one line, what to pass
        service.create_lora_training_client(base_model="tiny-arith", rank=64).result()
    assert refused.value.category == tinker.types.RequestErrorCategory.User
    assert "lora.rank 64: the rollout engines load adapters up to rank 32; " in str(refused.value)
    assert "start the cluster with `plexctl up --max-lora-rank 64`" in str(refused.value)
    for rank, bound in ((257, "<= 256"), (1024, "<= 256"), (0, ">= 1"), (-1, ">= 1")):  # past the spec's bounds
        with pytest.raises(tinker.RequestFailedError) as refused:  # the user's error too, in one line
            service.create_lora_training_client(base_model="tiny-arith", rank=rank).result()
        assert refused.value.category == tinker.types.RequestErrorCategory.User, (rank, refused.value)
        assert f"lora.rank: Expected `int` {bound} (asked for rank {rank})" in str(refused.value)
        assert "\n" not in str(refused.value).strip()
    assert {j["job_id"] for j in cluster.status()["jobs"]} == before  # nothing queued
    assert "Traceback" not in log.read_text()[log_at:]
    # `up --tinker-port` without --max-lora-rank loads the SDK's default rank (32; 16 on CPU otherwise)
    default = service.create_lora_training_client(base_model="tiny-arith").result()
    assert default.get_info().lora_rank == 32
    context = service.get_server_capabilities().supported_models[0].max_context_length  # its positions: 64
    tokens = [1] * (context + 1)
    too_long = tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": tokens})
    with pytest.raises(tinker.RequestFailedError) as refused:  # before it reaches the trainer
        default.forward_backward([too_long], "cross_entropy").result()
    assert refused.value.category == tinker.types.RequestErrorCategory.User
    assert f"datum 0 has {context + 1} tokens, more than the model's context of {context}" in str(refused.value)
    sampler = default.save_weights_and_get_sampling_client().result()
    out = sampler.sample(tinker.ModelInput.from_ints([1, 2]), 1, tinker.SamplingParams(max_tokens=2)).result()
    assert len(out.sequences[0].tokens) >= 1


def test_every_tokenizer_loads_offline_and_samplers_say_their_weights(service, cluster: Cluster, monkeypatch):
    """With the network absent, the tokenizer of a training client and of every kind of sampler
    loads at once (the SDK loads it by the model's directory, which the server reports);
    ``get_sampler`` names a sampler's weights as a ``tinker://`` path that makes a sampler again;
    saved sampler weights are listed with the time they were saved."""
    from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info

    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    training = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=17).result()
    saved = training.save_weights_for_sampler("offline").result().path
    samplers = {
        "of the current weights": training.save_weights_and_get_sampling_client().result(),
        "of saved weights": service.create_sampling_client(model_path=saved).result(),
        "of the base, by its path": service.create_sampling_client(base_model=_model_dir(cluster)).result(),
    }
    loaders = {"training client": training.get_tokenizer, **{k: s.get_tokenizer for k, s in samplers.items()}}
    for what, load in loaders.items():
        _load_tokenizer_from_model_info.cache_clear()  # the SDK's cache: each loads afresh
        t0 = time.monotonic()
        tokenizer = load()
        assert time.monotonic() - t0 < 10, what
        ids = tokenizer("12+7=")["input_ids"]
        assert tokenizer(tokenizer.decode(ids, skip_special_tokens=True))["input_ids"] == ids, what

    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    rest = tinker.RestClient(base_url=url, api_key=(cluster.home / "tinker-api-key").read_text().strip())
    current = rest.get_sampler(samplers["of the current weights"]._sampling_session_id).result()
    assert current.model_path and current.model_path.startswith(f"tinker://{training.model_id}/sampler_weights/")
    assert rest.get_sampler(samplers["of saved weights"]._sampling_session_id).result().model_path == saved
    again = service.create_sampling_client(model_path=current.model_path).result()
    greedy = tinker.SamplingParams(max_tokens=3, temperature=0.0)
    prompt = tinker.ModelInput.from_ints(tokenizer("3+4=")["input_ids"])
    first = samplers["of the current weights"].sample(prompt, 1, greedy).result().sequences[0].tokens
    assert again.sample(prompt, 1, greedy).result().sequences[0].tokens == first  # the same weights
    listed = {c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert abs(listed[saved].time.timestamp() - time.time()) < 600  # not 1970
    assert training.model_id in {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
    assert saved in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}


def _model_dir(cluster: Cluster) -> str:
    return str(cluster.status()["engines"][0]["model"])


def test_top_k_prompt_logprobs_come_from_vllm(service):
    training = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=19).result()
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    tokens = tokenizer("12+7=")["input_ids"]
    prompt, params = tinker.ModelInput.from_ints(tokens), tinker.SamplingParams(max_tokens=1)
    out = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=5).result()
    own, topk = out.prompt_logprobs, out.topk_prompt_logprobs
    assert own[0] is None and topk[0] is None and len(own) == len(topk) == len(tokens)
    assert own == pytest.approx(sampler.compute_logprobs(prompt).result(), abs=1e-4)
    for i in range(1, len(tokens)):
        values = [lp for _, lp in topk[i]]
        assert len(values) == 5 and values == sorted(values, reverse=True) and values[0] >= own[i] - 1e-4
        mine = dict(topk[i]).get(tokens[i])
        assert mine is None or mine == pytest.approx(own[i], abs=1e-4)  # the prompt token, if among them
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4
    last = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=2
    ).result()
    assert last.prompt_logprobs[:-2] == [None] * (len(tokens) - 2)
    assert last.prompt_logprobs[-2:] == pytest.approx(own[-2:], abs=1e-4)
    assert last.topk_prompt_logprobs[:-2] == [None] * (len(tokens) - 2)
    assert [[t for t, _ in row] for row in last.topk_prompt_logprobs[-2:]] == [[t for t, _ in r[:2]] for r in topk[-2:]]
    # the likeliest tokens at each sampled position: greedy, the sampled token is the first of them
    greedy = tinker.SamplingParams(max_tokens=3, temperature=0.0)
    [seq] = sampler.sample(prompt, 1, greedy, topk_sample_logprobs=4).result().sequences
    assert len(seq.topk_logprobs) == len(seq.tokens) >= 1
    for token, logprob, row in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
        values = [lp for _, lp in row]
        assert len(row) == 4 and values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-4
        assert row[0][0] == token and row[0][1] == pytest.approx(logprob, abs=1e-4)


def test_a_wrong_key_is_refused(cluster: Cluster):
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    client = tinker.ServiceClient(base_url=url, api_key="tml-" + "0" * 48)
    with pytest.raises(Exception, match="401|[Aa]uthentic|refused"):
        client.create_lora_training_client(base_model="tiny-arith", rank=8)


def test_tinker_clients_share_the_engines_with_a_yaml_job_and_a_closed_session_ends_its_job(cluster: Cluster):
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    key = (cluster.home / "tinker-api-key").read_text().strip()
    spec = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-arith.yaml")
    yaml_job = cluster.run(
        "submit", spec, "--set", "algo.steps=8", "--set", "checkpoint.every=0", "--name", "beside", "-q", check=True
    ).stdout.strip()
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model="tiny-arith", rank=4).result()
    data = supervised_data(training.get_tokenizer(), 16)
    while cluster.job(yaml_job)["state"] in ("queued", "running"):  # Tinker steps while the YAML job runs
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
    assert cluster.job(yaml_job)["state"] == "succeeded"
    job = _job_of(cluster, training)
    assert cluster.job(job)["state"] == "running"
    service.close("success").result()  # the session ends: so does its job, which succeeded
    cluster.wait_for(job, lambda j: j["state"] == "succeeded", timeout=60, what="its job ended by close()")


def test_a_killed_front_end_is_started_again_and_its_runs_lose_nothing(cluster: Cluster):
    """SIGKILL to the front end alone while a client is mid-run (two optim_steps taken, a
    forward_backward not yet stepped): status stops naming its URL and says it is restarting; the
    daemon starts it again on the same port (the SDK's base_url), and the same client goes on from
    the trainer's live state: its next optim_step steps on the kept forward_backward, and the run
    ends exactly where a run of the same seed never interrupted ends, its job never restarted."""
    from plexctl.common.cluster import tinker_state

    ready = cluster.state_dir / "tinker.json"
    before = json.loads(ready.read_text())
    service = tinker.ServiceClient(
        base_url=before["url"], api_key=(cluster.home / "tinker-api-key").read_text().strip()
    )
    adam = tinker.AdamParams(learning_rate=1e-2)
    known = {j["job_id"] for j in cluster.status()["jobs"]}
    try:
        training = service.create_lora_training_client(base_model="tiny-arith", rank=4, seed=11).result()
        [job_id] = {j["job_id"] for j in cluster.status()["jobs"]} - known
        data = supervised_data(training.get_tokenizer(), 4)
        for _ in range(2):
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(adam).result()
        training.forward_backward(data, "cross_entropy").result()  # not yet stepped when the front end dies

        os.kill(before["pid"], signal.SIGKILL)
        gone_by = time.monotonic() + 10  # SIGKILL is delivered asynchronously: the pid may run a moment
        while (seen := tinker_state(cluster.state_dir))[0] is not None and time.monotonic() < gone_by:
            time.sleep(0.05)
        url, note = seen
        assert url is None and note.startswith("restarting"), (url, note)
        assert "Tinker API: restarting" in cluster.run("status", check=True).stdout.replace("\n", " ")
        notes, deadline = [], time.monotonic() + 90
        while time.monotonic() < deadline:  # every status meanwhile says something of the front end
            shown = cluster.status()
            assert shown.get("tinker_url") or shown.get("tinker_note"), shown
            notes.append(shown.get("tinker_note"))
            now = json_file(ready) or {}
            if now.get("pid") not in (None, before["pid"]) and shown.get("tinker_url"):
                break
        assert all(n.startswith("restarting") for n in notes[:-1]), notes
        assert now.get("url") == before["url"], now  # the same address: the SDK's base_url still holds
        assert cluster.status()["tinker_url"] == before["url"]

        training.optim_step(adam).result()  # the same client: step 3, on the forward_backward sent before
        got = training.forward(data, "cross_entropy").result().metrics["loss:sum"]

        reference = service.create_lora_training_client(base_model="tiny-arith", rank=4, seed=11).result()
        for _ in range(3):
            reference.forward_backward(data, "cross_entropy").result()
            reference.optim_step(adam).result()
        assert got == pytest.approx(reference.forward(data, "cross_entropy").result().metrics["loss:sum"], rel=1e-6)

        job = cluster.job(job_id)
        assert job["state"] == "running" and job["restarts"] == 0 and job["step"] == 3, job
        with sqlite3.connect(cluster.state_dir / "journal.db") as db:
            said = [d for (d,) in db.execute("SELECT detail FROM events WHERE kind='note' AND job_id=?", (job_id,))]
        assert said == []  # nothing lost, nothing to say
    finally:
        service.close("success").result()
    assert "exited with code -9: starting it in 1 s" in (cluster.state_dir / "daemon.log").read_text()


def expected_accuracy(training, tokenizer) -> float:
    """The exact temperature-1 chance of answering each evaluation problem right (its answer's
    tokens and <eos>), from ``forward`` log-probs: no sampling noise."""
    data = supervised_data(tokenizer, len(all_problems()), all_problems())
    out = training.forward(data, "cross_entropy").result()
    total = 0.0
    for datum, o in zip(data, out.loss_fn_outputs):
        weights = datum.loss_fn_inputs["weights"].tolist()
        total += math.exp(sum(lp * w for lp, w in zip(o["logprobs"].tolist(), weights)))
    return total / len(data)


def test_a_cookbook_style_rl_loop_raises_the_evaluation_reward(service):
    """tinker-cookbook's minimal RL loop on the tiny task: sample groups from the latest weights,
    score them, importance-sampling forward_backward on group-centred advantages, optim_step."""
    training = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=7).result()
    tokenizer = training.get_tokenizer()
    rng = random.Random(0)
    problems = train_problems()
    first = expected_accuracy(training, tokenizer)
    for step in range(RL_STEPS):
        sampler = training.save_weights_and_get_sampling_client().result()
        batch = rng.sample(problems, 16)
        prompts = [tokenizer(p.prompt)["input_ids"] for p in batch]
        futures = [
            sampler.sample(
                tinker.ModelInput.from_ints(ids),
                num_samples=8,
                sampling_params=tinker.SamplingParams(max_tokens=4, temperature=1.0, seed=1000 * step + i),
            )
            for i, ids in enumerate(prompts)
        ]
        data = []
        for p, ids, future in zip(batch, prompts, futures):
            seqs = future.result().sequences
            rewards = [float(tokenizer.decode(s.tokens, skip_special_tokens=True).strip() == p.answer) for s in seqs]
            mean = sum(rewards) / len(rewards)
            for seq, reward in zip(seqs, rewards):
                if reward == mean:
                    continue  # no signal in a group that all scored the same
                tokens, pad = ids + list(seq.tokens), len(ids) - 1
                data.append(
                    tinker.Datum(
                        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * pad + list(seq.logprobs),
                            "advantages": [0.0] * pad + [reward - mean] * len(seq.tokens),
                        },
                    )
                )
        if data:
            training.forward_backward(data, "importance_sampling").result()
            training.optim_step(tinker.AdamParams(learning_rate=RL_LR)).result()
    last = expected_accuracy(training, tokenizer)
    assert last > first + RL_GAIN, (first, last)


def test_a_checkpoint_is_given_a_ttl_and_deleted_through_the_sdk(service, cluster: Cluster):
    training = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=23).result()
    rest = service.create_rest_client()
    kept = training.save_state("kept").result().path
    doomed = training.save_weights_for_sampler("doomed").result().path

    def listed() -> dict[str, tinker.types.Checkpoint]:
        return {c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}

    rest.set_checkpoint_ttl_from_tinker_path(kept, 7200).result()
    left = listed()[kept].expires_at.timestamp() - time.time()
    assert 7000 < left <= 7200 and listed()[doomed].expires_at is None
    with pytest.raises(tinker.BadRequestError, match="between 3600 \\(an hour\\) and"):
        rest.set_checkpoint_ttl_from_tinker_path(kept, 60).result()
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()
    assert listed()[kept].expires_at is None

    rest.delete_checkpoint_from_tinker_path(doomed).result()
    assert set(listed()) == {kept}
    assert "deleted by its owner" in (cluster.state_dir / "tinker.log").read_text()
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        rest.delete_checkpoint_from_tinker_path(doomed).result()  # gone already
    # what is left still loads
    training.load_state(kept).result()


def test_published_checkpoints_are_read_by_another_user_until_unpublished(service, cluster: Cluster, tmp_path):
    """publish_checkpoint_from_tinker_path: another user of the cluster (her own key, let in by the
    owner) samples the owner's sampler weights by their path, through the Tinker SDK and the OpenAI
    API, the same tokens the owner gets, and starts a run of her own from the owner's published
    state, its loss the owner's there; once unpublished, neither; she cannot publish them."""
    openai = pytest.importorskip("openai")
    training = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=31).result()
    tokenizer = training.get_tokenizer()
    for _ in range(2):
        training.forward_backward(supervised_data(tokenizer, 8), "cross_entropy").result()
        training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    path = training.save_weights_for_sampler("shared").result().path
    state = training.save_state("shared").result().path
    data = supervised_data(tokenizer, 4)
    owners_loss = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    rest = service.create_rest_client()
    for published in (path, state):
        rest.publish_checkpoint_from_tinker_path(published).result()
    rest.publish_checkpoint_from_tinker_path(path).result()  # again: it is (no 409, which the SDK retries 5 min)
    listed = {c.tinker_path: c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed[path] and listed[state]

    erin = Cluster(tmp_path / "erin-home", env={"TINKER_TELEMETRY": "0", "LOGNAME": "erin", "USER": "erin"})
    line = erin.run("keygen", check=True).stdout.splitlines()[-1]
    share = shlex.split(line.split("run: ", 1)[1])
    cluster.run(*share[1:], check=True)
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    her_key = (erin.home / "tinker-api-key").read_text().strip()
    prompt = tinker.ModelInput.from_ints(tokenizer("3+4=")["input_ids"])
    greedy = tinker.SamplingParams(max_tokens=3, temperature=0.0, seed=1)

    def sampled(client) -> tuple[list[int], list[float]]:
        seq = client.sample(prompt, 1, greedy).result().sequences[0]
        return seq.tokens, seq.logprobs

    theirs = sampled(service.create_sampling_client(model_path=path).result())
    her = tinker.ServiceClient(base_url=url, api_key=her_key)
    try:
        hers = sampled(her.create_sampling_client(model_path=path).result())
        assert hers[0] == theirs[0] and hers[1] == pytest.approx(theirs[1], abs=1e-5)
        api = openai.OpenAI(base_url=url + "/v1", api_key=her_key, max_retries=0)
        assert path in {m.id for m in api.models.list().data}
        chat = api.completions.create(model=path, prompt=[*prompt.to_ints()], max_tokens=3, temperature=0.0, seed=1)
        assert chat.model == path and chat.choices[0].text == tokenizer.decode(theirs[0], skip_special_tokens=True)
        with pytest.raises(tinker.BadRequestError, match="no training run"):
            her.create_rest_client().publish_checkpoint_from_tinker_path(path).result()  # not hers to publish
        her_run = her.create_training_client_from_state(state).result()  # a run of hers, from the owner's state
        assert her_run.model_id != training.model_id
        assert her_run.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            owners_loss, rel=1e-6
        )
        her_run.forward_backward(data, "cross_entropy").result()
        her_run.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()  # hers trains on; the owner's is as it was
        assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            owners_loss, rel=1e-6
        )

        for published in (path, state):
            rest.unpublish_checkpoint_from_tinker_path(published).result()
        listed = {c.tinker_path: c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints}
        assert not listed[path] and not listed[state]
        with pytest.raises(tinker.RequestFailedError, match="belongs to another user"):
            her.create_training_client_from_state(state).result()
        with pytest.raises(tinker.RequestFailedError, match="belongs to another user"):
            her_run.load_state(state).result()
        with pytest.raises(openai.NotFoundError):
            api.completions.create(model=path, prompt=[*prompt.to_ints()], max_tokens=3)
        with pytest.raises(tinker.PermissionDeniedError, match="belongs to another user"):
            her.create_sampling_client(model_path=path).result()
    finally:
        her.close("success").result()


def test_a_samplers_requests_sent_together_are_sampled_side_by_side(service, cluster: Cluster):
    """A sampling client's requests in flight at once (a group per prompt, as the SDK's users send
    them) run side by side on the rollout engine, batched: on the engine timeline their generate
    tasks overlap, where one at a time each would start after the last ended."""
    import itertools

    from plexctl.common.client import Client

    training = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=41).result()
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompts = [tinker.ModelInput.from_ints(tokenizer(f"{a}+2=")["input_ids"]) for a in range(4)]
    params = tinker.SamplingParams(max_tokens=40, stop=[], seed=1)  # no stop, not even at EOS: 40 tokens each
    futures = [sampler.sample(prompt, 4, params) for prompt in prompts]
    assert all(len(f.result().sequences[0].tokens) == 40 for f in futures)
    job = _job_of(cluster, training)
    timeline = Client(read_endpoint(cluster.state_dir).address).status(timeline=True).timeline
    spans = [s for s in timeline if s.job_id == job and s.method == "generate"][-len(prompts) :]
    assert len(spans) == len(prompts)
    assert any(a.start < b.end and b.start < a.end for a, b in itertools.combinations(spans, 2)), spans
