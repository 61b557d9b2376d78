"""Numerics and memory of the trainer engine (worker/trainer.py, worker/token_logprobs.py).

What a user sizing the trainer for a GPU relies on, checked on CPU with tiny random Qwen2s:
chunked log-probs and entropies equal the plain forward's; micro-batches cut by a token budget
give the whole batch's gradient; a 152k-token vocabulary trains without holding its logits (a step's
memory does not grow with the tokens trained); a bf16 engine keeps its adapters
and AdamW state in fp32 and publishes bf16 adapters; gradient checkpointing changes no gradient.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_tiny_qwen2
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from plexctl.common.protocol import LoraSpec, TrainBatch, TrainHParams
from plexctl.common.state_size import job_state_bytes, model_config
from worker.checkpoint_files import ADAPTER_WEIGHTS
from worker.token_logprobs import head_logprobs, token_logprobs
from worker.train_batches import micro_batch_bounds, pad_rows
from worker.trainer import TrainerEngine

REPO = Path(__file__).resolve().parents[1]
VOCAB = 96
LORA = LoraSpec(rank=4, alpha=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny Qwen2 (hidden 128, 2 layers, 2 heads, vocab 96, float32) in HF format."""
    return random_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), vocab_size=VOCAB)


def make_batch(seed: int, rows: int, vocab: int = VOCAB) -> TrainBatch:
    """Ragged rows (4 to 19 tokens): a 2-5 token prompt (mask 0), then the completion (mask 1)."""
    rng = random.Random(seed)
    input_ids, loss_mask, old = [], [], []
    for _ in range(rows):
        prompt, completion = rng.randint(2, 5), rng.randint(2, 14)
        input_ids.append([rng.randrange(1, vocab) for _ in range(prompt + completion)])
        loss_mask.append([0] * prompt + [1] * completion)
        old.append([(-4.5 + rng.uniform(-0.3, 0.3)) * m for m in loss_mask[-1]])
    return TrainBatch(input_ids, loss_mask, old, [rng.gauss(0.0, 1.0) for _ in range(rows)])


def trained_engine(model_dir: str, lora: LoraSpec = LORA, **options: object) -> TrainerEngine:
    """An engine whose job "A" took one step (its lora_B is no longer 0: every gradient flows)."""
    engine = TrainerEngine(model_dir, threads=2, **options)  # type: ignore[arg-type]
    engine.ensure_job("A", lora, seed=5)
    engine.train_step("A", make_batch(1, rows=6), TrainHParams(lr=1e-2))
    return engine


def assert_same_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float) -> None:
    """The gradient (all parameters as one vector) within ``rtol`` of the expected one, relative
    to its norm; each parameter's within 10 x ``rtol`` (fp32 sums in another order: a parameter
    whose gradient is a small sum of cancelling terms keeps a larger relative error)."""
    assert set(got) == set(expected)
    for key, grad in expected.items():
        assert grad.abs().sum() > 0, f"no gradient reaches {key}"
        error = float((got[key] - grad).norm() / grad.norm())
        assert error <= 10 * rtol, f"{key}: relative error {error:.2e}"
    difference = torch.cat([(got[key] - grad).flatten() for key, grad in expected.items()]).norm()
    error = float(difference / torch.cat([grad.flatten() for grad in expected.values()]).norm())
    assert error <= rtol, f"relative error {error:.2e}"


# ---------------------------------------------------------------- chunked log-probs


