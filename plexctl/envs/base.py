"""Multi-turn environments: the ``Env`` interface, tool-call syntax, and the episode runner.

An environment turns a dataset sample into a first prompt (``reset``) and then reads each of
the model's turns (``step``): a turn that calls a tool gets the tool's output back as an
*observation* to append (``done=False``); a final answer ends the episode with its reward.
``run_episodes`` drives many episodes at once: each turn's generation for all live episodes
is ONE ``generate`` call (so the scheduler sees the job's real gaps), and the steps (tools,
rewards) of that turn run concurrently in a ``SandboxPool`` before the next turn.

This module owns ``Env`` / ``StepResult`` (the interface) and ``RewardEnv`` (any single-turn
reward function as an environment); ``parse_tool_call`` (the ``name:argument;`` syntax, short
enough for a character-level model: ``call:12*7;`` -> observation ``=84;``); ``Episode`` and
``run_episodes``, with ``episode_batch`` / ``episode_metrics`` to hand episodes to the trainer.

Invariants: the engine's ``prompt_token_ids`` for turn k+1 are authoritative; later prompt
tokens (the observation) get mask 0 and log-prob 0, and no token is trained with another
context's log-prob (mismatches are counted in ``prefix_mismatches`` / ``dropped_tokens``).
Failures never stop a job: a step that raises or times out, a malformed call, or a final answer
without a usable reward gets ``failure_reward`` and is counted on the episode. It deliberately
does not batch turns of one episode, stream tokens, stop generation on tool-call syntax, or
cancel a step that hangs in Python. Reasoning and details: ``docs/environments.md``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from plexctl.common.protocol import Completion, Sampling, TrainBatch
from plexctl.common.user_code import one_line
from plexctl.rewards import RewardFn
from plexctl.sandbox import SandboxPool

GenerateFn = Callable[[list[str], Sampling], list[Completion]]
TURN_SEED_STRIDE = 1_000_003  # turn t of a request with seed s samples with seed s + t * stride


@dataclasses.dataclass
class StepResult:
    """What an environment answers to one model turn.

    ``observation``: text to append before the next turn (None or "" for none), when not done.
    ``reward``: the episode's reward when done; None means the episode failed (the runner gives
    ``failure_reward``). ``info`` flags, counted by the runner: ``tool_call``, ``tool_timeout``,
    ``malformed``, ``error`` (a one-line message).
    """

    observation: str | None
    done: bool
    reward: float | None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """One episode's environment. A new instance per episode: it may keep the episode's state."""

    def reset(self, sample: dict) -> str:
        """The first prompt text for ``sample``."""
        ...

    def step(self, completion_text: str) -> StepResult:
        """Read one model turn; run its tool call, or score its final answer."""
        ...


# ---------------------------------------------------------------- step results


def observe(text: str) -> StepResult:
    """A tool ran: append ``text`` and let the model continue."""
    return StepResult(observation=text, done=False, reward=None, info={"tool_call": True})


def final(reward: float) -> StepResult:
    return StepResult(observation=None, done=True, reward=float(reward))


def malformed(message: str) -> StepResult:
    return StepResult(observation=None, done=True, reward=None, info={"malformed": True, "error": message})


def tool_timeout(message: str) -> StepResult:
    return StepResult(
        observation=None, done=True, reward=None, info={"tool_call": True, "tool_timeout": True, "error": message}
    )


def errored(message: str) -> StepResult:
    return StepResult(observation=None, done=True, reward=None, info={"error": message})


# ---------------------------------------------------------------- tool-call syntax


class MalformedCall(ValueError):
    """A turn that starts a tool call it does not finish; ``str()`` is one line."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    tool: str
    argument: str


def parse_tool_call(text: str, tools: Sequence[str]) -> ToolCall | None:
    """The first ``tool:argument;`` in ``text``; None when no tool is called.

    Raises ``MalformedCall`` for a call without its closing ``;`` or with an empty argument.
    Text after the call is ignored (the observation follows the whole turn).
    """
    starts = [(text.find(f"{tool}:"), tool) for tool in tools]
    starts = [(at, tool) for at, tool in starts if at >= 0]
    if not starts:
        return None
    at, tool = min(starts)
    begin = at + len(tool) + 1
    end = text.find(";", begin)
    if end < 0:
        raise MalformedCall(f"`{tool}:` call without a closing `;`")
    argument = text[begin:end].strip()
    if not argument:
        raise MalformedCall(f"`{tool}:` call with an empty argument")
    return ToolCall(tool, argument)


