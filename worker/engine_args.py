"""The rollout engine's vLLM arguments per platform, as a pure function (no vLLM, no torch).

``rollout_engine_args`` says everything a platform changes about building the engine: the
``LLM(**llm_kwargs)`` keywords, the environment variables set while it is built, and which
CPU-only workarounds the engine applies. It is tested for both platforms on any machine.

- **cpu** (tests, laptops): the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  which the CPU workarounds need), eager mode, a KV cache of exactly ``kv_cache_gib``
  (``kv_cache_memory_bytes``, and ``VLLM_CPU_KVCACHE_SPACE`` unless the user set it), a small
  fixed memory share (``gpu_memory_utilization`` means host memory there, so the argument is
  ignored), tensor parallelism 1;
- **cuda**: the engine core in its own process (vLLM's default), CUDA graphs, the KV cache from
  ``gpu_memory_utilization`` of a GPU the engine owns (``kv_cache_gib`` is ignored),
  ``tensor_parallel_size`` GPUs, none of the CPU workarounds.

Bad inputs raise ``EngineArgsError`` (a ``ValueError``) with one line naming the argument.
Also here: ``default_max_lora_rank`` and ``adapter_slots``, the sizing rules for LoRA. Every
default that depends on the platform is ``plexctl.common.engine_defaults.ENGINE_DEFAULTS``'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from plexctl.common import engine_defaults as defaults
from plexctl.common.cluster_config import DEFAULTS
from plexctl.common.engine_defaults import CPU_KV_CACHE_GIB, ENGINE_DEFAULTS, EngineDefaults, Platform
from plexctl.common.memplan import CONTEXT_CAP
from worker.vllm_private import CPU_KVCACHE_ENV, LORA_RANKS, MULTIPROCESSING_ENV

GiB = 1 << 30
MAX_NUM_SEQS = 256  # sequences per engine step
BATCHED_TOKENS = MAX_NUM_SEQS * 64  # tokens per engine step, at least one whole sequence


class EngineArgsError(ValueError):
    """Engine arguments vLLM would refuse, or that make no sense on the platform."""


@dataclasses.dataclass(frozen=True)
class EngineArgsPlan:
    """How to build one rollout engine on one platform."""

    platform: Platform
    llm_kwargs: dict[str, Any]  # vllm.LLM(**llm_kwargs)
    env_forced: dict[str, str]  # set while the engine is built, whatever the environment says
    env_defaults: dict[str, str]  # set while the engine is built where unset (the user's value wins)
    install_cpu_lora_ops: bool  # replace vLLM's CPU LoRA ops (worker/cpu_lora_ops.py)
    eager_sampler_ops: bool  # run the sampler's compiled ops eagerly (vllm_private.eager_sampler_ops)
    pin_threads: bool  # run engine calls with ENGINE_THREADS torch threads, the caller's count restored
    undo_cpu_worker_patches: bool  # put back torch.set_num_threads and LD_PRELOAD after the build

    @property
    def in_process(self) -> bool:
        """Whether the engine core runs in the caller's process."""
        return self.env_forced.get(MULTIPROCESSING_ENV) == "0"


def platform() -> Platform:
    """ "cuda" when torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_lora_rank(rank: int) -> int:
    if rank not in LORA_RANKS:
        raise EngineArgsError(f"max_lora_rank {rank}: vLLM accepts one of {', '.join(map(str, LORA_RANKS))}")
    return rank


def default_max_lora_rank(platform: Platform, job_ranks: Iterable[int] = ()) -> int:
    """The smallest rank vLLM accepts that holds every given job's rank, at least the
    platform's default ``max_lora_rank``."""
    need = max([_defaults(platform).max_lora_rank, *job_ranks])
    fits = [r for r in LORA_RANKS if r >= need]
    if not fits:
        raise EngineArgsError(f"lora rank {need}: vLLM loads adapters up to rank {LORA_RANKS[-1]}")
    return fits[0]


def adapter_slots(
    expected_jobs: int | None, platform: Platform = "cuda", max_slots: int | None = None
) -> tuple[int, int]:
    """``(max_loras, max_cpu_loras)`` for a rollout engine expecting this many jobs: the rule of
    ``plexctl.common.engine_defaults.adapter_slots`` (the memory plan's too), its refusals as
    ``EngineArgsError``."""
    try:
        return defaults.adapter_slots(expected_jobs, platform, max_slots)
    except ValueError as exc:
        raise EngineArgsError(str(exc)) from None


def kv_cache_env(kv_cache_gib: float) -> dict[str, str]:
    """``VLLM_CPU_KVCACHE_SPACE`` for a whole number of GiB (the variable holds no fraction;
    ``kv_cache_memory_bytes`` carries the exact size either way)."""
    if float(kv_cache_gib).is_integer():
        return {CPU_KVCACHE_ENV: str(int(kv_cache_gib))}
    return {}


