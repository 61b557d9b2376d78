"""LoRA's A matmuls of the projections that read one input, as one matmul: q/k/v of each
attention, gate/up of each MLP.

``fused_lora_a(model, adapter)`` is a context: inside it, each such group of one adapter's LoRA
layers multiplies its input once by the group's stacked A weights (a ``cat`` made per forward, so
the gradients reach each layer's own A), and each layer takes its slice of the product into its
own B, dropout and scaling as PEFT runs them. What it saves is kernel launches and one read of the
input per projection: on a GPU at small ranks a launch costs more than the A product's FLOPs.

Invariants: no parameter, name or value changes; results equal the layers' own up to float
rounding of the larger matmul. A group is fused only where every layer is plain LoRA of that
adapter with no dropout (dropout draws a mask per layer, so the layers' inputs differ); the
product is reused only for the very tensor the group's first layer was called with (a
checkpointed layer's recomputation, another micro-batch: computed again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # projections of one input (Llama, Qwen)


def fusable_groups(model: torch.nn.Module, adapter: str) -> list[list[LoraLayer]]:
    """Each group of at least two of the adapter's LoRA layers that read one input and can share
    their A matmul (plain LoRA, no dropout), in module order."""
    groups = []
    for module in model.modules():
        for names in GROUPS:
            layers = [getattr(module, name, None) for name in names]
            plain = [layer for layer in layers if isinstance(layer, LoraLayer) and _plain(layer, adapter)]
            if len(plain) >= 2:
                groups.append(plain)
    return groups


def _plain(layer: LoraLayer, adapter: str) -> bool:
    return (
        adapter in layer.lora_A
        and isinstance(layer.lora_dropout[adapter], torch.nn.Identity)
        and not layer.use_dora.get(adapter, False)
        and isinstance(layer.lora_A[adapter], torch.nn.Linear)
    )


@contextlib.contextmanager
def fused_lora_a(model: torch.nn.Module, adapter: str) -> Iterator[int]:
    """Inside the block (forwards and the recomputation of checkpointed ones in the backward),
    each fusable group of ``adapter``'s layers shares one A matmul. Yields the number of groups."""
    groups = fusable_groups(model, adapter)
    patched: list[torch.nn.Linear] = []
    handles = []
    try:
        for layers in groups:
            seen: dict[str, Any] = {}  # the group's input now, and the one its product was made from
            a_modules = [_linear(layer.lora_A[adapter]) for layer in layers]
            sizes = [a.out_features for a in a_modules]
            for i, (layer, a) in enumerate(zip(layers, a_modules)):
                assert isinstance(layer, torch.nn.Module)
                handles.append(layer.register_forward_pre_hook(_note_input(seen)))
                a.forward = _slice_of_group(i, a_modules, sizes, seen)  # type: ignore[method-assign]  # removed after
                patched.append(a)
        yield len(groups)
    finally:
        for handle in handles:
            handle.remove()
        for a in patched:
            del a.forward


def group_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The group's input by its stacked A weights (one matmul)."""
    return F.linear(x, weight)


def _linear(module: torch.nn.Module) -> torch.nn.Linear:
    assert isinstance(module, torch.nn.Linear)  # ``_plain`` chose only these
    return module


def _note_input(seen: dict[str, Any]) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        seen["now"] = args[0]

    return hook


def _slice_of_group(i: int, a_modules: list[torch.nn.Linear], sizes: list[int], seen: dict[str, Any]) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if seen.get("made_from") is not seen.get("now") or "low" not in seen:
            weight = torch.cat([a.weight for a in a_modules])
            seen["low"] = group_product(x, weight).split(sizes, dim=-1)
            seen["made_from"] = seen.get("now")
        return seen["low"][i]

    return forward
