"""Every private or unstable vLLM name the worker relies on, in one place.

Each name is reached through a constant or a small function here, with the reason the worker
needs it; ``tests/test_vllm_private.py`` checks each against the installed vLLM (import path,
attribute, parameters), so an upgrade that moves or renames one fails there with the name,
not deep inside an engine start. Written against vLLM 0.32.0.

Invariant: importing this module imports neither vLLM nor torch (``worker.engine_args``, a
pure module, reads its constants); the functions import what they touch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# ---------------------------------------------------------------- environment (vllm/envs.py)

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0": the engine core runs in the caller's process
CPU_KVCACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # KV cache GiB of the CPU backend (whole numbers only)

# ---------------------------------------------------------------- configuration

# vllm.config.lora.MaxLoRARanks: the only max_lora_rank values LoRAConfig accepts (a Literal)
LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_RANKS_AT = ("vllm.config.lora", "MaxLoRARanks")

# ---------------------------------------------------------------- requests (LLM.llm_engine)

# LLM has no public call that adds requests without running them to the end, so continuous
# batching drives its v1 LLMEngine ("legacy, for backwards compatibility" in 0.32):
# add_request / step / abort_request / has_unfinished_requests / add_lora / remove_lora / list_loras.
# method: (the parameters the worker passes by position, those it passes by keyword)
ENGINE_METHODS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "add_request": (("request_id", "prompt", "params"), ("lora_request",)),
    "step": ((), ()),
    "abort_request": (("request_ids",), ("internal",)),
    "has_unfinished_requests": ((), ()),
    "add_lora": (("lora_request",), ()),
    "remove_lora": (("lora_id",), ()),
    "list_loras": ((), ()),
}


# ---------------------------------------------------------------- worker RPCs (LLM.collective_rpc)

# A full fine-tuning job's published weights are loaded in place through the worker's
# ``reload_weights`` (GPUModelRunner's, which CPUModelRunner inherits): not part of LLM's API.
# (class module, class name, method, the keywords the worker passes)
RELOAD_WEIGHTS = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "reload_weights")
RELOAD_WEIGHTS_KWARGS = ("weights_path", "is_checkpoint_format")
RELOAD_WEIGHTS_WORKERS = (("vllm.v1.worker.gpu_worker", "Worker"), ("vllm.v1.worker.cpu_worker", "CPUWorker"))


def reload_weights(llm: Any, weights_path: str) -> None:
    """Load the safetensors checkpoint in ``weights_path`` into the engine's model, in place."""
    method = RELOAD_WEIGHTS[2]
    llm.collective_rpc(method, kwargs=dict(zip(RELOAD_WEIGHTS_KWARGS, (weights_path, True))))


def llm_engine(llm: Any) -> Any:
    """The ``LLMEngine`` inside an ``LLM`` (``LLM.llm_engine``: an attribute, not documented API)."""
    return llm.llm_engine


