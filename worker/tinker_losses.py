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
* ``gspo`` (GSPO-token): every token's ratio takes the value of the sequence ratio
  ``s = exp(mean(tlp - slp))`` over the tokens ``sequence_ratio_mask`` marks, and the gradient of
  its own ``tlp``; then ``ppo``'s clipped objective on it (thresholds ``1 - 3e-4`` and ``1 + 4e-4``
  by default: the GSPO paper's ranges).

Each is the function of its entry in ``plexctl.common.losses.LOSS_REGISTRY`` (the one table of
losses: their inputs and settings); ``loss_function`` finds an entry's function, for RL losses too.
``check_call`` refuses a call the losses cannot take, with a one-line ``BatchError`` that names
the datum and the field. A datum's fields that its loss does not use are ignored (their
lengths are still checked). Nothing here clamps a ratio: a sampler log-prob far below the
trainer's gives an infinite loss, as it would in Tinker.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from plexctl.common.calls import TOKEN_LOSSES, LossCall, TokenDatum
from plexctl.common.losses import DATUM_INPUTS, LOSS_REGISTRY, Loss, LossConfigError, loss_of
from worker.errors import BatchError


@dataclass(frozen=True)
class LossInputs:
    """A datum's loss inputs (``DATUM_INPUTS``, by name) as float32 tensors of ``len(tokens)``
    (None: the datum has none); ``logprobs`` are the sampler's."""

    weights: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    sequence_ratio_mask: torch.Tensor | None = None

    @classmethod
    def of(cls, datum: TokenDatum, device: torch.device | str = "cpu") -> LossInputs:
        def tensor(values: list[float] | None) -> torch.Tensor | None:
            return None if values is None else torch.tensor(values, dtype=torch.float32, device=device)

        return cls(**{name: tensor(getattr(datum, name)) for name in DATUM_INPUTS})

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LossInputs:
        """Each input present, through ``fn`` (a row's slice, a move to a device)."""
        return LossInputs(**{name: None if (t := getattr(self, name)) is None else fn(t) for name in DATUM_INPUTS})


def token_loss_entry(loss_fn: str) -> Loss:
    """The registry's entry of a token loss (``BatchError``: no such loss)."""
    loss = loss_of(loss_fn, "token")
    if loss is None:
        raise BatchError(f"loss_fn {loss_fn!r} is not one of {', '.join(TOKEN_LOSSES)}")
    return loss


def loss_config(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
    """``config`` over the loss's defaults (``BatchError``: unknown loss, key, or a bad value)."""
    loss = token_loss_entry(loss_fn)
    unknown = loss.unknown(config)
    if unknown:
        accepted = ", ".join(loss.takes()) or "no loss_fn_config"
        raise BatchError(f"loss_fn {loss_fn} takes {accepted}; got loss_fn_config {', '.join(unknown)}")
    try:
        return loss.settings(config)
    except LossConfigError as e:
        raise BatchError(f"loss_fn {loss_fn}: loss_fn_config {e}") from None


def token_loss(
    loss_fn: str, config: Mapping[str, float], target_logprobs: torch.Tensor, inputs: LossInputs
) -> torch.Tensor:
    """One datum's loss (a scalar, the sum over its tokens) from the trainer's log-probs of its
    target tokens (``[N]``, float32, carrying the gradient) and its inputs (see the module)."""
    settings = loss_config(loss_fn, config)
    function: Callable[[torch.Tensor, LossInputs, Mapping[str, float]], torch.Tensor] = loss_function(loss_fn)
    return function(target_logprobs, inputs, settings)


@functools.cache
def loss_function(name: str) -> Callable[..., Any]:
    """The function a registry entry names (``"module:name"``), imported once."""
    module, _, attribute = LOSS_REGISTRY[name].function.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _ratio(tlp: torch.Tensor, inputs: LossInputs, loss_fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(tlp - slp)`` and the advantages."""
    slp = _required(inputs.logprobs, loss_fn, "logprobs")
    return torch.exp(tlp - slp), _required(inputs.advantages, loss_fn, "advantages")


def cross_entropy(tlp: torch.Tensor, inputs: LossInputs, _: Mapping[str, float]) -> torch.Tensor:
    return (-tlp * _required(inputs.weights, "cross_entropy", "weights")).sum()


def importance_sampling(tlp: torch.Tensor, inputs: LossInputs, _: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(tlp, inputs, "importance_sampling")
    return -(ratio * adv).sum()


def ppo(tlp: torch.Tensor, inputs: LossInputs, settings: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(tlp, inputs, "ppo")
    clipped = torch.clamp(ratio, settings["clip_low_threshold"], settings["clip_high_threshold"])
    return -torch.min(ratio * adv, clipped * adv).sum()


def cispo(tlp: torch.Tensor, inputs: LossInputs, settings: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(tlp, inputs, "cispo")
    clipped = torch.clamp(ratio, settings["clip_low_threshold"], settings["clip_high_threshold"])
    return -(clipped.detach() * tlp * adv).sum()


def dro(tlp: torch.Tensor, inputs: LossInputs, settings: Mapping[str, float]) -> torch.Tensor:
    slp = _required(inputs.logprobs, "dro", "logprobs")
    adv = _required(inputs.advantages, "dro", "advantages")
    return -(tlp * adv - 0.5 * settings["beta"] * (tlp - slp) ** 2).sum()


def gspo(tlp: torch.Tensor, inputs: LossInputs, settings: Mapping[str, float]) -> torch.Tensor:
    slp = _required(inputs.logprobs, "gspo", "logprobs")
    adv = _required(inputs.advantages, "gspo", "advantages")
    in_ratio = _required(inputs.sequence_ratio_mask, "gspo", "sequence_ratio_mask") != 0
    log_ratio = (tlp.detach() - slp)[in_ratio].mean() if bool(in_ratio.any()) else tlp.new_zeros(())
    ratio = torch.exp(log_ratio + tlp - tlp.detach())  # the sequence ratio's value, each token's own gradient
    clipped = torch.clamp(ratio, settings["clip_low_threshold"], settings["clip_high_threshold"])
    return -torch.min(ratio * adv, clipped * adv).sum()


def check_call(call: LossCall, vocab_size: int | None = None) -> None:
    """Refuse a call its loss cannot take (``BatchError``, one line naming the datum and the
    field): an unknown loss or config key, a missing input, a list whose length is not
    ``len(tokens)``, no data or no tokens, a non-finite input, and (with ``vocab_size``) a token
    id outside the vocabulary."""
    loss_config(call.loss_fn, call.loss_fn_config)
    if not call.data:
        raise BatchError("loss call has no data")
    needs = token_loss_entry(call.loss_fn).reads
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
