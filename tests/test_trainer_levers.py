"""The trainer's speed levers change no result beyond float rounding (``worker.trainer``,
``worker.decoder_layers``, ``worker.train_batches.length_order``).

On a tiny random Qwen2 in fp32 on CPU, each lever against the same engine without it:
length-bucketed micro-batches (rows cut longest first) give the unsorted path's gradients within
``BUCKET_RTOL`` (relative to the gradient's norm; not bit-equal: the micro-batches hold other
rows, so the sums run in another order; measured here 4e-7 to 5e-7) and every per-row log-prob
back in the batch's order within ``BUCKET_LOGPROB_ATOL``; checkpointing only each layer's MLP or
attention gives bit-identical gradients (recomputation replays the same kernels and, with LoRA
dropout, the same RNG state); decoder layers compiled with the ``aot_eager`` backend give the
eager gradients within ``COMPILE_RTOL`` (measured 4e-7 to 5e-7: aot_eager runs the same aten
ops, decomposed; about 30 s on 2 cores, so marked slow), and a second job's adapter compiles no new graph.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import random_tiny_qwen2

from plexctl.common.protocol import LoraSpec, TrainBatch, TrainHParams
from worker.train_batches import length_order, micro_batch_bounds, pad_rows, permute_rows
from worker.trainer import TrainerEngine

VOCAB = 96
LORA = LoraSpec(rank=4, alpha=8)
BUDGET = 80  # padded tokens per micro-batch: a batch of MIXED_ROWS is several micro-batches
MIXED_ROWS = 10
BUCKET_RTOL = 1e-5  # length buckets: the gradient vector's relative error
BUCKET_LOGPROB_ATOL = 1e-5  # length buckets: each log-prob
COMPILE_RTOL = 1e-5  # compiled layers (aot_eager): the gradient vector's relative error
FUSED_RTOL = 1e-6  # fused LoRA A matmuls: the gradient vector's relative error
PACKED_RTOL = 1e-5  # packed rows: the gradient vector's relative error
PACKED_LOGPROB_ATOL = 1e-5  # packed rows: each log-prob
VOCAB_BLOCK_RTOL = 1e-5  # the log-softmax in vocabulary blocks: gradients, metrics


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny Qwen2 (hidden 128, 2 layers, 2 heads, vocab 96, float32) in HF format."""
    return random_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-levers"), vocab_size=VOCAB)


def mixed_batch(seed: int, rows: int = MIXED_ROWS) -> TrainBatch:
    """Rows of 4 to 40 tokens in no order: a 2-4 token prompt (mask 0), then the completion."""
    rng = random.Random(seed)
    input_ids, loss_mask, old = [], [], []
    for _ in range(rows):
        prompt, completion = rng.randint(2, 4), rng.randint(2, 36)
        input_ids.append([rng.randrange(1, VOCAB) for _ in range(prompt + completion)])
        loss_mask.append([0] * prompt + [1] * completion)
        old.append([(-4.5 + rng.uniform(-0.3, 0.3)) * m for m in loss_mask[-1]])
    return TrainBatch(input_ids, loss_mask, old, [rng.gauss(0.0, 1.0) for _ in range(rows)])


def trained_engine(model_dir: str, lora: LoraSpec = LORA, jobs: str = "A", **options: object) -> TrainerEngine:
    """An engine whose jobs took one step each (lora_B no longer 0: every gradient flows)."""
    engine = TrainerEngine(model_dir, threads=2, **options)  # type: ignore[arg-type]
    for i, job in enumerate(jobs):
        engine.ensure_job(job, lora, seed=5 + i)
        engine.train_step(job, mixed_batch(1 + i, rows=4), TrainHParams(lr=1e-2))
    return engine


def relative_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """|got - expected| / |expected|, all parameters as one vector; every parameter has a gradient."""
    assert set(got) == set(expected)
    assert all(grad.abs().sum() > 0 for grad in expected.values())
    difference = torch.cat([(got[key] - grad).flatten() for key, grad in expected.items()]).norm()
    return float(difference / torch.cat([grad.flatten() for grad in expected.values()]).norm())


# ---------------------------------------------------------------- length buckets


