"""A trainer step's peak GPU memory, and the decisions made from it: gradient checkpointing, the
trainer's share of a GPU it shares, whether a job's step fits any trainer.

Pure arithmetic (no torch), so ``plexctl plan``, the daemon's submit check and the worker make
the same decision from the same numbers. ``step_peak`` estimates what torch's
``max_memory_allocated`` reaches during one ``train_step`` (no CUDA context, no allocator
fragmentation: those are ``memplan.TRAINER_GPU_RUNTIME_BYTES``), from what the trainer keeps
(``worker.trainer_math`` through transformers' Qwen2/Llama decoder layer, peft's LoRA layers,
``worker.token_logprobs``), not from a factor per shape. Calibrated against the peaks measured
on an H200 (``bench/results/gpu-h200-*.json``, ``tests/test_memplan.py``): 1.00-1.30x of each,
never below.

Invariants: ``choose_checkpointing`` turns checkpointing off only where the step without it fits
the room it is given; ``memory_fraction`` is None on a GPU the trainer owns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from plexctl.common.state_size import FP32_BYTES, dtype_bytes, lora_module_shapes

Checkpointing = Literal["auto", "on", "off"]
CHECKPOINTING: tuple[Checkpointing, ...] = ("auto", "on", "off")
LOGITS_FP32_COPIES = 2  # a chunk's fp32 logits and their log-softmax (then log-softmax and probabilities)
CUDA_WORKSPACE_BYTES = 64 << 20  # cuBLAS / cuBLASLt workspaces, allocated through torch's caching allocator
STEP_MARGIN = 0.03  # what the estimate does not see: kernel temporaries, small buffers, block rounding


def _dims(config: Mapping[str, Any]) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, layers, heads x head_dim, kv_heads x head_dim, heads)."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return (
        int(config["hidden_size"]),
        int(config["intermediate_size"]),
        int(config["num_hidden_layers"]),
        heads * head_dim,
        kv_heads * head_dim,
        heads,
    )


def layer_bytes_per_token(
    config: Mapping[str, Any], dtype: str, rank: int, target_modules: Sequence[str], full: bool = False
) -> int:
    """Bytes one decoder layer keeps for its backward, per token, with ``s`` = the engine dtype's
    bytes (2 for bf16) and h, I, q = heads x head_dim, kv = kv_heads x head_dim, r = rank:

        2 x 4h                      the fp32 copy of each RMSNorm's input (two norms)
      + s x (2q + 2kv) + 4 x heads  SDPA's saved q, k, v, output and its fp32 log-sum-exp
      + 3 x s x I                   the MLP's gate output (SiLU's input), activation and up output
      + sum over LoRA modules of s x (in + r): peft casts a module's input to the adapter's fp32,
                                    autocast casts it back, so each module keeps its own copy of
                                    its input, and A's output

    (0.5B: 61,440 bytes; 3B: 138,760, as counted on CPU by a saved-tensors hook). A full
    fine-tuning job keeps the linears' inputs instead of the LoRA terms: s x (2h + q + I)."""
    hidden, intermediate, _, q, kv, heads = _dims(config)
    s = dtype_bytes(dtype)
    size = 2 * FP32_BYTES * hidden + s * (2 * q + 2 * kv) + FP32_BYTES * heads + 3 * s * intermediate
    if full:
        return size + s * (2 * hidden + q + intermediate)
    shapes = lora_module_shapes(config)
    return size + sum(s * (shapes[m][0] + rank) for m in target_modules)


def head_bytes(config: Mapping[str, Any], tokens: int, dtype: str, chunk_tokens: int) -> int:
    """The log-prob head's peak (``worker.token_logprobs``): the final norm's fp32 input, the last
    hidden states and the gathered ones, an fp32 direction per token (the frozen head's gradient
    taken in the forward), and one chunk's fp32 logits and log-softmax."""
    hidden = int(config["hidden_size"])
    s = dtype_bytes(dtype)
    per_token = FP32_BYTES * hidden + 2 * s * hidden + FP32_BYTES * hidden
    chunk = min(chunk_tokens, tokens) * int(config["vocab_size"]) * FP32_BYTES * LOGITS_FP32_COPIES
    return tokens * per_token + chunk


