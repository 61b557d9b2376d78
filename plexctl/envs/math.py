"""The ``math`` environment: one turn, final-answer extraction, ``math_verify`` equivalence.

It reuses ``plexctl.rewards.math_reward`` (last ``\\boxed{}``, else after ``####``, else the
last number; then ``math_verify.verify`` against the reference, which may be a GSM8K-style
worked solution). That reward never raises: unparsable text scores 0.0.

It deliberately does not add tools or a format reward, and it does not time ``math_verify``
out by itself (its own signal timeouts work only on the main thread; in the pool, the
runner's ``step_timeout_s`` bounds a pathological expression).
"""

from __future__ import annotations

from plexctl.envs.base import RewardEnv
from plexctl.rewards import math_reward


class MathEnv(RewardEnv):
    """Single-turn GSM8K/MATH-style scoring. Config: ``prompt_field``, ``answer_field``."""

    def __init__(self, prompt_field: str = "prompt", answer_field: str = "answer") -> None:
        super().__init__(math_reward, prompt_field=prompt_field, answer_field=answer_field)
