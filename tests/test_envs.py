"""Environments on real samples, and the episode runner's token bookkeeping and failure accounting.

Tools and tests run in the real sandbox. The model is a fake ``generate``: a pure function
that answers each prompt with a scripted completion, tokenized by a character-level tokenizer
with the tiny model's conventions (``<bos>`` first, ``<eos>`` ends a completion but is not in
its text), so that the token sequences the runner builds can be checked position by position.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from plexctl.common.protocol import Completion, Sampling
from plexctl.envs import ENVS, EnvLoadError, load_env, python_tool_tiny_dataset, run_episodes
from plexctl.envs.base import (
    Episode,
    RewardEnv,
    StepResult,
    append_turn,
    episode_batch,
    episode_metrics,
    parse_tool_call,
)
from plexctl.envs.code import CodeEnv
from plexctl.envs.corpus import WORDS, builtin_corpus, fact_code, search_tiny_dataset
from plexctl.envs.python_tool import PythonToolEnv, python_tool_tiny_turns
from plexctl.envs.search import SearchEnv, index_for
from plexctl.sandbox import SandboxPool

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "configs" / "examples"

# ---------------------------------------------------------------- a character-level fake model

BOS, EOS = 1, 2
CHARS = "0123456789+-*=/ abcdefghijklmnopqrstuvwxyz.,:;?!()'\"<>"
CHAR_ID = {c: i + 4 for i, c in enumerate(CHARS)}


def encode(text: str) -> list[int]:
    return [CHAR_ID.get(c, 3) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i - 4] for i in ids if i >= 4)


def logprob_of(turn: int, position: int) -> float:
    """A distinct, recognisable behaviour log-prob for each generated token."""
    return -(turn * 100 + position + 1) / 1000


class ScriptedModel:
    """``generate(prompts, sampling)``: completion = script(prompt), tokenized like vLLM does."""

    def __init__(self, script: Callable[[str], str], tokenize: Callable[[str], list[int]] = encode) -> None:
        self.script = script
        self.tokenize = tokenize
        self.calls: list[list[str]] = []

    def __call__(self, prompts: list[str], sampling: Sampling) -> list[Completion]:
        assert sampling.n == 1
        self.calls.append(list(prompts))
        turn = len(self.calls) - 1
        out = []
        for i, prompt in enumerate(prompts):
            text = self.script(prompt)
            ids = encode(text) + [EOS]
            out.append(
                Completion(
                    prompt_index=i,
                    text=text,
                    prompt_token_ids=[BOS] + self.tokenize(prompt),
                    token_ids=ids,
                    logprobs=[logprob_of(turn, k) for k in range(len(ids))],
                    finish_reason="stop",
                )
            )
        return out[::-1]  # completions may come back in any order


def tool_user(prompt: str) -> str:
    """Calls the calculator with the prompt's expression, then copies the tool's answer."""
    if prompt.endswith(";"):  # an observation "=<value>;" ends the prompt
        return prompt[:-1].rsplit("=", 1)[1]
    return f"call:{prompt.rstrip('=')};"


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(max_workers=8) as p:
        yield p


@pytest.fixture
def clean_imports():
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        del sys.modules[name]


# ---------------------------------------------------------------- math


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("48/2 = 24 clips.\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
        ("The total is 1,000.", "1000", 1.0),
        ("\\boxed{x^2+1}", "x^2 + 1", 1.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("no idea", "7", 0.0),
    ],
)
def test_math_env_scores_equivalent_answers(completion: str, answer: str, reward: float) -> None:
    env = load_env("math")()
    assert env.reset({"prompt": "q?", "answer": answer}) == "q?"
    result = env.step(completion)
    assert result.done and result.reward == reward


def test_math_episodes_in_the_pool_are_single_turn(pool: SandboxPool) -> None:
    samples = [{"prompt": "half?", "answer": "0.5"}, {"prompt": "third?", "answer": "1/3"}]
    model = ScriptedModel(lambda p: "\\boxed{\\frac{1}{2}}")
    factory = load_env("math")
    episodes = run_episodes(model, [factory() for _ in samples], samples, Sampling(max_tokens=16), 3, pool)
    assert [ep.reward for ep in episodes] == [1.0, 0.0]
    assert [ep.turns for ep in episodes] == [1, 1] and len(model.calls) == 1


# ---------------------------------------------------------------- code


CODE_SAMPLE = {
    "prompt": "write square(x)",
    "tests": ["assert square(2) == 4", "assert square(-3) == 9", "assert square(0) == 0"],
}


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("Here:\n```python\ndef square(x):\n    return x * x\n```", 1.0),
        ("def square(x):\n    return abs(x) * 2", 2 / 3),  # fails square(-3) only
        ("def square(x):\n    return x +", 0.0),  # syntax error
        ("import os\nos._exit(0)", 0.0),  # leaves before the harness can report
        ("print('x 3 3')\ndef square(x):\n    return 0", 1 / 3),  # a forged report line does not count
        ("def square(x):\n    while True:\n        pass", 0.0),  # each test has its own time limit
    ],
)
def test_code_env_runs_tests_in_the_sandbox(completion: str, reward: float) -> None:
    env = CodeEnv(test_seconds=0.5)
    env.reset(CODE_SAMPLE)
    result = env.step(completion)
    assert result.done and result.reward == pytest.approx(reward), result


def test_code_env_all_mode_and_missing_tests() -> None:
    env = CodeEnv(reward_mode="all")
    env.reset(CODE_SAMPLE)
    assert env.step("def square(x):\n    return abs(x) * 2").reward == 0.0
    assert env.step("def square(x):\n    return x ** 2").reward == 1.0
    env.reset({"prompt": "p"})
    result = env.step("pass")
    assert result.reward is None and "no tests" in result.info["error"]


def test_code_env_run_past_the_sandbox_limits_is_a_tool_timeout() -> None:
    env = CodeEnv(cpu_seconds=1, wall_seconds=2)
    env.reset(CODE_SAMPLE)
    result = env.step("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass")
    assert result.done and result.reward is None and result.info["tool_timeout"]


# ---------------------------------------------------------------- python_tool


def test_tool_call_syntax() -> None:
    assert parse_tool_call("call:12*7;", ["call"]).argument == "12*7"
    assert parse_tool_call("84", ["call"]) is None
    assert parse_tool_call("x search:red fox; call:1;", ["call", "search"]).tool == "search"
    for bad in ("call:12*7", "call:;", "call:  ;"):
        with pytest.raises(ValueError):
            parse_tool_call(bad, ["call"])


CALCULATOR_CASES = ["12*7", "(3+4)*5", "-3//2", "7%-3", "2**-2", "2.5*4", "0**0", "1**(10**100)", "(-2)**3",
                    "2**10000", "10**4299+10**4299", "1/0", "0**-1", "2.0**10000", "1e308*10", "10**4300"]  # fmt: skip


@pytest.mark.parametrize("expression", CALCULATOR_CASES)
def test_the_calculator_answers_what_a_python_program_printing_the_expression_prints(expression: str) -> None:
    """In the driver, without a sandboxed process, the same answer a sandboxed ``print`` of the
    expression gives (``error`` where it fails)."""
    env = PythonToolEnv()
    env.reset({"prompt": "?", "answer": "0"})
    env.max_observation_chars = 4000  # within what the sandbox keeps of a program's output
    [sandboxed] = [env.run(f"print({expression})\n")]
    assert env.step(f"call:{expression};").observation == f"={sandboxed[:4000]};"


def test_the_calculator_refuses_a_result_past_its_digits_before_computing_it(monkeypatch) -> None:
    from plexctl.envs import python_tool

    monkeypatch.setattr(python_tool, "run_python", None)  # calculator calls run no program
    env = PythonToolEnv()
    env.reset({"prompt": "?", "answer": "0"})
    for expression in ("9**9**9**9", "10**10**10", "(10**3000)*(10**3000)", "2**14300"):
        t0 = time.perf_counter()
        step = env.step(f"call:{expression};")
        assert step.info["tool_timeout"] and "past the calculator's limit" in step.info["error"], step
        assert time.perf_counter() - t0 < 0.5
    assert env.step("call:10**4299;").observation == "=" + ("1" + "0" * 4299)[:16] + ";"


def test_python_tool_episode_tokens_masks_and_logprobs(pool: SandboxPool) -> None:
    sample = {"prompt": "3*7=", "answer": "21"}
    model = ScriptedModel(tool_user)
    [ep] = run_episodes(model, [PythonToolEnv()], [sample], Sampling(max_tokens=12, seed=5), 4, pool)
    assert model.calls == [["3*7="], ["3*7=call:3*7;=21;"]]
    assert ep.text == "3*7=call:3*7;=21;21"
    assert (ep.reward, ep.done, ep.turns, ep.tool_calls, ep.failed, ep.truncated) == (1.0, True, 2, 1, False, False)
    # <bos> prompt | turn 1 (its <eos> is not in the next prompt) | observation | turn 2 with <eos>
    expected = [BOS] + encode("3*7=") + encode("call:3*7;") + encode("=21;") + encode("21") + [EOS]
    mask = [0] * 5 + [1] * 9 + [0] * 4 + [1] * 3
    logprobs = [0.0] * 5 + [logprob_of(0, k) for k in range(9)] + [0.0] * 4 + [logprob_of(1, k) for k in range(3)]
    assert (ep.token_ids, ep.loss_mask, ep.logprobs) == (expected, mask, logprobs)
    assert ep.prompt_tokens == 5 and ep.prefix_mismatches == 0 and ep.dropped_tokens == 0
    assert decode([t for t, m in zip(ep.token_ids, ep.loss_mask) if m]) == "call:3*7;21"
    batch = episode_batch([ep], [0.5])
    assert batch.input_ids == [expected] and batch.loss_mask == [mask] and batch.advantages == [0.5]


def test_python_tool_many_episodes_one_generate_per_turn(pool: SandboxPool) -> None:
    samples = python_tool_tiny_dataset(12, seed=3)
    model = ScriptedModel(lambda p: "99" if p.startswith(samples[0]["prompt"]) else tool_user(p))
    episodes = run_episodes(model, [PythonToolEnv() for _ in samples], samples, Sampling(max_tokens=12), 4, pool)
    assert [len(c) for c in model.calls] == [12, 11]  # the first episode answered without the tool
    assert [ep.reward for ep in episodes] == [float(samples[0]["answer"] == "99")] + [1.0] * 11
    assert episode_metrics(episodes)["tool_calls"] == 11


def test_prefix_unstable_tokenization_is_masked_conservatively(pool: SandboxPool) -> None:
    """A BPE-like tokenizer that merges ';=' across the completion/observation boundary."""
    merged = 99

    def merging(text: str) -> list[int]:
        ids = encode(text.replace(";=", "\x00"))
        return [merged if c == 3 and ch == "\x00" else c for c, ch in zip(ids, text.replace(";=", "\x00"))]

    model = ScriptedModel(tool_user, tokenize=merging)
    [ep] = run_episodes(model, [PythonToolEnv()], [{"prompt": "3*7=", "answer": "21"}], Sampling(), 4, pool)
    assert ep.reward == 1.0 and ep.prefix_mismatches == 1 and ep.dropped_tokens == 2  # ';' and <eos>
    split = 5 + 8  # the turn-1 tokens before ';' keep their mask
    assert ep.loss_mask[:split] == [0] * 5 + [1] * 8
    assert ep.token_ids[split] == merged and ep.loss_mask[split] == 0 and ep.logprobs[split] == 0.0
    assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs)


def test_tiny_dataset_fits_the_tiny_vocabulary_and_context() -> None:
    data = python_tool_tiny_dataset(1000, seed=0)
    assert len(data) == 1000 and data == python_tool_tiny_dataset(1000, seed=0)
    assert len({d["prompt"] for d in data}) == 720
    for sample in data[:50]:
        a, b = sample["prompt"].rstrip("=").split("*")
        assert int(a) * int(b) == int(sample["answer"])
        turns = python_tool_tiny_turns(sample)
        transcript = sample["prompt"] + turns[0] + f"={sample['answer']};" + turns[1]
        assert set(transcript) <= set(CHARS) and len(transcript) + 3 <= 64


# ---------------------------------------------------------------- search


def test_bm25_puts_the_fact_first() -> None:
    index = index_for()
    assert len(index.passages) == len(builtin_corpus()) == len(WORDS) * 4
    for word in WORDS:
        [(_, top)] = index.search(word, k=1)
        assert top["text"] == f"{word} code {fact_code(word)}"
    assert index.search("nothing matches this", k=1) == []


def test_search_episode_returns_the_passage_and_honours_latency(pool: SandboxPool) -> None:
    samples = search_tiny_dataset(4, seed=1)

    def searcher(prompt: str) -> str:
        if prompt.endswith(";"):
            return prompt[:-1].rsplit(" ", 1)[1]  # the code at the end of "=<word> code <code>;"
        return f"search:{prompt.split()[-1].rstrip('?')};"

    model = ScriptedModel(searcher)
    t0 = time.perf_counter()
    episodes = run_episodes(model, [SearchEnv(latency_s=0.4) for _ in samples], samples, Sampling(), 3, pool)
    took = time.perf_counter() - t0
    assert [ep.reward for ep in episodes] == [1.0] * 4
    word = samples[0]["prompt"].split()[-1].rstrip("?")
    assert episodes[0].text == f"code of {word}?search:{word};={word} code {fact_code(word)};{fact_code(word)}"
    assert all(ep.step_seconds >= 0.4 for ep in episodes)
    assert 0.4 <= took < 1.6  # four stalls overlap in the pool


# ---------------------------------------------------------------- failure accounting


def test_a_raising_reward_gets_the_failure_reward_and_the_job_goes_on(pool: SandboxPool) -> None:
    def reward(completion: str, answer: str, record: dict) -> float:
        if completion == "boom":
            raise RuntimeError("reward exploded\nsecond line")
        return 1.0 if completion == answer else 0.0

    samples = [{"prompt": "a", "answer": "x"}, {"prompt": "b", "answer": "y"}, {"prompt": "c", "answer": "z"}]
    model = ScriptedModel(lambda p: {"a": "x", "b": "boom", "c": "nope"}[p])
    episodes = run_episodes(
        model, [RewardEnv(reward) for _ in samples], samples, Sampling(), 2, pool, failure_reward=-1.0
    )
    assert [ep.reward for ep in episodes] == [1.0, -1.0, 0.0]
    assert [ep.reward_errors for ep in episodes] == [0, 1, 0]
    assert episodes[1].failed and episodes[1].errors == ["reward raised RuntimeError: reward exploded"]
    assert math.isclose(episode_metrics(episodes)["reward_errors"], 1.0)


def test_timed_out_tool_and_malformed_call_are_counted(pool: SandboxPool) -> None:
    samples = [{"prompt": p, "answer": "0"} for p in ("slow", "broken", "bad", "ok")]
    turns = {"slow": "call:9**9**9**9;", "broken": "call:3*", "bad": "call:__import__('os');", "ok": "0"}
    model = ScriptedModel(lambda p: turns[p])
    envs = [PythonToolEnv(cpu_seconds=1, wall_seconds=3) for _ in samples]
    episodes = run_episodes(model, envs, samples, Sampling(), 3, pool, failure_reward=-0.5)
    slow, broken, bad, ok = episodes
    assert slow.tool_timeouts == 1 and slow.reward == -0.5 and slow.failed
    assert broken.malformed_calls == 1 and bad.malformed_calls == 1 and broken.reward == bad.reward == -0.5
    assert ok.reward == 1.0 and not ok.failed
    metrics = episode_metrics(episodes)
    assert (metrics["tool_timeouts"], metrics["malformed_calls"], metrics["reward_errors"]) == (1, 2, 0)


class ExplodingEnv(RewardEnv):
    """An environment whose own code raises, in ``reset`` or in ``step``."""

    def reset(self, sample: dict) -> str:
        if sample["prompt"] == "bad reset":
            raise KeyError("no such field")
        return super().reset(sample)

    def step(self, completion_text: str):
        raise ZeroDivisionError("tool crashed")


def test_an_env_that_raises_is_that_episodes_failure(pool: SandboxPool) -> None:
    samples = [
        {"prompt": "bad reset", "answer": "x"},
        {"prompt": "ok", "answer": "x"},
        {"prompt": "fine", "answer": "x"},
    ]
    model = ScriptedModel(lambda p: "x")
    envs = [ExplodingEnv(lambda c, a, r: 1.0), ExplodingEnv(lambda c, a, r: 1.0), RewardEnv(lambda c, a, r: 1.0)]
    reset_failed, step_failed, fine = run_episodes(model, envs, samples, Sampling(), 2, pool, failure_reward=-1.0)
    assert model.calls == [["ok", "fine"]]  # an episode that failed to reset is not generated for
    assert reset_failed.failed and reset_failed.reward_errors == 1 and reset_failed.turns == 0
    assert step_failed.failed and step_failed.reward == -1.0 and step_failed.reward_errors == 1
    assert step_failed.errors == ["step raised ZeroDivisionError: tool crashed"]
    assert fine.reward == 1.0
    batch = episode_batch([reset_failed, step_failed, fine], [-1.0, -1.0, 2.0])  # no token of reset_failed's
    assert batch.input_ids == [step_failed.token_ids, fine.token_ids] and batch.advantages == [-1.0, 2.0]


class HangingEnv(RewardEnv):
    def step(self, completion_text: str):
        time.sleep(3)
        return super().step(completion_text)


def test_a_step_that_hangs_past_step_timeout_is_abandoned(pool: SandboxPool) -> None:
    samples = [{"prompt": "a", "answer": "x"}, {"prompt": "b", "answer": "x"}]
    model = ScriptedModel(lambda p: "x")
    envs = [HangingEnv(lambda c, a, r: 1.0), RewardEnv(lambda c, a, r: 1.0)]
    t0 = time.perf_counter()
    hung, fine = run_episodes(model, envs, samples, Sampling(), 2, pool, step_timeout_s=0.5, failure_reward=-2.0)
    assert time.perf_counter() - t0 < 2.0
    assert hung.tool_timeouts == 1 and hung.reward == -2.0 and fine.reward == 1.0


class SlowEnv(RewardEnv):
    def step(self, completion_text: str):
        time.sleep(0.2)
        return super().step(completion_text)


def test_a_steps_timeout_runs_from_its_start_not_while_it_waits_for_a_thread() -> None:
    samples = [{"prompt": str(i), "answer": "x"} for i in range(16)]
    with SandboxPool(max_workers=2) as small:  # 8 rounds of 0.2 s steps: 1.6 s for the last to finish
        episodes = run_episodes(
            ScriptedModel(lambda p: "x"),
            [SlowEnv(lambda c, a, r: 1.0) for _ in samples],
            samples,
            Sampling(),
            1,
            small,
            step_timeout_s=0.5,
            failure_reward=-2.0,
        )
    assert [ep.tool_timeouts for ep in episodes] == [0] * 16 and {ep.reward for ep in episodes} == {1.0}
    assert all(0.15 < ep.step_seconds < 0.5 for ep in episodes)  # its own run, not the queue


class ChattyEnv(RewardEnv):
    """Answers every turn with a long observation, never ends."""

    def step(self, completion_text: str):
        return StepResult("o" * 20, done=False, reward=None)


def test_a_turn_is_not_generated_when_its_prompt_with_the_observation_would_pass_the_limit(pool) -> None:
    model = ScriptedModel(lambda p: "abc")
    [ep] = run_episodes(
        model,
        [ChattyEnv(lambda c, a, r: 1.0)],
        [{"prompt": "1+1=", "answer": "2"}],
        Sampling(),
        5,
        pool,
        max_total_tokens=len(encode("1+1=")) + 1 + 4 + 20,
    )  # bos, prompt, turn 1, observation
    assert ep.truncated and ep.turns == 1 and len(model.calls) == 1  # the next prompt would not have fit


def test_turn_and_token_limits_truncate(pool: SandboxPool) -> None:
    model = ScriptedModel(lambda p: "call:1+1;")  # never answers
    [by_turns] = run_episodes(
        model, [PythonToolEnv()], [{"prompt": "1+1=", "answer": "2"}], Sampling(), 3, pool, truncated_reward=-0.1
    )
    assert by_turns.truncated and by_turns.turns == 3 and by_turns.reward == -0.1 and by_turns.tool_calls == 3
    [by_tokens] = run_episodes(
        ScriptedModel(lambda p: "call:1+1;"),
        [PythonToolEnv()],
        [{"prompt": "1+1=", "answer": "2"}],
        Sampling(),
        10,
        pool,
        max_total_tokens=25,
    )
    assert by_tokens.truncated and by_tokens.turns == 2 and len(by_tokens.token_ids) == 27


# ---------------------------------------------------------------- loading


def test_registry_and_custom_env(pool: SandboxPool, clean_imports: None) -> None:
    assert set(ENVS) == {"math", "code", "python_tool", "search"}
    factory = load_env({"cls": "custom_env:GuessEnv", "path": str(EXAMPLES), "config": {"max_guesses": 2}})
    samples = [{"prompt": "guess:", "answer": "7"}, {"prompt": "guess:", "answer": "3"}]

    def guesser(prompt: str) -> str:
        if prompt.endswith("=higher;"):
            return "7"
        return "try:5;" if prompt == "guess:" else "3"

    episodes = run_episodes(ScriptedModel(guesser), [factory() for _ in samples], samples, Sampling(), 3, pool)
    assert [ep.reward for ep in episodes] == [1.0, 1.0]
    assert episodes[0].text == "guess:try:5;=higher;7"


@pytest.mark.parametrize(
    "spec, config, message",
    [
        ("nope", {}, "unknown built-in env 'nope'"),
        ("python_tool", {"mode": "shell"}, "refused its config: ValueError: mode must be one of"),
        ("search", {"colour": 1}, "refused its config: TypeError"),
        ({"name": "math", "cls": "x:Y"}, None, "set exactly one of"),
        ("custom_env_missing:GuessEnv", {}, "cannot import `custom_env_missing`"),
        ("custom_env:Nope", {}, "has no attribute `Nope`"),
    ],
)
def test_load_env_errors_are_one_line(spec, config, message: str, clean_imports: None) -> None:
    with pytest.raises(EnvLoadError) as err:
        load_env(spec, config, path=str(EXAMPLES) if isinstance(spec, str) and ":" in spec else None)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_append_turn_rejects_misaligned_logprobs() -> None:
    with pytest.raises(ValueError, match="log-probs"):
        append_turn(Episode(sample={}), Completion(0, "a", [BOS], [5, 6], [-0.1], "stop"))
