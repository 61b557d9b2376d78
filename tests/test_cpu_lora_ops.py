"""The CPU multi-LoRA ops against vLLM's own torch ops, and a token's result against its batch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import vllm.lora.ops.torch_ops.lora_ops as reference  # noqa: E402

from worker import cpu_lora_ops as ours  # noqa: E402

SLOTS = 4


def reference_fixed(name: str):
    """vLLM's op with the upstream fix for index -1: a zero slot appended for it to select."""
    op = getattr(reference, name)

    def fixed(inputs, weights, output, indices, *args):
        zero = weights.new_zeros((1, *weights.shape[1:]))
        return op(inputs, torch.cat([weights, zero]), output, indices, *args)

    return fixed


def case(tokens: int, inn: int, out: int, seed: int, none: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inn, generator=g)
    w = torch.randn(SLOTS, 1, out, inn, generator=g)
    idx = torch.randint(-1 if none else 0, SLOTS, (tokens,), generator=g)
    return x, w, idx


@pytest.mark.parametrize("tokens", [1, 3, 17, 300])
@pytest.mark.parametrize("add_inputs", [False, True])
def test_expand_ops_equal_vllms(tokens: int, add_inputs: bool) -> None:
    x, w, idx = case(tokens, 8, 96, seed=tokens)
    start = torch.randn(tokens, 96)
    a, b = start.clone(), start.clone()
    reference_fixed("bgmv_expand")(x, w, a, idx, add_inputs)
    ours.bgmv_expand(x, w, b, idx, add_inputs)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)

    wide = torch.randn(tokens, 200)
    a, b = wide.clone(), wide.clone()
    reference_fixed("bgmv_expand_slice")(x, w, a, idx, 40, 96, add_inputs)
    ours.bgmv_expand_slice(x, w, b, idx, 40, 96, add_inputs)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert torch.equal(b[:, :40], wide[:, :40]) and torch.equal(b[:, 136:], wide[:, 136:])


@pytest.mark.parametrize("tokens", [1, 3, 17, 300])
def test_shrink_op_equals_vllms(tokens: int) -> None:
    x, w, idx = case(tokens, 128, 8, seed=100 + tokens)
    a, b = torch.zeros(tokens, 8), torch.zeros(tokens, 8)
    reference_fixed("bgmv_shrink")(x, w, a, idx, 0.5)
    ours.bgmv_shrink(x, w, b, idx, 0.5)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_prefill_ops_reach_ours_once_installed() -> None:
    """sgmv (per-sequence indices) goes through the bgmv ops; index -1 then gives zeros."""
    ours.install()
    x, w, _ = case(10, 128, 8, seed=7)
    seq_idx, seq_len = torch.tensor([2, -1, 0]), torch.tensor([4, 3, 3])
    got = torch.zeros(10, 8)
    reference.sgmv_shrink(x, w, got, torch.tensor([0, 4, 7]), seq_len, seq_idx, 3, 4, 10, 1.0)
    want = torch.cat([x[:4] @ w[2, 0].T, torch.zeros(3, 8), x[7:] @ w[0, 0].T])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    assert punica_cpu.bgmv_expand is ours.bgmv_expand


@pytest.mark.parametrize("inn,out", [(8, 256), (128, 8), (16, 128)])
def test_a_tokens_result_does_not_depend_on_its_slot_or_its_batch(inn: int, out: int) -> None:
    """What keeps shared runs learning like isolated ones: the same token and adapter give the
    same bits whichever slot holds the adapter and whatever else is in the batch."""
    x, w, idx = case(64, inn, out, seed=inn + out, none=False)
    mixed = ours.lora_products(x, w, idx, torch.float32)
    for slot in range(SLOTS):  # the whole batch on one adapter, moved to each slot in turn
        moved = w.roll(slot, 0)
        alone = ours.lora_products(x, moved, torch.full((64,), slot), torch.float32)
        assert torch.equal(alone, ours.lora_products(x, w, torch.zeros(64, dtype=torch.long), torch.float32))
    for s in range(SLOTS):  # each adapter's rows, batched alone
        rows = (idx == s).nonzero().squeeze(1)
        assert torch.equal(ours.lora_products(x[rows], w, idx[rows], torch.float32), mixed[rows])
    for n in (1, 2, 3, 5):  # a decode tail of a few rows, as in a long batch
        assert torch.equal(ours.lora_products(x[:n], w, idx[:n], torch.float32), mixed[:n])
    big = torch.cat([x] * 5)  # and in a batch of more than one tile
    assert torch.equal(ours.lora_products(big, w, torch.cat([idx] * 5), torch.float32)[:64], mixed)
