"""The engines' defaults that depend on their platform (GPU or CPU), declared once.

``ENGINE_DEFAULTS`` holds one ``EngineDefaults`` per ``Platform``: what a worker's engines are
built with for each engine setting left null (``cluster_config.ClusterConfig``), and
``adapter_slots`` is the one rule that sizes a rollout engine's adapter slots from them. The
worker resolves its options from here (``worker.engine_args``, ``worker.engine_options``), the
memory plan assumes the cuda entry (``memplan.plan_settings``) and the settings' descriptions
quote it. Invariant: no other module states one of these values (``tests/test_engine_defaults.py``).
Pure Python (no torch, no vLLM, nothing of the worker): the CLI imports it on a login node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Platform = Literal["cpu", "cuda"]
PLATFORMS: tuple[Platform, ...] = ("cpu", "cuda")
CPU_KV_CACHE_GIB = 1.0  # the KV cache of a CPU rollout engine (on CUDA: what gpu_memory_utilization leaves)


@dataclass(frozen=True)
class EngineDefaults:
    """What a worker's engines get on one platform when nobody says otherwise (a field with a
    default here is the same on every platform)."""

    dtype: str  # weight dtype of both engines (``--dtype auto``)
    max_lora_rank: int  # highest LoRA rank a rollout engine loads: every adapter slot is padded to it
    max_lora_slots: int  # adapters in one batch at most (``adapter_slots``'s cap)
    gpu_memory_utilization: float  # vLLM's share of the GPUs the rollout engine owns (CPU: of host memory, fixed)
    max_cached_loras: int = 64  # adapters vLLM keeps in host memory, at most (7B rank 32: ~0.16 GiB each)
    micro_batch_tokens: int = 16384  # padded tokens of one trainer forward/backward
    # what one more forward/backward costs, in padded tokens: a shared pass cuts its rows into
    # micro-batches of like lengths where the padding saved is more (``quantile_passes``)
    pass_cost_tokens: int = 8192


ENGINE_DEFAULTS: dict[Platform, EngineDefaults] = {
    # CPU: no fast bf16; the LoRA ops multiply every slot at the padded rank, so few slots, and the
    # smallest vLLM rank that holds the CPU configs' (tiny models: 8); vLLM reads the memory share
    # as one of host memory, so it is fixed (the setting is a GPU's) and the KV cache sized apart
    "cpu": EngineDefaults(
        dtype="float32", max_lora_rank=16, max_lora_slots=4, gpu_memory_utilization=0.3, pass_cost_tokens=128
    ),
    # GPUs train and sample in bf16; the rank is above the shipped configs' (7B: 32)
    "cuda": EngineDefaults(dtype="bfloat16", max_lora_rank=64, max_lora_slots=16, gpu_memory_utilization=0.9),
}


def engine_defaults(platform: str) -> EngineDefaults:
    """The platform's defaults; ValueError naming the platforms for any other name."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r}: one of {', '.join(PLATFORMS)}")
    return ENGINE_DEFAULTS[platform]


def adapter_slots(expected_jobs: int | None, platform: str = "cuda", max_slots: int | None = None) -> tuple[int, int]:
    """``(max_loras, max_cpu_loras)`` of a rollout engine expecting this many jobs (None: no cap,
    as many as its host cache holds, ``max_cached_loras``): one batch slot per job up to
    ``max_slots`` (the platform's ``max_lora_slots`` unless given), and vLLM's host cache holding
    every job's adapter, at least twice the slots, at most ``max_cached_loras`` (or twice the
    slots, if more). ValueError for a negative job count or a cap under 1."""
    defaults = engine_defaults(platform)
    if expected_jobs is None:
        expected_jobs = defaults.max_cached_loras
    if expected_jobs < 0:
        raise ValueError(f"expected_jobs must be >= 0, got {expected_jobs}")
    cap = defaults.max_lora_slots if max_slots is None else max_slots
    if cap < 1:
        raise ValueError(f"max_slots must be >= 1, got {cap}")
    slots = min(max(expected_jobs, 1), cap)
    cached = min(max(2 * slots, expected_jobs), max(defaults.max_cached_loras, 2 * slots))
    return slots, cached


def by_platform(name: str) -> str:
    """A default as a setting's description says it: ``"64 on GPUs, 16 on CPU"``, or the one
    value where both platforms agree."""
    gpu, cpu = (getattr(ENGINE_DEFAULTS[p], name) for p in ("cuda", "cpu"))
    return str(gpu) if gpu == cpu else f"{gpu} on GPUs, {cpu} on CPU"
