"""The ``python_tool`` environment: a calculator / interpreter the model calls mid-episode.

Syntax, short enough for the tiny character-level model (digits, ``+ - * / = : ;``, lowercase):
the model writes ``call:12*7;``, the tool's answer comes back as the observation ``=84;``, and a
turn without a call is the final answer, scored by exact match with the sample's answer. So
the ideal episode for the prompt ``12*7=`` reads ``12*7=call:12*7;=84;84``.

Modes: ``calculator`` (default) accepts one arithmetic expression (numbers, ``+ - * / // % **``,
parentheses; anything else is a malformed call) and answers its value as ``print`` writes it;
``python`` runs the argument as a program in the sandbox and returns its stdout, so a program
that hangs hits the sandbox's CPU limit (a tool timeout: failure reward, counted) instead of
hanging the driver. The calculator evaluates in the driver, a call in microseconds instead of a
sandboxed process's tens of milliseconds: it runs nothing but arithmetic on numbers, and an
integer result past ``CALCULATOR_DIGITS`` digits (``9**9**9**9``) is refused before it is
computed, as past the calculator's limit (a tool timeout, as in the sandbox). A call that runs
but fails (``1/0``) is not a failure of the episode: the observation is ``=error;`` and the
model may try again.

Also here: ``python_tool_tiny_dataset``, the tiny multi-turn task (two-digit times one-digit
products: hard for the tiny model to compute, easy to copy from the tool), and
``python_tool_tiny_turns``, the ideal turns for a supervised warm start.

It deliberately does not keep interpreter state between calls (each python call is a fresh process)
or rewrite observations into the model's vocabulary (the calculator only prints digits, ``-``,
``.`` and ``e``; python mode prints what the program prints).
"""

from __future__ import annotations

import ast
import math
import operator
import random
from typing import Any

from plexctl.envs.base import MalformedCall, StepResult, final, malformed, observe, parse_tool_call, tool_timeout
from plexctl.sandbox import Limits, run_python

MODES = ("calculator", "python")
_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
CALCULATOR_DIGITS = 4300  # Python's own limit for printing an int (sys.int_info.default_max_str_digits)


class PastLimit(Exception):
    """A calculator result too large to compute and print."""


def _log10(value: int | float) -> float:
    """log10 of an int's magnitude (0 for 0, and for a float: its operations are bounded)."""
    return math.log10(abs(value)) if isinstance(value, int) and value else 0.0


def calculator_value(tree: ast.AST) -> int | float:
    """The value of a ``calculator_expression`` tree, as Python computes it; ``PastLimit`` for an
    int past ``CALCULATOR_DIGITS`` digits, found from the operands before the product or power is
    computed. Python's own errors (``ZeroDivisionError``, ``OverflowError``) are raised."""
    if isinstance(tree, ast.Expression):
        return calculator_value(tree.body)
    if isinstance(tree, ast.Constant):
        number = tree.value
        assert isinstance(number, (int, float))  # calculator_expression let only numbers through
        return number
    if isinstance(tree, ast.UnaryOp):
        value = calculator_value(tree.operand)
        return -value if isinstance(tree.op, ast.USub) else +value
    assert isinstance(tree, ast.BinOp)
    a, b = calculator_value(tree.left), calculator_value(tree.right)
    if isinstance(tree.op, ast.Mult):
        size = _log10(a) + _log10(b)
    elif isinstance(tree.op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and b > 0:
        size = b * _log10(a)  # |a| ** b
    else:
        size = max(_log10(a), _log10(b)) + 1  # sums, quotients, remainders: about their operands' size
    if size > CALCULATOR_DIGITS + 1:
        raise PastLimit(f"a result of over {CALCULATOR_DIGITS} digits")
    return _BINARY[type(tree.op)](a, b)


def calculator_expression(argument: str) -> ast.Expression:
    """The argument's tree if it is one arithmetic expression; ``MalformedCall`` otherwise."""
    try:
        tree = ast.parse(argument, mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a null byte
        raise MalformedCall(f"not an expression: {argument[:40]!r}") from None
    except RecursionError:
        raise MalformedCall("an expression nested too deep") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                raise MalformedCall(f"only numbers are allowed, got {node.value!r}")
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, *_OPERATORS)):
            raise MalformedCall(f"only arithmetic is allowed, got {type(node).__name__}")
    return tree


class PythonToolEnv:
    """Config: ``prompt_field``, ``answer_field``, ``mode`` (calculator | python), ``tool`` (the
    call name), ``max_observation_chars``, ``cpu_seconds``, ``wall_seconds``, ``memory_mb``."""

    def __init__(
        self,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        mode: str = "calculator",
        tool: str = "call",
        max_observation_chars: int = 16,
        cpu_seconds: int = 2,
        wall_seconds: float = 5.0,
        memory_mb: int = 256,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.mode = mode
        self.tool = tool
        self.max_observation_chars = max_observation_chars
        self.limits = Limits(
            cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_bytes=memory_mb * 2**20, output_bytes=4096
        )
        self.sample: dict[str, Any] = {}

    def reset(self, sample: dict) -> str:
        self.sample = sample
        return str(sample[self.prompt_field])

    def step(self, completion_text: str) -> StepResult:
        try:
            call = parse_tool_call(completion_text, [self.tool])
            if call is None:
                return final(1.0 if completion_text.strip() == str(self.sample[self.answer_field]).strip() else 0.0)
            if self.mode == "calculator":
                value = self.calculate(calculator_expression(call.argument))
            else:
                value = self.run(call.argument + "\n")
        except MalformedCall as e:
            return malformed(str(e))
        except PastLimit as e:
            return tool_timeout(f"`{self.tool}:` ran past the calculator's limit: {e}")
        except TimeoutError as e:
            return tool_timeout(f"`{self.tool}:` ran past the sandbox's {e} limit")
        return observe(f"={value[: self.max_observation_chars]};")

    @staticmethod
    def calculate(tree: ast.Expression) -> str:
        """What ``print`` writes of the expression's value ("error" where Python raises)."""
        try:
            return str(calculator_value(tree))
        except (ArithmeticError, ValueError, RecursionError):
            return "error"

    def run(self, program: str) -> str:
        """The program's stdout in the sandbox ("error" where it fails); ``TimeoutError`` naming
        the limit it ran past."""
        result = run_python(program, limits=self.limits)
        if result.limit_hit in ("wall", "cpu"):
            raise TimeoutError(result.limit_hit)
        return result.stdout.strip() if result.ok else "error"


# ---------------------------------------------------------------- the tiny task


def python_tool_tiny_dataset(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` prompts ``a*b=`` (a in 10..99, b in 2..9) with the product as answer.

    The 720 distinct problems are shuffled with ``seed`` and repeated when ``n`` is larger.
    """
    problems = [(a, b) for a in range(10, 100) for b in range(2, 10)]
    random.Random(seed).shuffle(problems)
    return [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in (problems[i % len(problems)] for i in range(n))]


def python_tool_tiny_turns(sample: dict[str, str], tool: str = "call") -> list[str]:
    """The ideal model turns for a tiny-task sample: the call, then the answer."""
    return [f"{tool}:{sample['prompt'].rstrip('=')};", sample["answer"]]
