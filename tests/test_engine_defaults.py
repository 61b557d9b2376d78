"""The engines' platform defaults are declared once (``plexctl.common.engine_defaults``): what a
worker resolves with no options is the declaration, the memory plan assumes a GPU worker's, the
settings' descriptions quote it, and no other module keeps a table of its own (pure, no torch)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from plexctl.common import cluster_config as K
from plexctl.common.cluster_config import DEFAULTS
from plexctl.common.engine_defaults import (
    CPU_KV_CACHE_GIB,
    ENGINE_DEFAULTS,
    PLATFORMS,
    EngineDefaults,
    Platform,
    adapter_slots,
    by_platform,
)
from plexctl.common.memplan import CPU_KV_CACHE_BYTES, GiB, NodeShape, engine_dtype, plan_settings

REPO = Path(__file__).resolve().parents[1]


def worker_gives(platform: Platform) -> dict[str, Any]:
    """Each default as a worker on ``platform`` resolves it from a command line that sets nothing."""
    from worker.engine_args import rollout_engine_args
    from worker.engine_options import engine_options
    from worker.main import _adapter_slots, _max_lora_rank
    from worker.trainer_math import pass_cost_tokens

    options = engine_options(platform, "auto", None, cuda_available=True, visible_devices="0")
    slots, cached = _adapter_slots(DEFAULTS, platform)
    return {
        "dtype": options.dtype,
        "max_lora_rank": _max_lora_rank(DEFAULTS, platform),
        "max_lora_slots": slots,  # no jobs_per_engine: as many jobs as the cache holds, so the cap
        "max_cached_loras": cached,
        "gpu_memory_utilization": rollout_engine_args(platform, "/m").llm_kwargs["gpu_memory_utilization"],
        "micro_batch_tokens": options.micro_batch_tokens,
        "pass_cost_tokens": pass_cost_tokens(platform),
    }


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_worker_that_is_told_nothing_gets_the_declaration(platform: Platform) -> None:
    assert worker_gives(platform) == dataclasses.asdict(ENGINE_DEFAULTS[platform])


def test_a_cpu_rollout_engine_gets_the_declared_kv_cache() -> None:
    from worker.engine_args import rollout_engine_args

    assert rollout_engine_args("cpu", "/m").llm_kwargs["kv_cache_memory_bytes"] == CPU_KV_CACHE_GIB * GiB


def test_the_plan_assumes_what_a_gpu_worker_is_given() -> None:
    """The default config's plan settings are the cuda entry field for field (the host cache and how a shared
    pass is cut are no plan's concern)."""
    options, gpu = plan_settings(DEFAULTS), worker_gives("cuda")
    assumed = {
        "dtype": engine_dtype(DEFAULTS, NodeShape.parse("1x80G")),
        "max_lora_rank": options.max_lora_rank,
        "max_lora_slots": options.max_loras,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "micro_batch_tokens": options.micro_batch_tokens,
    }
    assert set(assumed) == {f.name for f in dataclasses.fields(EngineDefaults)} - {
        "max_cached_loras",
        "pass_cost_tokens",
    }
    assert assumed == {name: gpu[name] for name in assumed}
    assert options.max_loras == adapter_slots(None, "cuda")[0]  # the worker's rule, not a copy of its result
    assert engine_dtype(DEFAULTS, NodeShape.parse("0")) == worker_gives("cpu")["dtype"]
    assert CPU_KV_CACHE_BYTES == CPU_KV_CACHE_GIB * GiB


def test_adapter_slots_without_an_expected_count_fill_the_cache_up_to_the_cap() -> None:
    for platform in PLATFORMS:
        d = ENGINE_DEFAULTS[platform]
        assert adapter_slots(None, platform) == adapter_slots(d.max_cached_loras, platform)
        assert adapter_slots(None, platform)[0] == min(d.max_lora_slots, d.max_cached_loras)
    with pytest.raises(ValueError, match="platform 'tpu'"):
        adapter_slots(3, "tpu")


@pytest.mark.parametrize(
    "setting, defaults",
    [
        ("dtype", ["dtype"]),
        ("max_loras", ["max_lora_slots", "max_cached_loras"]),
        ("max_lora_rank", ["max_lora_rank"]),
        ("micro_batch_tokens", ["micro_batch_tokens"]),
    ],
)
def test_the_settings_descriptions_quote_the_declaration(setting: str, defaults: list[str]) -> None:
    text = K.help_text(setting)
    assert all(by_platform(name) in text for name in defaults), text


def test_the_gpu_memory_share_is_described_as_a_gpus() -> None:
    text = K.help_text("gpu_memory_utilization")  # on CPU vLLM is given a fixed share of host memory
    assert f"default: {ENGINE_DEFAULTS['cuda'].gpu_memory_utilization}; ignored on CPU" in text


def _platform_tables(path: Path) -> list[str]:
    """``path:line`` of each dict literal keyed by the platforms: a second declaration."""
    platforms = set(PLATFORMS)
    return [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Dict)
        and node.keys
        and all(isinstance(k, ast.Constant) for k in node.keys)
        and {k.value for k in node.keys if isinstance(k, ast.Constant)} == platforms
    ]


def test_no_other_module_keeps_a_table_of_platform_defaults() -> None:
    own = REPO / "plexctl" / "common" / "engine_defaults.py"
    found = [
        where
        for folder in ("plexctl", "worker", "daemon")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != own
        for where in _platform_tables(path)
    ]
    assert found == [], "platform defaults belong in plexctl/common/engine_defaults.py:\n" + "\n".join(found)
    assert _platform_tables(own)  # the check sees the one there is
