"""The memory plan of a node: what each engine holds, how much KV cache and job state fit, what does not.

Pure arithmetic over a model's ``config.json`` (Llama/Qwen2-style) and the cluster's settings, no
torch, so ``plexctl plan`` and ``plexctl up`` can show it on a login node before anyone spends
GPU-hours. It owns the model's sizes (``parameter_count``, ``weights_bytes``, ``kv_bytes_per_token``,
``lora_slots_bytes``); a trainer's step, decided once (``trainer_step``, and ``worker_step`` from
what a worker knows at start: gradient checkpointing and the peak from
``plexctl.common.step_memory``); the shapes a plan is made of (``NodeShape`` "8x80G",
``EngineShape``, ``PlanSettings`` from a ``ClusterConfig`` by ``plan_settings``, ``JobShape``,
``default_engines``); ``plan_memory`` -> ``MemoryPlan`` with ``render_plan`` / ``plan_json``; and
submit's refusals (``step_problem`` / ``spec_step_problem``, ``job_problems``,
``full_job_problems``, ``check_full_state_fits``: exit 7).
What the engines get unless told is ``plexctl.common.engine_defaults``'s: a plan assumes a GPU
worker's (``plan_settings``), read from there, never restated; the settings themselves are
``ClusterConfig``'s, with its defaults.

Trainer engines may be wide (``trainer_width``: the smallest width whose per-rank step fits one GPU,
or the cluster's ``trainer_width``): a rank of N holds 1/N of the base weights but a whole lm_head
(``rank_weights_bytes``), 1/N of a full job's state and gradients but its lm_head's part, and a
LoRA job's whole (``rank_job_bytes``, as the runtime lays them out) plus ``fsdp_buffer_bytes``, a micro-batch's
activations whole (the ranks split a step's rows), and its own host and NVMe tier; width 1 is the
single-GPU trainer, figure for figure.

Invariants: every byte count is per GPU (a rollout engine of tp GPUs holds 1/tp of the weights,
of the KV heads and of the sharded LoRA factors; a trainer rank, what that rank holds); a plan with
no problems fits with the estimates here (activation peaks, CUDA reserves: documented constants,
a little generous, so "fits" leaves room to spare); a job ``job_problems`` refuses can never run
on these engines, whatever else runs.

Placement rule: engines own their GPUs. When they ask for more GPUs than the node has, each
missing GPU is one single-GPU trainer and one single-GPU rollout engine sharing a GPU (the 1-GPU
layout): the trainer is planned first, and the rollout engine gets ``gpu_memory_utilization`` of
what the trainer leaves. Engines of 0 GPUs run on the CPU, in host memory, beside the host tiers.
It does not place engines on real GPUs (``plexctl.common.layout`` does) nor measure anything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from plexctl.common.cluster_config import DEFAULTS, ClusterConfig
from plexctl.common.engine_defaults import CPU_KV_CACHE_GIB, ENGINE_DEFAULTS, adapter_slots
from plexctl.common.errors import Refused
from plexctl.common.sizes import fmt_bytes, parse_bytes
from plexctl.common.spec import DEFAULT_TARGET_MODULES
from plexctl.common.state_policy import STATE_TIERS, TIER_KINDS, tier_budgets
from plexctl.common.state_size import (
    FP32_BYTES,
    FullStateSize,
    dtype_bytes,
    full_state_size,
    job_state_bytes,
    lora_module_shapes,
    parameter_count,
)
from plexctl.common.step_memory import (
    Checkpointing,
    StepPeak,
    choose_checkpointing,
    memory_fraction,
    step_peak,
    trainer_share_bytes,
)

if TYPE_CHECKING:
    from plexctl.common.spec import JobSpec

GiB = 1 << 30
ALL_PROJECTIONS = tuple(DEFAULT_TARGET_MODULES)
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # tp splits their input; the other projections split their output
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM (0.32) accepts as max_lora_rank

CONTEXT_CAP = 4096  # max_model_len unless told: the model's context, at most this (engine_args)
ROLLOUT_STEP_TOKENS = 16384  # tokens in one engine step (worker.rollout's BATCHED_TOKENS): vLLM's profiled peak
ROLLOUT_STEP_SEQS = 256  # sequences in one engine step (worker.rollout's MAX_NUM_SEQS): the sampler's logits
ROLLOUT_GPU_RUNTIME_BYTES = 3 * GiB // 2  # CUDA graphs, CUDA context and NCCL buffers of a vLLM GPU process
TRAINER_GPU_RUNTIME_BYTES = 2 * GiB  # CUDA context, cuBLAS and attention workspaces, allocator fragmentation
CPU_RUNTIME_BYTES = 1 * GiB  # Python, torch and vLLM of a CPU worker process
DEFAULT_PROMPT_TOKENS = 512  # a job spec does not bound its prompts: a plan assumes prompts of up to this many
GPU_DEFAULTS = ENGINE_DEFAULTS["cuda"]  # what a GPU worker's engines get unless told: what a plan assumes
DEFAULT_MICRO_BATCH_TOKENS = GPU_DEFAULTS.micro_batch_tokens  # a trainer micro-batch's (at least one sequence)
CPU_KV_CACHE_BYTES = int(CPU_KV_CACHE_GIB * GiB)  # KV cache of a CPU rollout engine
DEFAULT_LOGITS_CHUNK_TOKENS = 1024  # tokens whose logits the trainer materialises at once (chunked log-probs)
DEFAULT_HOST = "256G"  # host memory of a node when not told (a conservative GPU node)
DEFAULT_NVME = "1T"  # node-local NVMe of a node when not told
FSDP_GATHERED_LAYERS = 2  # a wide trainer's unsharded layers at once: the one computing and the next, prefetched
MAX_TRAINER_WIDTH = 1024  # the widest trainer engine a plan looks for when naming the width a step needs


# ---------------------------------------------------------------- model sizes


def _head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))


def _kv_heads(config: Mapping[str, Any]) -> int:
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])


def weights_bytes(config: Mapping[str, Any], dtype: str) -> int:
    return parameter_count(config) * dtype_bytes(dtype)


def kv_bytes_per_token(config: Mapping[str, Any], dtype: str, tp: int) -> int:
    """K and V of one token on one GPU of a tp-way engine (KV heads split, replicated when fewer than tp)."""
    heads_per_gpu = math.ceil(_kv_heads(config) / max(tp, 1))
    return 2 * int(config["num_hidden_layers"]) * heads_per_gpu * _head_dim(config) * dtype_bytes(dtype)


def adapter_params(config: Mapping[str, Any], rank: int, target_modules: Sequence[str] = ALL_PROJECTIONS) -> int:
    shapes = lora_module_shapes(config)
    return int(config["num_hidden_layers"]) * sum(rank * (shapes[m][0] + shapes[m][1]) for m in set(target_modules))


def lora_slots_bytes(config: Mapping[str, Any], max_loras: int, max_lora_rank: int, dtype: str, tp: int) -> int:
    """The rollout engine's adapter slots on one GPU: ``max_loras`` adapters of ``max_lora_rank`` on
    all 7 projections, in the engine dtype (vLLM allocates them whatever the loaded ranks are)."""
    tp = max(tp, 1)
    per_layer = 0
    for module in ALL_PROJECTIONS:
        n_in, n_out = lora_module_shapes(config)[module]
        if module in ROW_PARALLEL:
            per_layer += max_lora_rank * (math.ceil(n_in / tp) + n_out)
        else:
            per_layer += max_lora_rank * (n_in + math.ceil(n_out / tp))
    return max_loras * int(config["num_hidden_layers"]) * per_layer * dtype_bytes(dtype)


def rollout_activation_bytes(config: Mapping[str, Any], dtype: str, tp: int) -> int:
    """vLLM's profiled peak of one engine step: ``ROLLOUT_STEP_TOKENS`` tokens through the widest
    layer (gate/up output, activation, residual and attention buffers) and the sampler's fp32
    logits and probabilities of ``ROLLOUT_STEP_SEQS`` sequences."""
    hidden, intermediate = int(config["hidden_size"]), int(config["intermediate_size"])
    step = ROLLOUT_STEP_TOKENS * (3 * math.ceil(intermediate / max(tp, 1)) + 4 * hidden) * dtype_bytes(dtype)
    sampler = ROLLOUT_STEP_SEQS * int(config["vocab_size"]) * FP32_BYTES * 2
    return step + sampler


def layer_parameters(config: Mapping[str, Any]) -> int:
    """Parameters of one decoder layer (projections, their biases, its two norms)."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return (parameter_count(config) - embeddings - hidden) // int(config["num_hidden_layers"])


def rank_weights_bytes(config: Mapping[str, Any], dtype: str, width: int) -> int:
    """One rank's bytes of the base weights on a trainer engine of ``width`` GPUs, as the runtime
    shards them (``TrainerEngine.shard_base``): every parameter but the lm_head split evenly, the
    lm_head whole on every rank (the chunked log-probs read it outside a forward); with tied
    embeddings the embedding is split and the lm_head is a whole copy of it. Width 1: the weights."""
    weights = weights_bytes(config, dtype)
    if width <= 1:
        return weights
    head = int(config["vocab_size"]) * int(config["hidden_size"]) * dtype_bytes(dtype)
    sharded = weights if config.get("tie_word_embeddings", False) else weights - head
    return math.ceil(sharded / width) + head


