"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO done right.

GRPO's two normalisations bias it: dividing by the group's reward std up-weights prompts that
are too easy or too hard, and dividing each sequence's loss by its own length favours long
wrong answers (their per-token penalty shrinks). Dr. GRPO removes both:

    A_i = r_i - mean(r)                                     # no std
    loss = mean_i  sum_t  pg_clip(i, t) / L_max            # no 1/|o_i|: a constant length

``L_max`` is the generation budget (``sampling.max_tokens``, every turn's for episodes): the
trainer's ``seq-mean-token-sum-norm`` aggregation with ``loss_agg_len = L_max``.
"""

from __future__ import annotations

from plexctl.algos.group_loop import GroupLoop
from plexctl.rl import Rollout, TrainHParams

LOSS_AGG = "seq-mean-token-sum-norm"


def centred_advantages(rewards: list[float], group_size: int) -> list[float]:
    """r - mean(r) within each consecutive group of ``group_size`` samples."""
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        mean = sum(group) / len(group)
        out.extend(r - mean for r in group)
    return out


class DrGRPO(GroupLoop):
    def hparams(self) -> TrainHParams:
        return self.job.hparams(loss_agg=LOSS_AGG, loss_agg_len=self.job.max_response_tokens())

    def advantages(self, rollout: Rollout) -> list[float]:
        return centred_advantages(rollout.rewards, self.group_size)
