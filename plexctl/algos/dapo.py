"""DAPO (Yu et al. 2025): decoupled clip and dynamic sampling policy optimisation.

Four changes to GRPO, each a line or two here:

    eps_low, eps_high = 0.2, 0.28                            # clip-higher: room for rare tokens to rise
    for each step:
        batch = {}
        while |batch| < prompts_per_step and rounds < max_gen_batches:
            sample G completions per prompt for prompts_per_step new prompts
            r_i = verifier(o_i) + R_length(|o_i|)            # soft overlong punishment
            batch += groups whose verifier rewards are not all equal   # dynamic sampling
        A_i = (r_i - mean(r)) / (std(r) + eps)              # as GRPO, on the shaped rewards
        minimise sum over all tokens of the batch / all tokens       # token-level loss
        publish

    R_length(L) = 0                                   if L <= L_max - L_cache
                = -penalty (L - (L_max - L_cache)) / L_cache   otherwise (-penalty at L_max)

``L_max`` is ``sampling.max_tokens``, ``L_cache`` is ``algo.overlong_buffer`` (a multi-turn
job has no length punishment: its episodes end by ``env`` limits, with ``env.truncated_reward``). Groups are
filtered on the verifier's rewards (the paper's accuracy), before the length penalty; a step
that finds fewer informative groups than ``prompts_per_step`` in ``max_gen_batches`` rounds
trains on those it found (none: the update is skipped).
"""

from __future__ import annotations

from plexctl.algos.group_loop import GroupLoop
from plexctl.algos.grpo import group_advantages
from plexctl.rl import Rollout, TrainHParams

CLIP_HIGH = 0.28
OVERLONG_BUFFER_SHARE = 5  # the paper: L_cache 4096 of L_max 20480


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment R_length of a ``length``-token completion (<= 0)."""
    if buffer <= 0:
        return 0.0
    expected = max_tokens - buffer
    if length <= expected:
        return 0.0
    return -penalty * min(length - expected, buffer) / buffer


def informative_groups(rewards: list[float], group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal (the others have no gradient)."""
    groups = [rewards[g : g + group_size] for g in range(0, len(rewards), group_size)]
    return [i for i, group in enumerate(groups) if max(group) != min(group)]


class DAPO(GroupLoop):
    def __init__(self, job) -> None:
        super().__init__(job)
        a, max_tokens = job.spec.algo, job.spec.sampling.max_tokens
        self.buffer = a.overlong_buffer if a.overlong_buffer is not None else max_tokens // OVERLONG_BUFFER_SHARE
        if job.spec.env is not None:  # an episode's tokens span many turns of max_tokens each: no
            self.buffer = 0  # single-turn budget to punish against (its limits truncate it)
        self.rounds = 0

    def hparams(self) -> TrainHParams:
        a = self.spec.algo
        return self.job.hparams(clip_high=a.clip_range_high if a.clip_range_high is not None else CLIP_HIGH)

    def shaped_rewards(self, rollout: Rollout) -> list[float]:
        a, max_tokens = self.spec.algo, self.spec.sampling.max_tokens
        return [
            r + overlong_penalty(n, max_tokens, self.buffer, a.overlong_penalty)
            for r, n in zip(rollout.rewards, rollout.lengths)
        ]

    def advantages(self, rollout: Rollout) -> list[float]:
        return group_advantages(self.shaped_rewards(rollout), self.group_size)

    def collect(self, step: int, rollout: Rollout) -> tuple[Rollout, Rollout]:
        a = self.spec.algo
        if not a.dynamic_sampling:
            self.rounds = 1
            return rollout, rollout
        seen, kept = rollout, rollout.keep(informative_groups(rollout.rewards, self.group_size))
        self.rounds = 1
        while len(kept.records) < a.prompts_per_step and self.rounds < a.max_gen_batches:
            more = self.job.rollout(
                self.job.prompts.next_batch(a.prompts_per_step),
                self.group_size,
                self.job.sampling(step, self.group_size, seed=self.job.rng.randrange(2**31)),
            )
            seen, kept = seen + more, kept + more.keep(informative_groups(more.rewards, self.group_size))
            self.rounds += 1
        return kept.keep(range(min(len(kept.records), a.prompts_per_step))), seen

    def step_metrics(self, trained: Rollout, seen: Rollout) -> dict[str, float]:
        shaped = self.shaped_rewards(seen)
        return {
            "dapo/groups_kept": float(len(trained.records)),
            "dapo/gen_rounds": float(self.rounds),
            "dapo/overlong_penalty": sum(shaped) / len(shaped) - sum(seen.rewards) / len(seen.rewards),
        }
