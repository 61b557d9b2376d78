"""The ``code`` environment: run model-written Python against the sample's tests, in the sandbox.

One turn. The program is the last fenced code block of the completion (```python ... ``` or
``` ... ```), or the whole completion when it has none. A harness runs it, then each test (a
string of Python, typically ``assert f(2) == 4``) in a copy of the program's namespace, each
under its own time limit (``test_seconds``, SIGALRM), all inside one ``run_python`` call.
The reward is the fraction of tests that pass (``reward_mode: fraction``) or 1.0 only when all
pass (``all``). A run that hits the sandbox's CPU or wall limit is a tool timeout (failure
reward, counted); a program that crashes its interpreter scores 0.0.

The harness (``plexctl/envs/code_harness.py``) reports ``<nonce> <passed> <total>`` on the real
stdout; the nonce comes on stdin and the program's own prints are captured, so printing a fake
result line does not score.
A program that inspects the harness's frames could still forge it: as any in-process test
harness, this one guards against accidents and casual reward hacking, not a determined
adversary. It deliberately does not install packages (standard library only) or compare
stdout against expected output (write such checks as tests).
"""

from __future__ import annotations

import functools
import re
import secrets
from pathlib import Path
from typing import Any

from plexctl.envs import code_harness
from plexctl.envs.base import StepResult, errored, final, tool_timeout
from plexctl.sandbox import Limits, run_python

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
REWARD_MODES = ("fraction", "all")


def extract_program(completion: str) -> str:
    """The last fenced code block of the completion, or the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


@functools.cache
def harness_source() -> str:
    """The harness: ``plexctl/envs/code_harness.py``'s text."""
    return Path(code_harness.__file__).read_text(encoding="utf-8")


def harness(program: str, tests: list[str], test_seconds: float) -> str:
    """The sandboxed program: the harness with the model's program and the tests filled in."""
    return harness_source() + f"\nrun_tests({program!r}, {tests!r}, {float(test_seconds)!r})\n"


def parse_report(stdout: str, nonce: str) -> tuple[int, int] | None:
    """(passed, total) from the harness's report line, or None when it did not report."""
    for line in reversed(stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit() and parts[2].isdigit():
            return int(parts[1]), int(parts[2])
    return None


class CodeEnv:
    """Config: ``prompt_field``, ``tests_field`` (a list of test strings, or one string),
    ``reward_mode`` (fraction | all), ``test_seconds``, ``cpu_seconds``, ``wall_seconds``,
    ``memory_mb``."""

    def __init__(
        self,
        prompt_field: str = "prompt",
        tests_field: str = "tests",
        reward_mode: str = "fraction",
        test_seconds: float = 2.0,
        cpu_seconds: int = 10,
        wall_seconds: float = 20.0,
        memory_mb: int = 512,
    ) -> None:
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode must be one of {', '.join(REWARD_MODES)}, got {reward_mode!r}")
        self.prompt_field = prompt_field
        self.tests_field = tests_field
        self.reward_mode = reward_mode
        self.test_seconds = test_seconds
        self.limits = Limits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_bytes=memory_mb * 2**20)
        self.sample: dict[str, Any] = {}

    def reset(self, sample: dict) -> str:
        self.sample = sample
        return str(sample[self.prompt_field])

    def step(self, completion_text: str) -> StepResult:
        tests = self.sample.get(self.tests_field)
        tests = [tests] if isinstance(tests, str) else list(tests or [])
        if not tests:
            return errored(f"sample has no tests in `{self.tests_field}`")
        nonce = secrets.token_hex(16)
        program = harness(extract_program(completion_text), [str(t) for t in tests], self.test_seconds)
        result = run_python(program, stdin=nonce + "\n", limits=self.limits)
        if result.limit_hit in ("wall", "cpu"):
            return tool_timeout(f"tests ran past the sandbox's {result.limit_hit} limit")
        if result.error is not None:
            return errored(result.error)
        report = parse_report(result.stdout, nonce)
        if report is None:
            return final(0.0)  # the program took its interpreter down before the report
        passed, total = report
        if self.reward_mode == "all":
            return final(1.0 if passed == total else 0.0)
        return final(passed / total)