def test_length_order_sorts_longest_first_within_spans_and_only_when_it_cuts() -> None:
    lengths = [5, 3, 8, 2, 8, 9, 4]
    assert length_order(lengths, None, 16) == [5, 2, 4, 0, 6, 1, 3]  # stable: row 2 before row 4
    assert length_order(lengths, None, None) is None  # one micro-batch: nothing to gain
    assert length_order([9, 8, 5, 1], 2, None) is None  # already in order
    assert length_order(lengths, 2, None, spans=[(0, 3), (3, 7)]) == [2, 0, 1, 5, 4, 6, 3]
    # on a mixed batch, the buckets pad fewer tokens in no more micro-batches
    batch = mixed_batch(7, rows=16)
    order = length_order([len(r) for r in batch.input_ids], None, BUDGET)
    assert order is not None and sorted(order) == list(range(16))
    plain = padded_tokens([len(r) for r in batch.input_ids])
    bucketed = padded_tokens([len(batch.input_ids[i]) for i in order])
    assert bucketed[0] < plain[0] and bucketed[1] <= plain[1], (bucketed, plain)


def padded_tokens(lengths: list[int]) -> tuple[int, int]:
    """(padded tokens, micro-batches) of ``lengths`` cut in order under ``BUDGET``."""
    bounds = micro_batch_bounds(lengths, None, BUDGET)
    return sum((stop - start) * max(lengths[start:stop]) for start, stop in bounds), len(bounds)


def test_permute_rows_moves_every_tensor_alike() -> None:
    batch = mixed_batch(3, rows=5)
    rows = pad_rows(batch.input_ids, batch.loss_mask, torch.device("cpu"))
    order = [4, 0, 3, 1, 2]
    moved = permute_rows(rows, order)
    assert moved.lengths == [rows.lengths[i] for i in order]
    for i, at in enumerate(order):
        assert torch.equal(moved.input_ids[i], rows.input_ids[at])
        assert torch.equal(moved.attention_mask[i], rows.attention_mask[at])
        assert torch.equal(moved.loss_mask[i], rows.loss_mask[at])


def test_length_buckets_give_the_unsorted_gradients_and_logprobs_in_order(model_dir: str) -> None:
    plain = trained_engine(model_dir, micro_batch_tokens=BUDGET, length_buckets=False)
    bucketed = trained_engine(model_dir, micro_batch_tokens=BUDGET, length_buckets=True)
    batch = mixed_batch(11)
    assert length_order([len(r) for r in batch.input_ids], None, BUDGET) is not None  # the lever is pulled
    for loss_agg in ("token-mean", "seq-mean-token-mean"):
        hp = TrainHParams(lr=1e-3, kl_coef=0.1, loss_agg=loss_agg)
        grads_plain, metrics_plain = plain.loss_gradients("A", batch, hp)
        grads_bucketed, metrics_bucketed = bucketed.loss_gradients("A", batch, hp)
        assert relative_error(grads_bucketed, grads_plain) <= BUCKET_RTOL
        assert metrics_bucketed == pytest.approx(metrics_plain, rel=1e-6, abs=1e-7)
    got = bucketed.logprobs("A", batch.input_ids, batch.loss_mask)
    expected = plain.logprobs("A", batch.input_ids, batch.loss_mask)
    assert [len(row) for row in got] == [len(row) for row in batch.input_ids]
    for row_got, row_expected in zip(got, expected):
        assert row_got == pytest.approx(row_expected, abs=BUCKET_LOGPROB_ATOL)


def test_length_buckets_in_a_group_keep_each_jobs_rows_its_own(model_dir: str) -> None:
    plain = trained_engine(model_dir, jobs="AB", micro_batch_tokens=BUDGET, length_buckets=False)
    bucketed = trained_engine(model_dir, jobs="AB", micro_batch_tokens=BUDGET, length_buckets=True)
    steps = [("A", mixed_batch(21, rows=6), TrainHParams(lr=1e-3)), ("B", mixed_batch(22, rows=5), TrainHParams())]
    for (grads_bucketed, _), (grads_plain, _) in zip(bucketed.group_gradients(steps), plain.group_gradients(steps)):
        assert relative_error(grads_bucketed, grads_plain) <= BUCKET_RTOL


# ---------------------------------------------------------------- a part of each layer checkpointed


