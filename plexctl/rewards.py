"""Reward functions: the built-ins, loading a user's ``module:function``, and a safety wrapper.

A reward function has the signature ``RewardFn``: it takes the completion text, the
reference answer and the whole sample record, and returns a float. This module owns

* the built-in rewards ``arith`` (exact match after stripping) and ``math`` (final-answer
  extraction, then ``math_verify``; imported lazily, so plexctl starts without it);
* ``load_reward``, which turns a job spec's ``reward`` section into a ``RewardFn`` and raises
  a one-line ``RewardLoadError`` when a custom function cannot be imported or is not callable;
* ``safe_reward``, which turns a reward that raises or returns a non-finite value into the
  job's ``failure_reward`` and counts how often that happened.

It deliberately does not sandbox user code, run rewards in parallel or with a time limit
(``math`` uses math_verify's own signal-based timeouts on the main thread only), and it does
not isolate two different modules that share a name: the second one is refused.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Protocol

from plexctl.user_code import import_object, one_line

RewardFn = Callable[[str, str, dict], float]

BUILTIN_REWARDS = ("arith", "math")
MATH_VERIFY_TIMEOUT_S = 5


class RewardLoadError(Exception):
    """A reward that cannot be loaded; ``str()`` is one line for the user."""


class RewardSource(Protocol):
    """What ``load_reward`` reads: the ``reward`` section of a job spec."""

    name: str | None
    fn: str | None
    path: str | None


# ---------------------------------------------------------------- built-in rewards


def arith_reward(completion: str, answer: str, record: dict) -> float:
    """1.0 when the completion, stripped, is exactly the answer, stripped."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced: the completion was cut off inside the box


def after_hashes(text: str) -> str | None:
    """The first line after the last ``####`` (the GSM8K answer marker), or None."""
    if "####" not in text:
        return None
    rest = text.rsplit("####", 1)[1].strip()
    return rest.splitlines()[0].strip() if rest else None


def last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_final_answer(completion: str) -> str | None:
    """The answer a completion commits to: last ``\\boxed{}``, else after ``####``, else the last number."""
    for extract in (last_boxed, after_hashes, last_number):
        found = extract(completion)
        if found:
            return _drop_thousands_commas(found)
    return None


def extract_reference(answer: str) -> str:
    """The gold answer: a ``\\boxed{}`` or ``####`` answer if the field holds a worked solution."""
    found = last_boxed(answer) or after_hashes(answer) or answer.strip()
    return _drop_thousands_commas(found)


def _drop_thousands_commas(text: str) -> str:
    text = text.strip().rstrip(".").strip()
    return text.replace(",", "") if _THOUSANDS.match(text) else text


def math_reward(completion: str, answer: str, record: dict) -> float:
    """1.0 when the completion's final answer is mathematically equal to the reference.

    Never raises: odd text, unparsable answers and math_verify errors all give 0.0.
    """
    try:
        import math_verify

        predicted = extract_final_answer(completion)
        if predicted is None:
            return 0.0
        timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        gold = math_verify.parse(f"${extract_reference(str(answer))}$", parsing_timeout=timeout)
        target = math_verify.parse(f"${predicted}$", parsing_timeout=timeout)
        if not gold or not target:
            return 0.0
        return 1.0 if math_verify.verify(gold, target, timeout_seconds=timeout) else 0.0
    except Exception:
        return 0.0


_BUILTINS: dict[str, RewardFn] = {"arith": arith_reward, "math": math_reward}


# ---------------------------------------------------------------- loading


def load_reward(reward_spec: RewardSource) -> RewardFn:
    """The reward function a job's ``reward`` section names (built-in or ``module:function``)."""
    if reward_spec.fn:
        return load_custom_reward(reward_spec.fn, reward_spec.path)
    if reward_spec.name in _BUILTINS:
        return _BUILTINS[reward_spec.name]
    raise RewardLoadError(
        f"unknown built-in reward {reward_spec.name!r} (choices: {', '.join(BUILTIN_REWARDS)}); "
        "or set `fn: module:function`"
    )


def load_custom_reward(target: str, path: str | None) -> RewardFn:
    """Import ``module:function`` (``function`` may be dotted) with ``path`` first on sys.path."""
    return import_object(target, path, "reward fn", RewardLoadError)


# ---------------------------------------------------------------- failure handling


class SafeReward:
    """A ``RewardFn`` that never raises: failures give ``failure_reward`` and count in ``errors``."""

    def __init__(self, fn: RewardFn, failure_reward: float) -> None:
        self.fn = fn
        self.failure_reward = failure_reward
        self.errors = 0
        self.last_error: str | None = None

    def __call__(self, completion: str, answer: str, record: dict) -> float:
        try:
            value = float(self.fn(completion, answer, record))
        except Exception as e:
            return self._failed(f"{type(e).__name__}: {one_line(e)}")
        if not math.isfinite(value):
            return self._failed(f"non-finite reward {value}")
        return value

    def _failed(self, reason: str) -> float:
        self.errors += 1
        self.last_error = reason
        return self.failure_reward


def safe_reward(fn: RewardFn, failure_reward: float) -> SafeReward:
    return SafeReward(fn, failure_reward)
