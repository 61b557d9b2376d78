"""The rollout engine's vLLM arguments: what a GPU node gets, what runs here, and bad inputs.

Pure: no vLLM, no GPU (``tests/test_vllm_private.py`` checks the keywords against vLLM's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from plexctl.common.engine_defaults import ENGINE_DEFAULTS
from worker.engine_args import (
    EngineArgsError,
    GiB,
    adapter_slots,
    default_max_lora_rank,
    rollout_engine_args,
)
from worker.vllm_private import CPU_KVCACHE_ENV, LORA_RANKS, MULTIPROCESSING_ENV

REPO = Path(__file__).resolve().parents[1]


def test_a_gpu_node_gets_cuda_graphs_its_own_process_and_the_kv_cache_from_its_memory_share() -> None:
    plan = rollout_engine_args(
        "cuda",
        "/models/qwen2.5-7b",
        dtype="bfloat16",
        max_lora_rank=64,
        max_loras=16,
        max_cpu_loras=64,
        max_model_len=4096,
        seed=3,
        gpu_memory_utilization=0.9,
        tensor_parallel_size=2,
    )
    kw = plan.llm_kwargs
    assert kw["enforce_eager"] is False  # CUDA graphs
    assert kw["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in kw
    assert kw["tensor_parallel_size"] == 2
    assert (kw["model"], kw["dtype"], kw["seed"], kw["max_model_len"]) == ("/models/qwen2.5-7b", "bfloat16", 3, 4096)
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"], kw["max_cpu_loras"]) == (True, 64, 16, 64)
    assert kw["max_num_batched_tokens"] >= 4096  # a whole sequence fits one step
    # JSON held to a schema (tool_choice, response_format) by xgrammar, written compactly
    assert kw["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True}

    assert not plan.in_process  # vLLM's engine core in its own process: nothing forces it in
    assert MULTIPROCESSING_ENV not in plan.env_forced and MULTIPROCESSING_ENV not in plan.env_defaults
    assert not any(name.startswith("VLLM_CPU_") for name in [*plan.env_forced, *plan.env_defaults])
    assert not (plan.install_cpu_lora_ops or plan.eager_sampler_ops or plan.pin_threads or plan.undo_cpu_worker_patches)
    # the KV cache size of CPU runs has no say on a GPU
    assert rollout_engine_args("cuda", "/m", kv_cache_gib=7.0) == rollout_engine_args("cuda", "/m", kv_cache_gib=1.0)


def test_what_runs_here_is_the_in_process_cpu_engine_with_its_workarounds() -> None:
    plan = rollout_engine_args("cpu", "/tiny", max_loras=2, max_cpu_loras=2, max_model_len=64, kv_cache_gib=1.0)
    assert plan.llm_kwargs == {
        "model": "/tiny",
        "dtype": "float32",
        "seed": 0,
        "max_model_len": 64,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 256 * 64,
        "enable_lora": True,
        "max_lora_rank": ENGINE_DEFAULTS["cpu"].max_lora_rank,
        "max_loras": 2,
        "max_cpu_loras": 2,
        "enforce_eager": True,
        "gpu_memory_utilization": ENGINE_DEFAULTS["cpu"].gpu_memory_utilization,
        "kv_cache_memory_bytes": GiB,
        "disable_log_stats": True,
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    }
    assert plan.in_process and plan.env_forced == {MULTIPROCESSING_ENV: "0"}
    assert plan.env_defaults == {CPU_KVCACHE_ENV: "1"}
    assert plan.install_cpu_lora_ops and plan.eager_sampler_ops and plan.pin_threads and plan.undo_cpu_worker_patches


def test_cpu_sizes_its_kv_cache_in_gib_and_ignores_the_gpu_memory_share() -> None:
    half = rollout_engine_args("cpu", "/tiny", kv_cache_gib=0.5, gpu_memory_utilization=0.95)
    assert half.llm_kwargs["kv_cache_memory_bytes"] == GiB // 2
    assert half.env_defaults == {}  # the variable holds whole GiB only; the bytes carry the size
    assert half.llm_kwargs["gpu_memory_utilization"] == ENGINE_DEFAULTS["cpu"].gpu_memory_utilization  # of host memory
    assert rollout_engine_args("cpu", "/tiny", kv_cache_gib=3).env_defaults == {CPU_KVCACHE_ENV: "3"}


def test_the_host_adapter_cache_is_never_smaller_than_the_slots() -> None:
    for platform in ("cpu", "cuda"):
        plan = rollout_engine_args(platform, "/m", max_loras=8, max_cpu_loras=2)
        assert plan.llm_kwargs["max_cpu_loras"] == 8  # vLLM refuses fewer


@pytest.mark.parametrize(
    "platform,kwargs,names",
    [
        ("cuda", {"max_lora_rank": 48}, "max_lora_rank 48"),
        ("cpu", {"max_lora_rank": 0}, "max_lora_rank 0"),
        ("cpu", {"tensor_parallel_size": 2}, "tensor_parallel_size 2"),
        ("cuda", {"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ("cuda", {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ("cpu", {"gpu_memory_utilization": -0.1}, "gpu_memory_utilization"),
        ("cuda", {"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ("cuda", {"max_loras": 0}, "max_loras"),
        ("cpu", {"max_model_len": 0}, "max_model_len"),
        ("cpu", {"kv_cache_gib": 0}, "kv_cache_gib"),
        ("tpu", {}, "platform 'tpu'"),
    ],
)
def test_bad_engine_arguments_are_one_line_errors_naming_the_argument(platform, kwargs, names) -> None:
    with pytest.raises(EngineArgsError) as info:
        rollout_engine_args(platform, "/m", **kwargs)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message and names in message


def test_a_bad_rank_error_lists_the_ranks_vllm_accepts() -> None:
    with pytest.raises(EngineArgsError, match="1, 8, 16, 32, 64, 128, 256, 320, 512"):
        rollout_engine_args("cuda", "/m", max_lora_rank=100)


def test_the_default_max_lora_rank_loads_every_shipped_config_and_rounds_up_to_a_vllm_rank() -> None:
    specs = {p.name: yaml.safe_load(p.read_text()) for p in sorted((REPO / "configs").glob("*.yaml"))}
    ranks = {name: spec["lora"]["rank"] for name, spec in specs.items() if "lora" in spec}  # full FT: none
    assert 32 in ranks.values()  # the 7B example
    gpu = default_max_lora_rank("cuda")
    assert gpu == ENGINE_DEFAULTS["cuda"].max_lora_rank >= max(ranks.values()) and gpu in LORA_RANKS
    assert default_max_lora_rank("cuda", ranks.values()) == gpu
    assert default_max_lora_rank("cuda", [100]) == 128 and default_max_lora_rank("cuda", [256]) == 256
    with pytest.raises(EngineArgsError, match="up to rank 512"):
        default_max_lora_rank("cuda", [600])
    # CPU: every adapter slot is multiplied at the padded rank, so the default is the smallest
    # vLLM rank above the tiny configs' (those that run on CPU), not the GPU's
    tiny = [rank for name, rank in ranks.items() if name.startswith("tiny")]
    cpu = default_max_lora_rank("cpu")
    assert tiny and cpu >= max(tiny) and cpu < gpu
    assert rollout_engine_args("cpu", "/m").llm_kwargs["max_lora_rank"] == cpu
    assert rollout_engine_args("cuda", "/m").llm_kwargs["max_lora_rank"] == gpu


def test_adapter_slots_grow_with_the_jobs_up_to_a_cap_with_a_host_cache_twice_as_large() -> None:
    assert adapter_slots(3) == (3, 6)
    assert adapter_slots(0) == (1, 2)
    big_loras, big_cache = adapter_slots(1000)
    assert big_loras == 16 and 2 * big_loras <= big_cache <= 1000
    assert adapter_slots(10, "cpu")[0] == 4  # on CPU every slot costs a multiply per token
    assert adapter_slots(10, "cuda", max_slots=4) == (4, 10)
    for jobs in range(0, 200, 7):
        for platform in ("cpu", "cuda"):
            loras, cached = adapter_slots(jobs, platform)
            assert 1 <= loras <= max(jobs, 1) and cached >= 2 * loras
            rollout_engine_args(platform, "/m", max_loras=loras, max_cpu_loras=cached)  # vLLM-valid
    with pytest.raises(EngineArgsError, match="expected_jobs"):
        adapter_slots(-1)


def test_the_platform_is_cuda_exactly_when_torch_sees_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from worker.engine_args import platform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform() == "cpu"
