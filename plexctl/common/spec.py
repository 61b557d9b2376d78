"""The job spec: one typed schema for a PlexRL job, loaded from YAML with precise errors.

This module owns the ``JobSpec`` structs (whose ``msgspec.Meta`` annotations are the
reference documentation of every field), ``read_spec`` (YAML + ``--set`` overrides ->
validated ``JobSpec`` with absolute paths), the rules across fields (run by the client and, on
the wire form, by the daemon: ``wire_rule_problems``) and the wire form of a spec.

Validation walks the struct fields itself instead of converting the whole document with
msgspec, because msgspec stops at the first error and knows nothing of YAML lines: every
problem in a file is collected as a ``SpecIssue`` (file, line, dotted YAML path, one-line
message) and raised together as a ``SpecError``. What the spec points at (data files, user
code) is checked by the job library (``plexctl.spec_files``), never here: this module imports
nothing of the job library.

It deliberately does not schedule, size or run anything, never holds a whole dataset, and
never imports torch, transformers or vLLM (plexctl must start fast on a login node; prompts
are counted with the ``tokenizers`` library when it is installed, and only those long enough
to matter).
"""

from __future__ import annotations

import datetime
import difflib
import json
import math
import operator
import os
import re
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

import msgspec
import yaml
from msgspec import Meta

from plexctl.common.errors import PlexError
from plexctl.common.losses import DEFAULT_RL_LOSS, LOSS_REGISTRY, LossConfigError, loss_names, loss_of
from plexctl.common.scalars import parse_value

NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
FN_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"
EMPTY_LORA_REFUSED = (
    "`lora:` is empty (null in YAML): write `lora: {}` for an adapter with the defaults, "
    "or leave `lora` out to train every weight"
)
OVERRIDE_FILE = "--set"
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PATH_FIELDS = (
    ("model", "path"),
    ("data", "path"),
    ("data", "eval_path"),
    ("reward", "path"),
    ("env", "path"),
    ("algo", "path"),
)
ALGORITHMS = ("grpo", "dr_grpo", "dapo", "rloo")
KINDS = ("loop", "external")
EXTERNAL = "external"  # a job driven by a client outside the cluster (a Tinker API training client)
DAPO_KEYS = ("dynamic_sampling", "max_gen_batches", "overlong_buffer", "overlong_penalty")
DR_GRPO_LOSS_AGG = "seq-mean-token-sum-norm"
if TYPE_CHECKING:
    RlLoss = str
else:
    RlLoss = Literal[loss_names("rl")]  # algo.loss: the registry's RL losses
RL_LOSS_DOC = "Trainer loss: " + "; ".join(f"{n} ({LOSS_REGISTRY[n].doc})" for n in loss_names("rl"))
RL_LOSS_PARAMS_DOC = ", ".join(
    f"{n}: {', '.join(LOSS_REGISTRY[n].takes())}" for n in loss_names("rl") if LOSS_REGISTRY[n].takes()
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # any one, as transformers loads
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt")  # vLLM's and transformers' weight formats
SPECIAL_TOKENS_BOUND = 8  # special tokens a tokenizer adds to a prompt (bos, a template's markers), at most


def _doc(description: str, **constraints: Any) -> Meta:
    return Meta(description=description, **constraints)


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelSpec(_Section, kw_only=True):
    """The job's base model: one the cluster serves (`plexctl up --model`, repeat it for several);
    its engines hold it resident, and jobs on other models share the workers."""

    path: Annotated[
        str,
        _doc(
            "Hugging Face model directory (config.json naming a *ForCausalLM architecture, tokenizer, "
            "weights); relative to the YAML file"
        ),
    ]
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"] | None,
        _doc(
            "Weight dtype the job needs its engines to serve (`plexctl up --dtype`; bfloat16 on GPUs, "
            "float32 on CPU by default); null: whatever they serve"
        ),
    ] = None


class LoraSpec(_Section, kw_only=True):
    """The LoRA adapter that is trained (the base model stays frozen)."""

    # also the trainer's LoRA settings on the wire (``calls.TrainerContext.lora``): renaming a field changes the wire

    rank: Annotated[int, _doc("LoRA rank r", ge=1, le=256)] = 8
    alpha: Annotated[int, _doc("LoRA scaling alpha (the update is scaled by alpha / rank)", ge=1)] = 16
    target_modules: Annotated[list[str], _doc("Names of the linear modules that get adapters", min_length=1)] = (
        msgspec.field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    )
    dropout: Annotated[float, _doc("Dropout on the adapter input", ge=0, lt=1)] = 0.0