def rank_job_bytes(config: Mapping[str, Any], nbytes: int, job: JobShape, width: int, fixed: int = 0) -> int:
    """One rank's share of a job's ``nbytes`` of state or gradients on a trainer engine of
    ``width``: a LoRA job's adapter and moments are whole on every rank (replicated); a full
    fine-tuning job's are cut as the base's parameters are (``worker.shards``): split evenly but an
    untied lm_head's part, whole on every rank, and ``fixed`` bytes of it not per parameter (step
    counts, RNG state) whole."""
    if not job.full or width <= 1:
        return nbytes
    params = parameter_count(config)
    tied = config.get("tie_word_embeddings", False)
    head = 0 if tied else int(config["vocab_size"]) * int(config["hidden_size"])
    per_param = nbytes - fixed
    head_bytes = per_param * head // params
    return math.ceil((per_param - head_bytes) / width) + head_bytes + fixed


def fsdp_buffer_bytes(config: Mapping[str, Any], dtype: str, job: JobShape, width: int) -> int:
    """What sharding a trainer over ``width`` GPUs adds to each rank's step (0 at width 1): FSDP's
    all-gather buffers, ``FSDP_GATHERED_LAYERS`` decoder layers' full parameters in the compute
    dtype (the layer computing and the next, prefetched), and for full fine-tuning the
    reduce-scatter buffer of one layer's gradients in fp32 (a LoRA adapter is replicated: its
    gradients are reduced in place). A full job of a model with tied embeddings also holds its
    lm_head gathered whole from the split embedding, the head's whole gradient, and that gradient
    in fp32 as it is summed over the ranks (``TrainingMath.job_weights``)."""
    if width <= 1:
        return 0
    layer = layer_parameters(config)
    trainable = layer if job.full else 0
    tied = job.full and config.get("tie_word_embeddings", False)
    head = int(config["vocab_size"]) * int(config["hidden_size"]) if tied else 0
    gathered = FSDP_GATHERED_LAYERS * layer * dtype_bytes(dtype) + trainable * FP32_BYTES
    return gathered + head * (2 * dtype_bytes(dtype) + FP32_BYTES)


def trainer_step(
    config: Mapping[str, Any],
    dtype: str,
    tokens: int,
    asked: str,
    room_bytes: int,
    *,
    states: int,
    job: JobShape | None = None,
    chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS,
    cuda: bool = True,
    width: int = 1,
) -> StepPeak:
    """The step a trainer runs, decided once: gradient checkpointing as ``asked`` (auto: off
    where the step without it fits ``room_bytes``, the trainer's share of its GPU less its
    runtime), and that step's peak (``step_memory.step_peak``) for micro-batches of ``tokens``
    with ``states`` bytes of job state on the device. ``job``: the largest job (None: one at a
    GPU's default ``max_lora_rank`` on every projection, the most its rollout engine loads).

    ``width``: the GPUs of the trainer engine; the peak is one rank's. FSDP2 shards the base
    weights but the lm_head (``rank_weights_bytes``); a full fine-tuning job's states and gradients
    (and autocast's casts of its weights) are split as the base is, its lm_head's part whole, a
    LoRA job's are whole on every rank
    (``rank_job_bytes``); plus ``fsdp_buffer_bytes`` (counted as workspace). Each rank runs
    micro-batches of ``tokens`` of its own, so activations are not divided. Width 1 is the
    single-GPU trainer, unchanged."""
    job = job or JobShape("", GPU_DEFAULTS.max_lora_rank, 0)
    width = max(1, width)
    weights = rank_weights_bytes(config, dtype, width)
    trainable = parameter_count(config) if job.full else adapter_params(config, job.rank, job.target_modules)
    buffers = fsdp_buffer_bytes(config, dtype, job, width) if cuda else 0

    def peak(checkpointing: bool) -> StepPeak:
        step = step_peak(
            config,
            tokens,
            dtype,
            checkpointing,
            weights=weights,
            states=rank_job_bytes(config, states, job, width),
            trainable_params=rank_job_bytes(config, trainable, job, width),
            rank=job.rank,
            target_modules=job.target_modules,
            full=job.full,
            chunk_tokens=chunk_tokens,
            cuda=cuda,
        )
        return replace(step, workspace=step.workspace + buffers) if buffers else step

    without = peak(False)
    return peak(choose_checkpointing(asked, without.total <= room_bytes, cuda))


def trainer_widths(limit: int, dividing: int | None = None) -> list[int]:
    """The widths a trainer engine is given: 1, 2, 4, 8, ... up to ``limit``, each dividing
    ``dividing`` GPUs where given (every GPU of them in an engine of that width)."""
    widths, width = [], 1
    while width <= limit:
        if dividing is None or dividing % width == 0:
            widths.append(width)
        width *= 2
    return widths


def step_fits_width(
    config: Mapping[str, Any],
    job: JobShape,
    dtype: str,
    gpu_bytes: int,
    width: int,
    cluster: ClusterConfig = DEFAULTS,
    *,
    tokens: int | None = None,
    state: int | None = None,
) -> bool:
    """Whether one rank's step of ``job`` on a trainer engine of ``width`` GPUs of ``gpu_bytes``
    fits the GPU less its runtime: its own ``state`` (None: ``job``'s) on the device, as a submit
    check counts it (more device slots are a cache, said apart: "lower device_slots"),
    micro-batches of ``tokens`` (None: ``job``'s, at most the cluster's budget) and
    checkpointing as the cluster asks."""
    options = plan_settings(cluster)
    tokens = tokens if tokens is not None else min(job.peak_tokens, options.micro_batch_tokens)
    state = state if state is not None else job_sizes(config, job, dtype, cuda=True)[0]
    room = gpu_bytes - TRAINER_GPU_RUNTIME_BYTES
    step = trainer_step(
        config,
        dtype,
        tokens,
        options.gradient_checkpointing,
        room,
        states=state,
        job=job,
        width=width,
    )
    return step.total <= room


def trainer_width(
    config: Mapping[str, Any],
    job: JobShape,
    dtype: str,
    gpu_bytes: int,
    trainer_gpus: int,
    cluster: ClusterConfig = DEFAULTS,
    *,
    tokens: int | None = None,
    state: int | None = None,
) -> int:
    """The GPUs of a trainer engine training ``job`` (the largest it holds, full or LoRA) on
    GPUs of ``gpu_bytes``, ``trainer_gpus`` of them in all: ``cluster.trainer_width`` when
    set; else the smallest of ``trainer_widths(trainer_gpus, trainer_gpus)`` whose per-rank step
    fits one GPU (``step_fits_width``), 1 where one GPU holds the step; 1 also when none does (the
    plan then says what does not fit, with today's single-GPU figures, and
    ``needed_trainer_width`` what width would)."""
    if cluster.trainer_width is not None:
        return cluster.trainer_width
    widths = trainer_widths(trainer_gpus, trainer_gpus) or [1]
    fits = (w for w in widths if step_fits_width(config, job, dtype, gpu_bytes, w, cluster, tokens=tokens, state=state))
    return next(fits, 1)


def needed_trainer_width(
    config: Mapping[str, Any],
    job: JobShape,
    dtype: str,
    gpu_bytes: int,
    cluster: ClusterConfig = DEFAULTS,
    *,
    tokens: int | None = None,
    state: int | None = None,
) -> int | None:
    """The smallest width of 1, 2, 4, ... (at most ``MAX_TRAINER_WIDTH``) whose per-rank step fits
    one GPU of ``gpu_bytes``, whatever GPUs a node has; None when none does (the activations of
    one micro-batch, which sharding does not divide, exceed the GPU)."""
    widths = trainer_widths(MAX_TRAINER_WIDTH)
    fits = (w for w in widths if step_fits_width(config, job, dtype, gpu_bytes, w, cluster, tokens=tokens, state=state))
    return next(fits, None)


def model_context(config: Mapping[str, Any]) -> int:
    return int(config.get("max_position_embeddings") or CONTEXT_CAP)


# ---------------------------------------------------------------- the shapes a plan is made of


_GPUS = re.compile(r"^\s*(\d+)\s*[x×*]\s*(\S.*)$", re.IGNORECASE)


def parse_gpus(text: str) -> tuple[int, int]:
    """``"8x80G"`` -> (8, 80 GiB); ``"0"``, ``"cpu"`` or ``"none"`` -> (0, 0). Raises ValueError."""
    if text.strip().lower() in ("0", "cpu", "none"):
        return 0, 0
    m = _GPUS.match(text)
    if not m:
        raise ValueError(f"not a GPU shape: {text!r} (examples: 8x80G, 1x141G, 0)")
    try:
        count, size = int(m.group(1)), parse_bytes(m.group(2))
    except ValueError:
        raise ValueError(f"not a GPU shape: {text!r} (examples: 8x80G, 1x141G, 0)") from None
    if count > 0 and size <= 0:
        raise ValueError(f"GPUs of no memory: {text!r}")
    return count, size if count else 0