def render_prompts(llm: Any, prompts: Sequence[str | list[int]]) -> list[Any]:
    """Prompts (text, or token ids as they are) as engine inputs for ``LLMEngine.add_request``,
    text tokenized as ``LLM.generate`` does (``LLMEngine.renderer.render_cmpl``: new in the 0.1x
    renderer refactor; passing raw text to ``add_request`` instead is deprecated there)."""
    return list(
        llm.llm_engine.renderer.render_cmpl(
            [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
        )
    )


def shutdown_engine(llm: Any) -> None:
    """Stop the engine core (and its processes when it runs in its own): neither ``LLM`` nor
    ``LLMEngine`` has a public close in 0.32 (``LLMEngine.engine_core.shutdown``)."""
    llm.llm_engine.engine_core.shutdown()


def release_process_state() -> None:
    """Free the process-global state an engine leaves (torch.distributed group, vLLM's env
    cache) so another engine can start in this process (vLLM's own tests call it)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


# ---------------------------------------------------------------- outputs

FLAT_LOGPROBS_AT = ("vllm.logprobs", "FlatLogprobs")
FLAT_LOGPROBS_FIELDS = ("start_indices", "token_ids", "logprobs", "ranks")


def sampled_token_logprobs(steps: Any, since: int = 0) -> tuple[list[int], list[float]]:
    """The first entry of each position (from ``since``) of a ``FlatLogprobs`` (with
    ``logprobs=0``: the sampled token's id and log-prob). ``SamplingParams(flat_logprobs=True)``
    is new in 0.1x and its layout (start indices into flat lists) is not documented API."""
    starts, ids, values = list(steps.start_indices)[since:], steps.token_ids, steps.logprobs
    return [ids[i] for i in starts], [float(values[i]) for i in starts]


def sampled_topk_logprobs(steps: Any, k: int, since: int = 0) -> list[list[tuple[int, float]]]:
    """The ``k`` likeliest tokens at each sampled position (from ``since``), most likely first,
    from a ``FlatLogprobs`` with ``logprobs=k``: each position holds the sampled token's entry (its
    own rank), then the top k by rank (1 is the likeliest; the sampled token may be among them)."""
    starts, ids, values, ranks = list(steps.start_indices), steps.token_ids, steps.logprobs, steps.ranks
    out = []
    for a, b in list(zip(starts, [*starts[1:], len(ids)]))[since:]:
        best: dict[int, tuple[int, float]] = {}
        for i in range(a + 1, b):  # past the sampled token's own entry
            if ranks[i] is not None and 1 <= ranks[i] <= k:
                best.setdefault(ranks[i], (ids[i], float(values[i])))
        out.append([best[r] for r in sorted(best)])
    return out


def prompt_token_logprobs(prompt_ids: list[int], steps: Any) -> list[float | None]:
    """Each prompt token's log-prob (None for the first, which nothing predicts) from vLLM's
    prompt log-probs with ``prompt_logprobs=0``: a ``FlatLogprobs`` (positions by start index,
    the prompt token's entry among each position's) or a list of per-position dicts (None at
    the first). A list one shorter than the prompt leaves the first position out."""
    if hasattr(steps, "start_indices"):
        starts, ids, values = list(steps.start_indices), steps.token_ids, steps.logprobs
        positions = list(zip(starts, [*starts[1:], len(ids)]))
    else:
        positions = list(steps)
    skip = len(prompt_ids) - len(positions)
    if skip not in (0, 1):
        raise ValueError(f"vLLM gave {len(positions)} prompt log-probs for {len(prompt_ids)} prompt tokens")
    out: list[float | None] = [None] * skip
    for position, token in zip(positions, prompt_ids[skip:]):
        if position is None:
            out.append(None)
        elif isinstance(position, tuple):
            a, b = position
            out.append(next((float(values[i]) for i in range(a, b) if ids[i] == token), None))
        else:
            entry = position.get(token)
            out.append(None if entry is None else float(entry.logprob))
    return out


def prompt_topk_logprobs(prompt_ids: list[int], steps: Any, k: int) -> list[list[tuple[int, float]] | None]:
    """The ``k`` likeliest tokens at each prompt position, most likely first (None for the first
    position), from vLLM's prompt log-probs with ``prompt_logprobs=k``: each position holds the
    prompt token's entry and the top k by rank (1 is the likeliest), in a ``FlatLogprobs`` (with
    its ``ranks``) or a per-position dict of ``Logprob`` (None at the first)."""
    if hasattr(steps, "start_indices"):
        starts, ids, values, ranks = list(steps.start_indices), steps.token_ids, steps.logprobs, steps.ranks
        positions: list[Any] = [
            [(ids[i], float(values[i]), ranks[i]) for i in range(a, b)] if b > a else None
            for a, b in zip(starts, [*starts[1:], len(ids)])
        ]
    else:
        positions = [None if p is None else [(t, float(lp.logprob), lp.rank) for t, lp in p.items()] for p in steps]
    skip = len(prompt_ids) - len(positions)
    if skip not in (0, 1):
        raise ValueError(f"vLLM gave {len(positions)} prompt log-probs for {len(prompt_ids)} prompt tokens")
    out: list[list[tuple[int, float]] | None] = [None] * skip
    for position in positions:
        if position is None:
            out.append(None)
            continue
        best: dict[int, tuple[int, float]] = {}  # rank -> token, log-prob; the prompt token may be among them
        for token, logprob, rank in position:
            if rank is not None and 1 <= rank <= k:
                best.setdefault(rank, (token, logprob))
        out.append([best[r] for r in sorted(best)])
    return out


# ---------------------------------------------------------------- the CPU backend

# vLLM's pure-torch LoRA ops, which worker/cpu_lora_ops.py replaces: the three bgmv ops in the
# module that defines them (its sgmv ops call them through these globals), its package, and the
# CPU punica wrapper, which imported them by name.
CPU_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
CPU_LORA_OP_MODULES = (
    "vllm.lora.ops.torch_ops.lora_ops",
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)


def cpu_lora_op_modules() -> list[ModuleType]:
    """The modules whose ``CPU_LORA_OPS`` globals vLLM's CPU LoRA layers call."""
    return [importlib.import_module(name) for name in CPU_LORA_OP_MODULES]


# The sampler counts each sampled token's rank (whenever log-probs are asked, the warm-up's
# included) with a ``torch.compile``d function: on CPU its first call compiles it with inductor,
# about 2 s of every engine start. The CPU engine calls the function it wraps, the same
# arithmetic run eagerly (``eager_sampler_ops``); a CUDA engine keeps the compiled kernel.
COMPILED_SAMPLER_OPS = (("vllm.v1.sample.sampler", "batched_count_greater_than"),)


def eager_sampler_ops() -> None:
    """Replace each of ``COMPILED_SAMPLER_OPS`` where the sampler calls it by the function
    ``torch.compile`` wrapped (idempotent)."""
    for module_name, name in COMPILED_SAMPLER_OPS:
        module = importlib.import_module(module_name)
        compiled = getattr(module, name)
        setattr(module, name, getattr(compiled, "_torchdynamo_orig_callable", compiled))


# In-process, vLLM's CPUWorker.init_device replaces ``torch.set_num_threads`` with a no-op that
# only warns; the engine keeps the real setter (torch's C binding) to pin its own threads, and
# puts ``torch.set_num_threads`` back after the engine is built.
CPU_WORKER_PATCH_AT = ("vllm.v1.worker.cpu_worker", "CPUWorker", "init_device")


def real_set_num_threads() -> Callable[[int], None]:
    """torch's own thread-count setter, whatever ``torch.set_num_threads`` has been replaced by."""
    import torch

    return torch._C.set_num_threads