class DataSpec(_Section, kw_only=True):
    """The prompts: JSONL or Parquet records with a prompt and a reference answer."""

    path: Annotated[
        str,
        _doc(
            "Training prompts (JSONL or Parquet; `submit` checks every record: an object whose "
            "prompt field is a non-empty string, with the answer field); relative to the YAML file"
        ),
    ]
    eval_path: Annotated[str | None, _doc("Fixed evaluation prompts, same format; null for none")] = None
    prompt_field: Annotated[str, _doc("Record field holding the prompt text", min_length=1)] = "prompt"
    answer_field: Annotated[str, _doc("Record field holding the reference answer", min_length=1)] = "answer"
    shuffle_seed: Annotated[int, _doc("Seed of the per-epoch prompt shuffle", ge=0, le=2**32 - 1)] = 0


class RewardSpec(_Section, kw_only=True):
    """How completions are scored. Set exactly one of ``name`` and ``fn``."""

    name: Annotated[
        Literal["arith", "math"] | None, _doc("Built-in reward: arith (exact match) or math (math_verify)")
    ] = None
    fn: Annotated[
        Annotated[str, Meta(pattern=FN_PATTERN)] | None,
        _doc("Custom reward `module:function(completion, answer, record) -> float`"),
    ] = None
    path: Annotated[str | None, _doc("Directory put first on sys.path to import `fn`; relative to the YAML file")] = (
        None
    )
    failure_reward: Annotated[
        float, _doc("Reward given when the reward function raises or returns a non-finite value")
    ] = 0.0
    max_error_rate: Annotated[
        float,
        _doc(
            "The job fails when more than this share of a step's samples hit a reward error or tool timeout", ge=0, le=1
        ),
    ] = 1.0
    timeout_s: Annotated[
        float,
        _doc(
            "Time limit per sample for a custom `fn` (run in the sandbox); past it the sample gets `failure_reward`",
            gt=0,
        ),
    ] = 10.0


class EnvSpec(_Section, kw_only=True):
    """A multi-turn environment with tools. When set, each sample is an episode (tool calls and
    observations between turns) and the environment scores it; ``reward.failure_reward`` is
    given when a step fails. Set exactly one of ``name`` and ``cls``."""

    name: Annotated[Literal["math", "code", "python_tool", "search"] | None, _doc("Built-in environment")] = None
    cls: Annotated[Annotated[str, Meta(pattern=FN_PATTERN)] | None, _doc("Custom environment `module:Class`")] = None
    path: Annotated[str | None, _doc("Directory put first on sys.path to import `cls`; relative to the YAML file")] = (
        None
    )
    config: Annotated[dict[str, Any], _doc("Keyword arguments of the environment class")] = msgspec.field(
        default_factory=dict
    )
    max_turns: Annotated[int, _doc("Model turns per episode", ge=1)] = 4
    max_total_tokens: Annotated[
        Annotated[int, Meta(ge=1)] | None, _doc("Token budget of a whole episode (prompt included)")
    ] = None
    step_timeout_s: Annotated[Annotated[float, Meta(gt=0)] | None, _doc("Seconds a tool or scoring step may take")] = (
        None
    )
    truncated_reward: Annotated[float, _doc("Reward of an episode cut by the turn or token limit")] = 0.0
    workers: Annotated[int, _doc("Sandboxed processes running tools and scoring concurrently", ge=1)] = 4


