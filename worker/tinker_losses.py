"""The Tinker API's token-level losses, and the checks of a loss call: pure torch, no engine.

``token_loss`` is one datum's loss, the SUM over its tokens (no mean: Tinker sums, and leaves
any normalisation to the advantages or weights), exactly as Tinker documents each loss, with
``tlp`` the trainer's log-probs of the target tokens, ``slp`` the sampler's (the datum's
``logprobs``), ``A`` its ``advantages`` and ``ratio = exp(tlp - slp)``:

* ``cross_entropy``: ``-(tlp * weights).sum()``.
* ``importance_sampling``: ``-(ratio * A).sum()``.
* ``ppo``: ``-min(ratio * A, clamp(ratio, clip_low_threshold, clip_high_threshold) * A).sum()``
  (thresholds 0.8 and 1.2 by default: Tinker's epsilon of 0.2).
* ``cispo``: ``-(clamp(ratio, clip_low_threshold, clip_high_threshold).detach() * tlp * A).sum()``
  (thresholds 0.0 and 4.0 by default).
* ``dro``: ``-(tlp * A - 0.5 * beta * (tlp - slp) ** 2).sum()``; ``beta`` has no default.

``check_call`` refuses a call the losses cannot take, with a one-line ``BatchError`` that names
the datum and the field. A datum's fields that its loss does not use are ignored (their
lengths are still checked). Nothing here clamps a ratio: a sampler log-prob far below the
trainer's gives an infinite loss, as it would in Tinker.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from plexctl.common.calls import DATUM_INPUTS, TOKEN_LOSS_TABLE, TOKEN_LOSSES, LossCall, TokenDatum
from worker.errors import BatchError


@dataclass(frozen=True)
class LossInputs:
    """A datum's loss inputs as float32 tensors of ``len(tokens)`` (None: the datum has none)."""

    weights: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None

    @classmethod
    def of(cls, datum: TokenDatum, device: torch.device | str = "cpu") -> LossInputs:
        def tensor(values: list[float] | None) -> torch.Tensor | None:
            return None if values is None else torch.tensor(values, dtype=torch.float32, device=device)

        return cls(tensor(datum.weights), tensor(datum.logprobs), tensor(datum.advantages))