# ---------------------------------------------------------------- single-turn rewards


class RewardEnv:
    """A single-turn environment around a ``RewardFn(completion, answer, record) -> float``."""

    def __init__(self, reward_fn: RewardFn, prompt_field: str = "prompt", answer_field: str = "answer") -> None:
        self.reward_fn = reward_fn
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.sample: dict = {}

    def reset(self, sample: dict) -> str:
        self.sample = sample
        return str(sample[self.prompt_field])

    def step(self, completion_text: str) -> StepResult:
        try:
            value = float(self.reward_fn(completion_text, str(self.sample[self.answer_field]), self.sample))
        except Exception as e:  # noqa: BLE001 - the user's reward may raise anything: that sample's error
            return errored(f"reward raised {type(e).__name__}: {one_line(e)}")
        if not math.isfinite(value):
            return errored(f"reward returned {value}")
        return final(value)


# ---------------------------------------------------------------- episodes


@dataclasses.dataclass
class Episode:
    """One multi-turn rollout: its text, its token sequence for training, and what happened.

    ``token_ids``, ``loss_mask`` and ``logprobs`` are aligned: mask 1 marks tokens the policy
    generated in this context (with their behaviour log-probs); prompt and observation tokens
    have mask 0 and log-prob 0.0.
    """

    sample: dict
    text: str = ""  # the next prompt: first prompt + completions + observations so far
    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0  # tokens of the first prompt
    reward: float = 0.0
    done: bool = False
    failed: bool = False  # the reward is the failure reward
    truncated: bool = False  # turn or token limit reached before a final answer
    turns: int = 0
    tool_calls: int = 0
    tool_timeouts: int = 0
    reward_errors: int = 0
    malformed_calls: int = 0
    prefix_mismatches: int = 0  # turns whose next prompt re-tokenized earlier generated tokens
    dropped_tokens: int = 0  # generated tokens masked out by those mismatches
    step_seconds: float = 0.0  # time in this episode's tool and reward steps
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    last_generated: int = 0  # tokens generated in the latest turn (internal bookkeeping)
    observed_chars: int = 0  # characters of the latest observation, not yet in token_ids (internal)


def run_episodes(
    generate: GenerateFn,
    envs: Sequence[Env],
    samples: Sequence[dict],
    sampling: Sampling,
    max_turns: int,
    pool: SandboxPool,
    *,
    failure_reward: float = 0.0,
    truncated_reward: float = 0.0,
    step_timeout_s: float | None = None,
    max_total_tokens: int | None = None,
) -> list[Episode]:
    """Run one episode per (env, sample) to the end; every turn is one ``generate`` call.

    ``sampling.n`` is forced to 1 (one completion per live episode); a GRPO group is several
    envs on the same sample. ``max_total_tokens``: an episode whose sequence reaches it before a
    final answer is truncated (set it below the model's context minus ``max_tokens``).
    """
    if len(envs) != len(samples):
        raise ValueError(f"{len(envs)} environments but {len(samples)} samples")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    episodes = [_reset(env, sample, failure_reward) for env, sample in zip(envs, samples)]
    for turn in range(max_turns):
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        if not live:
            break
        completions = _generate_turn(generate, [episodes[i].text for i in live], sampling, turn)
        for i, completion in zip(live, completions):
            append_turn(episodes[i], completion)
        _run_steps(
            pool,
            [(episodes[i], envs[i], completions[k].text) for k, i in enumerate(live)],
            failure_reward,
            step_timeout_s,
        )
        for i in live:
            ep = episodes[i]
            # the next prompt adds the observation: at most a token per character (+1 for a tokenizer's marks)
            grown = len(ep.token_ids) + (ep.observed_chars + 1 if ep.observed_chars else 0)
            if not ep.done and max_total_tokens is not None and grown >= max_total_tokens:
                _truncate(ep, truncated_reward)
    for ep in episodes:
        if not ep.done:
            _truncate(ep, truncated_reward)
    return episodes