class AlgoSpec(_Section, kw_only=True):
    """The RL algorithm and its hyperparameters: a built-in ``name``, or your own ``loop``."""

    name: Annotated[
        Literal["grpo", "dr_grpo", "dapo", "rloo"],
        _doc(
            "Built-in algorithm: grpo, dr_grpo (no std or length normalisation), dapo (clip-higher, "
            "dynamic sampling, overlong penalty), rloo (leave-one-out baseline)"
        ),
    ] = "grpo"
    loop: Annotated[
        Annotated[str, Meta(pattern=FN_PATTERN)] | None,
        _doc(
            "Your own algorithm `module:function(job)`, run in the job's driver with the `plexctl.rl` "
            "library (instead of `name`)"
        ),
    ] = None
    agent: Annotated[
        Annotated[str, Meta(pattern=FN_PATTERN)] | None,
        _doc(
            "An agent written against the OpenAI API, `module:function(record, base_url, api_key)` returning its "
            "answer: the built-in algorithm's environment, each sample one episode of it (its turns trained, its "
            "answer scored by `reward`), its `base_url` the job's current policy"
        ),
    ] = None
    path: Annotated[
        str | None,
        _doc("Directory put first on sys.path to import `loop`, `agent` and `loss_fn`; relative to the YAML file"),
    ] = None
    group_size: Annotated[int, _doc("Completions sampled per prompt", ge=2)] = 8
    prompts_per_step: Annotated[int, _doc("Prompts per optimizer step", ge=1)] = 8
    steps: Annotated[int, _doc("Optimizer steps to run", ge=1)] = 100
    lr: Annotated[float, _doc("Adam learning rate of the adapter", gt=0)] = 1e-4
    clip_range: Annotated[float, _doc("PPO ratio clip epsilon (low side)", gt=0)] = 0.2
    clip_range_high: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        _doc("PPO ratio clip epsilon (high side); null: clip_range (dapo: 0.28, its clip-higher)"),
    ] = None
    kl_coef: Annotated[float, _doc("Weight of the KL penalty to the base model", ge=0)] = 0.0
    loss: Annotated[RlLoss, _doc(RL_LOSS_DOC)] = DEFAULT_RL_LOSS
    loss_params: Annotated[dict[str, float], _doc(f"Parameters of the loss ({RL_LOSS_PARAMS_DOC})")] = msgspec.field(
        default_factory=dict
    )
    loss_fn: Annotated[
        Annotated[str, Meta(pattern=FN_PATTERN)] | None,
        _doc(
            "Your own per-token loss `module:function(logp, old_logprobs, advantages, mask, params)`, "
            "run in the trainer: only for users the cluster trusts (`plexctl up --trust-user-code`)"
        ),
    ] = None
    loss_agg: Annotated[
        Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"],
        _doc(
            "How token losses are averaged; seq-mean-token-sum-norm divides each sequence's sum by "
            "sampling.max_tokens (dr_grpo's, set for it when not written)"
        ),
    ] = "token-mean"
    max_staleness: Annotated[int, _doc("Policy versions a rollout may lag behind the trainer", ge=0)] = 0
    eval_every: Annotated[int, _doc("Evaluate on data.eval_path every N steps (0: only at start and end)", ge=0)] = 0
    eval_samples: Annotated[int, _doc("Samples per evaluation prompt", ge=1)] = 4
    dynamic_sampling: Annotated[
        bool, _doc("(dapo) Drop groups whose rewards are all equal and refill the batch with new prompts")
    ] = True
    max_gen_batches: Annotated[
        int, _doc("(dapo) Most generate rounds of prompts_per_step prompts per step when refilling", ge=1)
    ] = 3
    overlong_buffer: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _doc(
            "(dapo) Soft overlong punishment: over the last N tokens before sampling.max_tokens the "
            "penalty ramps from 0 to overlong_penalty; null: max_tokens // 5 (the paper's 4096 of 20480); "
            "0: off"
        ),
    ] = None
    overlong_penalty: Annotated[float, _doc("(dapo) Reward penalty of a completion at sampling.max_tokens", ge=0)] = 1.0


class SamplingSpec(_Section, kw_only=True):
    """Rollout sampling parameters."""

    temperature: Annotated[float, _doc("Sampling temperature", gt=0)] = 1.0
    top_p: Annotated[float, _doc("Nucleus sampling mass", gt=0, le=1)] = 1.0
    max_tokens: Annotated[
        int,
        _doc(
            "Maximum completion length in tokens; with the longest prompt it must fit "
            "the model's context (and the engines' `plexctl up --max-model-len`)",
            ge=1,
        ),
    ] = 8


class CheckpointSpec(_Section, kw_only=True):
    """When the adapter and optimizer state are saved."""

    every: Annotated[int, _doc("Checkpoint every N steps (0: only at the end)", ge=0)] = 10
    max_restarts: Annotated[
        int,
        _doc(
            "Times the job restarts from its last checkpoint after its driver "
            "crashes (killed, out of memory) before it fails",
            ge=0,
        ),
    ] = 2