def plain_logprobs_and_entropy(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch's fp32 log-softmax, as the trainer computed it before chunking."""
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits.float()[:, :-1], dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 8, 10_000])
def test_chunked_logprobs_and_entropy_equal_the_whole_batch_forward(model_dir: str, chunk_tokens: int) -> None:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(
        base, PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )  # a non-zero adapter
    model.eval()
    batch = make_batch(3, rows=5)
    rows = pad_rows(batch.input_ids, batch.loss_mask, torch.device("cpu"))
    assert rows.loss_mask.sum() % 8 != 0 and len(set(rows.lengths)) > 1  # a ragged last chunk, padding

    with torch.no_grad():
        logp, entropy = token_logprobs(
            model, rows.input_ids, rows.attention_mask, rows.loss_mask, chunk_tokens, entropy=True
        )
        expected_logp, expected_entropy = plain_logprobs_and_entropy(model, rows.input_ids, rows.attention_mask)
    assert entropy is not None
    mask = rows.loss_mask
    torch.testing.assert_close(logp[mask], expected_logp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], rtol=0, atol=1e-5)
    assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()

    # and their gradient: the chunks recomputed in the backward give the plain forward's
    weights = torch.randn(mask.shape).where(mask, 0.0)
    (token_logprobs(model, rows.input_ids, rows.attention_mask, mask, chunk_tokens)[0] * weights).sum().backward()
    chunked = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    (plain_logprobs_and_entropy(model, rows.input_ids, rows.attention_mask)[0] * weights).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_same_gradients(chunked, plain, rtol=1e-5)


def test_a_trainable_head_gets_the_plain_gradient_through_its_chunks() -> None:
    """A head that trains itself (no LoRA's frozen linear) is checkpointed chunk by chunk."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, VOCAB)
    hidden = torch.randn(3, 9, 16, requires_grad=True)
    ids = torch.randint(0, VOCAB, (3, 9))
    positions = torch.rand(3, 8) > 0.3
    weights = torch.randn(3, 8)
    (head_logprobs(hidden, head, ids, positions, chunk_tokens=4)[0] * weights).sum().backward()
    chunked = [t.grad.clone() for t in (hidden, head.weight, head.bias)]
    for t in (hidden, head.weight, head.bias):
        t.grad = None
    logp = torch.log_softmax(head(hidden[:, :-1]), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    (logp.where(positions, 0.0) * weights).sum().backward()
    for got, expected in zip(chunked, (hidden.grad, head.weight.grad, head.bias.grad)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_engine_logprobs_in_small_chunks_match_the_base_model(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=2, logprob_chunk_tokens=3)
    engine.ensure_job("A", LORA, seed=1)  # lora_B starts at 0: the policy is the base model
    batch = make_batch(4, rows=4)
    got = engine.logprobs("A", batch.input_ids, batch.loss_mask)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for ids, mask, row in zip(batch.input_ids, batch.loss_mask, got):
        with torch.no_grad():
            logp, _ = plain_logprobs_and_entropy(base, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        expected = [0.0] + [lp if m else 0.0 for lp, m in zip(logp[0].tolist(), mask[1:])]
        assert row == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------- micro-batches by token budget


def test_micro_batches_take_rows_in_order_within_the_token_budget() -> None:
    lengths = [5, 3, 8, 2, 2, 2, 9, 4]
    bounds = micro_batch_bounds(lengths, max_rows=None, max_tokens=16)
    assert bounds == [(0, 2), (2, 4), (4, 6), (6, 7), (7, 8)]
    for start, stop in bounds:
        assert (stop - start) * max(lengths[start:stop]) <= 16
    assert micro_batch_bounds([20, 3, 3], max_rows=None, max_tokens=16) == [(0, 1), (1, 3)]  # a long row alone
    assert micro_batch_bounds(lengths, max_rows=3, max_tokens=None) == [(0, 3), (3, 6), (6, 8)]
    assert micro_batch_bounds(lengths, max_rows=1, max_tokens=100) == [(i, i + 1) for i in range(8)]
    assert micro_batch_bounds(lengths, max_rows=None, max_tokens=None) == [(0, 8)]
    with pytest.raises(ValueError, match="max_tokens"):
        micro_batch_bounds(lengths, max_rows=None, max_tokens=0)


def test_token_budget_micro_batches_give_the_whole_batch_gradient(model_dir: str) -> None:
    budget = 40
    whole = trained_engine(model_dir)
    split = trained_engine(model_dir, micro_batch_tokens=budget)
    batch = make_batch(2, rows=9)
    parts = [stop - start for start, stop in micro_batch_bounds([len(r) for r in batch.input_ids], None, budget)]
    assert len(parts) > 2 and len(set(parts)) > 1, parts  # unequal micro-batches
    for loss_agg in ("token-mean", "seq-mean-token-mean"):
        hp = TrainHParams(lr=1e-3, kl_coef=0.1, loss_agg=loss_agg)
        grads_whole, metrics_whole = whole.loss_gradients("A", batch, hp)
        grads_split, metrics_split = split.loss_gradients("A", batch, hp)
        assert_same_gradients(grads_split, grads_whole, rtol=1e-5)
        assert metrics_split == pytest.approx(metrics_whole, rel=1e-6, abs=1e-7)


# ---------------------------------------------------------------- a real vocabulary, bounded memory

LARGE_VOCAB = 151_936  # Qwen2's
LARGE_ROWS, LARGE_LENGTH = 16, 1024
SHORT_COMPLETION, LONG_COMPLETION = 128, 896  # tokens trained per row


def completion_logits_bytes(completion: int) -> int:
    """What the fp32 logits of a batch's trained tokens alone would take."""
    return LARGE_ROWS * completion * LARGE_VOCAB * 4