def _reset(env: Env, sample: dict, failure_reward: float) -> Episode:
    ep = Episode(sample=sample)
    try:
        ep.text = str(env.reset(sample))
    except Exception as e:  # noqa: BLE001 - the user's environment may raise anything: that episode's error
        ep.reward_errors += 1
        _fail(ep, failure_reward, f"reset raised {type(e).__name__}: {one_line(e)}")
    return ep


def _generate_turn(generate: GenerateFn, prompts: list[str], sampling: Sampling, turn: int) -> list[Completion]:
    seed = None if sampling.seed is None else sampling.seed + turn * TURN_SEED_STRIDE
    completions = generate(prompts, msgspec.structs.replace(sampling, n=1, seed=seed))
    by_index: dict[int, Completion] = {}
    for c in completions:
        if not 0 <= c.prompt_index < len(prompts) or c.prompt_index in by_index:
            raise ValueError(f"generate returned an unexpected completion for prompt {c.prompt_index}")
        by_index[c.prompt_index] = c
    if len(by_index) != len(prompts):
        raise ValueError(f"generate returned {len(by_index)} completions for {len(prompts)} prompts")
    return [by_index[i] for i in range(len(prompts))]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def append_turn(ep: Episode, completion: Completion) -> None:
    """Add one turn: the engine's prompt (authoritative, see the module doc), then the generated tokens."""
    if len(completion.logprobs) != len(completion.token_ids):
        raise ValueError(f"completion has {len(completion.token_ids)} tokens but {len(completion.logprobs)} log-probs")
    prompt = list(completion.prompt_token_ids)
    if ep.turns == 0:
        ep.prompt_tokens = len(prompt)
        keep = 0
    else:
        keep = common_prefix_length(ep.token_ids, prompt)
        lost = len(ep.token_ids) - keep
        stop_token_only = lost == 1 and ep.finish_reasons[-1] == "stop" and ep.last_generated > 0
        if lost and not stop_token_only:
            ep.prefix_mismatches += 1
            ep.dropped_tokens += sum(ep.loss_mask[keep:])
    ep.token_ids = ep.token_ids[:keep] + prompt[keep:] + list(completion.token_ids)
    ep.loss_mask = ep.loss_mask[:keep] + [0] * (len(prompt) - keep) + [1] * len(completion.token_ids)
    ep.logprobs = ep.logprobs[:keep] + [0.0] * (len(prompt) - keep) + [float(x) for x in completion.logprobs]
    ep.text += completion.text
    ep.turns += 1
    ep.last_generated = len(completion.token_ids)
    ep.finish_reasons.append(completion.finish_reason)


