"""Tests of the trainer engine's token-level loss calls (worker/trainer_tokens.py,
worker/tinker_losses.py) with real torch and peft on a tiny random Qwen2.

They assert what a user of the Tinker-style calls relies on: each loss and its gradient are the
ones Tinker documents, checked against an independent transformers + peft model; a
forward_backward changes nothing; an optim_step learns; splitting data over calls changes only
float summation order; a datum's log-probs do not depend on the data beside it; a job's updates
are bit-for-bit those it gets alone; bad input is refused with one line naming the field.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import random_tiny_qwen2
from peft import PeftModel
from test_trainer import assert_exactly_equal
from transformers import AutoModelForCausalLM

from plexctl.common.calls import TOKEN_LOSSES, AdamStep, LossCall, TokenDatum
from plexctl.common.protocol import LoraSpec, TrainBatch, TrainHParams
from worker.errors import BatchError
from worker.tinker_losses import check_call
from worker.trainer import TrainerEngine
from worker.trainer_tokens import padded_width

VOCAB = 64
LORA = LoraSpec(rank=4, alpha=8)
LOSS_CONFIGS: dict[str, dict[str, float]] = {  # narrow cispo clips, so that some tokens are clipped
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {},
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.5},
    "gspo": {"clip_low_threshold": 0.97, "clip_high_threshold": 1.03},
}


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    random_tiny_qwen2(path, vocab_size=VOCAB)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_dir: str) -> TrainerEngine:
    """One engine for the tests that each use their own jobs."""
    return TrainerEngine(model_dir, threads=2)


@pytest.fixture(scope="module")
def split_engine(model_dir: str) -> TrainerEngine:
    """An engine whose micro-batches hold at most 2 data."""
    return TrainerEngine(model_dir, threads=2, micro_batch_rows=2)


def make_data(seed: int, count: int = 4, max_len: int = 20) -> list[TokenDatum]:
    """Data of 3 to ``max_len`` tokens (widths 16 and 32): a prompt of weight 0, a completion of
    weight 1, sampler log-probs near the tiny model's (about -log 64), one advantage per datum."""
    rng = random.Random(seed)
    data = []
    for _ in range(count):
        n = rng.randint(3, max_len)
        sequence = [rng.randrange(1, VOCAB) for _ in range(n + 1)]
        prompt = rng.randint(1, n - 1)
        advantage = rng.gauss(0.0, 1.0)
        data.append(
            TokenDatum(
                tokens=sequence[:-1],
                target_tokens=sequence[1:],
                weights=[0.0] * prompt + [1.0] * (n - prompt),
                logprobs=[-4.2 + rng.uniform(-0.5, 0.5) for _ in range(n)],
                advantages=[advantage] * n,
                sequence_ratio_mask=[0.0] * prompt + [1.0] * (n - prompt),
            )
        )
    return data


def new_job(engine: TrainerEngine, job_id: str, lora: LoraSpec | None = LORA, seed: int = 3) -> None:
    """A job whose adapter is not the identity (lora_B starts at zero), fresh AdamW."""
    engine.ensure_job(job_id, lora, seed)
    if lora is None:
        return
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, tensor in engine.adapter_state_dict(job_id).items():
            if "lora_B" in key:
                tensor.normal_(0.0, 0.05, generator=generator)


def hand_loss(loss_fn: str, config: Mapping[str, float], tlp: torch.Tensor, datum: TokenDatum) -> torch.Tensor:
    """The loss as Tinker's documentation writes it."""
    slp = torch.tensor(datum.logprobs or [])
    adv = torch.tensor(datum.advantages or [])
    ratio = torch.exp(tlp - slp)
    if loss_fn == "cross_entropy":
        return (-tlp * torch.tensor(datum.weights or [])).sum()
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    if loss_fn == "ppo":
        clipped = torch.clamp(ratio, config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2))
        return -torch.min(ratio * adv, clipped * adv).sum()
    if loss_fn == "cispo":
        clipped = torch.clamp(ratio, config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0))
        return -(clipped.detach() * tlp * adv).sum()
    if loss_fn == "gspo":  # GSPO-token: s's value, each token's own gradient, PPO's clip
        mask = torch.tensor(datum.sequence_ratio_mask or []) != 0
        s = torch.exp((tlp - slp)[mask].mean()).detach()
        token = s * torch.exp(tlp - tlp.detach())
        clipped = torch.clamp(token, config["clip_low_threshold"], config["clip_high_threshold"])
        return -torch.min(token * adv, clipped * adv).sum()
    assert loss_fn == "dro"
    return -(tlp * adv - 0.5 * config["beta"] * (tlp - slp) ** 2).sum()


