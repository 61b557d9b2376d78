"""GPU acceptance check for a lent GPU machine: the worker's own wiring on CUDA, measured.

Builds a 0.5B-class Qwen2 in code (Qwen2.5-0.5B's shape, random init: this measures speed and
memory, not learning) and runs, each part bounded and recorded as it ends:

1. ``trainer``: the worker's ``build_engines`` (``--device cuda``, dtype auto -> bf16) makes the
   state store and trainer engine; GRPO steps of ROWS x SEQ tokens on the 152k vocabulary with
   a rank-32 LoRA on every projection, micro-batched by the token budget; step time and peak
   GPU memory;
2. ``trainer_sleep``: the trainer's base weights to pinned host memory and back (another base's
   turn on the GPU): seconds, GB/s, memory freed, and the same log-probs after the wake;
3. ``swap``: the same store swaps several jobs through device and pinned host memory; the
   state copies' bandwidth beside a raw pinned ``copy_`` (cudaMemcpy) of the same bytes, in the
   same run;
4. ``rollout``: when vLLM imports, the worker's rollout engine on the same GPU (after the
   trainer is gone) generates from the base model and from a bf16 adapter the trainer
   published; tokens per second;
5. ``weights``: a whole-model weight load, as an engine switching to another base (or a full
   fine-tuning job's rollout engine taking its latest weights) does it: the model's safetensors
   read into host memory (pinned on CUDA), then copied into device tensors; seconds and GB/s of
   each, beside a raw pinned ``copy_`` of the same bytes. Runs on CPU too (the copies only);
6. ``sleep_wake``: CUDA and vLLM only (vLLM's sleep mode is CUDA-only; skipped otherwise, with
   the reason): a vLLM engine with ``enable_sleep_mode`` generates, sleeps at level 1 (weights
   to pinned host memory, KV cache dropped), wakes and generates again: the seconds of sleep and
   of wake, the GPU memory freed by the sleep, and whether the same seeded request gives the
   same tokens after the wake. These timings are what ``daemon.simulator``'s model-switch cost
   (``SimConfig.switch_s`` and ``h2d_gbps``) stands in for until they are measured.

Writes ``bench/results/gpu.json`` after every part (and copies it to ``$OUT``), so a call cut
short keeps what ran. ``--quick`` shrinks every shape (for a smoke run on CPU: ``--device cpu``).
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
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plexctl.common.atomic import write_json_atomic  # noqa: E402
from plexctl.common.protocol import GenRequest, LoraConfig, Sampling, TrainBatch, TrainHParams  # noqa: E402

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
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


def build_model(path: Path, shape: dict[str, int], dtype: str) -> None:
    """A random Qwen2 of ``shape`` with the tiny character tokenizer (vLLM needs one), in HF format."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from worker.tiny_models import BOS_ID, EOS_ID, PAD_ID, make_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype=dtype, **shape)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)


