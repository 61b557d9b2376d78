"""The policy-gradient loss per token, and its aggregation over a batch.

``grpo_token_terms`` is PPO's clipped surrogate with asymmetric clip (``pg-clip``),
``tis_token_terms`` truncated importance sampling for stale samples (``pg-tis``),
``user_token_terms`` a trusted user's own per-token loss; each adds ``kl_coef`` times the k3
estimate of the KL to the base model. ``aggregation_weights`` turns a loss mask into the
per-token weights of token-, sequence- or Dr. GRPO constant-length aggregation. The named losses
are the functions of their entries in ``plexctl.common.losses.LOSS_REGISTRY`` (their settings and
defaults are declared there). The trainer
engine (``worker.trainer``) calls them once per micro-batch; ``MetricSums`` sums the step's
metrics over its micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from plexctl.common.losses import LOSS_REGISTRY
from plexctl.common.protocol import TrainHParams
from worker.errors import LossLoadError

TIS_CAP = LOSS_REGISTRY["pg-tis"].settings({})["cap"]  # pg-tis's default cap, as the registry declares it
LOG_RATIO_CLAMP = 20.0  # |logp - old_logp| and |ref - logp| are clamped here (verl)
KL_CLAMP = 10.0  # the k3 estimate is clamped to [-10, 10] (verl's low_var_kl)


@dataclass(frozen=True)
class TokenTerms:
    loss: torch.Tensor  # pg + kl_coef * kl, [B, L-1]
    pg: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor  # bool: the clipped branch was the binding one


def grpo_token_terms(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    hp: TrainHParams,
) -> TokenTerms:
    """PPO clipped objective with asymmetric clip, plus the k3 KL to the reference policy."""
    ratio = torch.exp((logp - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = advantages.unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - hp.clip_low, 1.0 + hp.clip_high)
    pg = torch.maximum(unclipped, clipped)
    kl = _k3_kl(logp, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(pg)
    return TokenTerms(pg + hp.kl_coef * kl, pg, kl, ratio, clipped > unclipped)


def tis_token_terms(
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    hp: TrainHParams,
) -> TokenTerms:
    """Truncated importance sampling: -A * min(pi_theta / pi_behaviour, cap) * log pi_theta.

    With one optimizer step per batch the proximal policy of decoupled PPO is the adapter as
    it stands at this step, so its ratio is 1 and its clip never binds; what corrects for
    stale (or engine-mismatched) samples is the detached behaviour weight, truncated at
    ``cap``. ``clipped`` counts the truncated tokens, ``ratio`` is the weight before truncation.
    """
    cap = hp.loss_params.get("cap", TIS_CAP)
    behaviour_ratio = torch.exp((logp.detach() - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = behaviour_ratio.clamp(max=cap)
    proximal_ratio = torch.exp(logp - logp.detach())  # 1, with the gradient of log pi_theta
    pg = -advantages.unsqueeze(1) * weight * proximal_ratio
    kl = _k3_kl(logp, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(pg)
    return TokenTerms(pg + hp.kl_coef * kl, pg, kl, behaviour_ratio, behaviour_ratio > cap)


def user_token_terms(
    fn: Callable[..., torch.Tensor],
    hp: TrainHParams,
    logp: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> TokenTerms:
    """A user's ``fn(logp, old_logprobs, advantages, mask, params) -> [B, T]`` per-token loss.

    ``logp`` carries the gradient; the trainer aggregates the result with ``loss_agg`` and
    adds ``kl_coef`` times the k3 KL, as for a built-in loss.
    """
    try:
        pg = fn(logp, old_logprobs, advantages, mask, dict(hp.loss_params))
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything
        raise LossLoadError(f"loss fn `{hp.loss_fn}` raised {type(e).__name__}: {e}".splitlines()[0]) from None
    if not isinstance(pg, torch.Tensor) or pg.shape != logp.shape:
        got = tuple(pg.shape) if isinstance(pg, torch.Tensor) else type(pg).__name__
        raise LossLoadError(f"loss fn `{hp.loss_fn}` must return a tensor of shape {tuple(logp.shape)}, got {got}")
    ratio = torch.exp((logp.detach() - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    kl = _k3_kl(logp, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(pg)
    return TokenTerms(pg + hp.kl_coef * kl, pg, kl, ratio, torch.zeros_like(mask))


def _k3_kl(logp: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy || ref): exp(ref - logp) - (ref - logp) - 1 (verl low_var_kl)."""
    delta = (ref_logprobs - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(delta) - delta - 1.0).clamp(-KL_CLAMP, KL_CLAMP)


def aggregation_weights(loss_mask: torch.Tensor, loss_agg: str, norm_len: int = 0) -> torch.Tensor:
    """Per-token weights w so that the aggregated loss is sum(w * token_loss).

    ``norm_len`` is the constant of ``seq-mean-token-sum-norm`` (0: the longest row's tokens).
    """
    mask = loss_mask.float()
    if loss_agg == "token-mean":
        return mask / mask.sum().clamp(min=1.0)
    row_tokens = mask.sum(dim=1, keepdim=True)
    rows_with_tokens = (row_tokens > 0).sum().clamp(min=1)
    if loss_agg == "seq-mean-token-sum":
        return mask / rows_with_tokens
    if loss_agg == "seq-mean-token-sum-norm":
        length = float(norm_len) if norm_len > 0 else float(row_tokens.max().clamp(min=1.0))
        return mask / (length * rows_with_tokens)
    return mask / (row_tokens.clamp(min=1.0) * rows_with_tokens)


class MetricSums:
    """Running sums over micro-batches; token-mean metrics except the (weighted) losses."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.pg_loss = 0.0
        self.kl = 0.0
        self.clipped = 0.0
        self.ratio = 0.0
        self.entropy = 0.0

    def add(
        self,
        mask: torch.Tensor,
        weights: torch.Tensor,
        terms: TokenTerms,
        loss: torch.Tensor,
        entropy: torch.Tensor,
    ) -> None:
        with torch.no_grad():
            values = torch.stack(
                [
                    loss,
                    (terms.pg * weights).sum(),
                    terms.kl[mask].sum(),
                    terms.clipped[mask].sum().float(),
                    terms.ratio[mask].sum(),
                    entropy[mask].sum(),
                ]
            ).tolist()  # one device sync per micro-batch
        self.add_values(values)

    def all_reduce(self, reduce: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> None:
        """The sums over the ranks of an engine of several (``reduce``: summed in place)."""
        fields = ("loss", "pg_loss", "kl", "clipped", "ratio", "entropy")
        values = torch.tensor([getattr(self, f) for f in fields], dtype=torch.float64, device=device)
        for name, value in zip(fields, reduce(values).tolist()):
            setattr(self, name, value)

    def add_values(self, values: list[float]) -> None:
        """Add sums already taken: loss, pg_loss, kl, clipped, ratio, entropy (``add``'s order)."""
        self.loss += values[0]
        self.pg_loss += values[1]
        self.kl += values[2]
        self.clipped += values[3]
        self.ratio += values[4]
        self.entropy += values[5]

    def metrics(self, tokens: int) -> dict[str, float]:
        return {
            "loss": self.loss,
            "pg_loss": self.pg_loss,
            "kl": self.kl / tokens,
            "clip_frac": self.clipped / tokens,
            "ratio_mean": self.ratio / tokens,
            "entropy": self.entropy / tokens,
            "tokens": float(tokens),
        }