class JobSpec(_Section, kw_only=True):
    """One RL fine-tuning job."""

    name: Annotated[
        str,
        _doc(
            "Job name, 1-64 of A-Z a-z 0-9 . _ -; a queued or running job of yours that "
            "holds it refuses the submit (`plexctl submit --replace` cancels that job)",
            pattern=NAME_PATTERN,
        ),
    ]
    kind: Annotated[
        Literal["loop", "external"],
        _doc(
            "loop: the cluster runs the job's algorithm in a driver process; external: a client "
            "outside the cluster drives the job through the service calls (a Tinker API training "
            "client's job, made by the cluster's Tinker front end, not submitted): no driver, no data, "
            "no reward"
        ),
    ] = "loop"
    model: ModelSpec
    lora: Annotated[
        LoraSpec | None,
        _doc(
            "LoRA adapter, the base model frozen; left out: full fine-tuning (every weight trained, "
            "the job's state is its weights plus AdamW moments)"
        ),
    ] = None
    data: Annotated[DataSpec | None, _doc("The prompts (a loop job's; required there)")] = None
    reward: Annotated[RewardSpec | None, _doc("How a completion is scored (a loop job's; required there)")] = None
    env: Annotated[EnvSpec | None, _doc("Multi-turn environment with tools (null: single-turn)")] = None
    algo: AlgoSpec = msgspec.field(default_factory=AlgoSpec)
    sampling: SamplingSpec = msgspec.field(default_factory=SamplingSpec)
    checkpoint: CheckpointSpec = msgspec.field(default_factory=CheckpointSpec)
    priority: Annotated[int, _doc("Scheduling priority; higher runs first", ge=-(2**31), le=2**31 - 1)] = 0
    seed: Annotated[int, _doc("Seed of sampling and initialisation", ge=0, le=2**32 - 1)] = 0

    def loop_parts(self) -> tuple[DataSpec, RewardSpec]:
        """A loop job's data and reward (``ValueError`` for an external job, which has neither)."""
        if self.data is None or self.reward is None:
            raise ValueError(f"job {self.name} is {self.kind}: it has no data and reward for a loop")
        return self.data, self.reward

    @property
    def full_finetune(self) -> bool:
        """The job trains every weight of its model (no ``lora`` section)."""
        return self.lora is None

    @property
    def steps_total(self) -> int:
        """The steps the job will run; 0 for an external job, whose client decides as it goes."""
        return 0 if self.kind == EXTERNAL else self.algo.steps


# ---------------------------------------------------------------- errors


class SpecIssue(msgspec.Struct):
    """One problem in a spec: where (file, line, dotted YAML path) and what."""

    file: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class SpecError(PlexError):
    """A spec that cannot be used (exit code: usage); ``issues`` lists every problem found."""

    def __init__(self, issues: list[SpecIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(issue) for issue in issues))


Key = tuple[str | int, ...]