def worker_engines(model: Path, kinds: list[str], device: str, scratch: Path, extra: list[str]) -> dict[str, Any]:
    """The engines exactly as ``plexw`` builds them from its command line."""
    from worker.engine_args import DEFAULT_MAX_LORA_RANK
    from worker.engine_options import engine_options
    from worker.main import build_engines, build_parser

    args = build_parser().parse_args(
        [
            "--endpoint",
            "tcp://127.0.0.1:1",
            "--engines",
            ",".join(kinds),
            "--model",
            str(model),
            "--device",
            device,
            "--scratch",
            str(scratch),
            "--max-lora-rank",  # the GPU's default, on CPU too: the check's adapters are rank 32
            str(DEFAULT_MAX_LORA_RANK["cuda"]),
            *extra,
        ]
    )
    import torch

    options = engine_options(
        args.device,
        args.dtype,
        args.micro_batch_tokens,
        torch.cuda.is_available(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    return {"options": options, **build_engines(args, kinds, options, str(model))}


def grpo_batch(rows: int, seq: int, prompt: int, vocab: int, seed: int) -> TrainBatch:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g).tolist()
    mask = [[0] * prompt + [1] * (seq - prompt) for _ in range(rows)]
    old = [[0.0] * prompt + [-12.0] * (seq - prompt) for _ in range(rows)]
    adv = (torch.randn(rows, generator=g)).tolist()
    return TrainBatch(input_ids=ids, loss_mask=mask, old_logprobs=old, advantages=adv)


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
        ["--host-mem", a.host_mem, "--device-slots", "2", "--threads", "4"],
    )
    store, options = engines["trainer"], engines["options"]
    ctx["store"] = store
    trainer = store.trainer
    result.update(
        device=options.device,
        dtype=options.dtype,
        micro_batch_tokens=options.micro_batch_tokens,
        gradient_checkpointing=bool(getattr(trainer, "gradient_checkpointing", False)),
    )
    lora, hp = LoraConfig(rank=32, alpha=64), TrainHParams(lr=1e-5)
    batch = grpo_batch(a.rows, a.seq, a.seq // 4, ctx["vocab"], 0)
    result.update(rows=a.rows, seq=a.seq, vocab=ctx["vocab"], lora_rank=32)
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
    result["tokens_per_second"] = a.rows * a.seq / result["step_seconds_warm"]
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


def part_trainer_sleep(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    """The trainer's base to pinned host memory and back, as ``Trainers`` does when another base's
    task comes: seconds, GB/s and GPU memory freed, and the same log-probs after the wake."""
    import torch

    trainer = ctx["store"].trainer
    batch = grpo_batch(min(a.rows, 8), a.seq, a.seq // 4, ctx["vocab"], 1)
    before = trainer.logprobs("job0", batch.input_ids, batch.loss_mask)
    nbytes = sum(p.numel() * p.element_size() for p in trainer._base_params.values())
    cuda = torch.cuda.is_available()
    free = torch.cuda.mem_get_info()[0] if cuda else 0
    sync()
    t0 = time.perf_counter()
    trainer.sleep()
    sync()
    result["sleep_seconds"] = time.perf_counter() - t0
    if cuda:
        result["freed_gib"] = (torch.cuda.mem_get_info()[0] - free) / 2**30
    t0 = time.perf_counter()
    trainer.wake()
    sync()
    result["wake_seconds"] = time.perf_counter() - t0
    result.update(
        base_bytes=nbytes,
        sleep_gb_per_s=nbytes / result["sleep_seconds"] / 1e9,
        wake_gb_per_s=nbytes / result["wake_seconds"] / 1e9,
    )
    result["same_logprobs_after_wake"] = trainer.logprobs("job0", batch.input_ids, batch.loss_mask) == before


def part_swap(result: dict[str, Any], ctx: dict[str, Any], a: argparse.Namespace) -> None:
    import torch

    store = ctx["store"]
    trainer = store.trainer
    lora = LoraConfig(rank=32, alpha=64)
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
        ["--max-model-len", str(a.seq), "--gpu-memory-utilization", "0.6"],
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
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--swap-rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--host-mem", default="16G")
    a = ap.parse_args()
    if a.quick:
        a.rows, a.seq, a.steps, a.swap_rounds, a.prompts, a.gen_tokens, a.host_mem = 4, 64, 2, 2, 4, 8, "1G"
    shape = QUICK if a.quick else QWEN25_05B
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": a.device,
        "quick": a.quick,
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
    scratch = Path(tempfile.mkdtemp(prefix="plexrl-gpu-check-"))
    ctx: dict[str, Any] = {"scratch": scratch, "model": scratch / "model", "vocab": shape["vocab_size"], "shape": shape}
    failed = False

    def record() -> None:
        write_json_atomic(a.out, results)
        if os.environ.get("OUT"):
            shutil.copy(a.out, Path(os.environ["OUT"]) / a.out.name)

    parts: list[tuple[str, Callable[..., None]]] = [
        ("trainer", part_trainer),
        ("trainer_sleep", part_trainer_sleep),
        ("swap", part_swap),
        ("rollout", part_rollout),
        ("weights", part_weights),
        ("sleep_wake", part_sleep_wake),
    ]
    try:
        t0 = time.perf_counter()
        build_model(ctx["model"], shape, "bfloat16" if a.device == "cuda" else "float32")
        results["build_seconds"] = time.perf_counter() - t0
        record()
        for name, part in parts:
            result: dict[str, Any] = {}
            results["parts"][name] = result
            t0 = time.perf_counter()
            try:
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