def loss_config(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
    """``config`` over the loss's defaults (``BatchError``: unknown loss, key, or a missing one)."""
    if loss_fn not in TOKEN_LOSS_TABLE:
        raise BatchError(f"loss_fn {loss_fn!r} is not one of {', '.join(TOKEN_LOSSES)}")
    takes = TOKEN_LOSS_TABLE[loss_fn].config
    unknown = sorted(set(config) - set(takes))
    if unknown:
        accepted = ", ".join(takes) or "no loss_fn_config"
        raise BatchError(f"loss_fn {loss_fn} takes {accepted}; got loss_fn_config {', '.join(unknown)}")
    merged: dict[str, float] = {}
    for key, default in takes.items():
        value = config.get(key, default)
        if value is None:
            raise BatchError(f"loss_fn {loss_fn} needs loss_fn_config {key} (it has no default)")
        if not math.isfinite(value):
            raise BatchError(f"loss_fn_config {key} must be finite, got {value}")
        merged[key] = float(value)
    if "clip_low_threshold" in merged and merged["clip_low_threshold"] > merged["clip_high_threshold"]:
        raise BatchError(
            f"loss_fn_config clip_low_threshold ({merged['clip_low_threshold']}) is above "
            f"clip_high_threshold ({merged['clip_high_threshold']})"
        )
    if merged.get("beta", 0.0) < 0:
        raise BatchError(f"loss_fn_config beta must be >= 0, got {merged['beta']}")
    return merged


def token_loss(
    loss_fn: str, config: Mapping[str, float], target_logprobs: torch.Tensor, inputs: LossInputs
) -> torch.Tensor:
    """One datum's loss (a scalar, the sum over its tokens) from the trainer's log-probs of its
    target tokens (``[N]``, float32, carrying the gradient) and its inputs (see the module)."""
    settings = loss_config(loss_fn, config)
    return LOSS_FUNCTIONS[loss_fn](target_logprobs, inputs, settings)


def _ratio(tlp: torch.Tensor, inputs: LossInputs, loss_fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(tlp - slp)`` and the advantages."""
    slp = _required(inputs.sampling_logprobs, loss_fn, "logprobs")
    return torch.exp(tlp - slp), _required(inputs.advantages, loss_fn, "advantages")


def _cross_entropy(tlp: torch.Tensor, inputs: LossInputs, _: Mapping[str, float]) -> torch.Tensor:
    return (-tlp * _required(inputs.weights, "cross_entropy", "weights")).sum()


def _importance_sampling(tlp: torch.Tensor, inputs: LossInputs, _: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(tlp, inputs, "importance_sampling")
    return -(ratio * adv).sum()


def _ppo(tlp: torch.Tensor, inputs: LossInputs, settings: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(tlp, inputs, "ppo")
    clipped = torch.clamp(ratio, settings["clip_low_threshold"], settings["clip_high_threshold"])
    return -torch.min(ratio * adv, clipped * adv).sum()


def _cispo(tlp: torch.Tensor, inputs: LossInputs, settings: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(tlp, inputs, "cispo")
    clipped = torch.clamp(ratio, settings["clip_low_threshold"], settings["clip_high_threshold"])
    return -(clipped.detach() * tlp * adv).sum()


def _dro(tlp: torch.Tensor, inputs: LossInputs, settings: Mapping[str, float]) -> torch.Tensor:
    slp = _required(inputs.sampling_logprobs, "dro", "logprobs")
    adv = _required(inputs.advantages, "dro", "advantages")
    return -(tlp * adv - 0.5 * settings["beta"] * (tlp - slp) ** 2).sum()


# each entry of ``plexctl.common.calls.TOKEN_LOSS_TABLE``'s function, by its name
LOSS_FUNCTIONS: dict[str, Callable[[torch.Tensor, LossInputs, Mapping[str, float]], torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
}


def check_call(call: LossCall, vocab_size: int | None = None) -> None:
    """Refuse a call its loss cannot take (``BatchError``, one line naming the datum and the
    field): an unknown loss or config key, a missing input, a list whose length is not
    ``len(tokens)``, no data or no tokens, a non-finite input, and (with ``vocab_size``) a token
    id outside the vocabulary."""
    loss_config(call.loss_fn, call.loss_fn_config)
    if not call.data:
        raise BatchError("loss call has no data")
    needs = TOKEN_LOSS_TABLE[call.loss_fn].reads
    for i, datum in enumerate(call.data):
        n = len(datum.tokens)
        if n == 0:
            raise BatchError(f"datum {i}: tokens is empty")
        if len(datum.target_tokens) != n:
            raise BatchError(f"datum {i}: target_tokens has {len(datum.target_tokens)} entries, tokens {n}")
        for name in ("tokens", "target_tokens"):
            _check_ids(i, name, getattr(datum, name), vocab_size)
        for name in DATUM_INPUTS:
            values: list[float] | None = getattr(datum, name)
            if values is None:
                if name in needs:
                    raise BatchError(f"datum {i}: loss_fn {call.loss_fn} needs {name}, which the datum lacks")
                continue
            if len(values) != n:
                raise BatchError(f"datum {i}: {name} has {len(values)} entries, tokens {n}")
            if name in needs and not all(map(math.isfinite, values)):
                at = next(t for t, v in enumerate(values) if not math.isfinite(v))
                raise BatchError(f"datum {i}: {name}[{at}] is {values[at]}, not a finite number")


def _check_ids(i: int, name: str, ids: list[int], vocab_size: int | None) -> None:
    low, high = min(ids), max(ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        at = ids.index(bad)
        limit = f"0..{vocab_size - 1}" if vocab_size is not None else "ids >= 0"
        raise BatchError(f"datum {i}: {name}[{at}] = {bad} is outside the vocabulary ({limit})")


def _required(tensor: torch.Tensor | None, loss_fn: str, name: str) -> torch.Tensor:
    if tensor is None:
        raise BatchError(f"loss_fn {loss_fn} needs {name}, which the datum lacks")
    return tensor