_LARGE_VOCAB_STEPS = """
import json, sys
import torch
from plexctl.common.protocol import LoraSpec, TrainBatch, TrainHParams
from worker.trainer import TrainerEngine

def rss(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024

model_dir, rows, length, *completions = (int(a) if a.isdigit() else a for a in sys.argv[1:])
engine = TrainerEngine(model_dir, threads=2, logprob_chunk_tokens=256)
engine.ensure_job("A", LoraSpec(rank=4, alpha=8), seed=1)
g = torch.Generator().manual_seed(0)
results = []
for completion in completions:
    ids = torch.randint(1, 151_936, (rows, length), generator=g).tolist()
    mask = [[0] * (length - completion) + [1] * completion for _ in range(rows)]
    old = [[-12.0 * m for m in row] for row in mask]
    batch = TrainBatch(ids, mask, old, [1.0 if i % 2 else -1.0 for i in range(rows)])
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS from here on (Linux >= 4.0)
    before = rss("VmRSS")
    metrics = engine.train_step("A", batch, TrainHParams(lr=1e-3))
    results.append({"metrics": metrics, "step_peak": rss("VmHWM") - before})
print(json.dumps(results))
"""


@pytest.mark.slow
def test_a_real_vocabulary_trains_without_holding_its_logits(tmp_path: Path) -> None:
    """The memory a step takes above the engine's does not grow with the tokens trained: 7x the
    trained tokens (logits of 8.1 GiB instead of 1.2 GiB) cost under 1 GiB more. A constant
    overhead (allocator, kernels' workspaces) differs between CPUs; a growth with the logits
    does not hide in it."""
    short, long = completion_logits_bytes(SHORT_COMPLETION), completion_logits_bytes(LONG_COMPLETION)
    assert long > 8 << 30 and long - short > 6 << 30
    model_dir = random_tiny_qwen2(
        tmp_path / "wide",
        vocab_size=LARGE_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=LARGE_LENGTH,
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [model_dir, *map(str, (LARGE_ROWS, LARGE_LENGTH, SHORT_COMPLETION, LONG_COMPLETION))]
    done = subprocess.run(
        [sys.executable, "-c", _LARGE_VOCAB_STEPS, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for completion, result in zip((SHORT_COMPLETION, LONG_COMPLETION), results):
        metrics = result["metrics"]
        assert metrics["tokens"] == LARGE_ROWS * completion
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["skipped"] == 0.0
        assert metrics["entropy"] == pytest.approx(math.log(LARGE_VOCAB), rel=0.01)  # a random model: near uniform
    grown = results[1]["step_peak"] - results[0]["step_peak"]
    gib = [f"{r['step_peak'] / 2**30:.2f}" for r in results]
    assert grown < 1 << 30, f"step peaks {gib} GiB above the engine's: grows with the trained tokens"
    assert results[1]["step_peak"] < long / 4, f"step peaks {gib} GiB above the engine's"


# ---------------------------------------------------------------- bf16 engines


def test_a_bf16_engine_trains_fp32_adapters_and_publishes_bf16_ones(model_dir: str, tmp_path: Path) -> None:
    engine = TrainerEngine(model_dir, dtype="bfloat16", threads=2)
    assert engine.dtype == "bfloat16"
    assert {p.dtype for p in engine._base.parameters()} == {torch.bfloat16}
    engine.ensure_job("A", LORA, seed=5)
    batch = make_batch(6, rows=5)
    metrics = engine.train_step("A", batch, TrainHParams(lr=1e-2, kl_coef=0.05))
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["skipped"] == 0.0
    assert {t.dtype for t in engine.adapter_state_dict("A").values()} == {torch.float32}
    moments = engine.optimizer_state_dict("A")["state"].values()
    assert {t.dtype for state in moments for name, t in state.items() if name != "step"} == {torch.float32}
    # the admission estimate is the real state's size
    copy = engine.export_state("A")
    assert copy.nbytes == job_state_bytes(LORA.rank, list(LORA.target_modules), model_config(model_dir))

    engine.save_adapter("A", str(tmp_path / "adapter"))
    with safe_open(str(tmp_path / "adapter" / ADAPTER_WEIGHTS), "pt") as f:
        published = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - not a dict
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    held = engine.adapter_state_dict("A")
    for key, tensor in published.items():
        assert torch.equal(tensor, held[key].to(torch.bfloat16))
    engine.save_checkpoint("A", str(tmp_path / "ckpt"), {"step": 1})  # checkpoints keep fp32: exact
    with safe_open(str(tmp_path / "ckpt" / ADAPTER_WEIGHTS), "pt") as f:
        assert all(torch.equal(f.get_tensor(key), held[key]) for key in f.keys())  # noqa: SIM118

    # its log-probs are the fp32 engine's, to bf16 precision
    fp32 = TrainerEngine(model_dir, threads=2)
    fp32.ensure_job("A", LORA, seed=5)
    fp32.load_checkpoint("A", str(tmp_path / "ckpt"), LORA, seed=5)
    for got, expected in zip(
        engine.logprobs("A", batch.input_ids, batch.loss_mask), fp32.logprobs("A", batch.input_ids, batch.loss_mask)
    ):
        assert got == pytest.approx(expected, abs=0.1)


# ---------------------------------------------------------------- gradient checkpointing


def count_layer_runs(engine: TrainerEngine) -> list[int]:
    """A list that grows by one each time a decoder layer of the engine's base model starts."""
    runs: list[int] = []
    for layer in engine._base.model.layers:
        layer.register_forward_pre_hook(lambda *_: runs.append(1))
    return runs


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradient_checkpointing_gives_the_same_gradients(model_dir: str, dropout: float) -> None:
    lora = LoraSpec(rank=4, alpha=8, dropout=dropout)
    plain = trained_engine(model_dir, lora)
    checkpointed = trained_engine(model_dir, lora, gradient_checkpointing=True)
    batch = make_batch(8, rows=6)
    hp = TrainHParams(lr=1e-3, kl_coef=0.1)
    runs = {"plain": count_layer_runs(plain), "checkpointed": count_layer_runs(checkpointed)}
    grads_plain, metrics_plain = plain.loss_gradients("A", batch, hp)
    grads_checkpointed, metrics_checkpointed = checkpointed.loss_gradients("A", batch, hp)
    layers = len(plain._base.model.layers)
    assert len(runs["plain"]) == 2 * layers  # the reference forward, the policy's
    assert len(runs["checkpointed"]) == 3 * layers  # and each layer again in the backward
    assert_same_gradients(grads_checkpointed, grads_plain, rtol=1e-5)
    assert metrics_checkpointed == pytest.approx(metrics_plain, rel=1e-6, abs=1e-7)
