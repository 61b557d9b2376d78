"""GPU acceptance check for a lent GPU machine: the worker's own wiring on CUDA, measured beside a
plain transformers + peft step of the same shape.

Builds a Qwen2 of ``--shape`` in code (random weights: speed and memory, not learning) and runs
its parts in order, each bounded by ``--budget-s`` and recorded as it ends: ``trainer`` (GRPO
steps through ``build_engines``: step time, peak memory, MFU), ``trainer_sleep`` (the base to
its pinned host arena and back, beside a raw pinned copy), ``jobs`` (8 jobs of 8 x 1,024
tokens trained one at a time, 0.5B shape only), ``swap`` (job states through pinned memory
against raw copies), ``peer`` (the same step in plain transformers + peft: tokens/s, MFU, the
trainer/peer ratio), ``rollout`` and ``sleep_wake`` (vLLM; skipped with the reason where it does
not import or, for sleep mode, without CUDA), ``weights`` (a whole-model load), ``wide`` (a trainer
engine of ``--trainer-width`` ranks beside one of 1: speedup, per-rank memory against the plan).

The trainer's speed levers (``docs/gpu.md``) are flags, recorded in the ``trainer`` part:
``--length-buckets`` (with ``--ragged`` rows of mixed lengths, the only batches it changes; the
padded tokens with and without it are recorded), ``--checkpoint-scope``, ``--compile-layers``,
``--fuse-lora`` (the LoRA A matmuls of q/k/v and gate/up as one each), ``--pack-rows`` (a
micro-batch's rows in one sequence without padding; the model's attention kernel is recorded),
``--vocab-block N`` (the head's log-softmax in vocabulary blocks, no fp32 [chunk, vocab] tensor);
``--parts`` runs a subset (``trainer`` alone: a lever's A/B in a minute).

Writes ``bench/results/gpu.json`` after every part (and copies it to ``$OUT``). ``--quick``
runs the same code paths at a tiny shape on CPU in seconds (``--device cpu``; ``--rows`` and
``--seq`` given beside it are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plexctl.common.atomic import write_json_atomic  # noqa: E402
from plexctl.common.model_shapes import known_shape  # noqa: E402
from plexctl.common.protocol import GenRequest, LoraSpec, Sampling, TrainBatch, TrainHParams  # noqa: E402


def _qwen25(name: str) -> dict[str, Any]:
    """Qwen2.5's published shape (``plexctl.common.model_shapes``), as Qwen2Config's arguments, at
    a 4,096-token context."""
    shape = known_shape(name)
    assert shape is not None, name
    return {k: v for k, v in shape.items() if k not in ("model_type", "torch_dtype")} | {
        "max_position_embeddings": 4096
    }


SHAPES = {  # --shape (3B's as in /work/shared/gpu's runs)
    "0.5b": _qwen25("qwen2.5-0.5b-instruct"),
    "3b": _qwen25("qwen2.5-3b"),
    "7b": _qwen25("qwen2.5-7b"),
}
QUICK = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
# dense bf16 TFLOP/s from the spec sheets, by a piece of the device name (first match wins)
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0))
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
JOBS, JOB_ROWS = 8, 8  # the ``jobs`` part: so many jobs of so many rows (x --seq tokens), one at a time
SLEEP_RAW_MAX_BYTES = 1 << 30  # the raw pinned copy the base's sleep is compared with (bandwidth saturates well below)


def peak_tflops(device_name: str | None) -> float | None:
    """The device's dense bf16 peak (``PEAK_TFLOPS``); None for a device not in the table."""
    for piece, tflops in PEAK_TFLOPS:
        if device_name and piece in device_name:
            return tflops
    return None