@dataclass(frozen=True)
class NodeShape:
    """One node: its GPUs (count and memory each), host memory and node-local NVMe."""

    gpus: int
    gpu_bytes: int
    host_bytes: int
    nvme_bytes: int

    @classmethod
    def parse(cls, gpus: str, host: str | int = DEFAULT_HOST, nvme: str | int = DEFAULT_NVME) -> NodeShape:
        count, size = parse_gpus(gpus)
        return cls(count, size, parse_bytes(host), parse_bytes(nvme))

    def describe(self) -> str:
        gpus = (
            f"{self.gpus} x {_size(self.gpu_bytes)} {'GPU' if self.gpus == 1 else 'GPUs'}" if self.gpus else "no GPUs"
        )
        return f"{gpus}, host {_size(self.host_bytes)}, NVMe {_size(self.nvme_bytes)}"


EngineKind = Literal["rollout", "trainer"]


@dataclass(frozen=True)
class EngineShape:
    """One engine on the node: a rollout engine of ``gpus`` = tensor parallelism, or a trainer;
    ``gpus`` 0 runs it on the CPU."""

    kind: EngineKind
    gpus: int

    def __post_init__(self) -> None:
        if self.kind not in ("rollout", "trainer"):
            raise ValueError(f"engine kind {self.kind!r}: rollout or trainer")
        if self.gpus < 0:
            raise ValueError(f"engine of {self.gpus} GPUs")


