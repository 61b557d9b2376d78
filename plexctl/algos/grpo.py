"""GRPO (Shao et al. 2024, DeepSeekMath): group-relative advantages, PPO's clipped loss.

    for each step:
        sample G completions o_1..o_G per prompt q from pi_old, score r_1..r_G
        A_i = (r_i - mean(r)) / (std(r) + eps)              # within each prompt's group
        maximise mean_tokens min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)
            - beta KL(pi_theta || pi_ref)                   # trainer loss ``pg-clip``
        publish pi_theta as the next pi_old

The loop (sampling, staleness, evaluation, checkpoints) is ``GroupLoop``; aggregation,
clip range and KL weight come from the spec's ``algo`` section.
"""

from __future__ import annotations

import math

from plexctl.algos.group_loop import ErrorRateExceeded, GroupLoop
from plexctl.rl import Rollout

__all__ = ["GRPO", "ErrorRateExceeded", "group_advantages"]


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within each consecutive group of ``group_size`` samples."""
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out.extend((r - mean) / (std + eps) for r in group)
    return out


class GRPO(GroupLoop):
    def advantages(self, rollout: Rollout) -> list[float]:
        return group_advantages(rollout.rewards, self.group_size)