def reference_logprobs(model: torch.nn.Module, datum: TokenDatum) -> torch.Tensor:
    """log p(target_tokens[i] | tokens[: i + 1]) from the model's full logits, one datum, no padding."""
    logits = model(input_ids=torch.tensor([datum.tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(datum.target_tokens).unsqueeze(-1)).squeeze(-1)


def job_state(engine: TrainerEngine, job_id: str) -> dict[str, Any]:
    """Copies of everything a call could change: weights, AdamW state and hyper-parameters, RNG."""
    job = engine._job(job_id)
    optimizer = job.optimizer.state_dict()
    return {
        "weights": {key: t.detach().clone() for key, t in job.params.items()},
        "optimizer": {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]],
        "rng": {name: t.clone() for name, t in job.rng_state.items()},
    }


def gradients_from_moments(engine: TrainerEngine, job_id: str, beta1: float) -> dict[str, torch.Tensor]:
    """The gradient of a job's first AdamW step: its first moment is (1 - beta1) x the gradient."""
    job = engine._job(job_id)
    return {key: job.optimizer.state[p]["exp_avg"] / (1.0 - beta1) for key, p in job.params.items()}


def cross_entropy(engine: TrainerEngine, job_id: str, data: list[TokenDatum]) -> float:
    return engine.forward_backward(job_id, LossCall(data, "cross_entropy")).loss


def without_seconds(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k != "seconds:sum"}


# ---------------------------------------------------------------- the losses


@pytest.mark.parametrize("loss_fn", TOKEN_LOSSES)
def test_loss_and_gradient_are_the_documented_ones(
    engine: TrainerEngine, model_dir: str, tmp_path: Path, loss_fn: str
) -> None:
    """Log-probs, loss and gradient against a separate peft model and the documented formulas."""
    job_id = f"hand-{loss_fn}"
    new_job(engine, job_id)
    engine.save_adapter(job_id, str(tmp_path / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(tmp_path / "adapter"), is_trainable=True)
    reference.eval()
    config = LOSS_CONFIGS[loss_fn]
    call = LossCall(make_data(1, count=5), loss_fn, config)

    result = engine.forward_backward(job_id, call)
    expected = [reference_logprobs(reference, datum) for datum in call.data]
    expected_loss = sum(hand_loss(loss_fn, config, tlp, datum) for tlp, datum in zip(expected, call.data))
    assert isinstance(expected_loss, torch.Tensor)
    own_loss = sum(float(hand_loss(loss_fn, config, torch.tensor(lp), d)) for lp, d in zip(result.logprobs, call.data))

    assert [len(lp) for lp in result.logprobs] == [len(d.tokens) for d in call.data]
    for got, want in zip(result.logprobs, expected):
        assert got == pytest.approx(want.tolist(), abs=1e-5)
    assert result.loss == pytest.approx(own_loss, rel=1e-6, abs=1e-6)
    # The loss agrees as closely as the log-probs do: their 1e-5, weighted by how much each moves it.
    sensitivity = 0.0
    for lp, datum in zip(result.logprobs, call.data):
        probe = torch.tensor(lp, requires_grad=True)
        hand_loss(loss_fn, config, probe, datum).backward()
        assert probe.grad is not None
        sensitivity += float(probe.grad.abs().sum())
    assert result.loss == pytest.approx(expected_loss.item(), rel=1e-6, abs=1e-5 * sensitivity + 1e-6)
    if loss_fn in ("ppo", "cispo"):  # the clip binds somewhere, or the test would not test it
        ratios = torch.cat([torch.exp(tlp.detach() - torch.tensor(d.logprobs)) for tlp, d in zip(expected, call.data)])
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        assert ((ratios < low) | (ratios > high)).any() and ((ratios > low) & (ratios < high)).any()

    expected_loss.backward()
    want_grads = {name.replace(".default", ""): p.grad for name, p in reference.named_parameters() if p.requires_grad}
    metrics = engine.optim_step(job_id, [call], AdamStep(learning_rate=0.0, beta1=0.5)).metrics
    grads = gradients_from_moments(engine, job_id, beta1=0.5)
    assert set(grads) == set(want_grads)
    for key in grads:
        scale = float(want_grads[key].abs().max())  # a sum over tokens: float error grows with it
        torch.testing.assert_close(grads[key], want_grads[key], rtol=1e-4, atol=1e-5 * scale)
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert metrics["loss:sum"] == pytest.approx(result.loss, rel=1e-6, abs=1e-6)
    assert metrics["tokens:sum"] == sum(len(d.tokens) for d in call.data)
    assert all(":" in key for key in metrics)


def test_padded_width_is_fixed_by_the_length_alone() -> None:
    for length in range(1, 3000):
        width = padded_width(length)
        assert length + 1 <= width < length + 1 + max(16, (length + 1) / 4), length
        assert width % 16 == 0 and padded_width(length) == width
        assert padded_width(length, max_tokens=256) <= max(length + 1, 256)
    assert padded_width(127, max_positions=128) == 128 and padded_width(128, max_positions=128) == 128


# ---------------------------------------------------------------- state


@pytest.mark.parametrize("lora", [LoraSpec(rank=4, dropout=0.1), None], ids=["lora-dropout", "full"])
def test_forward_backward_changes_nothing(engine: TrainerEngine, lora: LoraSpec | None) -> None:
    job_id = f"still-{'full' if lora is None else 'lora'}"
    new_job(engine, job_id, lora)
    engine.optim_step(job_id, [LossCall(make_data(2), "cross_entropy")], AdamStep(learning_rate=1e-3))
    before = job_state(engine, job_id)
    base = {name: p.detach().clone() for name, p in engine._base_params.items()}
    global_rng = torch.get_rng_state()
    for loss_fn in TOKEN_LOSSES:
        engine.forward_backward(job_id, LossCall(make_data(3), loss_fn, LOSS_CONFIGS[loss_fn]))
    assert_exactly_equal(before, job_state(engine, job_id), job_id)
    assert_exactly_equal(base, {name: p.detach() for name, p in engine._base_params.items()}, "base")
    assert torch.equal(global_rng, torch.get_rng_state())
    assert all(p.grad is None for p in engine._job(job_id).params.values())
    assert all(p.grad is None and not p.requires_grad for p in engine._base_params.values())


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_optim_step_lowers_the_cross_entropy(engine: TrainerEngine, lora: LoraSpec | None) -> None:
    job_id = f"learn-{'full' if lora is None else 'lora'}"
    new_job(engine, job_id, lora)
    data = make_data(4, count=6)
    before = cross_entropy(engine, job_id, data)
    adam = AdamStep(learning_rate=1e-2 if lora is not None else 1e-3, grad_clip_norm=1.0)
    metrics = engine.optim_step(job_id, [LossCall(data, "cross_entropy")], adam).metrics
    after = cross_entropy(engine, job_id, data)
    assert after < before - 0.1, (before, after)
    assert metrics["loss:sum"] == pytest.approx(before, rel=1e-6)  # the step's forward saw the same weights
    assert metrics["grad_norm:mean"] > 0 and metrics["skipped:max"] == 0.0 and metrics["data:sum"] == 6
    groups = engine._job(job_id).optimizer.param_groups
    assert groups[0]["betas"] == (0.9, 0.999) and groups[0]["eps"] == 1e-8  # AdamStep's for its own step only


def test_two_calls_step_as_one_call_holding_their_data(split_engine: TrainerEngine) -> None:
    """The same gradient up to float summation order, not bit for bit: joined, the odd datum of
    width 16 in the first call shares a micro-batch (of at most 2) with one of the second, so each
    parameter's gradient sums the data's parts in another order. The losses are per datum and
    summed in order, so they are exact."""
    first, second = make_data(5, count=3), make_data(6)
    assert [padded_width(len(d.tokens)) for d in first + second] == [16, 16, 16, 16, 32, 32, 16]
    adam = AdamStep(learning_rate=1e-3, beta1=0.5, eps=1e-6)
    for job_id in ("split", "joined"):
        new_job(split_engine, job_id)
    split = split_engine.optim_step("split", [LossCall(first, "ppo"), LossCall(second, "ppo")], adam).metrics
    joined = split_engine.optim_step("joined", [LossCall(first + second, "ppo")], adam).metrics
    for key in ("loss:sum", "tokens:sum", "data:sum", "skipped:max"):
        assert split[key] == joined[key], key
    assert split["grad_norm:mean"] == pytest.approx(joined["grad_norm:mean"], rel=1e-6)
    grads_split = gradients_from_moments(split_engine, "split", 0.5)
    grads_joined = gradients_from_moments(split_engine, "joined", 0.5)
    for key in grads_split:
        scale = float(grads_joined[key].abs().max())  # float error: a share of the largest part summed
        torch.testing.assert_close(grads_split[key], grads_joined[key], rtol=1e-5, atol=1e-6 * scale)
    weights_joined = split_engine.adapter_state_dict("joined")
    for key, weight in split_engine.adapter_state_dict("split").items():
        torch.testing.assert_close(weight, weights_joined[key], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- determinism and isolation


def test_a_datums_logprobs_do_not_depend_on_the_data_beside_it(split_engine: TrainerEngine) -> None:
    new_job(split_engine, "alone")
    data = make_data(9, count=7, max_len=40)  # widths 16, 32 and 48; pairs of one width share a micro-batch
    alone = [split_engine.forward_backward("alone", LossCall([d], "ppo")) for d in data]
    together = split_engine.forward_backward("alone", LossCall(data, "ppo"))
    backwards = split_engine.forward_backward("alone", LossCall(data[::-1], "ppo"))
    assert len({padded_width(len(d.tokens)) for d in data}) > 1
    assert together.logprobs == [one.logprobs[0] for one in alone]
    assert backwards.logprobs == [one.logprobs[0] for one in alone][::-1]
    assert together.loss == sum(one.loss for one in alone)


def test_interleaved_jobs_get_exactly_the_updates_they_get_alone(model_dir: str) -> None:
    lora_a = LoraSpec(rank=4, alpha=8, dropout=0.1)  # its dropout draws from its own RNG
    calls = [
        [LossCall(make_data(10), "cross_entropy")],
        [LossCall(make_data(11), "ppo"), LossCall(make_data(12), "cispo")],
        [LossCall(make_data(13), "dro", {"beta": 0.1})],
    ]
    adam = AdamStep(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=0.5)

    alone = TrainerEngine(model_dir, threads=2)
    new_job(alone, "A", lora_a, seed=11)
    results_alone = []
    for step in calls:
        results_alone.append(alone.forward_backward("A", step[0]))
        results_alone.append(without_seconds(alone.optim_step("A", step, adam).metrics))

    shared = TrainerEngine(model_dir, threads=2)
    new_job(shared, "B", None, seed=22)  # a full fine-tuning job before A
    shared.optim_step("B", [LossCall(make_data(20), "importance_sampling")], AdamStep(learning_rate=1e-3))
    new_job(shared, "A", lora_a, seed=11)
    new_job(shared, "C", LoraSpec(rank=2, dropout=0.2), seed=33)
    grpo = TrainBatch([[3, 4, 5, 6]], [[0, 1, 1, 1]], [[0.0, -4.0, -4.1, -4.2]], [1.0])
    results_shared = []
    for k, step in enumerate(calls):
        shared.optim_step("C", [LossCall(make_data(30 + k), "ppo")], adam)
        results_shared.append(shared.forward_backward("A", step[0]))
        shared.train_step("C", grpo, TrainHParams(lr=1e-3))
        shared.forward_backward("B", LossCall(make_data(40 + k), "cross_entropy"))
        results_shared.append(without_seconds(shared.optim_step("A", step, adam).metrics))
        shared.optim_step("B", [LossCall(make_data(50 + k), "cross_entropy")], AdamStep(learning_rate=1e-3))
    shared.release("C")

    assert_exactly_equal(job_state(alone, "A"), job_state(shared, "A"), "A")
    assert results_alone == results_shared
    assert all(math.isfinite(r["loss:sum"]) for r in results_alone if isinstance(r, dict))


# ---------------------------------------------------------------- bad input


def good_datum(**fields: Any) -> TokenDatum:
    good: dict[str, Any] = dict(
        tokens=[1, 2, 3], target_tokens=[2, 3, 4], weights=[0.0, 1.0, 1.0], logprobs=[-1.0] * 3, advantages=[1.0] * 3
    )
    return TokenDatum(**{**good, **fields})


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (LossCall([good_datum()], "reinforce"), "loss_fn 'reinforce' is not one of cross_entropy, importance_sampling"),
        (LossCall([good_datum()], "ppo", {"clip": 0.2}), "loss_fn ppo takes clip_low_threshold, clip_high_threshold"),
        (LossCall([good_datum()], "cross_entropy", {"beta": 1.0}), "takes no loss_fn_config; got loss_fn_config beta"),
        (LossCall([good_datum()], "dro"), "loss_fn dro: loss_fn_config beta has no default; give one"),
        (LossCall([good_datum()], "ppo", {"clip_low_threshold": 1.5}), "clip_low_threshold (1.5) is above"),
        (LossCall([], "cross_entropy"), "loss call has no data"),
        (
            LossCall([good_datum(), good_datum(tokens=[], target_tokens=[])], "cross_entropy"),
            "datum 1: tokens is empty",
        ),
        (
            LossCall([good_datum(), good_datum(target_tokens=[2, 3])], "ppo"),
            "datum 1: target_tokens has 2 entries, tokens 3",
        ),
        (
            LossCall([good_datum(), good_datum(weights=None)], "cross_entropy"),
            "datum 1: loss_fn cross_entropy needs weights",
        ),
        (LossCall([good_datum(), good_datum(logprobs=None)], "ppo"), "datum 1: loss_fn ppo needs logprobs"),
        (LossCall([good_datum(), good_datum(advantages=None)], "cispo"), "datum 1: loss_fn cispo needs advantages"),
        (LossCall([good_datum(), good_datum(weights=[1.0])], "ppo"), "datum 1: weights has 1 entries, tokens 3"),
        (
            LossCall([good_datum(), good_datum(logprobs=[-1.0] * 4)], "dro", {"beta": 1}),
            "datum 1: logprobs has 4 entries",
        ),
        (LossCall([good_datum(), good_datum(advantages=[1.0, math.nan, 1.0])], "ppo"), "datum 1: advantages[1] is nan"),
        (
            LossCall([good_datum(), good_datum(tokens=[1, -2, 3])], "ppo"),
            "datum 1: tokens[1] = -2 is outside the vocabulary",
        ),
    ],
)
def test_a_bad_call_is_refused_naming_the_field(call: LossCall, message: str) -> None:
    with pytest.raises(BatchError) as error:
        check_call(call, VOCAB)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_engine_refuses_bad_calls_before_changing_anything(engine: TrainerEngine) -> None:
    new_job(engine, "refused")
    before = job_state(engine, "refused")
    outside = LossCall([good_datum(), good_datum(target_tokens=[2, 3, VOCAB])], "cross_entropy")
    with pytest.raises(BatchError, match=r"^datum 1: target_tokens\[2\] = 64 is outside the vocabulary \(0\.\.63\)$"):
        engine.forward_backward("refused", outside)
    good = LossCall([good_datum()], "cross_entropy")
    with pytest.raises(BatchError, match=r"^calls\[1\]: datum 1: target_tokens\[2\] = 64 is outside"):
        engine.optim_step("refused", [good, outside], AdamStep())
    with pytest.raises(BatchError, match=r"^adam\.beta2 must be finite and in \[0, 1\), got 1\.5$"):
        engine.optim_step("refused", [good], AdamStep(beta2=1.5))
    with pytest.raises(BatchError, match="optim_step has no loss calls"):
        engine.optim_step("refused", [], AdamStep())
    assert_exactly_equal(before, job_state(engine, "refused"))