@pytest.mark.parametrize("scope", ["mlp", "attn"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointing_a_part_of_each_layer_gives_the_same_gradients_bit_for_bit(
    model_dir: str, scope: str, dropout: float
) -> None:
    lora = LoraSpec(rank=4, alpha=8, dropout=dropout)
    plain = trained_engine(model_dir, lora)
    partial = trained_engine(model_dir, lora, gradient_checkpointing=True, checkpoint_scope=scope)
    part = "mlp" if scope == "mlp" else "self_attn"
    runs: list[int] = []
    for layer in partial._base.model.layers:
        getattr(layer, part).register_forward_pre_hook(lambda *_: runs.append(1))
    batch = mixed_batch(8, rows=6)
    hp = TrainHParams(lr=1e-3, kl_coef=0.1)
    grads_plain, metrics_plain = plain.loss_gradients("A", batch, hp)
    grads_partial, metrics_partial = partial.loss_gradients("A", batch, hp)
    layers = len(plain._base.model.layers)
    assert len(runs) == 2 * layers  # the reference forward, the policy's (a recomputation calls forward, no hook)
    assert partial.options.checkpointed_layers == []  # not the whole layers
    for key, grad in grads_plain.items():
        assert torch.equal(grads_partial[key], grad), key
    assert metrics_partial == metrics_plain
    with pytest.raises(RuntimeError, match="set once"):
        partial.set_layer_options(True, "attn")


def test_checkpoint_scope_is_checked_and_the_bool_api_is_the_whole_layer(model_dir: str) -> None:
    with pytest.raises(ValueError, match="checkpoint_scope"):
        TrainerEngine(model_dir, threads=2, gradient_checkpointing=True, checkpoint_scope="ffn")
    engine = TrainerEngine(model_dir, threads=2, gradient_checkpointing=True)
    whole = engine.options.checkpointed_layers
    assert engine.checkpoint_scope == "layer" and len(whole) == len(engine._base.model.layers)
    engine.set_layer_options(False)  # whole layers may be switched off again
    assert engine.options.checkpointed_layers == [] and not engine._base.is_gradient_checkpointing


# ---------------------------------------------------------------- compiled decoder layers


@pytest.mark.slow  # about 20 s on 2 cores: the first graphs' tracing and compile, even with aot_eager
def test_compiled_layers_give_the_eager_gradients_and_a_new_job_compiles_nothing(model_dir: str) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    lora = LoraSpec(rank=4, alpha=8, target_modules=["q_proj"])  # one graph break per layer: fewer graphs
    eager = trained_engine(model_dir, lora)
    compiled = trained_engine(model_dir, lora, compile_layers="aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    batch, hp = mixed_batch(9, rows=5), TrainHParams(lr=1e-3)
    for engine in (eager, compiled):  # another adapter, rows of other widths: the same graphs
        engine.ensure_job("B", lora, seed=7)
        engine.train_step("B", mixed_batch(2, rows=3), TrainHParams(lr=1e-2))
    for job in "AB":
        grads_compiled = compiled.loss_gradients(job, batch, hp)[0]
        assert relative_error(grads_compiled, eager.loss_gradients(job, batch, hp)[0]) <= COMPILE_RTOL
    assert counters["stats"]["unique_graphs"] == graphs


# ---------------------------------------------------------------- LoRA A matmuls fused across projections


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_lora_a_matmuls_give_the_layers_own_gradients_and_each_group_multiplies_once(
    model_dir: str, checkpointing: bool
) -> None:
    from worker import fused_lora
    from worker.fused_lora import fusable_groups

    plain = trained_engine(model_dir, gradient_checkpointing=checkpointing)
    fused = trained_engine(model_dir, gradient_checkpointing=checkpointing, fuse_lora=True)
    layers = len(plain._base.model.layers)
    groups = fusable_groups(fused.slots.peft, fused._job("A").adapter_name)
    assert [len(g) for g in groups] == [3, 2] * layers  # q/k/v and gate/up of every layer
    calls: list[int] = []  # the A weights a fused product multiplies: one product a group and forward
    real = fused_lora.group_product
    fused_calls = lambda x, w: calls.append(w.shape[0]) or real(x, w)  # noqa: E731
    batch, hp = mixed_batch(11, rows=6), TrainHParams(lr=1e-3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_lora, "group_product", fused_calls)
        grads_fused, metrics_fused = fused.loss_gradients("A", batch, hp)
    grads_plain, metrics_plain = plain.loss_gradients("A", batch, hp)
    forwards = 2 if checkpointing else 1  # a checkpointed layer's forward runs again in the backward
    assert sorted(calls) == sorted([3 * LORA.rank, 2 * LORA.rank] * layers * forwards)
    assert relative_error(grads_fused, grads_plain) <= FUSED_RTOL
    for name, value in metrics_plain.items():
        assert metrics_fused[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    # after the block every layer runs its own A again; adapters with dropout are not fused
    assert all("forward" not in vars(layer.lora_A[fused._job("A").adapter_name]) for group in groups for layer in group)
    fused.ensure_job("D", LoraSpec(rank=4, alpha=8, dropout=0.1), seed=9)
    with fused_lora.fused_lora_a(fused.slots.peft, fused._job("D").adapter_name) as count:
        assert count == 0


# ---------------------------------------------------------------- rows packed without padding


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_rows_give_the_padded_gradients_and_logprobs_and_the_decoder_sees_no_padding(
    model_dir: str, checkpointing: bool
) -> None:
    padded = trained_engine(model_dir, gradient_checkpointing=checkpointing)
    packed = trained_engine(model_dir, gradient_checkpointing=checkpointing, pack_rows=True)
    shapes: list[tuple[int, ...]] = []
    packed._base.model.register_forward_pre_hook(
        lambda _, args, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    batch, hp = mixed_batch(12), TrainHParams(lr=1e-3, kl_coef=0.1)
    grads_packed, metrics_packed = packed.loss_gradients("A", batch, hp)
    grads_padded, metrics_padded = padded.loss_gradients("A", batch, hp)
    tokens = sum(len(row) for row in batch.input_ids)
    assert shapes and all(shape[0] == 1 for shape in shapes)  # one sequence: every row's tokens, no padding
    assert sum(shape[1] for shape in shapes) == 2 * tokens  # the policy's forward and the reference's (KL)
    assert relative_error(grads_packed, grads_padded) <= PACKED_RTOL
    for name, value in metrics_padded.items():
        assert metrics_packed[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    rows = [row[:9] for row in batch.input_ids]
    masks = [[0] + [1] * (len(row) - 1) for row in rows]  # every token after the first
    for got, want in zip(packed.logprobs("A", rows, masks), padded.logprobs("A", rows, masks)):
        assert got == pytest.approx(want, abs=PACKED_LOGPROB_ATOL)


# ---------------------------------------------------------------- the log-softmax in vocabulary blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_log_softmax_in_vocabulary_blocks_gives_the_whole_vocabularys_gradients_and_logprobs(
    model_dir: str, dtype: str
) -> None:
    whole = trained_engine(model_dir, dtype=dtype)
    blocks = trained_engine(model_dir, dtype=dtype, logprob_vocab_block=VOCAB // 3 + 1)  # 3 blocks, one short
    batch, hp = mixed_batch(13), TrainHParams(lr=1e-3)
    grads_blocks, metrics_blocks = blocks.loss_gradients("A", batch, hp)
    grads_whole, metrics_whole = whole.loss_gradients("A", batch, hp)
    assert relative_error(grads_blocks, grads_whole) <= VOCAB_BLOCK_RTOL
    for name, value in metrics_whole.items():  # the entropy too
        assert metrics_blocks[name] == pytest.approx(value, rel=VOCAB_BLOCK_RTOL, abs=1e-6), name
    rows = [row[:9] for row in batch.input_ids]
    masks = [[0] + [1] * (len(row) - 1) for row in rows]
    for got, want in zip(blocks.logprobs("A", rows, masks), whole.logprobs("A", rows, masks)):
        assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="logprob_vocab_block"):
        TrainerEngine(model_dir, threads=2, logprob_vocab_block=0)


# ---------------------------------------------------------------- no fp32 copies of the LoRA layers' inputs


@pytest.mark.parametrize("checkpointing", [False, True])
def test_on_a_bf16_engine_lora_layers_take_their_input_in_bf16_and_the_gradients_keep_every_bit(
    model_dir: str, checkpointing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib

    import worker.trainer_math as tm

    engine = trained_engine(model_dir, dtype="bfloat16", gradient_checkpointing=checkpointing)
    seen: list[torch.dtype] = []
    q_proj = engine.slots.peft.base_model.model.model.layers[0].self_attn.q_proj
    q_proj.lora_A[engine._job("A").adapter_name].register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    batch, hp = mixed_batch(14), TrainHParams(lr=1e-3)
    grads, metrics = engine.loss_gradients("A", batch, hp)
    assert seen and set(seen) == {torch.bfloat16}  # no fp32 copy (the recomputation's too)
    monkeypatch.setattr(tm, "disable_input_dtype_casting", lambda model: contextlib.nullcontext())
    seen.clear()
    cast_grads, cast_metrics = engine.loss_gradients("A", batch, hp)
    assert set(seen) == {torch.float32}  # PEFT's own cast to the fp32 masters
    for key, grad in cast_grads.items():
        assert torch.equal(grads[key], grad), key
    assert metrics == cast_metrics
