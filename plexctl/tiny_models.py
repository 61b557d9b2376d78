"""The tiny models and tasks that let PlexRL run real RL end to end on a CPU.

This module owns the recipes of three tiny bases, built in code and cached on disk by one CLI
(``python -m plexctl.tiny_models --root DIR`` builds them, ``--only NAME`` one; each has its own
build lock): ``tiny-arith`` (a Qwen2-style float32 LM, a character-level tokenizer, single-digit
addition as ``data/arith``), ``tiny-tool`` (``build_tiny_tool``: the same model warm-started on the
multi-turn ``python_tool`` task, ``data/tool``) and ``tiny-llama`` (``build_tiny(root,
name="tiny-llama")``: tiny-arith's task on a Llama-style model of another size). Each is saved in
Hugging Face format, so vLLM and transformers load it as a real checkpoint, and gets a short,
deterministic supervised warm start that stops while the model is still *partial*, so RL has room
to improve it. Sizes, data and the stop criterion: docs/benchmarks.md, "The tiny models".

Token conventions, which every engine must agree on:

- every encoded text starts with ``<bos>`` (the tokenizer's post-processor adds it when
  ``add_special_tokens=True``, which is what vLLM and ``tokenizer(text)`` both do), so the
  ``prompt_token_ids`` that vLLM returns start with ``BOS_ID``;
- a completion ends with ``<eos>`` (``EOS_ID``, also in config.json and
  generation_config.json so vLLM stops on it); the model is trained to emit it.

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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

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
# A second base for the same task, of another architecture family and size: Llama-style, three
# layers, grouped-query attention (three query heads over one key/value head), 192 wide.
LLAMA_MODEL_NAME = "tiny-llama"
LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 192,
    "num_hidden_layers": 3,
    "num_attention_heads": 3,  # head_dim 64, as tiny-arith's
    "num_key_value_heads": 1,
    "intermediate_size": 384,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
ARITH_RECIPES: dict[str, tuple[str, dict[str, Any]]] = {  # name: (architecture family, config)
    MODEL_NAME: ("qwen2", MODEL_CONFIG),
    LLAMA_MODEL_NAME: ("llama", LLAMA_CONFIG),
}
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


def recipe_hash(name: str = MODEL_NAME) -> str:
    """A short hash of everything that determines the build's content."""
    family, config = ARITH_RECIPES[name]
    recipe = {
        "version": RECIPE_VERSION,
        "seed": SEED,
        "special": SPECIAL_TOKENS,
        "chars": CHARACTERS,
        "model": config,
        "sft": SFT,
        **({"family": family} if family != "qwen2" else {}),  # tiny-arith's hash as before
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


def make_model(vocab_size: int, name: str = MODEL_NAME) -> Any:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    family, fields = ARITH_RECIPES[name]
    config_class, model_class = (
        (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    )
    config = config_class(
        vocab_size=vocab_size,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **fields,
    )
    torch.manual_seed(SEED)
    model = model_class(config).to(torch.float32)  # type: ignore[arg-type]  # transformers' functools.wraps on .to
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
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
def sampled_accuracy(model: Any, tokenizer: Any, problems: list[Problem], samples: int, seed: int = SEED) -> float:
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
def build_lock(root: Path, recipe: str) -> Iterator[None]:
    """One builder of a recipe per root at a time (two test sessions may race); the two
    recipes build side by side."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{recipe}-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tiny_paths(root: Path, name: str = MODEL_NAME) -> tuple[Path, Path]:
    return root / "models" / name, root / "data" / ("arith" if name == MODEL_NAME else "arith-llama")


def read_cached(root: Path, name: str = MODEL_NAME) -> TinyPaths | None:
    """The cached build if its marker matches this recipe and its files are present."""
    model_dir, data_dir = tiny_paths(root, name)
    marker = model_dir / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if info.get("recipe_hash") != recipe_hash(name):
        return None
    if not (data_dir / "train.jsonl").exists() or not (data_dir / "eval.jsonl").exists():
        return None
    return paths_from_marker(root, info, name)


def paths_from_marker(root: Path, info: dict[str, Any], name: str = MODEL_NAME) -> TinyPaths:
    model_dir, data_dir = tiny_paths(root, name)
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


def write_model(model_tmp: Path, name: str = MODEL_NAME) -> WarmStart:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer), name)
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


def build(root: Path, name: str = MODEL_NAME) -> TinyPaths:
    """Build everything into temp dirs beside the targets, then rename into place."""

    def fill(model_tmp: Path, data_tmp: Path) -> dict[str, Any]:
        write_data(data_tmp)
        with torch_threads(1):
            result = write_model(model_tmp, name)
        return {
            "recipe_hash": recipe_hash(name),
            "warm_start_accuracy": result.expected_accuracy,
            "sampled_accuracy": result.sampled_accuracy,
            "sft_steps": result.steps,
        }

    return paths_from_marker(root, build_atomically(*tiny_paths(root, name), fill), name)


def build_atomically(model_dir: Path, data_dir: Path, fill: Callable[[Path, Path], dict[str, Any]]) -> dict[str, Any]:
    """Run ``fill(model_tmp, data_tmp)`` in temp dirs beside the targets, write its marker info
    into the model dir, then rename data and model into place (the marker lands last: a model
    dir with a marker is a complete build). Returns the marker info."""
    t0 = time.perf_counter()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    model_tmp = make_temp_dir_beside(model_dir)
    data_tmp = make_temp_dir_beside(data_dir)
    try:
        info = {**fill(model_tmp, data_tmp), "build_seconds": time.perf_counter() - t0}
        (model_tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        replace_dir(data_tmp, data_dir)
        replace_dir(model_tmp, model_dir)
    finally:
        shutil.rmtree(model_tmp, ignore_errors=True)
        shutil.rmtree(data_tmp, ignore_errors=True)
    return info


def cached_build(
    root: Path, force: bool, recipe: str, read_cached: Callable[[Path], Any], build: Callable[[Path], Any]
) -> Any:
    """The cached build under ``root`` if its recipe matches, else build it under the recipe's
    build lock."""
    root = Path(root).resolve()
    if not force and (cached := read_cached(root)) is not None:
        return cached
    with build_lock(root, recipe):
        if not force and (cached := read_cached(root)) is not None:
            return cached
        return build(root)


def build_tiny(root: Path, force: bool = False, name: str = MODEL_NAME) -> TinyPaths:
    """Build (or return the cached) tiny model ``name`` (tiny-arith, tiny-llama) and arithmetic
    data under ``root``."""
    return cached_build(root, force, name, lambda r: read_cached(r, name), lambda r: build(r, name))


# ---------------------------------------------------------------- the tiny-tool recipe
#
# A second model for the multi-turn ``python_tool`` task (``a*b=`` with a in 10..99, b in 2..9):
# the same architecture and tokenizer, its own warm start. An ideal episode, token by token:
#
#   turn 1 prompt  <bos>12*7=                 generated  call:12*7;<eos>
#   turn 2 prompt  <bos>12*7=call:12*7;=84;   generated  84<eos>
#
# The <eos> that ends the call turn is not part of the completion text, so it never reaches the
# next prompt, and the episode runner drops it from the training sequence: RL never trains it.
# The warm start must teach it (a turn ends at <eos> or at max_tokens; a model that kept writing
# after ``;`` would see the observation land after its own junk). The longest ideal episode
# (``99*9=``) needs 25 positions (turn 2: a 21-token prompt, then ``891<eos>``), well inside
# max_position_embeddings 64 and the rollout engine's max_model_len 64, so this recipe keeps
# MODEL_CONFIG unchanged.
#
# Partial on purpose (``training_rows``): every supervised example trains the tool transcript
# past its first token (the call, the <eos> after it, and the answer copied from the observation,
# which sits in the context, untrained), but the first token, i.e. the decision to call, is
# trained as ``c`` only with probability ``tool_share``; otherwise the example answers from
# memory (``12*7=84<eos>``), which the tiny model cannot compute. So the model knows the format
# and the copy, yet calls the tool on only ~``tool_share`` of its samples: its expected episode
# reward starts near ``tool_share`` x the tool-path accuracy, and RL has to learn *to call*.

TOOL_RECIPE_VERSION = 1  # bump when a code change alters what the tool build writes
TOOL_MODEL_NAME = "tiny-tool"
TOOL_TASK: dict[str, Any] = {
    "problems": 720,  # every distinct a*b of python_tool_tiny_dataset, shuffled with data_seed
    "data_seed": 0,
    "eval_problems": 64,  # the first 64 are the held-out evaluation set, the rest train
    "tool": "call",
}
TOOL_SFT: dict[str, Any] = {
    "lr": 3e-3,
    "weight_decay": 0.0,
    "batch_size": 64,  # examples per step (three rows each, see training_rows)
    "max_steps": 1500,
    "check_every": 5,  # steps between two checks of the stop criterion
    "tool_share": 0.3,  # probability that a supervised example calls the tool
    "target_tool_accuracy": 0.9,  # stop once an episode that starts a call succeeds this often
    "mc_samples_per_problem": 4,  # Monte-Carlo check through the real environment, reported only
    "mc_max_tokens": 12,  # per turn, as configs/tiny-tool.yaml
    "mc_max_turns": 3,
}


@dataclasses.dataclass(frozen=True)
class ToolPaths:
    """Where one build of the tiny-tool recipe lives, and what its warm start reached."""

    root: Path
    model_dir: Path
    data_dir: Path
    train_path: Path
    eval_path: Path
    recipe_hash: str
    expected_reward: float  # expected temperature-1.0 episode reward on the eval set (ideal paths)
    tool_share: float  # probability that the first generated token starts a call
    tool_accuracy: float  # expected reward of the episodes that start a call
    sampled_reward: float  # Monte-Carlo episode reward through the real environment
    sampled_tool_calls: float  # tool calls per sampled episode
    sft_steps: int
    build_seconds: float


def tool_records() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, eval) records of the python_tool tiny task: disjoint, fixed order."""
    from plexctl.envs.python_tool import python_tool_tiny_dataset

    records = python_tool_tiny_dataset(TOOL_TASK["problems"], seed=TOOL_TASK["data_seed"])
    assert len({r["prompt"] for r in records}) == len(records), "the tiny tool task repeats a problem"
    n_eval = TOOL_TASK["eval_problems"]
    return records[n_eval:], records[:n_eval]


def tool_recipe_hash() -> str:
    """A short hash of everything that determines the tiny-tool build, data included."""
    train, evals = tool_records()
    recipe = {
        "version": TOOL_RECIPE_VERSION,
        "seed": SEED,
        "special": SPECIAL_TOKENS,
        "chars": CHARACTERS,
        "model": MODEL_CONFIG,
        "task": TOOL_TASK,
        "sft": TOOL_SFT,
        "data": hashlib.sha256(json.dumps([train, evals]).encode()).hexdigest(),
        "rows": [training_rows(evals[0], True), training_rows(evals[0], False)],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def tool_observation(record: dict[str, str]) -> str:
    """What python_tool's calculator answers to the right call (``=84;``)."""
    return f"={record['answer']};"


Row = tuple[str, str, bool]  # (context, target, whether <eos> follows the target)


def tool_turn_rows(record: dict[str, str]) -> list[Row]:
    """The two supervised rows of a tool transcript: the call turn, then the answer turn.

    The answer row's context holds the call and the observation; neither is trained there (the
    observation is not the model's, and after the call the model must stop, not go on with ``=``).
    """
    from plexctl.envs.python_tool import python_tool_tiny_turns

    call, answer = python_tool_tiny_turns(record, TOOL_TASK["tool"])
    return [(record["prompt"], call, True), (record["prompt"] + call + tool_observation(record), answer, True)]


def direct_rows(record: dict[str, str]) -> list[Row]:
    """A transcript that answers from memory, without the tool."""
    return [(record["prompt"], record["answer"], True)]


def training_rows(record: dict[str, str], calls_tool: bool) -> list[Row]:
    """One supervised example. The tool transcript past its first token is always trained (the
    format, the stop after the call, copying the observation: learned at the full data rate);
    the first token, i.e. the decision to call, is trained only when ``calls_tool``, and the
    direct answer otherwise, so the model calls with about that probability."""
    (prompt, call, _), answer_row = tool_turn_rows(record)
    decision = (prompt, call[0], False) if calls_tool else direct_rows(record)[0]
    return [(prompt + call[0], call[1:], True), answer_row, decision]


def encode_rows(tokenizer: Any, rows: list[Row]) -> SftBatch:
    """'<bos>context target[<eos>]', right-padded; targets are the target tokens (and <eos>)."""
    encoded = []
    for context, target, eos in rows:
        context_ids = tokenizer(context)["input_ids"]
        target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + ([EOS_ID] if eos else [])
        encoded.append((context_ids, target_ids))
    width = max(len(c) + len(t) for c, t in encoded)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    target_mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (context_ids, target_ids) in enumerate(encoded):
        row = context_ids + target_ids
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        target_mask[i, len(context_ids) - 1 : len(row) - 1] = 1.0  # position t predicts token t+1
    return SftBatch(ids, attn, target_mask)


class TokenMemo:
    """The tokenizer's ``input_ids`` of each text, computed once: the supervised rows repeat
    every epoch, and tokenizing them again took a sixth of the tiny-tool build."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ids: dict[tuple[str, bool], list[int]] = {}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        key = (text, add_special_tokens)
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": ids}  # read-only


def encode_by_length(tokenizer: Any, rows: list[Row]) -> list[SftBatch]:
    """The rows in batches of equal context length (each row kind pads only to its own width)."""
    groups: dict[int, list[Row]] = {}
    for row in rows:
        groups.setdefault(len(row[0]), []).append(row)
    return [encode_rows(tokenizer, groups[k]) for k in sorted(groups)]


@dataclasses.dataclass(frozen=True)
class ToolMeasure:
    expected_reward: float
    tool_share: float
    tool_accuracy: float


class ToolMeter:
    """Exact temperature-1.0 quantities of a tiny-tool model on fixed problems (no sampling).

    The expected reward counts the two paths that matter: the ideal tool episode (call, then the
    copied answer) and a correct answer from memory. Other rewarded paths (``call:7*12;``, a retry
    after a wrong call) are left out, so it is a slight lower bound of the true expected reward.
    """

    def __init__(self, tokenizer: Any, records: list[dict[str, str]]) -> None:
        self.call = encode_rows(tokenizer, [tool_turn_rows(r)[0] for r in records])  # from the first token
        self.answer = encode_rows(tokenizer, [tool_turn_rows(r)[1] for r in records])
        self.direct = encode_rows(tokenizer, [direct_rows(r)[0] for r in records])
        self.prompts = torch.tensor([tokenizer(r["prompt"])["input_ids"] for r in records])  # equal lengths
        self.call_first_id = tokenizer.convert_tokens_to_ids(TOOL_TASK["tool"][0])

    @torch.no_grad()
    def __call__(self, model: Any) -> ToolMeasure:
        tool_path = (answer_logprobs(model, self.call) + answer_logprobs(model, self.answer)).exp()
        direct = answer_logprobs(model, self.direct).exp()
        first = torch.softmax(model(input_ids=self.prompts).logits[:, -1].float(), dim=-1)[:, self.call_first_id]
        share = float(first.mean())
        return ToolMeasure(
            expected_reward=float((tool_path + direct).mean()),
            tool_share=share,
            tool_accuracy=float(tool_path.mean()) / max(share, 1e-12),
        )


@dataclasses.dataclass(frozen=True)
class ToolWarmStart:
    steps: int
    measure: ToolMeasure
    sampled_reward: float
    sampled_tool_calls: float


def tool_warm_start(
    model: Any, tokenizer: Any, train: list[dict[str, str]], evals: list[dict[str, str]]
) -> ToolWarmStart:
    """Supervised steps (see ``training_rows``) until the tool path is accurate enough."""
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    meter = ToolMeter(tokenizer, evals)
    tokens = TokenMemo(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=TOOL_SFT["lr"], weight_decay=TOOL_SFT["weight_decay"])
    order: list[dict[str, str]] = []
    step = 0
    model.eval()
    measure = meter(model)
    while measure.tool_accuracy < TOOL_SFT["target_tool_accuracy"] and step < TOOL_SFT["max_steps"]:
        for _ in range(TOOL_SFT["check_every"]):
            sft_step(model, tokens, opt, next_examples(rng, order, train))
            step += 1
        model.eval()
        measure = meter(model)
    reward, calls = sampled_tool_reward(model, tokenizer, evals, TOOL_SFT["mc_samples_per_problem"])
    return ToolWarmStart(step, measure, reward, calls)


def next_examples(rng: random.Random, order: list[dict[str, str]], train: list[dict[str, str]]) -> list[Row]:
    """The next batch of supervised rows; ``order`` is the rest of the epoch, refilled in place."""
    rows: list[Row] = []
    for _ in range(TOOL_SFT["batch_size"]):
        if not order:  # a fresh shuffle of the training problems per epoch
            order.extend(train)
            rng.shuffle(order)
        rows += training_rows(order.pop(), calls_tool=rng.random() < TOOL_SFT["tool_share"])
    return rows


def sft_step(model: Any, tokenizer: Any, opt: torch.optim.Optimizer, rows: list[Row]) -> None:
    """One optimizer step on the mean log-loss of the rows' target tokens."""
    batches = encode_by_length(tokenizer, rows)
    model.train()
    # a tensor: typeshed's sum() adds its start, 0, to the type
    loss = cast(
        torch.Tensor, -sum(answer_logprobs(model, b).sum() for b in batches) / sum(b.target_mask.sum() for b in batches)
    )
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


@torch.no_grad()
def sample_turns(model: Any, tokenizer: Any, prompts: list[str], max_tokens: int, gen: torch.Generator) -> list[str]:
    """One temperature-1.0 turn per prompt: tokens until <eos> or ``max_tokens``, as text."""
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    for length in sorted(by_length):  # equal lengths batch without padding
        rows = by_length[length]
        ids = torch.tensor([encoded[i] for i in rows])
        done = torch.zeros(len(rows), dtype=torch.bool)
        for _ in range(max_tokens):
            logits = model(input_ids=ids).logits[:, -1].float()
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            for k, i in enumerate(rows):
                if not done[k]:
                    out[i].append(int(nxt[k]))
            done |= nxt[:, 0] == EOS_ID
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt], dim=1)
    return [tokenizer.decode(toks, skip_special_tokens=True) for toks in out]


def sampled_tool_reward(
    model: Any, tokenizer: Any, records: list[dict[str, str]], samples: int, seed: int = SEED
) -> tuple[float, float]:
    """(mean reward, tool calls per episode) of sampled episodes through the real ``python_tool``
    environment (the calculator in its sandbox), turn by turn as the episode runner does (without
    its token budget: three turns of at most 12 tokens stay inside the model's 64 positions)."""
    from plexctl.envs.python_tool import PythonToolEnv
    from plexctl.sandbox import SandboxPool

    gen = torch.Generator().manual_seed(seed)
    episodes = [r for r in records for _ in range(samples)]
    envs = [PythonToolEnv(tool=TOOL_TASK["tool"]) for _ in episodes]
    texts = [env.reset(r) for env, r in zip(envs, episodes)]
    rewards = [0.0] * len(episodes)
    calls = 0
    live = list(range(len(episodes)))
    with SandboxPool(max_workers=2) as pool:
        for _ in range(TOOL_SFT["mc_max_turns"]):
            if not live:
                break
            turns = sample_turns(model, tokenizer, [texts[i] for i in live], TOOL_SFT["mc_max_tokens"], gen)
            results = [f.result() for f in [pool.call(envs[i].step, t) for i, t in zip(live, turns)]]
            still = []
            for i, turn, result in zip(live, turns, results):
                calls += bool(result.info.get("tool_call"))
                if result.done:
                    rewards[i] = result.reward or 0.0
                else:
                    texts[i] += turn + (result.observation or "")
                    still.append(i)
            live = still
    return sum(rewards) / len(rewards), calls / len(rewards)


def tool_paths(root: Path) -> tuple[Path, Path]:
    return root / "models" / TOOL_MODEL_NAME, root / "data" / "tool"


def read_cached_tool(root: Path) -> ToolPaths | None:
    """The cached tiny-tool build if its marker matches this recipe and its files are present."""
    model_dir, data_dir = tool_paths(root)
    try:
        info = json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if info.get("recipe_hash") != tool_recipe_hash():
        return None
    if not (data_dir / "train.jsonl").exists() or not (data_dir / "eval.jsonl").exists():
        return None
    return tool_paths_from_marker(root, info)


def tool_paths_from_marker(root: Path, info: dict[str, Any]) -> ToolPaths:
    model_dir, data_dir = tool_paths(root)
    return ToolPaths(
        root=root,
        model_dir=model_dir,
        data_dir=data_dir,
        train_path=data_dir / "train.jsonl",
        eval_path=data_dir / "eval.jsonl",
        recipe_hash=info["recipe_hash"],
        expected_reward=info["expected_reward"],
        tool_share=info["tool_share"],
        tool_accuracy=info["tool_accuracy"],
        sampled_reward=info["sampled_reward"],
        sampled_tool_calls=info["sampled_tool_calls"],
        sft_steps=info["sft_steps"],
        build_seconds=info["build_seconds"],
    )


def write_records(path: Path, records: list[dict[str, str]]) -> None:
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def build_tool(root: Path) -> ToolPaths:
    """Build the tiny-tool model and data into temp dirs beside the targets, then rename."""
    from transformers.utils import logging as hf_logging

    def fill(model_tmp: Path, data_tmp: Path) -> dict[str, Any]:
        train, evals = tool_records()
        write_records(data_tmp / "train.jsonl", train)
        write_records(data_tmp / "eval.jsonl", evals)
        hf_logging.disable_progress_bar()
        with torch_threads(1):
            torch.manual_seed(SEED)
            tokenizer = make_tokenizer()
            model = make_model(len(tokenizer))
            result = tool_warm_start(model, tokenizer, train, evals)
            model.save_pretrained(model_tmp, safe_serialization=True)
            tokenizer.save_pretrained(model_tmp)
        for f in model_tmp.iterdir():
            f.chmod(0o644)
        return {
            "recipe_hash": tool_recipe_hash(),
            "expected_reward": result.measure.expected_reward,
            "tool_share": result.measure.tool_share,
            "tool_accuracy": result.measure.tool_accuracy,
            "sampled_reward": result.sampled_reward,
            "sampled_tool_calls": result.sampled_tool_calls,
            "sft_steps": result.steps,
        }

    return tool_paths_from_marker(root, build_atomically(*tool_paths(root), fill))


def build_tiny_tool(root: Path, force: bool = False) -> ToolPaths:
    """Build (or return the cached) tiny-tool model and python_tool data under ``root``."""
    return cached_build(root, force, TOOL_MODEL_NAME, read_cached_tool, build_tool)


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plexctl.tiny_models",
        description="Build the tiny models: tiny-arith (addition) and tiny-tool (calculator calls); "
        "tiny-llama (addition on a Llama-style base) with --only.",
    )
    parser.add_argument("--root", type=Path, default=Path(".plexrl"), help="default: ./.plexrl")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument(
        "--only",
        choices=[MODEL_NAME, TOOL_MODEL_NAME, LLAMA_MODEL_NAME],
        default=None,
        help="build this recipe alone (default: tiny-arith and tiny-tool)",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.only in (None, MODEL_NAME, LLAMA_MODEL_NAME):
        report_tiny(root, args.force, args.only or MODEL_NAME)
    if args.only in (None, TOOL_MODEL_NAME):
        report_tiny_tool(root, args.force)
    return 0


def report_tiny(root: Path, force: bool, name: str = MODEL_NAME) -> None:
    cached = not force and read_cached(root, name) is not None
    t0 = time.perf_counter()
    paths = build_tiny(root, force=force, name=name)
    took = time.perf_counter() - t0
    print(f"model:  {paths.model_dir}")
    print(f"train:  {paths.train_path}")
    print(f"eval:   {paths.eval_path}")
    print(f"recipe: {paths.recipe_hash}  ({'cached' if cached else 'built'} in {took:.1f} s)")
    print(
        f"warm start: {paths.sft_steps} SFT steps, exact-answer accuracy at temperature 1.0: "
        f"{paths.warm_start_accuracy:.1%} expected, {paths.sampled_accuracy:.1%} sampled"
    )


def report_tiny_tool(root: Path, force: bool) -> None:
    cached = not force and read_cached_tool(root) is not None
    t0 = time.perf_counter()
    tool = build_tiny_tool(root, force=force)
    took = time.perf_counter() - t0
    print(f"model:  {tool.model_dir}")
    print(f"train:  {tool.train_path}")
    print(f"eval:   {tool.eval_path}")
    print(f"recipe: {tool.recipe_hash}  ({'cached' if cached else 'built'} in {took:.1f} s)")
    print(
        f"warm start: {tool.sft_steps} SFT steps, episode reward at temperature 1.0: "
        f"{tool.expected_reward:.1%} expected ({tool.tool_share:.1%} call the tool, "
        f"{tool.tool_accuracy:.1%} of those succeed), {tool.sampled_reward:.1%} sampled with "
        f"{tool.sampled_tool_calls:.2f} tool calls per episode"
    )


if __name__ == "__main__":
    sys.exit(main())