def dotted(path: Key) -> str:
    """``("lora", "target_modules", 2)`` -> ``lora.target_modules[2]``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


class Issues:
    """Collects issues, locating each by YAML line or marking it as coming from ``--set``."""

    def __init__(self, file: str, lines: dict[Key, int], overridden: dict[Key, str]) -> None:
        self.file, self.lines, self.overridden = file, lines, overridden
        self.found: list[SpecIssue] = []

    def add(self, path: Key, message: str) -> None:
        for n in range(len(path), 0, -1):
            if path[:n] in self.overridden:
                self.found.append(SpecIssue(self.overridden[path[:n]], None, dotted(path), message))
                return
        line = next((self.lines[path[:n]] for n in range(len(path), 0, -1) if path[:n] in self.lines), None)
        self.found.append(SpecIssue(self.file, line, dotted(path), message))


# ---------------------------------------------------------------- schema walk

_INVALID = object()
_KIND = {int: "an integer", float: "a float", str: "a string", bool: "a boolean"}
_BOUNDS = (("ge", ">=", operator.ge), ("gt", ">", operator.gt), ("le", "<=", operator.le), ("lt", "<", operator.lt))


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (datetime.date, datetime.datetime)):  # YAML reads 2024-01-01 as a date
        return value.isoformat()
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def unwrap_type(tp: Any) -> tuple[Any, list[Meta], bool]:
    """(base type, Meta constraints, whether null is allowed) of a field type."""
    metas: list[Meta] = []
    optional = False
    while True:
        if get_origin(tp) is Annotated:
            tp, *extra = get_args(tp)
            metas += [m for m in extra if isinstance(m, Meta)]
        elif get_origin(tp) in (Union, types.UnionType):
            members = [a for a in get_args(tp) if a is not type(None)]
            optional = optional or len(members) < len(get_args(tp))
            if len(members) > 1:
                return Union[tuple(members)], metas, optional
            tp = members[0]
        else:
            return tp, metas, optional


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _unknown_key_message(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean `{close[0]}`?" if close else f"valid keys: {', '.join(valid)}"
    return f"unknown key `{key}` ({hint})"


def _constraint_violation(meta: Meta, value: Any, written: Any) -> str | None:
    """Why ``value`` (converted from ``written``, as the user wrote it) breaks ``meta``, or None."""
    shown = _show(written if isinstance(written, (int, float)) else value)
    for attr, symbol, holds in _BOUNDS:
        bound = getattr(meta, attr)
        if bound is not None and not holds(value, bound):
            return f"must be {symbol} {bound}, got {shown}"
    if meta.pattern is not None and not re.search(meta.pattern, value):
        return f"must match {meta.pattern}, got {_show(value)}"
    if meta.min_length is not None and len(value) < meta.min_length:
        return f"must have at least {meta.min_length} {'item' if isinstance(value, list) else 'character'}(s)"
    return None


class _SchemaWalk:
    """Converts a YAML document to struct-shaped builtins, collecting every issue."""

    def __init__(self, issues: Issues) -> None:
        self.issues = issues

    def struct(self, cls: type[msgspec.Struct], value: Any, path: Key) -> Any:
        if not isinstance(value, dict):
            self.issues.add(path, f"expected a mapping, got {_show(value)}")
            return _INVALID
        fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
        out: dict[str, Any] = {}
        for key, item in value.items():
            key = str(key)
            if key not in fields:
                self.issues.add(path + (key,), _unknown_key_message(key, list(fields)))
                continue
            converted = self.value(fields[key].type, item, path + (key,))
            if converted is not _INVALID:
                out[key] = converted
        for name, field in fields.items():
            if field.required and name not in value:
                self.issues.add(path + (name,), f"missing required key `{name}`")
        return out

    def value(self, tp: Any, value: Any, path: Key) -> Any:
        base, metas, optional = unwrap_type(tp)
        if value is None:
            if optional:
                return None
            self.issues.add(path, f"expected {self._kind(base)}, got null")
            return _INVALID
        if _is_struct(base):
            return self.struct(base, value, path)
        if get_origin(base) is list:
            converted = self.sequence(get_args(base)[0], value, path)
        elif get_origin(base) is dict:
            converted = self.mapping(get_args(base)[1], value, path)
        elif get_origin(base) is Literal:
            converted = self.choice(get_args(base), value, path)
        else:
            converted = self.scalar(base, value, path)
        if converted is _INVALID:
            return _INVALID
        for meta in metas:
            problem = _constraint_violation(meta, converted, value)
            if problem:
                self.issues.add(path, problem)
                return _INVALID
        return converted

    def sequence(self, item_type: Any, value: Any, path: Key) -> Any:
        if not isinstance(value, list):
            self.issues.add(path, f"expected a list, got {_show(value)}")
            return _INVALID
        items = [self.value(item_type, item, path + (i,)) for i, item in enumerate(value)]
        return _INVALID if any(item is _INVALID for item in items) else items

    def mapping(self, item_type: Any, value: Any, path: Key) -> Any:
        if not isinstance(value, dict):
            self.issues.add(path, f"expected a mapping, got {_show(value)}")
            return _INVALID
        items = {str(k): self.value(item_type, item, path + (str(k),)) for k, item in value.items()}
        return _INVALID if any(item is _INVALID for item in items.values()) else items

    def choice(self, choices: tuple[Any, ...], value: Any, path: Key) -> Any:
        if isinstance(value, str) and value in choices:
            return value
        self.issues.add(path, f"must be one of {', '.join(map(str, choices))}; got {_show(value)}")
        return _INVALID

    def scalar(self, tp: type, value: Any, path: Key) -> Any:
        if isinstance(value, bool) and tp is not bool:
            converted: Any = _INVALID
        else:
            try:  # strict=False: "1e-4" (a string to YAML) is a float, 8.0 an int
                converted = msgspec.convert(value, tp, strict=False)
            except msgspec.ValidationError:
                converted = _INVALID
        if converted is _INVALID:
            self.issues.add(path, f"expected {self._kind(tp)}, got {_show(value)}")
        elif tp is float and not math.isfinite(converted):
            self.issues.add(path, f"must be a finite number, got {_show(value)}")
            return _INVALID
        elif tp is int and not -(2**63) <= converted < 2**63:
            self.issues.add(path, f"must fit in 64 bits, got {_show(value)}")
            return _INVALID
        return converted

    @staticmethod
    def _kind(tp: Any) -> str:
        if _is_struct(tp):
            return "a mapping"
        if get_origin(tp) is list:
            return "a list"
        if get_origin(tp) is Literal:
            return "one of " + ", ".join(map(str, get_args(tp)))
        return _KIND.get(tp, getattr(tp, "__name__", str(tp)))


# ---------------------------------------------------------------- rules across fields


def _check_rules(doc: dict[str, Any], issues: Issues) -> None:
    """Rules across fields, judged on what the user wrote (``doc`` before conversion)."""
    if doc.get("kind") == EXTERNAL:
        issues.add(
            ("kind",),
            "external: the job of a Tinker API training client, made by the cluster's Tinker front end "
            "(`plexctl up --tinker-port`), not submitted",
        )
    elif doc.get("kind", "loop") == "loop":
        for section in ("data", "reward"):
            if doc.get(section) is None:
                issues.add((section,), f"missing required key `{section}` (a loop job's)")
    if "lora" in doc and doc["lora"] is None:
        issues.add(("lora",), EMPTY_LORA_REFUSED)
    reward = doc.get("reward")
    if isinstance(reward, dict):
        has_name, has_fn = reward.get("name") is not None, reward.get("fn") is not None
        if has_name == has_fn:
            got = "both" if has_name else "neither"
            issues.add(
                ("reward",), f"set exactly one of `name` (built-in: arith, math) or `fn` (module:function); got {got}"
            )
        elif has_name and reward.get("path") is not None:
            issues.add(("reward", "path"), "`path` only applies to a custom `fn`, not to a built-in reward")
    algo = doc.get("algo")
    if isinstance(algo, dict):
        _check_algo_rules(algo, doc, issues)


def _check_algo_rules(algo: dict[str, Any], doc: dict[str, Any], issues: Issues) -> None:
    """Keys that belong to one algorithm, loss or loop are refused elsewhere, with the reason."""
    name = algo.get("name", "grpo")
    if algo.get("loop") is not None and "name" in algo:
        issues.add(("algo", "loop"), "set either `name` (a built-in algorithm) or `loop` (your own), not both")
    if algo.get("path") is not None and all(algo.get(k) is None for k in ("loop", "agent", "loss_fn")):
        issues.add(("algo", "path"), "`path` only applies to a custom `loop`, `agent` or `loss_fn`")
    if algo.get("agent") is not None and algo.get("loop") is not None:
        issues.add(("algo", "agent"), "a `loop` of your own runs its agent itself (job.agent_endpoint()): drop `agent`")
    if algo.get("agent") is not None and doc.get("env") is not None:
        issues.add(("algo", "agent"), "the agent is the job's environment: drop `env`, or `agent`")
    if algo.get("agent") is not None and name == "dapo":
        issues.add(
            ("algo", "agent"), "dapo refills its groups from the prompts: use grpo, dr_grpo or rloo with an agent"
        )
    owner = "your own loop" if algo.get("loop") is not None else name
    if owner != "dapo" and owner in ALGORITHMS + ("your own loop",):
        for key in DAPO_KEYS:
            if key in algo:
                issues.add(("algo", key), f"only applies to algo.name dapo (this job runs {owner})")
    if name == "dr_grpo" and algo.get("loop") is None and algo.get("loss_agg", DR_GRPO_LOSS_AGG) != DR_GRPO_LOSS_AGG:
        issues.add(
            ("algo", "loss_agg"),
            f"dr_grpo aggregates with {DR_GRPO_LOSS_AGG} (no length normalisation); drop the key or use algo.name grpo",
        )
    if algo.get("loss_fn") is not None and "loss" in algo:
        issues.add(("algo", "loss"), "set either `loss` (a built-in loss) or `loss_fn` (your own), not both")
    params, entry = algo.get("loss_params"), loss_of(str(algo.get("loss", DEFAULT_RL_LOSS)), "rl")
    if isinstance(params, dict) and algo.get("loss_fn") is None and entry is not None:
        takes = ", ".join(entry.takes()) or "no parameters"
        for key in entry.unknown(params):
            issues.add(("algo", "loss_params", key), f"loss {algo.get('loss', DEFAULT_RL_LOSS)} takes {takes}")
        given = {k: v for k, v in params.items() if k in entry.config and _is_number(v)}
        try:
            entry.settings(given)
        except LossConfigError as e:
            issues.add(("algo", "loss_params", e.key), e.problem)
    buffer, sampling = algo.get("overlong_buffer"), doc.get("sampling")
    max_tokens = sampling.get("max_tokens", 8) if isinstance(sampling, dict) else 8
    if isinstance(buffer, int) and isinstance(max_tokens, int) and buffer >= max_tokens > 0:
        issues.add(("algo", "overlong_buffer"), f"must be < sampling.max_tokens ({max_tokens}), got {buffer}")
    if buffer and doc.get("env") is not None:
        issues.add(
            ("algo", "overlong_buffer"),
            "applies to single-turn jobs; a multi-turn episode cut by its limits gets env.truncated_reward",
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _algorithm_defaults(converted: dict[str, Any], doc: dict[str, Any]) -> None:
    """Fill what an algorithm fixes and the user left unwritten, so the spec says what runs."""
    algo, written = converted.get("algo"), doc.get("algo")
    if isinstance(algo, dict) and algo.get("name") == "dr_grpo" and algo.get("loop") is None:
        if not (isinstance(written, dict) and "loss_agg" in written):
            algo["loss_agg"] = DR_GRPO_LOSS_AGG


def _resolve_paths(doc: dict[str, Any], base_dir: Path) -> None:
    for section, key in PATH_FIELDS:
        part = doc.get(section)
        if isinstance(part, dict) and isinstance(part.get(key), str):
            part[key] = os.path.normpath(base_dir / os.path.expanduser(part[key]))


def model_dir_problem(model_dir: Path) -> str | None:
    """Why the engines cannot load ``model_dir`` (no config.json, tokenizer or weights), or None."""
    if not model_dir.is_dir():
        return f"model directory not found: {model_dir}"
    if not (model_dir / "config.json").is_file():
        return f"no config.json in {model_dir} (expected a Hugging Face model directory)"
    try:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as exc:
        return f"{model_dir / 'config.json'} is not a JSON object: {exc}"
    if not any(isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures):
        return (
            f"{model_dir / 'config.json'}: architectures {architectures}: not a causal language model "
            f"(the engines load a *ForCausalLM model)"
        )
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return f"no tokenizer in {model_dir} (one of {', '.join(TOKENIZER_FILES)}): the engines cannot tokenize prompts"
    if not any(next(model_dir.glob(pattern), None) for pattern in WEIGHT_GLOBS):
        return f"no weights in {model_dir} (no {', '.join(WEIGHT_GLOBS)} file)"
    return None


# ---------------------------------------------------------------- YAML and overrides


def _record_lines(
    node: yaml.Node,
    path: Key,
    lines: dict[Key, int],
    file: str,
    duplicates: list[SpecIssue],
    seen: set[int] | None = None,
) -> None:
    """Map every key / list item path of a composed YAML document to its 1-based line (a node
    that an alias repeats is mapped where it is written only), and note each key written twice
    in one mapping (YAML would keep the last silently) at its second line."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = path + (str(key_node.value),)
            line = key_node.start_mark.line + 1
            if child in lines:
                duplicates.append(SpecIssue(file, line, dotted(child), f"duplicate key (first on line {lines[child]})"))
            else:
                lines[child] = line
            _record_lines(value_node, child, lines, file, duplicates, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _record_lines(item, path + (i,), lines, file, duplicates, seen)


def _parse_yaml(text: str, file: str) -> tuple[Any, dict[Key, int]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        line = mark.line + 1 if mark else None
        raise SpecError([SpecIssue(file, line, "", f"YAML syntax error: {problem}")]) from None
    lines: dict[Key, int] = {}
    if node is not None:
        problem = _alias_problem(node)
        if problem:
            raise SpecError([SpecIssue(file, None, "", problem)])
        duplicates: list[SpecIssue] = []
        _record_lines(node, (), lines, file, duplicates)
        if duplicates:
            raise SpecError(duplicates)
    return doc, lines


MAX_SPEC_VALUES = 100_000  # a job spec with YAML aliases expanded: far more than any real one


def _alias_problem(root: yaml.Node) -> str | None:
    """Why the document's YAML aliases make it unusable (one that contains itself, or expands
    to more than ``MAX_SPEC_VALUES`` values), or None."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise RecursionError
        open_nodes.add(key)
        children = (
            [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else node.value
            if isinstance(node, yaml.SequenceNode)
            else []
        )
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_SPEC_VALUES:
                break
        open_nodes.discard(key)
        sizes[key] = total
        return total

    try:
        if size(root) > MAX_SPEC_VALUES:
            return f"YAML aliases expand the spec to more than {MAX_SPEC_VALUES:,} values"
    except RecursionError:
        return "a YAML alias refers to a node that contains it"
    return None


def _apply_override(doc: dict[str, Any], text: str, overridden: dict[Key, str]) -> SpecIssue | None:
    """Set ``a.b.c=value`` (value parsed as YAML 1.2: ``plexctl.common.scalars``) in ``doc``,
    creating sections as needed."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        return SpecIssue(OVERRIDE_FILE, None, key.strip(), f"expected KEY=VALUE (e.g. algo.lr=3e-4), got {text!r}")
    try:
        value = parse_value(key.strip(), raw)
    except ValueError as e:
        return SpecIssue(OVERRIDE_FILE, None, key.strip(), str(e).removeprefix(f"{key.strip()}: "))
    section = doc
    for n, part in enumerate(parts[:-1], start=1):
        if section.get(part) is None:
            section[part] = {}
            overridden[tuple(parts[:n])] = OVERRIDE_FILE
        section = section[part]
        if not isinstance(section, dict):
            return SpecIssue(OVERRIDE_FILE, None, ".".join(parts[:n]), f"is not a mapping, cannot set `{key.strip()}`")
    section[parts[-1]] = value
    overridden[tuple(parts)] = OVERRIDE_FILE
    return None


# ---------------------------------------------------------------- public API


def read_spec(
    path: str | Path,
    overrides: Sequence[str] = (),
    name: str | None = None,
    check: Callable[[dict[str, Any], Issues], None] | None = None,
) -> JobSpec:
    """Read, override, validate and resolve a job spec; raise ``SpecError`` listing every problem.

    ``overrides`` are ``a.b=value`` strings (value parsed as YAML), ``name`` replaces the job
    name. Relative paths (model.path, data.path, data.eval_path, reward.path), including
    overridden ones, are made absolute against the YAML file's directory. ``check`` adds the
    problems of what the spec points at (``plexctl.spec_files.check_files``: the job library's,
    which reads data and imports code) to the same list.
    """
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except IsADirectoryError:
        raise SpecError([SpecIssue(file, None, "", "is a directory, not a spec file")]) from None
    except (FileNotFoundError, NotADirectoryError):
        raise SpecError([SpecIssue(file, None, "", "spec file not found")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError([SpecIssue(file, None, "", f"cannot read spec file: {e}")]) from None
    doc, lines = _parse_yaml(text, file)
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise SpecError([SpecIssue(file, 1, "", f"expected a mapping at the top level, got {_show(doc)}")])
    overridden: dict[Key, str] = {}
    problems = [p for p in (_apply_override(doc, o, overridden) for o in overrides) if p is not None]
    if name is not None:
        doc["name"] = name
        overridden[("name",)] = "--name"
    issues = Issues(file, lines, overridden)
    issues.found += problems
    converted = _SchemaWalk(issues).struct(JobSpec, doc, ())
    _check_rules(doc, issues)
    _algorithm_defaults(converted, doc)
    _resolve_paths(converted, Path(os.path.abspath(path)).parent)
    if check is not None:
        check(converted, issues)
    if issues.found:
        raise SpecError(issues.found)
    return msgspec.convert(converted, JobSpec)


def spec_to_wire(spec: JobSpec) -> dict[str, Any]:
    return msgspec.to_builtins(spec)


def _written(value: Any, default: Any) -> Any:
    """A wire spec's sections as if written: fields equal to their default left out."""
    if isinstance(value, dict) and isinstance(default, dict):
        return {k: _written(v, default.get(k)) for k, v in value.items() if k not in default or v != default[k]}
    return value


def wire_rule_problems(d: dict[str, Any], from_tinker_front_end: bool = False) -> list[str]:
    """The rules across fields (``_check_rules``, the ones ``load_spec`` runs for the client) on a
    spec as it came over the wire, one line each: the daemon runs them on every submit, whatever
    client sent it. ``kind: external`` passes only from the cluster's Tinker front end, where
    ``data`` and ``reward`` are left out."""
    spec = spec_from_wire(d)
    defaults = {
        section: msgspec.to_builtins(type(getattr(spec, section))())
        for section in ("algo", "reward", "sampling", "checkpoint")
        if getattr(spec, section) is not None and section != "reward"
    }
    doc = {k: _written(v, defaults.get(k)) for k, v in spec_to_wire(spec).items() if k != "lora" or v is not None}
    if spec.reward is not None:
        doc["reward"] = {k: v for k, v in msgspec.to_builtins(spec.reward).items() if v is not None}
    if from_tinker_front_end and spec.kind == EXTERNAL:
        doc.pop("kind", None)
        if spec.data is not None or spec.reward is not None or spec.env is not None:
            return ["an external job has no data, reward or env"]
        return []
    issues = Issues("<submit>", {}, {})
    _check_rules(doc, issues)
    return [f"{i.path}: {i.message}" if i.path else i.message for i in issues.found]


def spec_from_wire(d: dict[str, Any]) -> JobSpec:
    """A ``JobSpec`` from its wire form (no file checks); ``SpecError`` if it does not fit."""
    try:
        return msgspec.convert(d, JobSpec)
    except msgspec.ValidationError as e:
        message, _, where = str(e).partition(" - at `$")
        raise SpecError([SpecIssue("<wire>", None, where.rstrip("`").lstrip("."), message)]) from None
