"""What a worker's engines are built with, decided from its options and its platform.

Pure functions (no torch, no vLLM): the device the engines run on, their weight dtype, the
trainer's micro-batch token budget (the rollout engine's own arguments: ``worker.engine_args``;
each platform's defaults: ``plexctl.common.engine_defaults``).
Each refuses what cannot work with one line naming the option (``OptionError``), so a worker
told ``--device cuda`` on a node without a GPU says so instead of training on the CPU. The
worker calls them once at start; the tests call them for both platforms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from plexctl.common.engine_defaults import ENGINE_DEFAULTS, Platform

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


class OptionError(ValueError):
    """A worker option that cannot work here: one line naming the option and what it found."""


@dataclass(frozen=True)
class EngineOptions:
    device: Platform
    dtype: str
    micro_batch_tokens: int


def resolve_device(asked: str, cuda_available: bool, visible_devices: str | None) -> Platform:
    """``cpu`` or ``cuda`` for ``--device`` (auto: cuda when this process sees a GPU)."""
    if asked not in DEVICES:
        raise OptionError(f"--device {asked!r}: choose one of {', '.join(DEVICES)}")
    if asked == "cuda" and not cuda_available:
        seen = f"CUDA_VISIBLE_DEVICES={visible_devices!r}" if visible_devices is not None else "no GPU"
        raise OptionError(f"--device cuda: this process sees no usable CUDA device ({seen})")
    if asked == "auto":
        return "cuda" if cuda_available else "cpu"
    return cast("Platform", asked)  # cpu or cuda: checked above


def resolve_dtype(asked: str, device: Platform) -> str:
    """The engines' weight dtype for ``--dtype`` (auto: the platform's default dtype)."""
    if asked == "auto":
        return ENGINE_DEFAULTS[device].dtype
    if asked not in DTYPES:
        raise OptionError(f"--dtype {asked!r}: choose one of auto, {', '.join(DTYPES)}")
    return asked


def engine_options(
    device: str, dtype: str, micro_batch_tokens: int | None, cuda_available: bool, visible_devices: str | None
) -> EngineOptions:
    resolved = resolve_device(device, cuda_available, visible_devices)
    if micro_batch_tokens is not None and micro_batch_tokens < 1:
        raise OptionError(f"--micro-batch-tokens {micro_batch_tokens}: must be at least 1")
    budget = micro_batch_tokens or ENGINE_DEFAULTS[resolved].micro_batch_tokens
    return EngineOptions(resolved, resolve_dtype(dtype, resolved), budget)


def visible_device_ids(visible_devices: str | None) -> list[str]:
    """The GPU ids of ``CUDA_VISIBLE_DEVICES`` ("" or unset: none)."""
    return [d.strip() for d in (visible_devices or "").split(",") if d.strip()]


def trainer_attention(device: str, dtype: str, pack_rows: bool, flash_attn: bool) -> str | None:
    """The attention kernel a trainer's base runs: ``flash_attention_2`` where packed rows can
    use its varlen path (a GPU, bf16 or fp16 weights, the ``flash_attn`` package importable);
    None otherwise: the model's own default (SDPA), which packed rows give an N x N mask."""
    if pack_rows and flash_attn and device == "cuda" and dtype in ("bfloat16", "float16"):
        return "flash_attention_2"
    return None
