"""The tiny model and task that let PlexRL run real RL end to end on a CPU.

This module owns one recipe, built in code and cached on disk:

- a Qwen2-style causal LM (hidden 128, 2 layers, 2 heads of dim 64, float32) saved in
  Hugging Face format, so vLLM and transformers load it through the same code path as a
  real checkpoint;
- a character-level tokenizer (``tokenizers`` WordLevel over single characters, joined back
  without spaces), saved with ``save_pretrained`` so ``AutoTokenizer.from_pretrained(dir)``
  works;
- the task: single-digit addition ("3+5=" -> "8"), written as ``data/arith/train.jsonl``
  (the 100 problems, shuffled with the seed) and ``data/arith/eval.jsonl`` (the same 100 in
  a fixed order);
- a short, deterministic supervised warm start on "a+b=c<eos>" that stops while the model
  is still *partial* (temperature-1.0 exact-answer accuracy of about a third), so RL has
  room to improve it. RL from random init does not move on this scale (see DESIGN.md).

Token conventions, which every engine must agree on:

- every encoded text starts with ``<bos>`` (the tokenizer's post-processor adds it when
  ``add_special_tokens=True``, which is what vLLM and ``tokenizer(text)`` both do), so the
  ``prompt_token_ids`` that vLLM returns start with ``BOS_ID``;
- a completion ends with ``<eos>`` (``EOS_ID``, also in config.json and
  generation_config.json so vLLM stops on it); the model is trained to emit it.

Exact-answer accuracy is measured without sampling noise: the probability, under
temperature-1.0 sampling, of emitting exactly the answer digits followed by ``<eos>``,
averaged over the 100 problems. That is the expected value of the sampled accuracy, so the
stop criterion is deterministic; a Monte-Carlo estimate with a fixed generator is reported
beside it as a check.

It deliberately does not: download anything, train to convergence, run RL, or know about
vLLM (the rollout engine only gets the model directory).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# ---------------------------------------------------------------- the recipe

RECIPE_VERSION = 1  # bump when a code change alters what the build writes
SEED = 0

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: list[str] = [PAD, BOS, EOS, UNK]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARACTERS: str = "0123456789+-*=/ abcdefghijklmnopqrstuvwxyz.,:;?!()'\"<>"

MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 64: vLLM's CPU attention needs >= 32
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

SFT: dict[str, Any] = {
    "lr": 3e-3,
    "weight_decay": 0.0,
    "batch_size": 100,  # full batch: the task has 100 problems
    "max_steps": 1000,
    "target_accuracy": 0.35,  # stop at the first step whose expected accuracy reaches this
    "mc_samples_per_problem": 16,  # Monte-Carlo check, reported only
}

MODEL_NAME = "tiny-arith"
MARKER = "plexrl-build.json"


@dataclasses.dataclass(frozen=True)
class TinyPaths:
    """Where one build of the tiny recipe lives, and what its warm start reached."""

    root: Path
    model_dir: Path
    data_dir: Path
    train_path: Path
    eval_path: Path
    recipe_hash: str
    warm_start_accuracy: float  # expected temperature-1.0 exact-answer accuracy
    sampled_accuracy: float  # Monte-Carlo estimate of the same, fixed generator
    sft_steps: int
    build_seconds: float


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def recipe_hash() -> str:
    """A short hash of everything that determines the build's content."""
    recipe = {
        "version": RECIPE_VERSION,
        "seed": SEED,
        "special": SPECIAL_TOKENS,
        "chars": CHARACTERS,
        "model": MODEL_CONFIG,
        "sft": SFT,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- task


def all_problems() -> list[Problem]:
    """The 100 single-digit additions in a fixed order (a-major)."""
    return [Problem(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


def train_problems(seed: int = SEED) -> list[Problem]:
    problems = all_problems()
    random.Random(seed).shuffle(problems)
    return problems


def write_jsonl(path: Path, problems: list[Problem]) -> None:
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")


# ---------------------------------------------------------------- tokenizer


def vocabulary() -> dict[str, int]:
    tokens = SPECIAL_TOKENS + list(CHARACTERS)
    assert len(set(tokens)) == len(tokens), "duplicate character in the vocabulary"
    return {t: i for i, t in enumerate(tokens)}


def make_tokenizer() -> Any:
    """A per-character WordLevel tokenizer that prepends <bos>, wrapped for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="right",
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


# ---------------------------------------------------------------- model


def make_model(vocab_size: int) -> Any:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **MODEL_CONFIG,
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    return model


@dataclasses.dataclass
class SftBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    target_mask: torch.Tensor  # [B, T-1]: 1 where the next token is answer or <eos>


def encode_problems(tokenizer: Any, problems: list[Problem]) -> SftBatch:
    """'<bos>a+b=c<eos>', right-padded; targets are the answer digits and <eos>."""
    rows = []
    prompt_lens = []
    for p in problems:
        prompt_ids = tokenizer(p.prompt)["input_ids"]
        answer_ids = tokenizer(p.answer, add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + answer_ids + [EOS_ID])
        prompt_lens.append(len(prompt_ids))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    target = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (row, plen) in enumerate(zip(rows, prompt_lens)):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        target[i, plen - 1 : len(row) - 1] = 1.0  # position t predicts token t+1
    return SftBatch(ids, attn, target)


def answer_logprobs(model: Any, batch: SftBatch) -> torch.Tensor:
    """log P(answer digits + <eos> | prompt) per problem, temperature 1.0."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return (token_logp * batch.target_mask).sum(dim=1)


@torch.no_grad()
def expected_accuracy(model: Any, batch: SftBatch) -> float:
    """Mean probability of sampling exactly the answer then <eos> (no sampling noise)."""
    return float(answer_logprobs(model, batch).exp().mean())


@torch.no_grad()
def sampled_accuracy(
    model: Any, tokenizer: Any, problems: list[Problem], samples: int, seed: int = SEED
) -> float:
    """Monte-Carlo exact-answer accuracy at temperature 1.0 with a fixed generator."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [p.prompt for p in problems for _ in range(samples)]
    answers = [p.answer for p in problems for _ in range(samples)]
    ids = torch.tensor([tokenizer(p)["input_ids"] for p in prompts])  # equal lengths
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(3):  # at most two digits and <eos>
        logits = model(input_ids=ids).logits[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        for i in range(len(prompts)):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= nxt[:, 0] == EOS_ID
        ids = torch.cat([ids, nxt], dim=1)
    correct = 0
    for toks, answer in zip(out, answers):
        if toks and toks[-1] == EOS_ID and tokenizer.decode(toks[:-1]) == answer:
            correct += 1
    return correct / len(prompts)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    steps: int
    expected_accuracy: float
    sampled_accuracy: float


def warm_start(model: Any, tokenizer: Any, problems: list[Problem]) -> WarmStart:
    """Supervised steps on the answer tokens until the expected accuracy reaches target."""
    torch.manual_seed(SEED)
    batch = encode_problems(tokenizer, problems)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT["lr"], weight_decay=SFT["weight_decay"])
    step = 0
    model.eval()
    acc = expected_accuracy(model, batch)
    while acc < SFT["target_accuracy"] and step < SFT["max_steps"]:
        model.train()
        loss = -answer_logprobs(model, batch).sum() / batch.target_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        model.eval()
        acc = expected_accuracy(model, batch)
    mc = sampled_accuracy(model, tokenizer, all_problems(), SFT["mc_samples_per_problem"])
    return WarmStart(step, acc, mc)


# ---------------------------------------------------------------- build + cache


@contextlib.contextmanager
def build_lock(root: Path) -> Iterator[None]:
    """One builder per root at a time (two test sessions may race)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".tiny-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tiny_paths(root: Path) -> tuple[Path, Path]:
    return root / "models" / MODEL_NAME, root / "data" / "arith"


def read_cached(root: Path) -> TinyPaths | None:
    """The cached build if its marker matches this recipe and its files are present."""
    model_dir, data_dir = tiny_paths(root)
    marker = model_dir / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if info.get("recipe_hash") != recipe_hash():
        return None
    if not (data_dir / "train.jsonl").exists() or not (data_dir / "eval.jsonl").exists():
        return None
    return paths_from_marker(root, info)


def paths_from_marker(root: Path, info: dict[str, Any]) -> TinyPaths:
    model_dir, data_dir = tiny_paths(root)
    return TinyPaths(
        root=root,
        model_dir=model_dir,
        data_dir=data_dir,
        train_path=data_dir / "train.jsonl",
        eval_path=data_dir / "eval.jsonl",
        recipe_hash=info["recipe_hash"],
        warm_start_accuracy=info["warm_start_accuracy"],
        sampled_accuracy=info["sampled_accuracy"],
        sft_steps=info["sft_steps"],
        build_seconds=info["build_seconds"],
    )


def replace_dir(tmp: Path, target: Path) -> None:
    """Move a finished directory into place: rename the old one aside, rename, delete old."""
    target.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(target, old)
    os.rename(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def make_temp_dir_beside(target: Path) -> Path:
    """A fresh directory next to ``target`` (same filesystem, so rename is atomic)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the build is meant to be shared
    return tmp


def write_data(data_tmp: Path) -> None:
    write_jsonl(data_tmp / "train.jsonl", train_problems())
    write_jsonl(data_tmp / "eval.jsonl", all_problems())


def write_model(model_tmp: Path) -> WarmStart:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    result = warm_start(model, tokenizer, train_problems())
    model.save_pretrained(model_tmp, safe_serialization=True)
    tokenizer.save_pretrained(model_tmp)
    for f in model_tmp.iterdir():
        f.chmod(0o644)  # transformers writes the weights 0600
    return result


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads. One thread: the model is too small to gain
    from more, the result does not depend on the machine's core count, and two spinning
    OpenMP threads beside another busy process on 2 cores ran the build 40x slower."""
    previous = torch.get_num_threads()
    torch._C.set_num_threads(n)
    try:
        yield
    finally:
        torch._C.set_num_threads(previous)


def build(root: Path) -> TinyPaths:
    """Build everything into temp dirs beside the targets, then rename into place."""
    t0 = time.perf_counter()
    model_dir, data_dir = tiny_paths(root)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    model_tmp = make_temp_dir_beside(model_dir)
    data_tmp = make_temp_dir_beside(data_dir)
    try:
        write_data(data_tmp)
        with torch_threads(1):
            result = write_model(model_tmp)
        info = {
            "recipe_hash": recipe_hash(),
            "warm_start_accuracy": result.expected_accuracy,
            "sampled_accuracy": result.sampled_accuracy,
            "sft_steps": result.steps,
            "build_seconds": time.perf_counter() - t0,
        }
        (model_tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        replace_dir(data_tmp, data_dir)
        replace_dir(model_tmp, model_dir)  # the marker lands last: the build is complete
    finally:
        shutil.rmtree(model_tmp, ignore_errors=True)
        shutil.rmtree(data_tmp, ignore_errors=True)
    return paths_from_marker(root, info)


def build_tiny(root: Path, force: bool = False) -> TinyPaths:
    """Build (or return the cached) tiny model and arithmetic data under ``root``."""
    root = Path(root).resolve()
    if not force and (cached := read_cached(root)) is not None:
        return cached
    with build_lock(root):
        if not force and (cached := read_cached(root)) is not None:
            return cached
        return build(root)


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker.tiny", description="Build the tiny model and arithmetic task."
    )
    parser.add_argument("--root", type=Path, default=Path(".plexrl"), help="default: ./.plexrl")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    cached = not args.force and read_cached(args.root.resolve()) is not None
    t0 = time.perf_counter()
    paths = build_tiny(args.root, force=args.force)
    took = time.perf_counter() - t0
    print(f"model:  {paths.model_dir}")
    print(f"train:  {paths.train_path}")
    print(f"eval:   {paths.eval_path}")
    print(f"recipe: {paths.recipe_hash}  ({'cached' if cached else 'built'} in {took:.1f} s)")
    print(
        f"warm start: {paths.sft_steps} SFT steps, exact-answer accuracy at temperature 1.0: "
        f"{paths.warm_start_accuracy:.1%} expected, {paths.sampled_accuracy:.1%} sampled"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
