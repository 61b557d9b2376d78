"""Each private or unstable vLLM name in ``worker/vllm_private.py`` against the installed vLLM.

A vLLM upgrade that moves or renames one fails here, naming it (import path, attribute,
parameters), instead of failing an engine start. By introspection: no engine is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm

from worker import cpu_lora_ops, vllm_private
from worker.engine_args import rollout_engine_args


def resolve(module: str, *attrs: str) -> Any:
    """``module.attr.attr...``, or a failure that names what moved."""
    where = ".".join([module, *attrs])
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"vLLM {vllm.__version__}: module {module} is gone ({e}); update worker/vllm_private.py")
    for attr in attrs:
        if not hasattr(obj, attr):
            pytest.fail(f"vLLM {vllm.__version__}: {where} is gone (no {attr!r}); update worker/vllm_private.py")
        obj = getattr(obj, attr)
    return obj


def parameters(fn: Any) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def assigns(fn: Any, target: str) -> bool:
    """Whether ``fn``'s source assigns ``target`` (an attribute set in ``__init__``, a patch)."""
    return any(
        line.strip().startswith(f"{target} =") or line.strip().startswith(f"{target}:")
        for line in inspect.getsource(fn).splitlines()
    )


def test_the_environment_variables_the_engine_sets_are_vllms() -> None:
    known = resolve("vllm.envs", "environment_variables")
    for name in (vllm_private.MULTIPROCESSING_ENV, vllm_private.CPU_KVCACHE_ENV):
        assert name in known, f"vLLM {vllm.__version__} no longer reads {name}"


def test_the_lora_ranks_are_those_vllm_accepts() -> None:
    ranks = typing.get_args(resolve(*vllm_private.LORA_RANKS_AT))
    assert tuple(ranks) == vllm_private.LORA_RANKS, (
        f"vLLM {vllm.__version__} accepts max_lora_rank in {ranks}: update LORA_RANKS"
    )


def test_every_engine_keyword_of_both_platforms_is_an_engine_args_field() -> None:
    fields = {f.name for f in dataclasses.fields(resolve("vllm.engine.arg_utils", "EngineArgs"))}
    for platform in ("cpu", "cuda"):
        unknown = set(rollout_engine_args(platform, "/m").llm_kwargs) - fields
        assert not unknown, f"vLLM {vllm.__version__}: EngineArgs has no {sorted(unknown)} ({platform} plan)"


def test_the_llm_engine_has_the_calls_continuous_batching_uses() -> None:
    llm = resolve("vllm", "LLM")
    assert assigns(llm.__init__, "self.llm_engine"), "LLM no longer sets self.llm_engine"
    engine = resolve("vllm.v1.engine.llm_engine", "LLMEngine")
    for method, (positional, keywords) in vllm_private.ENGINE_METHODS.items():
        have = parameters(resolve("vllm.v1.engine.llm_engine", "LLMEngine", method))
        assert have[: len(positional)] == list(positional) and set(keywords) <= set(have), (
            f"LLMEngine.{method}{tuple(have)}: the worker passes {positional} by position, {keywords} by keyword"
        )
    assert assigns(engine.__init__, "self.renderer"), "LLMEngine no longer has a renderer"
    assert assigns(engine.__init__, "self.engine_core"), "LLMEngine no longer has an engine_core"


def test_prompts_render_through_the_renderer_as_llm_generate_does() -> None:
    render = resolve("vllm.renderers", "BaseRenderer", "render_cmpl")
    assert parameters(render)[:2] == ["prompts", "tok_params"], parameters(render)
    assert inspect.signature(render).parameters["tok_params"].default is None  # None: the completion defaults


def test_engine_clients_shut_down_and_the_process_state_is_released() -> None:
    for client in ("InprocClient", "SyncMPClient"):  # in-process (CPU) and own process (CUDA)
        resolve("vllm.v1.engine.core_client", client, "shutdown")
    resolve("vllm.distributed.parallel_state", "cleanup_dist_env_and_memory")


