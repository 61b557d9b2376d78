"""RLOO (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): REINFORCE, leave-one-out baseline.

Each of the k samples of a prompt is judged against the mean reward of the *other* k - 1, an
unbiased baseline that needs no value network:

    A_i = r_i - 1/(k-1) sum_{j != i} r_j   ( = k/(k-1) (r_i - mean(r)) )
    loss = -A_i log pi_theta(o_i | q)      # with one step per batch, pg-clip's ratio is 1 on-policy

The loss and its aggregation come from the spec (``pg-clip``, ``token-mean`` by default;
``seq-mean-token-sum`` is the paper's sequence log-probability).
"""

from __future__ import annotations

from plexctl.algos.group_loop import GroupLoop
from plexctl.rl import Rollout


def leave_one_out_advantages(rewards: list[float], group_size: int) -> list[float]:
    """r_i minus the mean of the other rewards of its group (groups of ``group_size`` >= 2)."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt")
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        total = sum(group)
        out.extend(r - (total - r) / (len(group) - 1) for r in group)
    return out


class RLOO(GroupLoop):
    def advantages(self, rollout: Rollout) -> list[float]:
        return leave_one_out_advantages(rollout.rewards, self.group_size)
