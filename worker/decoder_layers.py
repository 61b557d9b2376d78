"""How a trainer's decoder layers run: which part of each is checkpointed, and whether they are
compiled.

What it owns. ``checkpoint_submodules`` checkpoints one part of every decoder layer (its MLP or
its attention; non-reentrant ``torch.utils.checkpoint``, under grad mode only) instead of the
whole layer that transformers' ``gradient_checkpointing_enable`` checkpoints: the part's
activations are made again in the backward, the rest of the layer's are kept. ``compile_layers``
runs each decoder layer through ``torch.compile`` (dynamic shapes: micro-batches of every width
share the graphs); ``keep_adapters_eager`` keeps the PEFT LoRA layers out of those graphs, so
which job's adapter is active (and which require a gradient) changes no guard: a new job costs
no compile.

Invariants: neither changes a parameter's name or value, nor a result beyond float rounding of
the compiled kernels (recomputation is bit-for-bit on CPU; the RNG state is replayed, so LoRA
dropout draws the same masks). A checkpointed part runs eagerly under compile (a graph break).

Not here: whether to checkpoint at all (the memory plan, ``plexctl.common.memplan``, which
counts whole layers), transformers' own whole-layer checkpointing (``worker.trainer``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

__all__ = [
    "CHECKPOINT_SCOPES",
    "checkpoint_submodules",
    "compile_layers",
    "decoder_layers",
    "keep_adapters_eager",
]

CHECKPOINT_SCOPES = ("layer", "mlp", "attn")  # what ``gradient_checkpointing`` recomputes
_SUBMODULES = {"mlp": "mlp", "attn": "self_attn"}  # scope -> the decoder layer's attribute (Llama, Qwen, Mistral)
_EAGER_MARK = "_plexrl_eager_under_compile"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers marks them ``GradientCheckpointingLayer``)."""
    layers: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layer transformers can checkpoint")
    return layers


def checkpoint_submodules(model: torch.nn.Module, scope: str) -> int:
    """Checkpoint ``scope``'s part (``"mlp"`` or ``"attn"``) of every decoder layer; returns how
    many parts. Without grad mode the part runs plainly."""
    if scope not in _SUBMODULES:
        raise ValueError(f"a decoder layer's part to checkpoint is one of {sorted(_SUBMODULES)}, got {scope!r}")
    parts = []
    for layer in decoder_layers(model):
        part = getattr(layer, _SUBMODULES[scope], None)
        if not isinstance(part, torch.nn.Module):
            raise ValueError(f"{type(layer).__name__} has no {_SUBMODULES[scope]!r} to checkpoint")
        parts.append(part)
    for part in parts:
        part.forward = _checkpointed(part.forward)  # an instance attribute: names and hooks stay the module's
    return len(parts)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @torch.compiler.disable  # a compiled layer runs the checkpoint eagerly (no graph break inside it)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def compile_layers(model: torch.nn.Module, backend: str) -> int:
    """``torch.compile`` every decoder layer in place with ``backend`` (``"inductor"``; tests use
    ``"aot_eager"``), dynamic shapes; returns how many layers."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    return len(layers)


def keep_adapters_eager(model: torch.nn.Module) -> None:
    """Every PEFT LoRA layer of ``model`` runs eagerly inside a compiled decoder layer (its base
    matmul with it): graphs hold no adapter, so no job's adapter recompiles them. Idempotent;
    LoRA layers made after a call need another."""
    for module in model.modules():
        if isinstance(module, LoraLayer) and not getattr(module, _EAGER_MARK, False):
            module.forward = torch.compiler.disable(module.forward)
            setattr(module, _EAGER_MARK, True)
