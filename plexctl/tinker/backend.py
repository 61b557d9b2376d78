"""What the Tinker front end asks of a cluster: the ``Backend`` interface, its types, and the SDK's
rules for the ids and ``tinker://`` paths a backend forms.

Every method is synchronous and may block (the server calls it off its event loop, on a thread).
The server has already authenticated the caller and checked that the model or sampler named is one
``user`` created through it; a backend checks what only it can (a ``tinker://`` path that names
another user's run, a base model it does not serve). Calls on one model come one at a time, in the
order the user's training client numbered them; ``sample`` calls may overlap, on one sampler too.

A call that waits for the cluster's capacity (its job is queued behind others) says so with
``say_waiting(reason)``: the SDK's polls of its future are then answered "paused_capacity" with
that reason; ``say_waiting(None)`` once it runs. ``capacity_note`` says, as a new session starts,
whether a run would wait now.

Errors: raise ``UserError`` for what the user can fix (its message, one line, is what they see, with
category "user"); anything else reaches them as an internal error (category "server") and is logged
with its traceback.

Ids: ``model_id`` must be ``sdk_model_id(session_id, model_seq_id)`` (the SDK computes it itself
when it creates a training client from a checkpoint) and ids and checkpoint names must not hold
``/``: a ``tinker://`` path is ``tinker://<model_id>/weights|sampler_weights/<name>``
(``checkpoint_path``).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

import msgspec

from plexctl.common import calls as C

CheckpointKind = Literal["training", "sampler"]
STOP_REASONS = ("stop", "length")  # a stop string, token or EOS ended it; max_tokens did

_SEGMENT_OF_KIND: dict[str, str] = {"training": "weights", "sampler": "sampler_weights"}
_KIND_OF_SEGMENT: dict[str, CheckpointKind] = {"weights": "training", "sampler_weights": "sampler"}
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")  # fits a URL path segment and a tinker:// path


_WAITING: ContextVar[Callable[[str | None], None] | None] = ContextVar("tinker_waiting", default=None)


def say_waiting(reason: str | None) -> None:
    """The request being served waits for capacity because of ``reason`` (None: no longer)."""
    tell = _WAITING.get()
    if tell is not None:
        tell(reason)


@contextmanager
def waits_told_to(tell: Callable[[str | None], None]) -> Iterator[None]:
    """Within: ``say_waiting`` calls ``tell`` (the server, around the work of one request)."""
    token = _WAITING.set(tell)
    try:
        yield
    finally:
        _WAITING.reset(token)


class UserError(Exception):
    """A request the user can fix; ``str(error)`` is the one line they are shown."""


class ServedModel(msgspec.Struct, frozen=True):
    """A base model the cluster trains and samples. ``tokenizer_dir``: a local directory that
    ``transformers.AutoTokenizer.from_pretrained`` loads ("": the SDK looks ``name`` up on the hub)."""

    name: str
    max_context_length: int
    tokenizer_dir: str = ""


class TrainingRun(msgspec.Struct, frozen=True):
    """A training run (a Tinker "model"): a LoRA adapter of ``lora_rank``, or every weight of the
    base when ``lora_rank`` is None (full fine-tuning); ``tokenizer_dir`` as in ``ServedModel``;
    ``max_context_length``: the most tokens a datum of its may hold, its base model's context (the
    server refuses a longer one before the backend sees it; 0: not said, none refused)."""

    model_id: str
    base_model: str
    lora_rank: int | None
    tokenizer_dir: str = ""
    max_context_length: int = 0

    @property
    def is_lora(self) -> bool:
        return self.lora_rank is not None


class ForwardResult(msgspec.Struct, frozen=True):
    """``logprobs[i][t]``: log p(target_tokens[t]) of datum i, one per token; ``loss``: the loss
    summed over tokens and data (the SDK's ``loss:sum``)."""

    logprobs: list[list[float]]
    loss: float


class Sampler(msgspec.Struct, frozen=True):
    """Fixed weights to sample from: a base model, or a run's saved sampler weights;
    ``tokenizer_dir`` as in ``ServedModel``."""

    sampler_id: str
    base_model: str
    model_path: str | None = None  # the tinker:// path of its weights; None: the base model
    tokenizer_dir: str = ""


class SampleParams(msgspec.Struct, frozen=True):
    """How to sample, in vLLM's terms. ``max_tokens`` None: up to the context length; ``top_k``
    -1: no limit. Generation stops at a ``stop`` string, a ``stop_token_ids`` token or, unless
    ``ignore_eos``, the end-of-sequence token."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False


class SampledSequence(msgspec.Struct, frozen=True):
    """One sample: its tokens, the sampler's log-prob of each, why it ended (``STOP_REASONS``);
    asked for, the k likeliest ``(token, log-prob)`` at each of its positions, most likely first."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk_logprobs: list[list[tuple[int, float]]] | None = None


class SampleResult(msgspec.Struct, frozen=True):
    """``prompt_logprobs`` (asked for only): one per prompt token, None for the first;
    ``topk_prompt_logprobs`` (asked for only): at each prompt position the k likeliest
    ``(token, log-prob)``, most likely first, None for the first."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


class CheckpointInfo(msgspec.Struct, frozen=True):
    """A saved checkpoint: its ``tinker://`` path, when it was saved (Unix seconds), its size,
    when it expires (None: never)."""

    tinker_path: str
    time: float
    size_bytes: int | None = None
    expires_at: float | None = None
    public: bool = False  # readable by the cluster's other users


MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 86400  # a checkpoint's TTL, as the SDK documents it


class CheckpointPath(msgspec.Struct, frozen=True):
    model_id: str
    kind: CheckpointKind
    name: str


def sdk_model_id(session_id: str, model_seq_id: int) -> str:
    """The id the SDK expects for the ``model_seq_id``-th training client of a session."""
    return f"{session_id}:train:{model_seq_id}"


def check_name(name: str) -> str:
    """A checkpoint name as the user gave it, or ``UserError``."""
    if not name or "/" in name or name in (".", "..") or any(c.isspace() for c in name):
        raise UserError(f"checkpoint name {name!r} must be non-empty, without '/' or spaces")
    return name


def checkpoint_path(model_id: str, kind: CheckpointKind, name: str) -> str:
    return f"tinker://{model_id}/{_SEGMENT_OF_KIND[kind]}/{check_name(name)}"


def parse_checkpoint_path(path: str) -> CheckpointPath:
    """``tinker://<model_id>/weights|sampler_weights/<name>``, or ``UserError``."""
    parts = path.removeprefix("tinker://").split("/")
    well_formed = path.startswith("tinker://") and len(parts) == 3 and bool(parts[2])
    if not well_formed or parts[1] not in _KIND_OF_SEGMENT or not ID_PATTERN.fullmatch(parts[0]):
        raise UserError(f"{path!r} is not a checkpoint path (tinker://<model_id>/weights/<name>)")
    return CheckpointPath(parts[0], _KIND_OF_SEGMENT[parts[1]], parts[2])


class Backend(abc.ABC):
    """The cluster, as the Tinker front end uses it (see the module docstring for the rules)."""

    @abc.abstractmethod
    def authenticate(self, api_key: str) -> str | None:
        """The user ``api_key`` belongs to; None: refused."""

    @abc.abstractmethod
    def models(self) -> list[ServedModel]:
        """The base models users may train and sample."""

    @abc.abstractmethod
    def create_model(
        self, user: str, session_id: str, model_seq_id: int, base_model: str, rank: int | None, seed: int | None
    ) -> TrainingRun:
        """A new run on ``base_model`` (a LoRA adapter of ``rank``; None: every weight), with id
        ``sdk_model_id(session_id, model_seq_id)``."""

    @abc.abstractmethod
    def weights_info(self, user: str, path: str) -> TrainingRun:
        """The run that saved the checkpoint at ``path`` (its base model and LoRA rank, None for full fine-tuning)."""

    @abc.abstractmethod
    def forward_backward(self, user: str, model_id: str, call: C.LossCall, forward_only: bool) -> ForwardResult:
        """The call's per-token log-probs and loss; unless ``forward_only``, the call counts toward
        the next ``optim_step`` (its gradient is summed with the others' since the last step)."""

    @abc.abstractmethod
    def optim_step(self, user: str, model_id: str, adam: C.AdamStep) -> dict[str, float]:
        """One AdamW step on the gradient of the forward_backward calls since the last step."""

    @abc.abstractmethod
    def save_weights_for_sampler(self, user: str, model_id: str, name: str) -> str:
        """Save the current weights for sampling; their path, ``checkpoint_path(model_id, "sampler", name)``."""

    @abc.abstractmethod
    def save_state(self, user: str, model_id: str, name: str) -> str:
        """Save weights and optimizer state; their path, ``checkpoint_path(model_id, "training", name)``."""

    @abc.abstractmethod
    def load_state(self, user: str, model_id: str, path: str, optimizer: bool) -> None:
        """Load the weights saved at ``path`` (and, with ``optimizer``, the optimizer state)."""

    @abc.abstractmethod
    def create_sampler(self, user: str, session_id: str, model_path: str | None, base_model: str | None) -> Sampler:
        """A sampler of the sampler weights at ``model_path``, or of ``base_model`` alone, for
        ``session_id`` (what it holds is freed when the session ends)."""

    @abc.abstractmethod
    def sampler_for_weights(self, user: str, model_id: str, seq: int) -> Sampler:
        """A sampler of the run's current weights (a snapshot: later steps do not change it).
        ``seq`` numbers the request within the run, unique and increasing."""

    @abc.abstractmethod
    def sample(
        self,
        user: str,
        sampler_id: str,
        prompt_tokens: list[int],
        num_samples: int,
        params: SampleParams,
        prompt_logprobs: bool,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> SampleResult:
        """``num_samples`` continuations of the prompt, each with the log-prob of every token;
        asked for, the prompt's log-probs and the ``topk_prompt_logprobs`` likeliest tokens at
        each of its positions, and the ``topk_sample_logprobs`` likeliest at each sampled one
        (at most ``calls.MAX_TOPK`` each)."""

    @abc.abstractmethod
    def list_checkpoints(self, user: str, model_id: str) -> list[CheckpointInfo]:
        """The run's saved checkpoints, both kinds."""

    def delete_checkpoint(self, user: str, path: str) -> None:
        """Delete the user's checkpoint at ``path`` (a ``tinker://`` path), its files with it."""
        raise UserError("deleting checkpoints is not served by this backend")

    def set_checkpoint_ttl(self, user: str, path: str, ttl_s: int | None, now: float) -> None:
        """The user's checkpoint at ``path`` expires ``ttl_s`` seconds after ``now`` (None: never)."""
        raise UserError("checkpoint TTLs are not served by this backend")

    def publish_checkpoint(self, user: str, path: str, public: bool) -> None:
        """Make the user's checkpoint at ``path`` readable by the cluster's other users (``public``),
        or theirs alone again (where it already is: nothing to do)."""
        raise UserError("publishing checkpoints is not served by this backend")

    def is_public(self, path: str) -> bool:
        """Whether the checkpoint at ``path`` was published (readable by every user)."""
        return False

    def expire(self, now: float) -> list[str]:
        """Delete the checkpoints past their TTL; their paths."""
        return []

    @abc.abstractmethod
    def end_session(self, user: str, session_id: str) -> None:
        """The session ended (closed by the client, or silent too long): free what it holds."""

    def capacity_note(self) -> str | None:
        """Why a run created now would wait for room (one line), or None: it would start at once."""
        return None

    def known_runs(self) -> list[tuple[str, TrainingRun]]:
        """The runs, with their users, that a restarted front end takes back (their sessions have
        not ended): their clients' next calls go on. A run's id starts with its session's and a
        ``:``. None by default."""
        return []

    def known_sampler(self, user: str, sampler_id: str) -> Sampler | None:
        """A sampler of ``user``'s that a restarted front end takes back; None: unknown."""
        return None