def backward_bytes(config: Mapping[str, Any], tokens: int, dtype: str) -> int:
    """One layer's backward working set: the gradients of the MLP's product, gate and up outputs,
    the fp32 gradient of down_proj's input (peft's cast) and the residual stream's gradient."""
    hidden, intermediate = int(config["hidden_size"]), int(config["intermediate_size"])
    s = dtype_bytes(dtype)
    return tokens * (3 * s * intermediate + FP32_BYTES * intermediate + s * hidden)


@dataclass(frozen=True)
class StepPeak:
    """The parts of a step's peak (bytes); ``total`` is the estimate of ``max_memory_allocated``."""

    checkpointing: bool
    weights: int  # the base model, in the engine dtype
    states: int  # the jobs' states on the device (fp32 adapter or weights, AdamW moments)
    gradients: int  # fp32 gradients of the job in training, + autocast's copies of its weights
    kept: int  # activations kept to the backward: every layer's, or (checkpointing) the layer inputs
    transient: int  # the larger of the head's peak and a layer's backward (+ its recomputation)
    workspace: int  # cuBLAS workspaces on CUDA

    @property
    def total(self) -> int:
        parts = self.weights + self.states + self.gradients + self.kept + self.transient + self.workspace
        return math.ceil(parts * (1 + STEP_MARGIN))

    @property
    def activations(self) -> int:
        """What a micro-batch adds to the resident weights, states and gradients."""
        return self.total - self.weights - self.states - self.gradients


def step_peak(
    config: Mapping[str, Any],
    tokens: int,
    dtype: str,
    checkpointing: bool,
    *,
    weights: int,
    states: int,
    trainable_params: int,
    rank: int = 0,
    target_modules: Sequence[str] = (),
    full: bool = False,
    chunk_tokens: int = 1024,
    cuda: bool = True,
) -> StepPeak:
    """The peak of a step whose micro-batches hold ``tokens`` padded tokens. Without
    checkpointing every layer keeps its activations until the backward, then one layer's
    backward runs; with it only the layers' inputs are kept and one layer at a time is
    recomputed beside its backward. ``trainable_params``: the job's (its gradients in fp32,
    autocast's cast of them in the engine dtype)."""
    _, _, layers, _, _, _ = _dims(config)
    s = dtype_bytes(dtype)
    layer = tokens * layer_bytes_per_token(config, dtype, rank, target_modules, full)
    backward = backward_bytes(config, tokens, dtype)
    if checkpointing:
        kept = layers * tokens * int(config["hidden_size"]) * s
        backward += layer
    else:
        kept = layers * layer
    return StepPeak(
        checkpointing=checkpointing,
        weights=weights,
        states=states,
        gradients=trainable_params * (FP32_BYTES + s),
        kept=kept,
        transient=max(head_bytes(config, tokens, dtype, chunk_tokens), backward),
        workspace=CUDA_WORKSPACE_BYTES if cuda else 0,
    )


def choose_checkpointing(asked: str, fits_without: bool, cuda: bool) -> bool:
    """Gradient checkpointing for ``--gradient-checkpointing``: on / off as asked; auto: off where
    the step without it fits (``fits_without``), and always off on the CPU (recomputing costs
    a third more time there and memory is rarely the limit)."""
    if asked not in CHECKPOINTING:
        raise ValueError(f"gradient checkpointing {asked!r}: choose one of {', '.join(CHECKPOINTING)}")
    if asked != "auto":
        return asked == "on"
    return cuda and not fits_without


def trainer_share_bytes(gpu_bytes: int, rollout_utilization: float | None) -> int:
    """The trainer's share of its GPU: all of it, or what a rollout engine on the same GPU
    (``rollout_utilization``: vLLM's ``gpu_memory_utilization``, a share of the whole GPU) leaves."""
    if rollout_utilization is None:
        return gpu_bytes
    if not 0 < rollout_utilization < 1:
        raise ValueError(
            f"a rollout engine sharing the GPU with a trainer takes a share in (0, 1), got {rollout_utilization}"
        )
    return int(gpu_bytes * (1 - rollout_utilization))


def memory_fraction(share_bytes: int, gpu_bytes: int, shared: bool) -> float | None:
    """What to give ``torch.cuda.set_per_process_memory_fraction`` on a GPU the trainer shares
    (None where it owns the GPU: nothing to cap)."""
    if not shared or gpu_bytes <= 0:
        return None
    return max(0.0, min(1.0, share_bytes / gpu_bytes))