def _run_steps(
    pool: SandboxPool, work: list[tuple[Episode, Env, str]], failure_reward: float, step_timeout_s: float | None
) -> None:
    """Run every live episode's step concurrently in the pool, then apply the results in order.

    A step's ``step_timeout_s`` runs from when a pool thread starts it, not while it waits for
    one; a step still waiting when every step ahead of it could have used its whole timeout
    (the pool's rounds times the timeout) is not run and times out too."""
    started = time.perf_counter()
    began: dict[int, float] = {}  # step -> when a pool thread started it
    futures = [pool.call(_timed_step, env, text, began, k) for k, (_, env, text) in enumerate(work)]
    rounds = -(-len(work) // max(1, pool.max_workers))
    for k, ((ep, _, _), future) in enumerate(zip(work, futures)):
        try:
            result, seconds = _step_result(future, began, k, step_timeout_s, started, rounds)
        except concurrent.futures.TimeoutError:
            future.cancel()  # one still waiting for a thread does not run at all
            ep.step_seconds += time.perf_counter() - began.get(k, time.perf_counter())
            ep.tool_timeouts += 1
            _fail(ep, failure_reward, f"step took longer than {step_timeout_s}s")
            continue
        except Exception as e:  # noqa: BLE001 - the user's environment may raise anything: that episode's error
            ep.step_seconds += time.perf_counter() - began.get(k, started)
            ep.reward_errors += 1
            _fail(ep, failure_reward, f"step raised {type(e).__name__}: {one_line(e)}")
            continue
        ep.step_seconds += seconds
        apply_step(ep, result, failure_reward)


def _step_result(
    future: concurrent.futures.Future,
    began: dict[int, float],
    k: int,
    timeout: float | None,
    submitted: float,
    rounds: int,
) -> tuple[StepResult, float]:
    """The step's result within ``timeout`` of its start (see ``_run_steps``); TimeoutError past it."""
    if timeout is None:
        return future.result()
    queue_deadline = submitted + rounds * timeout
    while k not in began:  # waiting for a pool thread: not counted
        if future.done():
            return future.result()
        if time.perf_counter() > queue_deadline:
            raise concurrent.futures.TimeoutError
        concurrent.futures.wait([future], timeout=0.01)
    return future.result(timeout=max(began[k] + timeout - time.perf_counter(), 0.0))


def _timed_step(env: Env, text: str, began: dict[int, float], k: int) -> tuple[StepResult, float]:
    t0 = began[k] = time.perf_counter()
    result = env.step(text)
    return result, time.perf_counter() - t0


def apply_step(ep: Episode, result: StepResult, failure_reward: float) -> None:
    """Count the step's flags, then append its observation or end the episode with its reward."""
    if not isinstance(result, StepResult):
        ep.reward_errors += 1
        _fail(ep, failure_reward, f"step returned a {type(result).__name__}, not a StepResult")
        return
    info = result.info or {}
    ep.tool_calls += bool(info.get("tool_call"))
    ep.tool_timeouts += bool(info.get("tool_timeout"))
    ep.malformed_calls += bool(info.get("malformed"))
    counted = any(info.get(k) for k in ("tool_timeout", "malformed"))
    if info.get("error") and not counted:
        ep.reward_errors += 1
    if info.get("error"):
        ep.errors.append(str(info["error"]))
    if not result.done:
        ep.text += result.observation or ""
        ep.observed_chars = len(result.observation or "")
        return
    reward = result.reward
    if reward is None or not math.isfinite(float(reward)):
        if not counted and not info.get("error"):
            ep.reward_errors += 1
        _fail(ep, failure_reward, str(info.get("error") or f"final answer without a usable reward ({reward})"))
        return
    ep.reward = float(reward)
    ep.done = True


def _fail(ep: Episode, failure_reward: float, message: str) -> None:
    if not ep.errors or ep.errors[-1] != message:
        ep.errors.append(message)
    ep.reward = failure_reward
    ep.failed = True
    ep.done = True


def _truncate(ep: Episode, truncated_reward: float) -> None:
    ep.reward = truncated_reward
    ep.truncated = True
    ep.done = True


# ---------------------------------------------------------------- to the trainer


def episode_batch(episodes: Sequence[Episode], advantages: Sequence[float]) -> TrainBatch:
    """One ``TrainBatch`` row per episode: its whole sequence, observation tokens masked out.
    An episode with no generated token (its reset failed) has nothing to train: no row (its
    reward still counted in its group's advantages)."""
    if len(episodes) != len(advantages):
        raise ValueError(f"{len(episodes)} episodes but {len(advantages)} advantages")
    rows = [(ep, a) for ep, a in zip(episodes, advantages) if any(ep.loss_mask)]
    return TrainBatch(
        input_ids=[list(ep.token_ids) for ep, _ in rows],
        loss_mask=[list(ep.loss_mask) for ep, _ in rows],
        old_logprobs=[list(ep.logprobs) for ep, _ in rows],
        advantages=[float(a) for _, a in rows],
    )


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Step metrics for a job's report: means per episode and failure counts (sums)."""
    n = max(len(episodes), 1)
    return {
        "reward_mean": sum(ep.reward for ep in episodes) / n,
        "turns_mean": sum(ep.turns for ep in episodes) / n,
        "tool_calls": float(sum(ep.tool_calls for ep in episodes)),
        "tool_timeouts": float(sum(ep.tool_timeouts for ep in episodes)),
        "reward_errors": float(sum(ep.reward_errors for ep in episodes)),
        "malformed_calls": float(sum(ep.malformed_calls for ep in episodes)),
        "failed": float(sum(ep.failed for ep in episodes)),
        "truncated": float(sum(ep.truncated for ep in episodes)),
        "prefix_mismatches": float(sum(ep.prefix_mismatches for ep in episodes)),
        "step_seconds": sum(ep.step_seconds for ep in episodes),
    }
