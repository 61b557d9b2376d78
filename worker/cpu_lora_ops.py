"""Multi-LoRA ops for vLLM's CPU punica wrapper: one matrix multiply per op, not a weight per token.

vLLM's pure-torch LoRA ops gather a copy of a whole adapter matrix per token (why that matters:
docs/gpu.md, "The rollout engine on CPU"). These replacements compute the same products as plain
matrix multiplies over the stacked adapter slots:

- **shrink** (``in`` large, ``out`` = rank): every token times every slot's matrix in one
  multiply, ``x @ W[L*out, in].T``, then each token keeps its own slot's columns;
- **expand** (``in`` = rank, ``out`` large): each token's input is placed in its slot's block
  of an ``L*in`` row of zeros, and one multiply by the slots stacked along ``in`` gives every
  token's own delta; the other blocks add exact zeros.

Invariants (``tests/test_cpu_lora_ops.py``): a token's result depends only on its own input and
its slot's weights, never on which slot holds them, which other adapters share the batch or how
many tokens it has: the stack always has ``max_loras`` slots, and every multiply is one of
``TILE`` rows, zero-padded, since matrix kernels choose their method by shape. Index -1 ("no
LoRA") gives a zero delta.

The ``sgmv`` (prefill) ops expand per-sequence indices to per-token indices and call the
``bgmv`` ops through their module's globals, so replacing the three ``bgmv`` functions in
that module, its package and the punica wrapper covers every path (``install``); the CPU
engine installs them, a CUDA engine never does.
"""

from __future__ import annotations

import torch

from worker import vllm_private

OPS = vllm_private.CPU_LORA_OPS  # the ops replaced, in each of vllm_private.CPU_LORA_OP_MODULES
TILE = 64  # rows per matrix multiply: every multiply has the same shape, whatever the batch


def _tiled_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` computed as multiplies of exactly ``TILE`` rows (zero-padded): matrix kernels
    pick their method by shape (a few rows take other paths than many), so with one shape a
    row's bits depend only on that row, never on how many rows share the batch."""
    rows = a.shape[0]
    pad = -rows % TILE
    if pad:
        a = torch.cat([a, a.new_zeros((pad, a.shape[1]))])
    return torch.matmul(a.view(-1, TILE, a.shape[1]), b).view(-1, b.shape[1])[:rows]


def _stacked(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(L, out, in)`` from vLLM's ``(L, 1, out, in)`` or ``(L, out, in)`` slot stacks."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    return weights.to(dtype=dtype)


def lora_products(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Row ``t`` of the result is ``weights[indices[t]] @ inputs[t]`` (zeros where the index is -1)."""
    w = _stacked(weights, dtype)
    slots, out, inn = w.shape
    x = inputs.to(dtype=dtype)
    rows = x.shape[0]
    none = indices < 0
    any_none = bool(none.any())
    slot = indices.clamp(min=0) if any_none else indices
    if inn <= out:  # expand: each row's input in its slot's block, one multiply by the blocks
        blocks = x.new_zeros((rows, slots, inn))
        blocks[torch.arange(rows), slot] = x.masked_fill(none.unsqueeze(1), 0.0) if any_none else x
        return _tiled_matmul(blocks.view(rows, slots * inn), w.transpose(1, 2).reshape(slots * inn, out))
    # shrink: every slot's product, then each row's own
    every = _tiled_matmul(x, w.reshape(slots * out, inn).T).view(rows, slots, out)
    mine = every[torch.arange(rows), slot]
    return mine.masked_fill_(none.unsqueeze(1), 0.0) if any_none else mine


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = lora_products(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def install() -> None:
    """Put these ops where vLLM's CPU punica wrapper (and the sgmv ops) look them up
    (``worker.vllm_private.CPU_LORA_OP_MODULES``)."""
    for module in vllm_private.cpu_lora_op_modules():
        for name in OPS:
            setattr(module, name, globals()[name])
