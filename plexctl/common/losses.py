"""Every loss a trainer computes, declared once: one ``Loss`` entry per name in ``LOSS_REGISTRY``.

Two kinds share the table: ``rl`` losses (what a job's ``algo.loss`` names; the trainer's
per-token policy-gradient terms) and ``token`` losses (the Tinker API's ``loss_fn``: one
datum's summed token loss). An entry holds what the loss reads, its settings with their
defaults and bounds, and its function as ``"module:name"`` (imported by the worker alone, so this
module stays free of torch). The spec's ``algo.loss`` choices and the checks of ``loss_params``,
the wire's checks of a ``forward_backward`` request, the trainer's checks and its dispatch all
read this table: a new loss is one entry here and its function, nothing else.

``Loss.settings`` is the one check of a loss's settings: it refuses a missing, non-finite or
out-of-bounds value with ``LossConfigError`` (the key and a phrase); each caller names the field
the user wrote (``algo.loss_params``, ``loss_fn_config``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

LossKind = Literal["rl", "token"]

DATUM_INPUTS = (
    "weights",
    "logprobs",
    "advantages",
    "sequence_ratio_mask",
)  # a datum's float inputs, beside target_tokens
DATUM_DEFAULTS = {"weights": 1.0}  # a loss input a client may leave out: each token's value then


class LossConfigError(ValueError):
    """A loss's setting the loss cannot take: ``key`` and ``problem``, a phrase about its value."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key} {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class Loss:
    """One loss. ``reads``: the datum fields a token loss reads beside ``target_tokens``;
    ``config``: its settings and their defaults (None: the caller must give one); ``above`` and
    ``at_least``: a setting's strict and inclusive lower bounds; ``ordered``: two settings whose
    first may not exceed its second."""

    kind: LossKind
    function: str  # "module:name", the worker's implementation
    doc: str
    reads: tuple[str, ...] = ()
    config: Mapping[str, float | None] = field(default_factory=dict)
    above: Mapping[str, float] = field(default_factory=dict)
    at_least: Mapping[str, float] = field(default_factory=dict)
    ordered: tuple[str, str] | None = None

    def takes(self) -> tuple[str, ...]:
        return tuple(self.config)

    def unknown(self, config: Mapping[str, object]) -> list[str]:
        """The keys of ``config`` this loss does not take, sorted."""
        return sorted(str(k) for k in config if k not in self.config)

    def required(self) -> tuple[str, ...]:
        """The datum inputs a client must send (``DATUM_DEFAULTS`` fills the others it reads)."""
        return ("target_tokens", *(name for name in self.reads if name not in DATUM_DEFAULTS))

    def settings(self, config: Mapping[str, float]) -> dict[str, float]:
        """``config`` over the defaults, checked (unknown keys are the caller's to refuse)."""
        merged: dict[str, float] = {}
        for key, default in self.config.items():
            value = config.get(key, default)
            if value is None:
                raise LossConfigError(key, "has no default; give one")
            if not math.isfinite(value):
                raise LossConfigError(key, f"must be finite, got {value}")
            if key in self.above and not value > self.above[key]:
                raise LossConfigError(key, f"must be > {self.above[key]:g}, got {value:g}")
            if key in self.at_least and not value >= self.at_least[key]:
                raise LossConfigError(key, f"must be >= {self.at_least[key]:g}, got {value:g}")
            merged[key] = float(value)
        if self.ordered and merged[self.ordered[0]] > merged[self.ordered[1]]:
            low, high = self.ordered
            raise LossConfigError(low, f"({merged[low]:g}) is above {high} ({merged[high]:g})")
        return merged


_IS = ("logprobs", "advantages")  # what the importance-weighted token losses read
_CLIP = ("clip_low_threshold", "clip_high_threshold")

LOSS_REGISTRY: dict[str, Loss] = {
    "pg-clip": Loss("rl", "worker.loss_terms:grpo_token_terms", "PPO clipped ratio to the behaviour policy"),
    "pg-tis": Loss(
        "rl",
        "worker.loss_terms:tis_token_terms",
        "truncated importance sampling for stale samples, weight capped at loss_params.cap, default 2",
        config={"cap": 2.0},
        above={"cap": 0.0},
    ),
    "cross_entropy": Loss("token", "worker.tinker_losses:cross_entropy", "-(tlp * weights).sum()", ("weights",)),
    "importance_sampling": Loss("token", "worker.tinker_losses:importance_sampling", "-(ratio * A).sum()", _IS),
    "ppo": Loss(
        "token",
        "worker.tinker_losses:ppo",
        "-min(ratio * A, clamp(ratio, low, high) * A).sum()",
        _IS,
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        ordered=_CLIP,
    ),
    "cispo": Loss(
        "token",
        "worker.tinker_losses:cispo",
        "-(clamp(ratio, low, high).detach() * tlp * A).sum()",
        _IS,
        {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        ordered=_CLIP,
    ),
    "gspo": Loss(
        "token",
        "worker.tinker_losses:gspo",
        "ppo's clipped objective on the sequence ratio exp(mean(tlp - slp) over sequence_ratio_mask), per token",
        (*_IS, "sequence_ratio_mask"),
        {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
        ordered=_CLIP,
    ),
    "dro": Loss(
        "token",
        "worker.tinker_losses:dro",
        "-(tlp * A - 0.5 * beta * (tlp - slp) ** 2).sum()",
        _IS,
        {"beta": None},
        at_least={"beta": 0.0},
    ),
}
DEFAULT_RL_LOSS = "pg-clip"


def loss_names(kind: LossKind) -> tuple[str, ...]:
    """The losses of one kind, in the registry's order."""
    return tuple(name for name, loss in LOSS_REGISTRY.items() if loss.kind == kind)


def loss_of(name: str, kind: LossKind) -> Loss | None:
    """The entry of ``name`` if it is a loss of ``kind``."""
    loss = LOSS_REGISTRY.get(name)
    return loss if loss is not None and loss.kind == kind else None