def default_engines(gpus: int, tp: int = DEFAULTS.tp) -> list[EngineShape]:
    """The engines of a node of ``gpus`` GPUs when nobody says otherwise.

    0 GPUs: one CPU worker with both engines; 1 GPU: a rollout engine and a trainer sharing it;
    G GPUs: max(1, G // 4) single-GPU trainers and as many tp-GPU rollout engines as the other
    GPUs hold (8 -> 6 rollout + 2 trainer). Raises ValueError when no rollout engine of tp fits."""
    if tp < 1:
        raise ValueError(f"tp {tp}: at least 1")
    if gpus <= 0:
        return [EngineShape("rollout", 0), EngineShape("trainer", 0)]
    if gpus == 1:
        if tp > 1:
            raise ValueError(f"tp {tp} on a node of 1 GPU")
        return [EngineShape("rollout", 1), EngineShape("trainer", 1)]
    trainers = max(1, gpus // 4)
    rollouts = (gpus - trainers) // tp
    if rollouts == 0:
        raise ValueError(f"tp {tp}: {gpus} GPUs less {trainers} trainer(s) leave no room for a rollout engine")
    return [EngineShape("rollout", tp)] * rollouts + [EngineShape("trainer", 1)] * trainers


@dataclass(frozen=True)
class PlanSettings:
    """A ``ClusterConfig``'s engine settings as a plan uses them (``plan_settings``): sizes in bytes,
    and what the config leaves to the platform resolved to a GPU worker's (``ENGINE_DEFAULTS["cuda"]``;
    the dtype, the node's platform's: ``engine_dtype``). No defaults of its own."""

    gpu_memory_utilization: float  # share of a rollout engine's GPU vLLM may use
    max_lora_rank: int  # highest LoRA rank rollout engines load, each slot's size
    max_loras: int  # adapter slots of a rollout engine
    device_slots: int  # jobs whose state a trainer keeps on its device
    tier_bytes: dict[str, int]  # each storage tier of each trainer rank (``state_policy.tier_budgets``)
    max_model_len: int | None  # None: the model's context, at most CONTEXT_CAP
    micro_batch_tokens: int  # the trainer's micro-batch budget
    gradient_checkpointing: Checkpointing
    # the cluster's other base models, in the engines' dtype (``plans_for_specs``): on a GPU an
    # engine's other models sleep in pinned host memory, on the CPU they stay resident
    other_weights_bytes: int


def plan_settings(cluster: ClusterConfig, other_weights_bytes: int = 0) -> PlanSettings:
    """``cluster``'s settings for a plan; a setting left to the platform gets a GPU worker's value
    (its adapter slots by the worker's rule, ``adapter_slots``)."""
    return PlanSettings(
        gpu_memory_utilization=cluster.gpu_memory_utilization or GPU_DEFAULTS.gpu_memory_utilization,
        max_lora_rank=cluster.max_lora_rank or GPU_DEFAULTS.max_lora_rank,
        max_loras=cluster.max_loras or adapter_slots(cluster.jobs_per_engine, "cuda")[0],
        device_slots=cluster.device_slots,
        tier_bytes=tier_budgets(cluster),
        max_model_len=cluster.max_model_len,
        micro_batch_tokens=cluster.micro_batch_tokens or DEFAULT_MICRO_BATCH_TOKENS,
        gradient_checkpointing=cluster.gradient_checkpointing,
        other_weights_bytes=other_weights_bytes,
    )


def engine_dtype(cluster: ClusterConfig, node: NodeShape) -> str:
    """The engines' weight dtype: as set, else the default of the node's platform (a GPU's where it has GPUs)."""
    return ENGINE_DEFAULTS["cuda" if node.gpus else "cpu"].dtype if cluster.dtype == "auto" else cluster.dtype


@dataclass(frozen=True)
class JobShape:
    """What a plan needs to know of a job."""

    name: str
    rank: int
    max_seq_len: int  # prompt + completion tokens of one sequence
    target_modules: tuple[str, ...] = ALL_PROJECTIONS
    dtype: str | None = None  # the job's model.dtype (None: whatever the engines serve)
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS
    full: bool = False  # full fine-tuning (no adapter: rank 0, no target modules)

    @property
    def peak_tokens(self) -> int:
        """Tokens of its largest micro-batch (a micro-batch holds at least one whole sequence)."""
        return max(self.micro_batch_tokens, self.max_seq_len)


def job_shape(
    spec: JobSpec, prompt_tokens: int = DEFAULT_PROMPT_TOKENS, micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS
) -> JobShape:
    """A spec's shape. Sequences are ``prompt_tokens`` + ``sampling.max_tokens`` (multi-turn:
    ``env.max_total_tokens``, else the prompt and ``max_turns`` completions); the micro-batch is
    ``micro_batch_tokens`` or the whole step's tokens when fewer."""
    if spec.env is None:
        seq = prompt_tokens + spec.sampling.max_tokens
    elif spec.env.max_total_tokens is not None:
        seq = spec.env.max_total_tokens
    else:
        seq = prompt_tokens + spec.env.max_turns * spec.sampling.max_tokens
    step_tokens = spec.algo.prompts_per_step * spec.algo.group_size * seq
    return JobShape(
        name=spec.name,
        rank=spec.lora.rank if spec.lora is not None else 0,
        max_seq_len=seq,
        target_modules=tuple(spec.lora.target_modules) if spec.lora is not None else (),
        dtype=spec.model.dtype,
        micro_batch_tokens=max(seq, min(micro_batch_tokens, step_tokens)),
        full=spec.lora is None,
    )


def job_sizes(config: Mapping[str, Any], job: JobShape, dtype: str, cuda: bool) -> tuple[int, int]:
    """(state bytes, fp32 gradient bytes) of ``job`` on a model of ``config`` served in ``dtype``:
    an adapter's, or a full fine-tuning job's (weights, fp32 masters, AdamW moments; every weight's
    gradient)."""
    if job.full:
        size = full_state_size(config, job.dtype or dtype, cuda=cuda)
        return size.total, size.params * FP32_BYTES
    state = job_state_bytes(job.rank, list(job.target_modules), config, cuda=cuda)
    return state, adapter_params(config, job.rank, job.target_modules) * FP32_BYTES


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RolloutPlan:
    """One rollout engine, per GPU. ``budget_bytes`` is what vLLM may use (on the CPU: what it
    holds); the KV cache is what the budget leaves after weights, LoRA slots and reserve."""

    index: int
    gpus: int  # tp; 0: on the CPU
    shared: bool  # shares its GPU with a trainer
    gpu_bytes: int
    left_by_trainer: int  # shared: what the trainer leaves of the GPU
    memory_share: float  # the cluster's gpu_memory_utilization: the share of its GPU (or of what is left) it gets
    budget_bytes: int
    weights_bytes: int
    lora_slots_bytes: int
    reserve_bytes: int  # activation peak, sampler, CUDA graphs and context
    kv_bytes_per_token: int
    max_loras: int
    max_lora_rank: int

    @property
    def vllm_utilization(self) -> float:
        """The ``gpu_memory_utilization`` to give vLLM: the budget as a share of the whole GPU."""
        return self.budget_bytes / self.gpu_bytes if self.gpu_bytes else 0.0

    @property
    def fixed_bytes(self) -> int:
        return self.weights_bytes + self.lora_slots_bytes + self.reserve_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return max(0, self.budget_bytes - self.fixed_bytes)

    @property
    def kv_tokens(self) -> int:
        return self.kv_cache_bytes // self.kv_bytes_per_token


@dataclass(frozen=True)
class TrainerPlan:
    """One trainer engine, per GPU: of one GPU, or of ``gpus`` whose ranks each hold 1/gpus of the
    weights, job states and gradients and FSDP's buffers (on the CPU: in the host memory the rest
    leaves). Each rank keeps its own host and NVMe tier, holding its shard of each job's state."""

    index: int
    gpus: int  # its width; 0: on the CPU
    shared: bool  # shares its GPU with a rollout engine (planned first)
    capacity_bytes: int  # its GPU; on the CPU: host memory left by the CPU rollout engines and the host tiers
    weights_bytes: int
    device_slots: int
    job_state_bytes: int  # the largest job's state (no jobs: one at max_lora_rank on all projections)
    gradient_bytes: int  # fp32 gradients of the job being trained
    micro_batch_tokens: int
    activation_bytes: int  # what a micro-batch adds at the step's peak (activations, logits chunk, casts)
    runtime_bytes: int
    tier_bytes: dict[str, int]  # each storage tier of each rank, fastest first
    rollout_bytes: int = 0  # shared: the budget of the rollout engine on its GPU
    other_bases_bytes: int = 0  # the cluster's other base models, which it holds beside this one
    gradient_checkpointing: bool = True  # decided by ``trainer_step``
    step_peak_bytes: int = 0  # the step's estimated max_memory_allocated (weights, states, gradients, activations)
    room_bytes: int = 0  # its share of the GPU less runtime and other bases: what a step may reach
    fsdp_buffer_bytes: int = 0  # a wide trainer's all-gather and reduce-scatter buffers (fsdp_buffer_bytes)

    @property
    def device_state_bytes(self) -> int:
        return self.device_slots * self.job_state_bytes

    @property
    def fixed_bytes(self) -> int:
        """All but the jobs' state: what one more device slot must fit beside."""
        return (
            self.weights_bytes
            + self.other_bases_bytes
            + self.gradient_bytes
            + self.activation_bytes
            + self.fsdp_buffer_bytes
            + self.runtime_bytes
        )

    @property
    def used_bytes(self) -> int:
        return self.fixed_bytes + self.device_state_bytes

    @property
    def room_for_state(self) -> int:
        return max(0, self.capacity_bytes - self.fixed_bytes)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes - self.rollout_bytes

    def tier_jobs(self, tier: str) -> int:
        """Jobs' states (each rank's shard of them) one rank's storage tier holds."""
        return self.tier_bytes[tier] // self.job_state_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of one node; ``problems`` empty means everything fits."""

    model: str
    config: Mapping[str, Any]
    params: int
    dtype: str
    node: NodeShape
    settings: PlanSettings
    engines: tuple[EngineShape, ...]
    max_model_len: int
    rollouts: tuple[RolloutPlan, ...]
    trainers: tuple[TrainerPlan, ...]
    jobs: tuple[JobShape, ...]
    cpu_engine_bytes: int  # engines on the CPU, in host memory
    trainer_width: int  # GPUs of each GPU trainer engine (``trainer_width``): its figures are per rank
    problems: tuple[str, ...] = field(default=())
    width_asked: bool = False  # the cluster set ``trainer_width`` (else the plan chose it)
    width_fits: bool = True  # the largest job's step fits one rank of that width (``step_fits_width``)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def trainer_ranks(self) -> int:
        """Trainer processes: one per GPU of a GPU trainer, one per CPU trainer; each has its tiers."""
        return sum(max(t.gpus, 1) for t in self.trainers)


def _largest_job(
    config: Mapping[str, Any], options: PlanSettings, jobs: Sequence[JobShape], dtype: str, cuda: bool
) -> tuple[int, int, JobShape]:
    """(state bytes, fp32 gradient bytes, the job with the most gradient) of the planned jobs;
    without jobs, of one at ``max_lora_rank`` on all projections (the largest a rollout engine
    loads)."""
    known = set(lora_module_shapes(config))
    shaped = [j for j in jobs if set(j.target_modules) <= known]
    if not shaped:
        shaped = [JobShape("", options.max_lora_rank, 0)]
    sizes = [(*job_sizes(config, j, dtype, cuda), j) for j in shaped]
    largest = max(sizes, key=lambda size: size[1])[2]
    return max(size[0] for size in sizes), max(size[1] for size in sizes), largest


def _shared_pairs(engines: Sequence[EngineShape], gpus: int) -> tuple[set[int], list[tuple[int, int]], str | None]:
    """Which engines share a GPU: (engines on the CPU, [(rollout position, trainer position)], problem)."""
    cpu = {i for i, e in enumerate(engines) if e.gpus == 0}
    asked = sum(e.gpus for e in engines)
    missing = asked - gpus
    if missing <= 0:
        return cpu, [], None
    if gpus == 0:
        return cpu, [], f"the engines ask for {_gpus(asked)}, the node has none"
    rollouts = [i for i, e in enumerate(engines) if e.kind == "rollout" and e.gpus == 1]
    trainers = [i for i, e in enumerate(engines) if e.kind == "trainer" and e.gpus == 1]
    pairs = list(zip(rollouts, trainers))[:missing]
    if len(pairs) < missing:
        return (
            cpu,
            pairs,
            (
                f"the engines ask for {_gpus(asked)}, the node has {gpus} (only a single-GPU trainer "
                f"and a single-GPU rollout engine can share one)"
            ),
        )
    return cpu, pairs, None


def _wide_trainers(
    config: Mapping[str, Any],
    node: NodeShape,
    engines: tuple[EngineShape, ...],
    cluster: ClusterConfig,
    cpu: set[int],
    pairs: list[tuple[int, int]],
    largest: JobShape,
    dtype: str,
    tokens: int,
    state: int,
) -> tuple[int, tuple[EngineShape, ...], list[str]]:
    """(the width, the engines with the GPU trainers' GPUs regrouped into engines of that width,
    problems). The GPU trainers' GPUs are the pool a width divides; trainers that share their GPU
    with a rollout engine (the 1-GPU layout) and CPU trainers stay single."""
    option = "--trainer-width"
    asked = cluster.trainer_width
    trainers = [p for p, e in enumerate(engines) if e.kind == "trainer" and p not in cpu]
    pool = sum(engines[p].gpus for p in trainers)
    if pairs or not trainers:
        if asked is not None and asked > 1:
            why = "they share their GPU with a rollout engine" if pairs else "no trainer has a GPU"
            return 1, engines, [f"{option} {asked}: trainers here are of 1 GPU ({why})"]
        return 1, engines, []
    width = trainer_width(config, largest, dtype, node.gpu_bytes, pool, cluster, tokens=tokens, state=state)
    if width == 1 and all(engines[p].gpus == 1 for p in trainers):
        return 1, engines, []
    problems = []
    if width > pool or pool % width:
        problems.append(
            f"{option} {width}: does not divide the node's {_gpus(pool)} for trainers; widths that do: "
            f"{', '.join(str(w) for w in range(1, pool + 1) if pool % w == 0)}"
        )
    others = tuple(e for p, e in enumerate(engines) if p not in trainers)
    return width, others + (EngineShape("trainer", width),) * max(1, pool // width), problems


def _width_hint(plan: MemoryPlan, cluster: ClusterConfig, largest: JobShape, tokens: int, state: int) -> list[str]:
    """Where the plan chose the width and its widest trainer's step still does not fit: the width
    that would, or that none does."""
    wide = [t for t in plan.trainers if t.gpus and not t.shared]
    if plan.width_asked or not wide or plan.width_fits:
        return []
    need = needed_trainer_width(
        plan.config, largest, plan.dtype, plan.node.gpu_bytes, cluster, tokens=tokens, state=state
    )
    pool = sum(t.gpus for t in wide)
    if need is None:
        return [
            f"trainer engines: no width up to {MAX_TRAINER_WIDTH} GPUs fits the step on GPUs of "
            f"{_size(plan.node.gpu_bytes)} (a micro-batch's activations are not sharded: lower --micro-batch-tokens)"
        ]
    return [
        f"trainer engines: the step fits trainer engines of {_gpus(need)} (--trainer-width {need}), "
        f"the node gives trainers {pool} (--trainer-gpus)"
    ]


def plan_memory(
    config: Mapping[str, Any],
    node: NodeShape,
    engines: Sequence[EngineShape] | None = None,
    cluster: ClusterConfig = DEFAULTS,
    jobs: Sequence[JobShape] = (),
    model: str = "",
    other_weights_bytes: int = 0,
) -> MemoryPlan:
    """The memory plan of ``engines`` (default: ``default_engines(node.gpus)``) on ``node`` with
    ``cluster``'s settings, for ``jobs`` (their largest state and micro-batch size the trainers;
    each is also checked with ``job_problems``, its problems listed in the plan's);
    ``other_weights_bytes``: the other base models the engines hold (``plans_for_specs``)."""
    options = plan_settings(cluster, other_weights_bytes)
    dtype = engine_dtype(cluster, node)
    dtype_bytes(dtype)
    engines = tuple(engines if engines is not None else default_engines(node.gpus))
    max_model_len = options.max_model_len or min(model_context(config), CONTEXT_CAP)
    weights = weights_bytes(config, dtype)
    state, gradient, largest = _largest_job(config, options, jobs, dtype, cuda=node.gpus > 0)
    # the largest micro-batch of the jobs (without jobs: the budget); a job beyond the budget is its own problem
    micro_tokens = max(
        (min(j.peak_tokens, options.micro_batch_tokens) for j in jobs), default=options.micro_batch_tokens
    )
    cpu, pairs, placement_problem = _shared_pairs(engines, node.gpus)
    problems = [placement_problem] if placement_problem else []
    width, engines, width_problems = _wide_trainers(
        config, node, engines, cluster, cpu, pairs, largest, dtype, micro_tokens, state
    )
    problems += width_problems
    cpu = cpu if width == 1 else {p for p, e in enumerate(engines) if e.gpus == 0}
    partner = {r: t for r, t in pairs} | {t: r for r, t in pairs}
    ranks = sum(1 if p in cpu else e.gpus for p, e in enumerate(engines) if e.kind == "trainer")
    host_tiers = ranks * _medium_bytes(options, "host")  # each trainer rank keeps its tiers

    def rollout_plan(position: int, index: int, engine: EngineShape, left_by_trainer: int) -> RolloutPlan:
        tp = max(engine.gpus, 1)
        on_gpu = engine.gpus > 0 and position not in cpu
        lora = lora_slots_bytes(config, options.max_loras, options.max_lora_rank, dtype, tp)
        reserve = rollout_activation_bytes(config, dtype, tp) + (ROLLOUT_GPU_RUNTIME_BYTES if on_gpu else 0)
        shard = math.ceil(weights / tp)
        if not on_gpu:
            budget = shard + lora + reserve + CPU_KV_CACHE_BYTES
        elif position in partner:
            budget = int(options.gpu_memory_utilization * max(0, left_by_trainer))
        else:
            budget = int(options.gpu_memory_utilization * node.gpu_bytes)
        return RolloutPlan(
            index=index,
            gpus=engine.gpus if on_gpu else 0,
            shared=position in partner,
            gpu_bytes=node.gpu_bytes if on_gpu else 0,
            left_by_trainer=left_by_trainer,
            memory_share=options.gpu_memory_utilization if on_gpu else 0.0,
            budget_bytes=budget,
            weights_bytes=shard,
            lora_slots_bytes=lora,
            reserve_bytes=reserve,
            kv_bytes_per_token=kv_bytes_per_token(config, dtype, tp),
            max_loras=options.max_loras,
            max_lora_rank=options.max_lora_rank,
        )

    def trainer_plan(position: int, index: int, engine: EngineShape, capacity: int) -> TrainerPlan:
        on_gpu = engine.gpus > 0 and position not in cpu
        ranks = engine.gpus if on_gpu else 1  # its figures are one rank's
        runtime = TRAINER_GPU_RUNTIME_BYTES if on_gpu else CPU_RUNTIME_BYTES
        other = 0 if on_gpu else options.other_weights_bytes  # a GPU's sleep in host memory
        share = trainer_share_bytes(capacity, options.gpu_memory_utilization if position in partner else None)
        step = trainer_step(
            config,
            dtype,
            micro_tokens,
            options.gradient_checkpointing,
            share - runtime - other,
            states=options.device_slots * state,
            job=largest,
            chunk_tokens=DEFAULT_LOGITS_CHUNK_TOKENS,
            cuda=on_gpu,
            width=ranks,
        )
        rank_weights, rank_state = (
            rank_weights_bytes(config, dtype, ranks),
            rank_job_bytes(config, state, largest, ranks),
        )
        rank_gradient = rank_job_bytes(config, gradient, largest, ranks)
        buffers = fsdp_buffer_bytes(config, dtype, largest, ranks) if on_gpu else 0
        return TrainerPlan(
            index=index,
            gpus=engine.gpus if on_gpu else 0,
            shared=position in partner,
            capacity_bytes=capacity,
            weights_bytes=rank_weights,
            device_slots=options.device_slots,
            job_state_bytes=rank_state,
            gradient_bytes=rank_gradient,
            micro_batch_tokens=micro_tokens,
            activation_bytes=step.total - rank_weights - options.device_slots * rank_state - rank_gradient - buffers,
            fsdp_buffer_bytes=buffers,
            runtime_bytes=runtime,
            tier_bytes=options.tier_bytes,
            other_bases_bytes=other,
            gradient_checkpointing=step.checkpointing,
            step_peak_bytes=step.total,
            room_bytes=share - runtime - other,
        )

    kinds = {"rollout": 0, "trainer": 0}
    index_of: dict[int, int] = {}
    for position, engine in enumerate(engines):
        index_of[position] = kinds[engine.kind]
        kinds[engine.kind] += 1
    # GPU trainers first (a shared GPU's rollout engine gets what its trainer leaves), then the
    # rollout engines, then the CPU trainers (they get the host memory the rest leaves).
    trainers: dict[int, TrainerPlan] = {}
    for position, engine in enumerate(engines):
        if engine.kind == "trainer" and position not in cpu:
            trainers[position] = trainer_plan(position, index_of[position], engine, node.gpu_bytes)
    rollouts: dict[int, RolloutPlan] = {}
    for position, engine in enumerate(engines):
        if engine.kind == "rollout":
            t = trainers.get(partner.get(position, -1))
            left = node.gpu_bytes - t.used_bytes if t is not None else node.gpu_bytes
            rollouts[position] = rollout_plan(position, index_of[position], engine, left)
            if t is not None:
                trainers[partner[position]] = replace(t, rollout_bytes=rollouts[position].budget_bytes)
    # an engine's other models: resident beside it on the CPU, asleep in pinned host memory on a GPU
    # (a rollout engine's, and a GPU trainer's; a CPU trainer's count in its own plan)
    cpu_rollout_bytes = sum(r.budget_bytes for p, r in rollouts.items() if p in cpu) + (
        len(rollouts) + len(trainers)
    ) * (options.other_weights_bytes)
    cpu_trainers = [p for p, e in enumerate(engines) if e.kind == "trainer" and p in cpu]
    for position in cpu_trainers:
        left = (node.host_bytes - host_tiers - cpu_rollout_bytes) // len(cpu_trainers)
        trainers[position] = trainer_plan(position, index_of[position], engines[position], left)
    cpu_bytes = cpu_rollout_bytes + sum(trainers[p].used_bytes for p in cpu_trainers)

    plan = MemoryPlan(
        model=model,
        config=dict(config),
        params=parameter_count(config),
        dtype=dtype,
        node=node,
        settings=options,
        engines=engines,
        max_model_len=max_model_len,
        rollouts=tuple(rollouts[p] for p in sorted(rollouts)),
        trainers=tuple(trainers[p] for p in sorted(trainers)),
        jobs=tuple(jobs),
        cpu_engine_bytes=cpu_bytes,
        trainer_width=width,
        width_asked=cluster.trainer_width is not None,
        width_fits=not node.gpus
        or step_fits_width(config, largest, dtype, node.gpu_bytes, width, cluster, tokens=micro_tokens, state=state),
    )
    problems += _engine_problems(plan)
    problems += _width_hint(plan, cluster, largest, micro_tokens, state)
    problems += _node_problems(plan, host_tiers)
    for job in jobs:
        problems += job_problems(plan, job)
    return replace(plan, problems=tuple(problems))


# ---------------------------------------------------------------- what does not fit


def _engine_problems(plan: MemoryPlan) -> list[str]:
    problems: list[str] = []
    heads = int(plan.config["num_attention_heads"])
    for r in plan.rollouts:
        name = f"rollout engine {r.index}"
        if r.gpus and heads % r.gpus:
            problems.append(f"{name}: tp {r.gpus} does not divide the model's {heads} attention heads")
        if not r.gpus:
            continue
        where = f"{name} on {_gpus(r.gpus)}"
        if r.shared:
            budget = (
                f"{r.memory_share:.2f} x the {_size(max(0, r.left_by_trainer))} its trainer leaves = "
                f"{_size(r.budget_bytes)}"
            )
        else:
            budget = f"{r.memory_share:.2f} x {_size(r.gpu_bytes)} = {_size(r.budget_bytes)}"
        if r.fixed_bytes > r.budget_bytes:
            problems.append(
                f"{where}: weights {_size(r.weights_bytes)} + LoRA slots {_size(r.lora_slots_bytes)} "
                f"+ reserve {_size(r.reserve_bytes)} = {_size(r.fixed_bytes)} exceed {budget}"
            )
        elif r.kv_tokens < plan.max_model_len:
            problems.append(
                f"{name}: the KV cache holds {r.kv_tokens:,} tokens, below max_model_len {plan.max_model_len:,}"
            )
    for t in plan.trainers:
        name = f"trainer engine {t.index}"
        where = (
            f"{name} on the CPU"
            if not t.gpus
            else f"{name} on 1 GPU"
            if t.gpus == 1
            else f"{name} on {t.gpus} GPUs, per GPU"
        )
        capacity = _size(t.capacity_bytes)
        room = f"the GPU's {capacity}" if t.gpus else f"the {capacity} of host memory left"
        if t.weights_bytes > t.capacity_bytes:
            problems.append(f"{where}: weights {_size(t.weights_bytes)} exceed {room}")
        elif t.fixed_bytes > t.capacity_bytes:
            problems.append(
                f"{where}: weights {_size(t.weights_bytes)} + activations of a "
                f"{t.micro_batch_tokens:,}-token micro-batch {_size(t.activation_bytes)} + gradients "
                f"and runtime {_size(t.gradient_bytes + t.runtime_bytes)}"
                + (f" + FSDP buffers {_size(t.fsdp_buffer_bytes)}" if t.fsdp_buffer_bytes else "")
                + f" = {_size(t.fixed_bytes)} exceed {room}"
            )
        elif t.used_bytes > t.capacity_bytes:
            fit = t.room_for_state // t.job_state_bytes
            problems.append(
                f"{where}: {t.device_slots} jobs' state on device need {_size(t.device_state_bytes)}, "
                f"{_size(t.room_for_state)} left after weights, activations and runtime (at most "
                f"{fit} fit: lower device_slots)"
            )
    return problems


def _node_problems(plan: MemoryPlan, host_tiers: int) -> list[str]:
    o, node = plan.settings, plan.node
    problems: list[str] = []
    if not plan.rollouts:
        problems.append("no rollout engine: jobs cannot generate")
    if not plan.trainers:
        problems.append("no trainer engine: jobs cannot train")
    if o.max_lora_rank not in VLLM_LORA_RANKS:
        problems.append(f"max_lora_rank {o.max_lora_rank}: vLLM accepts {', '.join(map(str, VLLM_LORA_RANKS))}")
    context = model_context(plan.config)
    if plan.max_model_len > context:
        problems.append(
            f"max_model_len {plan.max_model_len:,} exceeds the model's context {context:,} (max_position_embeddings)"
        )
    media = {"host": ("host memory", node.host_bytes), "nvme": ("NVMe", node.nvme_bytes)}
    for medium, (what_medium, capacity) in media.items():
        kinds = [kind for kind in STATE_TIERS if kind.medium == medium]
        tiers = plan.trainer_ranks * _medium_bytes(o, medium)
        beside = plan.cpu_engine_bytes if medium == "host" else 0
        if not kinds or tiers + beside <= capacity:
            continue
        what = "engines on the CPU" + (" and sleeping models" if o.other_weights_bytes else "")
        cpu = f" + {what} {_size(beside)}" if beside else ""
        each = " + ".join(f"{kind.label}(s) of {_size(o.tier_bytes[kind.name])}" for kind in kinds)
        total = _size(tiers + beside)
        problems.append(
            f"{what_medium}: {plan.trainer_ranks} {each}{cpu} = {total} exceed the node's {_size(capacity)}"
        )
    return problems


def _medium_bytes(settings: PlanSettings, medium: str) -> int:
    """Bytes one trainer rank's storage tiers take of the node's ``medium`` (host memory, NVMe)."""
    return sum(nbytes for name, nbytes in settings.tier_bytes.items() if TIER_KINDS[name].medium == medium)


def job_problems(plan: MemoryPlan, job: JobShape) -> list[str]:
    """Why ``job`` can never run on the plan's engines, one line each with the numbers; [] if it can."""
    problems: list[str] = []
    say = problems.append
    prefix = f"job {job.name}: "
    if job.dtype is not None and job.dtype != plan.dtype:
        say(f"{prefix}model.dtype {job.dtype}, but the engines run {plan.dtype}")
    if job.rank > plan.settings.max_lora_rank:
        say(f"{prefix}LoRA rank {job.rank} is above the rollout engines' max_lora_rank {plan.settings.max_lora_rank}")
    unknown = sorted(set(job.target_modules) - set(lora_module_shapes(plan.config)))
    if unknown:
        say(f"{prefix}no known shape for target modules {unknown} (known: {', '.join(ALL_PROJECTIONS)})")
        return problems
    if job.max_seq_len > plan.max_model_len:
        say(f"{prefix}sequences of up to {job.max_seq_len:,} tokens exceed max_model_len {plan.max_model_len:,}")
    elif plan.rollouts and job.max_seq_len > min(r.kv_tokens for r in plan.rollouts):
        say(
            f"{prefix}a sequence of {job.max_seq_len:,} tokens exceeds the KV cache of "
            f"{min(r.kv_tokens for r in plan.rollouts):,} tokens"
        )
    state, gradient = job_sizes(plan.config, job, plan.dtype, cuda=plan.node.gpus > 0)
    largest = max(plan.settings.tier_bytes.values())
    width = plan.trainer_width
    if math.ceil(state / width) > largest:
        shard = f" ({_size(math.ceil(state / width))} per rank of a {width}-GPU trainer)" if width > 1 else ""
        say(f"{prefix}its state {_size(state)}{shard} exceeds the largest tier ({_tier_sizes(plan.settings)})")
    if plan.trainers and all(t.weights_bytes <= t.capacity_bytes for t in plan.trainers):
        rooms = [
            TrainerRoom(
                f"trainer engine {t.index}",
                t.room_bytes,
                t.gradient_checkpointing,
                t.micro_batch_tokens,
                max(t.gpus, 1),
            )
            for t in plan.trainers
        ]
        problem = step_problem(
            plan.config, job, plan.dtype, rooms, DEFAULT_LOGITS_CHUNK_TOKENS, cuda=plan.node.gpus > 0
        )
        if problem:
            say(f"{prefix}{problem}")
    return problems


@dataclass(frozen=True)
class WorkerStep:
    """A GPU trainer's step as its worker builds it: checkpointing, the step's estimated peak, the
    room a step may reach, and the memory fraction to cap the process at (None: owns its GPU)."""

    gradient_checkpointing: bool
    step_peak_bytes: int
    room_bytes: int
    memory_fraction: float | None


def worker_step(
    config: Mapping[str, Any],
    dtype: str,
    micro_batch_tokens: int,
    asked: str,
    gpu_bytes: int,
    rollout_utilization: float | None,
    device_slots: int,
    max_lora_rank: int,
    cuda: bool,
) -> WorkerStep:
    """The decision ``plan_memory`` makes for a trainer, from what a worker knows at start: its
    GPU's memory, the share a rollout engine on the same GPU was given (None: none shares it),
    its device slots, and the largest adapter its rollout engines load (``max_lora_rank`` on all
    projections) as the job to plan for."""
    job = JobShape("", max_lora_rank, 0)
    state = job_sizes(config, job, dtype, cuda)[0]
    runtime = TRAINER_GPU_RUNTIME_BYTES if cuda else CPU_RUNTIME_BYTES
    shared = cuda and rollout_utilization is not None
    share = trainer_share_bytes(gpu_bytes, rollout_utilization if shared else None) if cuda else 0
    room = share - runtime
    step = trainer_step(config, dtype, micro_batch_tokens, asked, room, states=device_slots * state, job=job, cuda=cuda)
    return WorkerStep(
        gradient_checkpointing=step.checkpointing,
        step_peak_bytes=step.total,
        room_bytes=room if cuda else 0,
        memory_fraction=memory_fraction(share, gpu_bytes, shared),
    )


@dataclass(frozen=True)
class TrainerRoom:
    """What a submit check needs of a running trainer: the bytes a step may reach (its share of
    the GPU less its runtime), its checkpointing and micro-batch budget, as it registered them."""

    name: str
    room_bytes: int  # per GPU
    gradient_checkpointing: bool
    micro_batch_tokens: int
    width: int = 1  # its GPUs: a step's peak is one rank's


def step_problem(
    config: Mapping[str, Any],
    job: JobShape,
    dtype: str,
    trainers: Sequence[TrainerRoom],
    chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS,
    cuda: bool = True,
) -> str:
    """Why ``job``'s step fits none of ``trainers`` (its own state alone on the device, each
    trainer's checkpointing and micro-batch budget, a micro-batch at least one whole sequence),
    one line with the numbers of the closest; "" when one fits or none is known."""
    if not trainers:
        return ""
    state = job_sizes(config, job, dtype, cuda)[0]
    best: tuple[int, TrainerRoom, StepPeak, int] | None = None
    for t in trainers:
        tokens = max(t.micro_batch_tokens, job.max_seq_len)
        mode = "on" if t.gradient_checkpointing else "off"
        peak = trainer_step(
            config,
            dtype,
            tokens,
            mode,
            t.room_bytes,
            states=state,
            job=job,
            chunk_tokens=chunk_tokens,
            cuda=cuda,
            width=t.width,
        )
        if peak.total <= t.room_bytes:
            return ""
        if best is None or peak.total - t.room_bytes < best[2].total - best[1].room_bytes:
            best = (tokens, t, peak, state)
    assert best is not None
    tokens, t, peak, state = best
    if t.width > 1:
        return (
            f"a step needs {_size(peak.total)} per GPU of {t.width} (weights {_size(peak.weights)} + its state "
            f"{_size(peak.states)} + activations of a {tokens:,}-token micro-batch, checkpointing "
            f"{'on' if t.gradient_checkpointing else 'off'}, gradients and FSDP buffers "
            f"{_size(peak.total - peak.weights - peak.states)}), more than {t.name} has for a step per GPU "
            f"({_size(t.room_bytes)})"
        )
    return (
        f"a step needs {_size(peak.total)} (weights {_size(peak.weights)} + its state {_size(state)} + "
        f"activations of a {tokens:,}-token micro-batch, checkpointing "
        f"{'on' if t.gradient_checkpointing else 'off'}, {_size(peak.total - peak.weights - peak.states)}), "
        f"more than {t.name} has for a step ({_size(t.room_bytes)})"
    )


def spec_step_problem(spec: JobSpec, trainers: Sequence[TrainerRoom], dtype: str) -> str:
    """``step_problem`` of a job spec on the trainers its model's workers registered (the
    daemon's submit check); "" for a model of no known shape (the worker's store decides)."""
    from plexctl.common.model_shapes import UnknownModelShape, model_config_for

    try:
        config = model_config_for(spec.model.path)
        return step_problem(config, job_shape(spec), spec.model.dtype or dtype, trainers)
    except (OSError, KeyError, ValueError, UnknownModelShape):
        return ""


# ---------------------------------------------------------------- full fine-tuning, other models


class DoesNotFit(Refused):
    """A job the cluster's engines or tiers can never hold (exit 7): one line with the numbers."""


@dataclass(frozen=True)
class FullJob:
    """What the refusals need to know of a job: its name, its model and dtype, and whether it
    trains every weight (a spec without ``lora:``)."""

    name: str
    model_path: str
    config: Mapping[str, Any]
    dtype: str | None = None  # the job's model.dtype (None: whatever the engines serve)
    full: bool = True
    spec_file: str = ""  # the spec's file, named in the message when known

    @classmethod
    def of(cls, spec: JobSpec, config: Mapping[str, Any] | None = None, spec_file: str = "") -> FullJob:
        """From a job spec; ``config`` defaults to the model's (``model_shapes.model_config_for``)."""
        from plexctl.common.model_shapes import model_config_for

        return cls(
            name=spec.name,
            model_path=spec.model.path,
            config=config if config is not None else model_config_for(spec.model.path),
            dtype=spec.model.dtype,
            full=spec.lora is None,
            spec_file=spec_file,
        )


def _state_tiers(plan: MemoryPlan) -> list[tuple[str, int]]:
    """(tier, bytes) a job's state can live in on this plan: the largest trainer's device room
    beside its weights-free fixed needs, the host tier, the NVMe tier."""
    tiers: list[tuple[str, int]] = []
    if plan.trainers:
        t = max(plan.trainers, key=lambda t: t.capacity_bytes)
        tiers.append(("device", max(0, t.capacity_bytes - t.activation_bytes - t.runtime_bytes)))
    tiers += [(TIER_KINDS[name].label, nbytes) for name, nbytes in plan.settings.tier_bytes.items()]
    return tiers


def _tier_sizes(settings: PlanSettings) -> str:
    """The storage tiers of a rank, one phrase: "host tier 8.0 GiB, NVMe tier 64.0 GiB"."""
    return ", ".join(f"{TIER_KINDS[name].label} {_size(nbytes)}" for name, nbytes in settings.tier_bytes.items())


def full_job_problems(plan: MemoryPlan, job: FullJob) -> list[str]:
    """Why ``job`` can never run on ``plan``'s engines and tiers, one line each with its numbers:

    - its model's weights (in its dtype, else the engines') fit no rollout engine (weights per
      GPU of a tp-way engine + the engine's reserve over its budget) or no trainer (over the GPU,
      or over the host memory a CPU trainer has);
    - full fine-tuning: its state (weights, fp32 masters, AdamW moments) fits no tier (device
      room of the largest trainer, host tier, NVMe tier), or does not fit the device beside its
      gradients, activations and runtime when it trains. [] if it can run."""
    dtype = job.dtype or plan.dtype
    where = f"{job.spec_file}: model.path" if job.spec_file else f"job {job.name}: model.path"
    model = job.model_path.rstrip("/").rsplit("/", 1)[-1] or job.model_path
    problems: list[str] = []
    weights = weights_bytes(job.config, dtype)
    rollout_fits = [
        r
        for r in plan.rollouts
        if math.ceil(weights / max(r.gpus, 1)) + r.reserve_bytes <= r.budget_bytes or r.gpus == 0
    ]
    if plan.rollouts and not rollout_fits:
        r = max(plan.rollouts, key=lambda r: r.budget_bytes * max(r.gpus, 1))
        shard = math.ceil(weights / max(r.gpus, 1))
        problems.append(
            f"{where}: {model}'s {dtype} weights {_size(weights)} ({_size(shard)} per GPU of a tp-{r.gpus} "
            f"rollout engine, + reserve {_size(r.reserve_bytes)}) fit no rollout engine (budget "
            f"{_size(r.budget_bytes)} per GPU)"
        )
    trainer_room = max((t.capacity_bytes for t in plan.trainers), default=0)
    if plan.trainers and weights > trainer_room:
        problems.append(
            f"{where}: {model}'s {dtype} weights {_size(weights)} fit no trainer (largest {_size(trainer_room)})"
        )
    if not job.full:
        return problems
    state: FullStateSize = full_state_size(job.config, dtype, cuda=plan.node.gpus > 0)
    tiers = _state_tiers(plan)
    width = plan.trainer_width
    what = f"{where}: full fine-tuning of {model} (no `lora:`): state {_size(state.total)} ({state.describe()})"
    per_rank = math.ceil(state.total / width)
    if width > 1:
        what += f", {_size(per_rank)} per rank of a {width}-GPU trainer"
    if all(per_rank > room for _, room in tiers):
        problems.append(f"{what} fits no tier ({', '.join(f'{name} {_size(room)}' for name, room in tiers)})")
    elif plan.trainers:
        t = max(plan.trainers, key=lambda t: t.capacity_bytes)
        gradients = math.ceil(state.params * FP32_BYTES / width)
        extra = t.activation_bytes + t.fsdp_buffer_bytes + t.runtime_bytes
        need = per_rank + gradients + extra
        if need > t.capacity_bytes:
            held = (
                "a trainer holds the state it trains; it is not sharded"
                if width == 1
                else f"each of its {width} ranks holds 1/{width} of the state and gradients"
            )
            problems.append(
                f"{what} + fp32 gradients {_size(gradients)} + activations and runtime "
                f"{_size(extra)} = {_size(need)} exceed the largest trainer's "
                f"{_size(t.capacity_bytes)} ({held})"
            )
    return problems


def check_full_state_fits(spec: JobSpec | FullJob, plan: MemoryPlan, spec_file: str = "") -> None:
    """Refuse (``DoesNotFit``, exit 7, one line) a job whose model fits no engine or whose full
    fine-tuning state fits no tier of ``plan``; return None if it can run. ``spec`` is a job
    spec (its model's config from ``model_shapes.model_config_for``) or a ``FullJob``."""
    job = spec if isinstance(spec, FullJob) else FullJob.of(spec, spec_file=spec_file)
    problems = full_job_problems(plan, job)
    if problems:
        raise DoesNotFit("; ".join(problems))


# ---------------------------------------------------------------- rendering


def _size(n: float) -> str:
    """GiB with one decimal; smaller sizes in MiB/KiB (a tiny model's), TiB from 1 TiB."""
    if n == 0 or GiB // 20 <= abs(n) < 1024 * GiB:
        return f"{n / GiB:.1f} GiB"
    return fmt_bytes(n)


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _indices(indices: Sequence[int]) -> str:
    return str(indices[0]) if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"


Row = tuple[str, int | None, str]  # label, bytes (None: no bytes column), note


def _rollout_rows(r: RolloutPlan, max_model_len: int) -> list[Row]:
    if r.gpus == 0:
        budget: Row = ("in host memory", r.budget_bytes, "")
    elif r.shared:
        budget = (
            f"budget: {r.memory_share:.2f} x {_size(max(0, r.left_by_trainer))} the trainer leaves",
            r.budget_bytes,
            f"vLLM gpu_memory_utilization {r.vllm_utilization:.3f}",
        )
    else:
        budget = (f"budget: {r.memory_share:.2f} x {_size(r.gpu_bytes)}", r.budget_bytes, "")
    full = r.kv_tokens // max_model_len
    return [
        budget,
        ("weights" + (f" (1/{r.gpus})" if r.gpus > 1 else ""), r.weights_bytes, ""),
        (f"LoRA slots: {r.max_loras} x rank {r.max_lora_rank}", r.lora_slots_bytes, ""),
        ("activations, sampler" + (", CUDA graphs" if r.gpus else ""), r.reserve_bytes, ""),
        (
            "KV cache",
            r.kv_cache_bytes,
            (
                f"{r.kv_tokens:,} tokens ({fmt_bytes(r.kv_bytes_per_token)} each), {full:,} sequences of "
                f"max_model_len {max_model_len:,}"
            ),
        ),
    ]


def _trainer_rows(t: TrainerPlan) -> list[Row]:
    rows: list[Row] = [
        (
            "GPU" if t.gpus else "host memory left to it",
            t.capacity_bytes,
            "shared with a rollout engine" if t.shared else "",
        ),
        ("weights" + (f" (1/{t.gpus})" if t.gpus > 1 else ""), t.weights_bytes, ""),
        *([("the other base models' weights", t.other_bases_bytes, "held beside it")] if t.other_bases_bytes else []),
        (
            f"job state on device: {t.device_slots} x {_size(t.job_state_bytes)}",
            t.device_state_bytes,
            "largest job: fp32 adapter or full weights, + AdamW moments" + (f"; 1/{t.gpus} each" if t.gpus > 1 else ""),
        ),
        ("gradients (the job in training)" + (f" (1/{t.gpus})" if t.gpus > 1 else ""), t.gradient_bytes, ""),
        *(
            [
                (
                    "FSDP buffers",
                    t.fsdp_buffer_bytes,
                    f"all-gather of {FSDP_GATHERED_LAYERS} layers, reduce-scatter of one layer's gradients",
                )
            ]
            if t.fsdp_buffer_bytes
            else []
        ),
        (
            f"activations: {t.micro_batch_tokens:,}-token micro-batch",
            t.activation_bytes,
            f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}, chunked logits; "
            f"step peak {_size(t.step_peak_bytes)}",
        ),
        ("CUDA context, workspaces" if t.gpus else "process runtime", t.runtime_bytes, ""),
    ]
    if t.shared:
        rows.append(("the rollout engine's budget", t.rollout_bytes, "planned after the trainer"))
    more = max(0, t.free_bytes) // t.job_state_bytes
    rows.append(
        (
            "free",
            t.free_bytes,
            f"room for {more:,} more jobs' state on device" if t.free_bytes >= 0 else "over capacity",
        )
    )
    rows += [(TIER_KINDS[name].label, nbytes, f"{t.tier_jobs(name):,} jobs") for name, nbytes in t.tier_bytes.items()]
    return rows


def _table(title: str, rows: list[Row]) -> list[str]:
    width = max(len(label) for label, _, _ in rows) + 2
    lines = [title]
    for label, n, note in rows:
        value = _size(n) if n is not None else ""
        lines.append(f"  {label:<{width}}{value:>10}" + (f"   {note}" if note else ""))
    return lines


def _grouped(plans: Sequence[RolloutPlan] | Sequence[TrainerPlan]) -> list[tuple[list[int], Any]]:
    """Consecutive engines with the same plan (all but their index), rendered once."""
    groups: list[tuple[list[int], Any]] = []
    for p in plans:
        key = {**p.__dict__, "index": None}
        if groups and {**groups[-1][1].__dict__, "index": None} == key:
            groups[-1][0].append(p.index)
        else:
            groups.append(([p.index], p))
    return groups


def render_plan(plan: MemoryPlan) -> str:
    """The plan as plain text: a table per (group of identical) engine(s), the jobs, the problems."""
    o = plan.settings
    params = f"{plan.params / 1e9:.2f} B" if plan.params >= 10**8 else f"{plan.params / 1e6:.2f} M"
    lines = [
        (
            f"Memory plan for {plan.model or 'the model'}: {params} parameters, "
            f"{plan.dtype} weights {_size(weights_bytes(plan.config, plan.dtype))}"
        ),
        f"Node: {plan.node.describe()}",
        (
            f"Options: max_model_len {plan.max_model_len:,}, max_loras {o.max_loras}, max_lora_rank "
            f"{o.max_lora_rank}, device_slots {o.device_slots}, "
            f"gpu_memory_utilization {o.gpu_memory_utilization}"
        ),
    ]
    if any(t.gpus for t in plan.trainers):
        why = (
            "as asked"
            if plan.width_asked
            else f"no width of the node's {_gpus(sum(t.gpus for t in plan.trainers))} for trainers holds the step"
            if not plan.width_fits
            else "one GPU holds the step"
            if plan.trainer_width == 1
            else "the smallest width whose per-rank step fits one GPU"
        )
        lines.append(f"Trainer width: trainer engines of {_gpus(plan.trainer_width)} ({why})")
        if plan.trainer_width > 1 and any(j.full for j in plan.jobs):
            lines.append(
                "  Full fine-tuning on engines of several GPUs is sized here; the runtime trains it on "
                "engines of one GPU for now, and refuses it on wider ones (docs/gpu.md)"
            )
    for indices, r in _grouped(plan.rollouts):
        where = (
            "on the CPU"
            if r.gpus == 0
            else f"{_gpus(r.gpus)} each (tp {r.gpus}), per GPU"
            if len(indices) > 1
            else f"{_gpus(r.gpus)} (tp {r.gpus}), per GPU"
        )
        title = f"Rollout engine{'s' if len(indices) > 1 else ''} {_indices(indices)}: {where}"
        lines += ["", *_table(title, _rollout_rows(r, plan.max_model_len))]
    for indices, t in _grouped(plan.trainers):
        if t.gpus > 1:
            where = f"{_gpus(t.gpus)}{' each' if len(indices) > 1 else ''} (FSDP, data parallel), per GPU"
        else:
            where = "on the CPU" if t.gpus == 0 else ("1 GPU each" if len(indices) > 1 else "1 GPU")
        title = f"Trainer engine{'s' if len(indices) > 1 else ''} {_indices(indices)}: {where}"
        lines += ["", *_table(title, _trainer_rows(t))]
    if plan.jobs:
        cuda = plan.node.gpus > 0
        lines += ["", "Jobs"]
        width = max(len(j.name) for j in plan.jobs) + 2
        known = set(lora_module_shapes(plan.config))
        for j in plan.jobs:
            state = (
                _size(job_sizes(plan.config, j, plan.dtype, cuda=cuda)[0]) if set(j.target_modules) <= known else "?"
            )
            verdict = "refused" if job_problems(plan, j) else "fits"
            trains = "all weights" if j.full else f"rank {j.rank} on {len(j.target_modules)} modules"
            lines.append(
                f"  {j.name:<{width}}{trains}   state {state}   "
                f"sequences {j.max_seq_len:,} tokens   micro-batch {j.peak_tokens:,} tokens   {verdict}"
            )
    lines.append("")
    if plan.problems:
        lines.append(f"Does not fit ({len(plan.problems)}):")
        lines += [f"  - {p}" for p in plan.problems]
    else:
        lines.append("Everything fits.")
    return "\n".join(lines)


def plan_json(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as JSON (``plexctl plan --json``): per engine its figures in bytes, per trainer
    its step (``gradient_checkpointing`` resolved, ``step_peak_bytes``: the estimate of torch's
    ``max_memory_allocated`` during a step), the jobs and the problems."""
    return {
        "model": plan.model,
        "params": plan.params,
        "dtype": plan.dtype,
        "node": {"gpus": plan.node.gpus, "gpu_bytes": plan.node.gpu_bytes, "host_bytes": plan.node.host_bytes},
        "trainer_width": plan.trainer_width,
        "rollouts": [
            {
                "index": r.index,
                "gpus": r.gpus,
                "shared": r.shared,
                "budget_bytes": r.budget_bytes,
                "vllm_gpu_memory_utilization": round(r.vllm_utilization, 4),
                "weights_bytes": r.weights_bytes,
                "kv_cache_bytes": r.kv_cache_bytes,
                "kv_tokens": r.kv_tokens,
            }
            for r in plan.rollouts
        ],
        "trainers": [
            {
                "index": t.index,
                "gpus": t.gpus,
                "shared": t.shared,
                "capacity_bytes": t.capacity_bytes,
                "room_bytes": t.room_bytes,
                "gradient_checkpointing": t.gradient_checkpointing,
                "micro_batch_tokens": t.micro_batch_tokens,
                "step_peak_bytes": t.step_peak_bytes,
                "weights_bytes": t.weights_bytes,
                "device_state_bytes": t.device_state_bytes,
                "gradient_bytes": t.gradient_bytes,
                "activation_bytes": t.activation_bytes,
                "fsdp_buffer_bytes": t.fsdp_buffer_bytes,
                "runtime_bytes": t.runtime_bytes,
                "free_bytes": t.free_bytes,
            }
            for t in plan.trainers
        ],
        "jobs": [
            {"name": j.name, "rank": j.rank, "max_seq_len": j.max_seq_len, "micro_batch_tokens": j.peak_tokens}
            for j in plan.jobs
        ],
        "fits": plan.fits,
        "problems": list(plan.problems),
    }


def plans_for_specs(
    specs: Sequence[JobSpec],
    node: NodeShape,
    engines: Sequence[EngineShape] | None = None,
    cluster: ClusterConfig = DEFAULTS,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
) -> list[MemoryPlan]:
    """One plan per base model of ``specs``, each of a node serving them all: its engines hold
    the other models too (``PlanSettings.other_weights_bytes``), so each plan counts them."""
    from plexctl.common.model_shapes import model_config_for

    by_model: dict[str, list[JobSpec]] = {}
    for spec in specs:
        by_model.setdefault(spec.model.path, []).append(spec)
    dtype = engine_dtype(cluster, node)
    weights = {path: weights_bytes(model_config_for(path), dtype) for path in by_model}
    return [
        plan_for_specs(
            jobs,
            node,
            engines,
            cluster,
            prompt_tokens,
            other_weights_bytes=sum(weights.values()) - weights[path],
        )
        for path, jobs in sorted(by_model.items())
    ]


def plan_for_specs(
    specs: Sequence[JobSpec],
    node: NodeShape,
    engines: Sequence[EngineShape] | None = None,
    cluster: ClusterConfig = DEFAULTS,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    other_weights_bytes: int = 0,
) -> MemoryPlan:
    """The plan of a node serving the jobs of ``specs`` (one base model: their ``model.path``,
    whose config comes from ``plexctl.common.model_shapes.model_config_for``)."""
    from plexctl.common.model_shapes import model_config_for

    paths = sorted({s.model.path for s in specs})
    if len(paths) != 1:
        raise ValueError(f"a plan is for one base model; these jobs use {len(paths)}: {', '.join(paths) or 'none'}")
    jobs = [job_shape(s, prompt_tokens, plan_settings(cluster).micro_batch_tokens) for s in specs]
    return plan_memory(
        model_config_for(paths[0]),
        node,
        engines,
        cluster,
        jobs,
        model=paths[0].rstrip("/").rsplit("/", 1)[-1],
        other_weights_bytes=other_weights_bytes,
    )
