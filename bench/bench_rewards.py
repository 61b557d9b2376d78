"""Rewards with a cost, for the multiplexing benchmark's job mix.

``slow_exact`` waits like a remote verifier or tool would (the driver idles, the engines are
free for other jobs); ``cpu_exact`` burns CPU in the driver like heavy reward code does.
Both score exactly like the built-in ``arith`` reward, so learning is comparable.
"""

from __future__ import annotations

import os
import time

WAIT_S = float(os.environ.get("PLEXRL_BENCH_REWARD_WAIT_S", "0.003"))
BURN_S = float(os.environ.get("PLEXRL_BENCH_REWARD_BURN_S", "0.0015"))


def _exact(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def slow_exact(completion: str, answer: str, sample: dict) -> float:
    time.sleep(WAIT_S)
    return _exact(completion, answer)


def cpu_exact(completion: str, answer: str, sample: dict) -> float:
    end = time.perf_counter() + BURN_S
    x = 0
    while time.perf_counter() < end:
        x += 1
    return _exact(completion, answer)