def model_flops_per_token(shape: dict[str, Any], seq: int) -> float:
    """Model FLOPs of one trained token: 4 x the matmul parameters (forward + activation
    gradients; the base is frozen, recomputation not counted) plus causal attention (QK^T and PV
    over seq/2 positions on average, forward and its gradients), as shared/gpu's figures count."""
    h, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    matmul = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * shape["vocab_size"]
    attention = layers * 2 * 2 * seq * h / 2
    return 4 * matmul + 2 * attention


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model-FLOP utilisation (0-1) against ``peak`` TFLOP/s; None when the peak is unknown."""
    return tokens_per_second * flops_per_token / (peak * 1e12) if peak else None


def put_mfu(result: dict[str, Any], tokens_per_second: float, ctx: dict[str, Any]) -> None:
    """``result["mfu"]`` at the run's shape and ``--seq``, where the device's peak is known."""
    value = mfu(tokens_per_second, model_flops_per_token(ctx["shape"], ctx["seq"]), ctx["peak_tflops"])
    if value is not None:
        result["mfu"] = value


def micro_rows(micro_batch_tokens: int, seq: int) -> int:
    """Rows of one peer micro-batch: as many as the trainer's token budget holds (at least one)."""
    return max(1, micro_batch_tokens // seq)


def build_model(path: Path, shape: dict[str, Any], dtype: str, device: str = "cpu") -> None:
    """A random Qwen2 of ``shape`` with the tiny character tokenizer (vLLM needs one), in HF
    format; initialised on ``device`` (a 7B's random init takes minutes on a CPU)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from plexctl.tiny_models import BOS_ID, EOS_ID, PAD_ID, make_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype=dtype, **shape)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the trainer's memory plan and peak start from an empty GPU


def worker_engines(
    model: Path, kinds: list[str], device: str, scratch: Path, settings: dict[str, Any], flags: Sequence[str] = ()
) -> dict[str, Any]:
    """The engines exactly as ``plexw`` builds them from its command line and a cluster config of ``settings``."""
    from plexctl.common.cluster_config import ClusterConfig, checked
    from plexctl.common.engine_defaults import ENGINE_DEFAULTS
    from worker.engine_options import engine_options
    from worker.main import build_engines, build_parser

    # the GPU's default rank, on CPU too: the check's adapters are rank 32
    config = checked(ClusterConfig(device=device, max_lora_rank=ENGINE_DEFAULTS["cuda"].max_lora_rank, **settings))
    args = build_parser().parse_args(
        ["--endpoint", "tcp://127.0.0.1:1", "--engines", ",".join(kinds), "--model", str(model)]
        + ["--scratch", str(scratch), *flags]
    )
    import torch

    options = engine_options(
        config.device,
        config.dtype,
        config.micro_batch_tokens,
        torch.cuda.is_available(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    return {"options": options, **build_engines(args, config, kinds, options, str(model))}


def grpo_batch(rows: int, seq: int, prompt: int, vocab: int, seed: int, ragged: bool = False) -> TrainBatch:
    """``rows`` rows of ``seq`` tokens, the first ``prompt`` untrained; ``ragged``: each row's
    completion cut to a length drawn uniformly from 1 to ``seq - prompt`` (rollouts that stop
    early), the rows in no order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g).tolist()
    lengths = torch.randint(prompt + 1, seq + 1, (rows,), generator=g).tolist() if ragged else [seq] * rows
    ids = [row[:n] for row, n in zip(ids, lengths)]
    mask = [[0] * prompt + [1] * (n - prompt) for n in lengths]
    old = [[0.0] * prompt + [-12.0] * (n - prompt) for n in lengths]
    adv = (torch.randn(rows, generator=g)).tolist()
    return TrainBatch(input_ids=ids, loss_mask=mask, old_logprobs=old, advantages=adv)