def test_flat_logprobs_keep_the_layout_the_engine_reads() -> None:
    flat = resolve(*vllm_private.FLAT_LOGPROBS_AT)
    fields = {f.name for f in dataclasses.fields(flat)}
    assert set(vllm_private.FLAT_LOGPROBS_FIELDS) <= fields, f"FlatLogprobs fields: {sorted(fields)}"
    from vllm.logprobs import Logprob
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    steps = flat()
    steps.append({7: Logprob(-0.5, 1, None), 3: Logprob(-1.0, 2, None)})
    steps.append({9: Logprob(-0.25, 1, None)})
    assert vllm_private.sampled_token_logprobs(steps) == ([7, 9], [-0.5, -0.25])
    params = SamplingParams(logprobs=0, flat_logprobs=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    assert params.flat_logprobs and not params.detokenize


def test_the_cpu_lora_ops_cpu_lora_ops_replaces_are_where_it_puts_its_own() -> None:
    assert vllm_private.CPU_LORA_OPS == cpu_lora_ops.OPS
    for module in vllm_private.CPU_LORA_OP_MODULES:
        for op in vllm_private.CPU_LORA_OPS:
            resolve(module, op)
    defining = vllm_private.CPU_LORA_OP_MODULES[0]
    for op in vllm_private.CPU_LORA_OPS:  # vLLM calls ours as its own: by position, the defaults by name
        theirs = inspect.signature(resolve(defining, op)).parameters.values()
        ours = inspect.signature(getattr(cpu_lora_ops, op)).parameters.values()
        shape = [(p.name if p.default is not p.empty else "", p.default) for p in theirs]
        assert shape == [(p.name if p.default is not p.empty else "", p.default) for p in ours], (
            f"{defining}.{op}{inspect.signature(resolve(defining, op))} "
            f"!= worker.cpu_lora_ops.{op}{inspect.signature(getattr(cpu_lora_ops, op))}"
        )
    for sgmv, bgmv in (
        ("sgmv_shrink", "bgmv_shrink"),
        ("sgmv_expand", "bgmv_expand"),
        ("sgmv_expand_slice", "bgmv_expand_slice"),
    ):  # prefill reaches ours through globals
        assert bgmv in resolve(defining, sgmv).__code__.co_names, f"{defining}.{sgmv} no longer calls {bgmv}"


def test_the_samplers_compiled_ops_wrap_what_the_cpu_engine_calls_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    for module_name, name in vllm_private.COMPILED_SAMPLER_OPS:
        module = importlib.import_module(module_name)
        compiled = getattr(importlib.import_module(getattr(module, name).__module__), name)  # where vLLM defines it
        assert hasattr(compiled, "_torchdynamo_orig_callable"), f"{module_name}.{name} is no longer torch.compile'd"
        assert name in resolve(module_name, "Sampler").gather_logprobs.__code__.co_names
        monkeypatch.setattr(module, name, compiled)  # as vLLM leaves it
        vllm_private.eager_sampler_ops()
        vllm_private.eager_sampler_ops()  # idempotent
        eager = getattr(module, name)
        assert eager is compiled._torchdynamo_orig_callable
        x, values = torch.randn(5, 11), torch.randn(5, 1)
        assert torch.equal(eager(x, values), (x >= values).sum(-1))


def test_the_cpu_worker_still_replaces_torch_set_num_threads() -> None:
    init_device = resolve(*vllm_private.CPU_WORKER_PATCH_AT)
    assert assigns(init_device, "torch.set_num_threads"), (
        "vLLM's CPUWorker.init_device no longer replaces torch.set_num_threads: "
        "the undo in RolloutEngine._start (undo_cpu_worker_patches) may go"
    )
    import torch

    assert vllm_private.real_set_num_threads() is torch._C.set_num_threads


def test_in_place_weight_loads_reach_the_model_runner_of_both_platforms():
    module, cls, method = vllm_private.RELOAD_WEIGHTS
    runner = resolve(module, cls, method)
    assert set(vllm_private.RELOAD_WEIGHTS_KWARGS) <= set(parameters(runner)), parameters(runner)
    for worker_module, worker_cls in vllm_private.RELOAD_WEIGHTS_WORKERS:
        assert callable(resolve(worker_module, worker_cls, method))  # what collective_rpc calls by name


def test_prompt_logprobs_are_read_from_flat_lists_and_from_dicts() -> None:
    from types import SimpleNamespace

    from worker.vllm_private import prompt_token_logprobs

    prompt = [5, 7, 9]
    # positions 1 and 2 (the first left out), each with the prompt token's entry among others
    flat = SimpleNamespace(start_indices=[0, 2], token_ids=[3, 7, 9, 4], logprobs=[-0.1, -0.2, -0.3, -0.4])
    assert prompt_token_logprobs(prompt, flat) == [None, -0.2, -0.3]
    entry = lambda lp: SimpleNamespace(logprob=lp)  # noqa: E731
    dicts = [None, {7: entry(-1.5)}, {9: entry(-2.5), 1: entry(-0.1)}]
    assert prompt_token_logprobs(prompt, dicts) == [None, -1.5, -2.5]
    with pytest.raises(ValueError, match="prompt log-probs for 3 prompt tokens"):
        prompt_token_logprobs(prompt, [None])
