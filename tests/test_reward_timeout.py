"""A sample's reward is killed at its timeout whatever its code does with signals.

The reward runs in a sandboxed process with an alarm per sample; code that ignores SIGALRM or
catches the exception it raises must still fail at about its ``timeout_s`` (the driver kills the
process), not hold the step for the whole chunk's time, and not take the other samples with it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from plexctl.rewards import SandboxedReward
from plexctl.sandbox import SandboxPool

TIMEOUT_S = 1.0

DEFIANT_REWARD = """
import signal, time

def score(completion, answer, record):
    if completion == "ignore":  # the alarm never reaches it
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            time.sleep(0.05)
    if completion == "catch":  # the alarm's exception is caught, and the loop goes on
        while True:
            try:
                while True:
                    time.sleep(0.05)
            except BaseException:
                pass
    if completion == "ignore-then-return":  # defeats the alarm, returns late but within the kill
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(1.3)
        return 5.0
    return float(completion == answer)
"""


@pytest.fixture
def reward(tmp_path: Path):
    (tmp_path / "rw_defiant.py").write_text(DEFIANT_REWARD)
    with SandboxPool(max_workers=1) as pool:  # one process: every sample of a step in one chunk
        scorer = SandboxedReward("rw_defiant:score", str(tmp_path), -1.0, pool, timeout_s=TIMEOUT_S)
        try:
            assert scorer.score_many([("4", "4", {})]) == [1.0]  # started, the function imported
            yield scorer
        finally:
            scorer.close()


@pytest.mark.parametrize("defiance", ["ignore", "catch"])
def test_a_reward_that_defeats_its_alarm_fails_within_three_timeouts(reward: SandboxedReward, defiance: str) -> None:
    t0 = time.monotonic()
    assert reward.score_many([(defiance, "", {})]) == [-1.0]
    took = time.monotonic() - t0
    assert took < 3 * TIMEOUT_S, f"{defiance}: the sample failed after {took:.1f} s"
    assert reward.errors == 1 and reward.last_error.startswith(f"timed out after {TIMEOUT_S:g}s")
    assert "killed" in reward.last_error
    assert reward.score_many([("4", "4", {}), ("5", "4", {})]) == [1.0, 0.0]  # a new process scores on


def test_the_other_samples_of_the_step_are_scored_and_it_takes_one_timeout_per_defiant_sample(
    reward: SandboxedReward,
) -> None:
    items = [
        ("ignore", "", {}),
        ("4", "4", {}),
        ("catch", "", {}),
        ("5", "4", {}),
        ("ignore-then-return", "", {}),
        ("4", "4", {}),
    ]
    t0 = time.monotonic()
    values = reward.score_many(items)
    took = time.monotonic() - t0
    assert values == [-1.0, 1.0, -1.0, 0.0, -1.0, 1.0]
    assert took < 3 * 3 * TIMEOUT_S, f"three late samples held the step {took:.1f} s"
    assert reward.errors == 3 and reward.last_error.startswith(f"timed out after {TIMEOUT_S:g}s")