def padded_tokens(lengths: list[int], order: list[int] | None, micro_batch_tokens: int | None) -> int:
    """Padded tokens of ``lengths`` cut into micro-batches in ``order`` (None: as they come)."""
    from worker.train_batches import micro_batch_bounds

    ordered = [lengths[i] for i in order] if order is not None else lengths
    bounds = micro_batch_bounds(ordered, None, micro_batch_tokens)
    return sum((stop - start) * max(ordered[start:stop]) for start, stop in bounds)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def part_trainer(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    import torch

    engines = worker_engines(
        ctx["model"],
        ["trainer"],
        a.device,
        ctx["scratch"],
        {
            "host_mem": a.host_mem,
            "device_slots": 2,
            "gradient_checkpointing": a.gradient_checkpointing,
            "micro_batch_tokens": a.micro_batch_tokens or None,
        },
        ["--threads", "4"],
    )
    store, options = engines["trainer"], engines["options"]
    ctx["store"] = store
    trainer = store.trainer
    from worker.train_batches import length_order

    trainer.length_buckets = a.length_buckets == "on"
    trainer.fuse_lora = a.fuse_lora == "on"
    trainer.set_pack_rows(a.pack_rows == "on")
    trainer.logprob_vocab_block = a.vocab_block or None
    compile_backend = None if a.compile_layers == "off" else a.compile_layers
    if a.checkpoint_scope != "layer" or compile_backend is not None:
        trainer.set_layer_options(trainer.gradient_checkpointing, a.checkpoint_scope, compile_backend)
    result.update(
        device=options.device,
        dtype=options.dtype,
        micro_batch_tokens=options.micro_batch_tokens,
        gradient_checkpointing=bool(getattr(trainer, "gradient_checkpointing", False)),
        checkpoint_scope=trainer.checkpoint_scope,
        compile_layers=trainer.compile_layers,
        length_buckets=trainer.length_buckets,
        fuse_lora=trainer.fuse_lora,
        pack_rows=trainer.pack_rows,
        vocab_block=trainer.logprob_vocab_block,
        attention=str(getattr(trainer._base.config, "_attn_implementation", "")),
        ragged=a.ragged,
    )
    lora, hp = LoraSpec(rank=32, alpha=64), TrainHParams(lr=1e-5)
    batch = grpo_batch(a.rows, a.seq, a.seq // 4, ctx["vocab"], 0, ragged=a.ragged)
    lengths = [len(row) for row in batch.input_ids]
    order = length_order(lengths, None, options.micro_batch_tokens)
    result.update(rows=a.rows, seq=a.seq, vocab=ctx["vocab"], lora_rank=32, tokens=sum(lengths))
    result["padded_tokens_in_order"] = padded_tokens(lengths, None, options.micro_batch_tokens)
    result["padded_tokens_bucketed"] = padded_tokens(lengths, order, options.micro_batch_tokens)
    result["padded_tokens"] = result["padded_tokens_bucketed" if trainer.length_buckets else "padded_tokens_in_order"]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _step in range(a.steps):
        store.ensure_resident("job0", lora, 0)
        sync()
        t0 = time.perf_counter()
        metrics = trainer.train_step("job0", batch, hp)
        sync()
        times.append(time.perf_counter() - t0)
        result["loss"] = metrics["loss"]
    result["step_seconds"] = times
    result["step_seconds_warm"] = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    result["tokens_per_second"] = sum(lengths) / result["step_seconds_warm"]  # real tokens, not padding
    result["model_flops_per_token"] = model_flops_per_token(ctx["shape"], a.seq)
    put_mfu(result, result["tokens_per_second"], ctx)
    from plexctl.common.memplan import JobShape, trainer_step
    from plexctl.common.state_size import job_state_bytes

    weights = sum(p.numel() * p.element_size() for p in trainer._base_params.values())
    result["base_weights_gib"] = weights / 2**30
    job = JobShape("job0", 32, a.seq, micro_batch_tokens=options.micro_batch_tokens)
    state = job_state_bytes(32, list(job.target_modules), ctx["shape"], cuda=options.device == "cuda")
    asked = "on" if result["gradient_checkpointing"] else "off"
    planned = trainer_step(ctx["shape"], options.dtype, options.micro_batch_tokens, asked, 0, states=state, job=job)
    result["plan_step_peak_gib"] = planned.total / 2**30  # the memory plan's estimate of max_memory_allocated
    if torch.cuda.is_available():
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["gpu_total_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30


def part_wide(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    """A trainer engine of ``--trainer-width`` ranks (``worker.trainer_group``: the base sharded
    with FSDP2, NCCL between GPUs, gloo on CPU) beside one of 1 rank, the same GRPO steps, each
    rank taking its share of a step's rows: step time, tokens/s and their ratio, each rank's peak
    memory and base bytes against the memory plan's per-rank figures, MFU over the ranks' GPUs.
    With fewer GPUs than the width it says so and runs the widest it can."""
    import torch

    from plexctl.common.memplan import JobShape, rank_weights_bytes, trainer_step
    from plexctl.common.state_size import job_state_bytes
    from worker.trainer_group import TrainerGroup

    cuda = a.device == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    width = a.trainer_width if not cuda else max(1, min(a.trainer_width, gpus))
    if width != a.trainer_width:
        result["note"] = (
            f"{gpus} GPU(s) for a trainer width of {a.trainer_width}: ran width {width}; "
            "multi-rank speed needs a node with that many GPUs"
        )
    dtype = "bfloat16" if cuda else "float32"
    checkpointing = a.gradient_checkpointing != "off"
    options = {"dtype": dtype, "gradient_checkpointing": checkpointing} if cuda else {"threads": 1}
    lora, hp = LoraSpec(rank=32, alpha=64), TrainHParams(lr=1e-5)
    batch = grpo_batch(a.rows, a.seq, a.seq // 4, ctx["vocab"], 0)
    tokens = sum(len(row) for row in batch.input_ids)
    job = JobShape("job0", 32, a.seq)
    state = job_state_bytes(32, list(job.target_modules), ctx["shape"], cuda=cuda)
    result.update(trainer_width=a.trainer_width, rows=a.rows, seq=a.seq, tokens=tokens, dtype=dtype, widths={})
    for w in sorted({1, width}):
        row: dict[str, Any] = {}
        result["widths"][str(w)] = row
        with TrainerGroup(str(ctx["model"]), width=w, engine_options=options, timeout_s=600) as group:
            group.ensure_job("job0", lora, 0)
            group.memory_peaks(reset=True)
            times = []
            for _step in range(a.steps):
                t0 = time.perf_counter()
                metrics = group.train_step("job0", batch, hp)  # returns once every rank is done
                times.append(time.perf_counter() - t0)
            row["loss"] = metrics["loss"]
            row["base_bytes_per_rank"] = group.base_bytes()
            row["state_bytes_per_rank"] = group.rank_state_bytes("job0")
            peaks = group.memory_peaks()
        warm = sorted(times[1:] or times)[len(times[1:] or times) // 2]
        row.update(step_seconds=times, step_seconds_warm=warm, tokens_per_second=tokens / warm)
        row["plan_base_bytes_per_rank"] = rank_weights_bytes(ctx["shape"], dtype, w)
        share = -(-a.rows // w) * a.seq  # a rank's rows, in one pass (the group's step takes no micro-batches)
        planned = trainer_step(
            ctx["shape"], dtype, share, "on" if checkpointing else "off", 0, states=state, job=job, cuda=cuda, width=w
        )
        row["plan_step_peak_gib"] = planned.total / 2**30
        if all(p is not None for p in peaks):
            row["peak_gpu_gib_per_rank"] = [p / 2**30 for p in peaks]
        value = mfu(tokens / warm, model_flops_per_token(ctx["shape"], a.seq), ctx["peak_tflops"])
        if value is not None:
            row["mfu"] = value / w  # over the engine's w GPUs
    one, wide = result["widths"]["1"], result["widths"][str(width)]
    result["speedup"] = one["step_seconds_warm"] / wide["step_seconds_warm"]
    if not cuda:
        result["note"] = (
            f"{width} CPU ranks on {os.cpu_count()} cores: the ranks agree and the memory per rank is the plan's; "
            "their speed says nothing of GPUs"
        )


def part_trainer_sleep(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    """The trainer's base to its pinned host arena and back, twice (the first sleep makes and
    pins the arena), as ``Trainers`` does when another base's task comes: seconds, GB/s and GPU
    memory freed beside a raw pinned copy, and the same log-probs after the wakes."""
    import torch

    trainer = ctx["store"].trainer
    batch = grpo_batch(min(a.rows, 8), a.seq, a.seq // 4, ctx["vocab"], 1)
    before = trainer.logprobs("job0", batch.input_ids, batch.loss_mask)
    nbytes = sum(p.numel() * p.element_size() for p in trainer._base_params.values())
    cuda = torch.cuda.is_available()
    for rnd in ("first", "warm"):
        free = torch.cuda.mem_get_info()[0] if cuda else 0
        sync()
        t0 = time.perf_counter()
        trainer.sleep()
        sync()
        sleep_s = time.perf_counter() - t0
        if cuda:
            result["freed_gib"] = (torch.cuda.mem_get_info()[0] - free) / 2**30
        t0 = time.perf_counter()
        trainer.wake()
        sync()
        wake_s = time.perf_counter() - t0
        suffix = "_first" if rnd == "first" else ""
        result[f"sleep_seconds{suffix}"], result[f"wake_seconds{suffix}"] = sleep_s, wake_s
        result[f"sleep_gb_per_s{suffix}"], result[f"wake_gb_per_s{suffix}"] = (
            nbytes / sleep_s / 1e9,
            nbytes / wake_s / 1e9,
        )
    result["base_bytes"] = nbytes
    result["host_arena_pinned"] = bool(trainer.host_arena is not None and trainer.host_arena.pinned)
    raw = raw_copy_gb_per_s(min(nbytes, SLEEP_RAW_MAX_BYTES), cuda)
    result.update(raw_d2h_gb_per_s=raw["d2h"], raw_h2d_gb_per_s=raw["h2d"])
    result["sleep_over_raw"] = result["sleep_gb_per_s"] / raw["d2h"]
    result["wake_over_raw"] = result["wake_gb_per_s"] / raw["h2d"]
    result["same_logprobs_after_wake"] = trainer.logprobs("job0", batch.input_ids, batch.loss_mask) == before


def raw_copy_gb_per_s(nbytes: int, cuda: bool) -> dict[str, float]:
    """GB/s of a plain ``copy_`` of ``nbytes`` between pinned host memory and the device (on CPU,
    between two host buffers), each way, the best of 5 after a warm one."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        seconds = []
        for _ in range(6):
            sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=cuda)
            sync()
            seconds.append(time.perf_counter() - t0)
        out[name] = nbytes / min(seconds[1:]) / 1e9
    return out


def part_jobs(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    """JOBS jobs of JOB_ROWS x ``--seq`` tokens trained one at a time through the worker's store
    and trainer (each made resident, swapping with the others, then one step), at the 0.5B
    shape; the round after a warm one is timed. Recorded as ``one_at_a_time``; beside it,
    ``grouped``: the same steps in shared passes (``TrainingMath.train_group``), as many jobs a
    pass as the device tier holds at once, made resident together as the worker does, and
    ``grouped_speedup`` (one-at-a-time round over grouped round)."""
    if ctx["shape_name"] not in ("0.5b", "quick"):
        result["skipped"] = "runs at the 0.5B shape only (--shape 0.5b)"
        return
    store = ctx["store"]
    trainer = store.trainer
    lora, hp = LoraSpec(rank=32, alpha=64), TrainHParams(lr=1e-5)
    rows = min(JOB_ROWS, a.rows)
    jobs = [f"solo{j}" for j in range(JOBS)]
    batches = [grpo_batch(rows, a.seq, a.seq // 4, ctx["vocab"], 100 + j) for j in range(JOBS)]
    round_s = swap_s = 0.0
    for _round in range(2):  # the first makes the jobs and warms up
        sync()
        t_round, swap_s = time.perf_counter(), 0.0
        for job, batch in zip(jobs, batches):
            t0 = time.perf_counter()
            store.ensure_resident(job, lora, 0)
            sync()
            swap_s += time.perf_counter() - t0
            trainer.train_step(job, batch, hp)
        sync()
        round_s = time.perf_counter() - t_round
    tokens = JOBS * rows * a.seq
    result["one_at_a_time"] = {
        "jobs": JOBS,
        "rows": rows,
        "seq": a.seq,
        "device_slots": store.device_slots,
        "round_seconds": round_s,
        "resident_seconds": swap_s,  # of it: making each job resident (swaps)
        "tokens_per_second": tokens / round_s,
    }
    put_mfu(result["one_at_a_time"], tokens / round_s, ctx)
    size = max(1, store.device_slots)
    for _round in range(2):  # the first warms the grouped path up
        sync()
        t_round, swap_s = time.perf_counter(), 0.0
        for i in range(0, JOBS, size):
            chunk = list(zip(jobs, batches))[i : i + size]
            t0 = time.perf_counter()
            store.set_upcoming([job for job, _ in chunk])
            for job, _ in chunk:
                store.ensure_resident(job, lora, 0)
            sync()
            swap_s += time.perf_counter() - t0
            trainer.train_group([(job, batch, hp) for job, batch in chunk])
        sync()
        grouped_s = time.perf_counter() - t_round
    result["grouped"] = {
        "jobs": JOBS,
        "jobs_per_pass": min(size, JOBS),
        "round_seconds": grouped_s,
        "resident_seconds": swap_s,
        "tokens_per_second": tokens / grouped_s,
    }
    put_mfu(result["grouped"], tokens / grouped_s, ctx)
    result["grouped_speedup"] = round_s / grouped_s
    for job in jobs:
        store.drop(job)


def part_swap(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    import torch

    store = ctx["store"]
    trainer = store.trainer
    lora = LoraSpec(rank=32, alpha=64)
    for j in range(4):  # 4 jobs, 2 device slots: every ensure_resident past the first two swaps
        store.ensure_resident(f"job{j}", lora, j)
    moved: list[tuple[int, float]] = []
    for _round in range(a.swap_rounds):
        for j in range(4):
            m = store.ensure_resident(f"job{j}", lora, j)
            if m.get("bytes"):
                moved.append((int(m["bytes"]), float(m["seconds"])))
    store.ensure_resident("job0", lora, 0)  # resident again: its size and its adapter are read on the device
    nbytes = trainer.state_bytes("job0")
    result["state_bytes"] = nbytes
    result["swaps"] = len(moved)
    if moved:
        result["swap_gib_per_s"] = sum(b for b, _ in moved) / sum(s for _, s in moved) / 2**30
    cuda = torch.cuda.is_available()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    for name, dst, src in (("raw_h2d_gib_per_s", dev, host), ("raw_d2h_gib_per_s", host, dev)):
        dst.copy_(src, non_blocking=cuda)
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(src, non_blocking=cuda)
        sync()
        result[name] = 10 * nbytes / (time.perf_counter() - t0) / 2**30
    if moved:
        result["swap_over_raw"] = result["swap_gib_per_s"] / min(
            result["raw_h2d_gib_per_s"], result["raw_d2h_gib_per_s"]
        )
    adapter = ctx["scratch"] / "adapter-v1"
    trainer.save_adapter("job0", str(adapter))
    ctx["adapter"] = adapter
    del ctx["store"], store, trainer
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def part_peer(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    """The LoRA GRPO step a user would write with plain transformers + peft, at the trainer
    part's shape, rows, tokens and gradient checkpointing: rank 32 (alpha 64) on the 7
    projections, fp32 adapter and AdamW, bf16 autocast on CUDA, micro-batches of the trainer's
    token budget, log-probs of the completion only (fp32 log-softmax), the clipped ratio loss;
    tokens/s, peak memory, MFU and the trainer/peer ratio."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    trainer_part = ctx["results"]["parts"].get("trainer", {})
    cuda = a.device == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    ckpt = bool(trainer_part.get("gradient_checkpointing", False))
    micro = micro_rows(int(trainer_part.get("micro_batch_tokens") or a.rows * a.seq), a.seq)
    prompt = a.seq // 4
    result.update(rows=a.rows, seq=a.seq, micro_rows=micro, gradient_checkpointing=ckpt, lora_rank=32)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**ctx["shape"])).to(torch.bfloat16 if cuda else torch.float32)
    model.requires_grad_(False)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, PeftLoraConfig(r=32, lora_alpha=64, target_modules=LORA_MODULES))
    adapter = [p for p in model.parameters() if p.requires_grad]
    for p in adapter:
        p.data = p.data.float()
    model.train()
    optimizer = torch.optim.AdamW(adapter, lr=1e-5)
    batch = grpo_batch(a.rows, a.seq, prompt, ctx["vocab"], 0)
    ids = torch.tensor(batch.input_ids, device=device)
    old = torch.tensor(batch.old_logprobs, device=device)[:, prompt:]
    adv = torch.tensor(batch.advantages, device=device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    times = []
    for _step in range(a.steps):
        sync()
        t0 = time.perf_counter()
        for start in range(0, a.rows, micro):
            rows = ids[start : start + micro]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(input_ids=rows, logits_to_keep=a.seq - prompt + 1).logits[:, :-1]
            logp = logits.float().log_softmax(-1).gather(-1, rows[:, prompt:, None]).squeeze(-1)
            ratio = torch.exp(logp - old[start : start + micro])
            gain = adv[start : start + micro, None]
            per_token = -torch.minimum(ratio * gain, ratio.clamp(0.8, 1.2) * gain)
            (per_token.sum() / (a.rows * (a.seq - prompt))).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    warm = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    result.update(step_seconds=times, step_seconds_warm=warm, tokens_per_second=a.rows * a.seq / warm)
    put_mfu(result, result["tokens_per_second"], ctx)
    if cuda:
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["resident_before_gib"] = base_gib  # what was allocated before the peer began
    if trainer_part.get("tokens_per_second"):
        result["trainer_over_peer"] = trainer_part["tokens_per_second"] / result["tokens_per_second"]
    del model, optimizer, adapter
    if cuda:
        torch.cuda.empty_cache()


def part_rollout(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    try:
        import vllm
    except ImportError as exc:
        result["skipped"] = f"vllm not importable here ({exc})"
        return
    from plexctl.common.protocol import AdapterRef

    result["vllm"] = vllm.__version__
    t0 = time.perf_counter()
    engines = worker_engines(
        ctx["model"],
        ["rollout"],
        a.device,
        ctx["scratch"],
        {"max_model_len": a.seq, "gpu_memory_utilization": 0.6},
    )
    engine = engines["rollout"]
    result["start_seconds"] = time.perf_counter() - t0
    prompts = [f"{i}+{i}=" for i in range(a.prompts)]
    sampling = Sampling(max_tokens=a.gen_tokens, n=4, seed=0, temperature=1.0)
    for name, adapter in (("base", None), ("adapter", AdapterRef("job0", 1, str(ctx.get("adapter", ""))))):
        if adapter is not None and not ctx.get("adapter"):
            continue
        t0 = time.perf_counter()
        out = engine.generate([GenRequest(job_id="job0", prompts=prompts, sampling=sampling, adapter=adapter)])
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for c in out[0])
        result[f"{name}_tokens_per_second"] = tokens / seconds
        result[f"{name}_sequences"] = len(out[0])
    engine.close()


def part_weights(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    cuda = a.device == "cuda" and torch.cuda.is_available()
    files = sorted(Path(ctx["model"]).glob("*.safetensors"))
    t0 = time.perf_counter()
    host = {name: t for f in files for name, t in load_file(str(f), device="cpu").items()}
    result["read_seconds"] = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in host.values())
    result.update(tensors=len(host), bytes=nbytes, read_gb_per_s=nbytes / result["read_seconds"] / 1e9)
    if cuda:
        t0 = time.perf_counter()
        host = {name: t.pin_memory() for name, t in host.items()}
        result["pin_seconds"] = time.perf_counter() - t0
    device = {name: torch.empty_like(t, device="cuda" if cuda else "cpu") for name, t in host.items()}
    seconds = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for name, t in host.items():
            device[name].copy_(t, non_blocking=cuda)
        sync()
        seconds.append(time.perf_counter() - t0)
    result["load_seconds"] = sorted(seconds)[1]
    result["load_gb_per_s"] = nbytes / result["load_seconds"] / 1e9
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    flat_device = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    raw = []
    for _ in range(4):  # the first faults the pages in
        sync()
        t0 = time.perf_counter()
        flat_device.copy_(flat_host, non_blocking=cuda)
        sync()
        raw.append(time.perf_counter() - t0)
    result["raw_gb_per_s"] = nbytes / sorted(raw[1:])[1] / 1e9
    result["load_over_raw"] = result["load_gb_per_s"] / result["raw_gb_per_s"]
    del device, host, flat_host, flat_device


def part_sleep_wake(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    import torch

    if a.device != "cuda" or not torch.cuda.is_available():
        result["skipped"] = "needs CUDA: vLLM's sleep mode runs on CUDA only"
        return
    try:
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        result["skipped"] = f"vllm not importable here ({exc})"
        return
    t0 = time.perf_counter()
    llm = LLM(
        model=str(ctx["model"]),
        enable_sleep_mode=True,
        gpu_memory_utilization=0.5,
        max_model_len=a.seq,
        enforce_eager=True,
        seed=0,
    )
    result["start_seconds"] = time.perf_counter() - t0
    prompts = [f"{i}+{i}=" for i in range(a.prompts)]
    params = SamplingParams(max_tokens=a.gen_tokens, temperature=1.0, seed=0)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    free_awake = torch.cuda.mem_get_info()[0]
    sync()
    t0 = time.perf_counter()
    llm.sleep(level=1)
    sync()
    result["sleep_seconds"] = time.perf_counter() - t0
    result["freed_gib"] = (torch.cuda.mem_get_info()[0] - free_awake) / 2**30
    t0 = time.perf_counter()
    llm.wake_up()
    sync()
    result["wake_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    result["first_generate_after_wake_seconds"] = time.perf_counter() - t0
    result["same_tokens_after_wake"] = [list(x) for x in before] == [list(x) for x in after]
    del llm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=None, help="rows per step (64; --quick: 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (1024; --quick: 64)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--swap-rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--host-mem", default="16G")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="the model's shape (random weights)")
    ap.add_argument("--gradient-checkpointing", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--budget-s", type=float, default=420.0, help="parts not begun by then are skipped")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="the worker's (default: its own)")
    ap.add_argument("--ragged", action="store_true", help="the trainer's rows of mixed lengths (see grpo_batch)")
    ap.add_argument("--length-buckets", choices=["on", "off"], default="off", help="the trainer's rows cut by length")
    ap.add_argument("--checkpoint-scope", choices=["layer", "mlp", "attn"], default="layer")
    ap.add_argument("--fuse-lora", choices=["on", "off"], default="off", help="one A matmul per q/k/v, gate/up")
    ap.add_argument("--pack-rows", choices=["on", "off"], default="off", help="rows packed into one sequence")
    ap.add_argument("--vocab-block", type=int, default=0, help="the head's log-softmax in blocks of N (0: whole)")
    ap.add_argument("--compile-layers", default="off", help="torch.compile backend of the decoder layers (inductor)")
    ap.add_argument("--parts", default=None, help="comma-separated parts to run (default: all, in order)")
    ap.add_argument("--trainer-width", type=int, default=2, help="the wide part's ranks (one GPU each)")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.swap_rounds, a.prompts, a.gen_tokens, a.host_mem = 2, 2, 4, 8, "1G"
    a.rows = a.rows or (4 if a.quick else 64)
    a.seq = a.seq or (64 if a.quick else 1024)
    shape = QUICK if a.quick else SHAPES[a.shape]
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": a.device,
        "quick": a.quick,
        "shape": "quick" if a.quick else a.shape,
        "model_shape": shape,
        "parts": {},
    }
    try:
        import torch

        results["torch"] = torch.__version__
        if torch.cuda.is_available():
            results["gpu"] = torch.cuda.get_device_name(0)
            results["gpu_count"] = torch.cuda.device_count()
    except ImportError as exc:
        results["error"] = f"torch not importable: {exc}"
    results["peak_tflops"] = peak_tflops(results.get("gpu")) if a.device == "cuda" else None  # MFU's; None: omitted
    scratch = Path(tempfile.mkdtemp(prefix="plexrl-gpu-check-"))
    ctx: dict[str, Any] = {
        "scratch": scratch,
        "model": scratch / "model",
        "vocab": shape["vocab_size"],
        "shape": shape,
        "shape_name": results["shape"],
        "peak_tflops": results["peak_tflops"],
        "seq": a.seq,
        "results": results,
    }
    failed = False

    def record() -> None:
        write_json_atomic(a.out, results)
        if os.environ.get("OUT"):
            shutil.copy(a.out, Path(os.environ["OUT"]) / a.out.name)

    parts: list[tuple[str, Callable[..., None]]] = [
        ("trainer", part_trainer),
        ("trainer_sleep", part_trainer_sleep),
        ("jobs", part_jobs),
        ("swap", part_swap),
        ("peer", part_peer),
        ("rollout", part_rollout),
        ("weights", part_weights),
        ("sleep_wake", part_sleep_wake),
        ("wide", part_wide),
    ]
    if a.parts:
        wanted = a.parts.split(",")
        unknown = sorted(set(wanted) - {name for name, _ in parts})
        if unknown:
            ap.error(f"--parts: no part {', '.join(unknown)}")
        parts = [(name, part) for name, part in parts if name in wanted]
    try:
        began = t0 = time.perf_counter()
        cuda = a.device == "cuda" and "gpu" in results
        build_model(ctx["model"], shape, "bfloat16" if a.device == "cuda" else "float32", "cuda" if cuda else "cpu")
        results["build_seconds"] = time.perf_counter() - t0
        record()
        for name, part in parts:
            result: dict[str, Any] = {}
            results["parts"][name] = result
            t0 = time.perf_counter()
            try:
                if t0 - began > a.budget_s:
                    result["skipped"] = f"out of time: {t0 - began:.0f} s of the {a.budget_s:.0f} s budget gone"
                else:
                    part(result, ctx, a)
            except Exception as exc:  # noqa: BLE001 - recorded; the next part still runs
                failed = True
                result["error"] = f"{type(exc).__name__}: {exc}"
                result["traceback"] = traceback.format_exc()[-4000:]
            result["seconds"] = time.perf_counter() - t0
            record()
            print(f"{name}: " + json.dumps({k: v for k, v in result.items() if k != "traceback"}), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