def rollout_engine_args(
    platform: Platform,
    model_path: str,
    dtype: str | None = None,
    max_lora_rank: int | None = None,
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
    max_model_len: int | None = None,
    seed: int = 0,
    kv_cache_gib: float = CPU_KV_CACHE_GIB,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int = DEFAULTS.tp,
    sleep_mode: bool = False,
) -> EngineArgsPlan:
    """The plan for one rollout engine. ``max_cpu_loras`` is raised to ``max_loras`` if below
    it (vLLM requires it). ``sleep_mode`` (CUDA only, see ``sleep_between_models``): the engine
    can put its weights in pinned host memory and drop its KV cache while another model's
    engine serves. What is None gets the platform's default (``ENGINE_DEFAULTS``: the dtype, the
    rank, the adapter slots of a worker told nothing, a GPU's memory share); ``max_model_len``
    None: the model's context, at most ``CONTEXT_CAP``."""
    platform_defaults = _defaults(platform)
    default_slots, default_cached = adapter_slots(None, platform)
    dtype = dtype or platform_defaults.dtype
    max_loras = default_slots if max_loras is None else max_loras
    max_cpu_loras = default_cached if max_cpu_loras is None else max_cpu_loras
    if max_model_len is None:
        max_model_len = default_max_model_len(model_path)
    if gpu_memory_utilization is None:
        gpu_memory_utilization = ENGINE_DEFAULTS["cuda"].gpu_memory_utilization
    if max_lora_rank is None:
        max_lora_rank = platform_defaults.max_lora_rank
    check_lora_rank(max_lora_rank)
    for name, value in (
        ("max_loras", max_loras),
        ("max_model_len", max_model_len),
        ("tensor_parallel_size", tensor_parallel_size),
    ):
        if value < 1:
            raise EngineArgsError(f"{name} must be >= 1, got {value}")
    if not 0 < gpu_memory_utilization <= 1:
        raise EngineArgsError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    common: dict[str, Any] = {
        "model": str(model_path),
        "dtype": dtype,
        "seed": seed,
        "max_model_len": max_model_len,
        # with the tiny model's 64-token context a whole batch of full-length prompts fits one
        # step: vLLM then never splits a prompt across steps, which a seeded sampler cannot do
        # on CPU; a longer context gets the same budget (or one sequence)
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": max(BATCHED_TOKENS, max_model_len),
        "enable_lora": True,
        "max_lora_rank": max_lora_rank,
        "max_loras": max_loras,
        "max_cpu_loras": max(max_cpu_loras, max_loras),
        "disable_log_stats": True,
        # JSON held to a schema is written compactly: a sample cannot run on in whitespace
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    }
    if platform == "cpu":
        if tensor_parallel_size != 1:
            raise EngineArgsError(f"tensor_parallel_size {tensor_parallel_size}: the CPU engine runs on one process")
        if kv_cache_gib <= 0:
            raise EngineArgsError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
        if sleep_mode:
            raise EngineArgsError("sleep_mode: vLLM's CPU engine cannot sleep (its engines stay resident)")
        return EngineArgsPlan(
            platform="cpu",
            llm_kwargs={
                **common,
                "enforce_eager": True,
                "gpu_memory_utilization": platform_defaults.gpu_memory_utilization,  # of host memory, fixed
                "kv_cache_memory_bytes": int(kv_cache_gib * GiB),
            },
            env_forced={MULTIPROCESSING_ENV: "0"},
            env_defaults=kv_cache_env(kv_cache_gib),
            install_cpu_lora_ops=True,
            eager_sampler_ops=True,
            pin_threads=True,
            undo_cpu_worker_patches=True,
        )
    return EngineArgsPlan(
        platform="cuda",
        llm_kwargs={
            **common,
            "enforce_eager": False,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            **({"enable_sleep_mode": True} if sleep_mode else {}),
        },
        env_forced={},
        env_defaults={},
        install_cpu_lora_ops=False,
        eager_sampler_ops=False,
        pin_threads=False,
        undo_cpu_worker_patches=False,
    )


def _defaults(platform: str) -> EngineDefaults:
    """The platform's ``ENGINE_DEFAULTS`` entry; ``EngineArgsError`` for an unknown platform."""
    try:
        return defaults.engine_defaults(platform)
    except ValueError as exc:
        raise EngineArgsError(str(exc)) from None


def sleep_between_models(platform: Platform, models: int) -> bool:
    """Whether a worker's engines of a kind take turns on its GPUs: on CUDA with more than one
    model, the engines of models not being served sleep (weights in pinned host memory; a
    rollout engine's KV cache dropped) and one wakes when a call needs it; on CPU they stay
    resident (vLLM's CPU engine cannot sleep; the memory plan counts every model's weights)."""
    return platform == "cuda" and models > 1


def default_max_model_len(model_path: str) -> int:
    """The model's own context (``max_position_embeddings``), at most ``CONTEXT_CAP`` (the plan's
    figure: KV cache and activations grow with it)."""
    try:
        context = int(json.loads((Path(model_path) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return CONTEXT_CAP
    return max(1, min(context, CONTEXT_CAP))
