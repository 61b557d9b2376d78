"""Rewards (built-in, custom, failure handling) and the prompt data they score."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest

from plexctl.common.spec import RewardSpec
from plexctl.data import DataError, PromptCursor, first_record, load_records
from plexctl.rewards import (
    RewardLoadError,
    arith_reward,
    load_reward,
    math_reward,
    safe_reward,
)


@pytest.fixture
def clean_imports():
    """Undo what importing a user's reward module does to sys.path and sys.modules."""
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        del sys.modules[name]


# ---------------------------------------------------------------- built-ins


def test_arith_is_exact_match_after_strip() -> None:
    reward = load_reward(RewardSpec(name="arith"))
    assert reward(" 42\n", "42", {}) == 1.0
    assert reward("42.0", "42", {}) == 0.0
    assert reward("", "42", {}) == 0.0
    assert arith_reward("7", " 7 ", {"prompt": "3+4="}) == 1.0


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", 1.0),
        ("She sold 48/2 = 24 clips.\n#### 42", "42", 1.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # GSM8K-style reference
        ("First 5, then 7 apples.", "7", 1.0),  # last number
        ("First 5, then 7 apples.", "5", 0.0),
        ("The total is 1,000.", "1000", 1.0),
        ("\\boxed{3} is wrong, \\boxed{4} is right", "4", 1.0),  # the last box
        ("\\boxed{x^2+1}", "x^2 + 1", 1.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ],
)
def test_math_reward_on_real_examples(completion: str, answer: str, expected: float) -> None:
    assert load_reward(RewardSpec(name="math"))(completion, answer, {}) == expected


GARBAGE = ["", "no answer here", "\\boxed{", "}}}{{{", "####", "\\boxed{\\frac{", "\x00\x01", "$$$"]


@pytest.mark.parametrize("garbage", GARBAGE)
def test_math_reward_never_raises_on_garbage(garbage: str) -> None:
    assert math_reward(garbage, "42", {}) == 0.0
    assert math_reward("42", garbage, {}) in (0.0, 1.0)


def test_math_reward_works_off_the_main_thread() -> None:
    results: list[float] = []
    thread = threading.Thread(target=lambda: results.append(math_reward("\\boxed{\\frac{1}{2}}", "0.5", {})))
    thread.start()
    thread.join()
    assert results == [1.0]


# ---------------------------------------------------------------- custom rewards


def test_custom_reward_from_a_module_in_reward_path(tmp_path: Path, clean_imports) -> None:
    (tmp_path / "rw_custom_ok.py").write_text(
        "def score(completion, answer, record):\n"
        "    return 1.0 if completion.strip() == answer and record['level'] == 2 else 0.5\n"
    )
    reward = load_reward(RewardSpec(fn="rw_custom_ok:score", path=str(tmp_path)))
    assert reward("3", "3", {"level": 2}) == 1.0
    assert reward("4", "3", {"level": 2}) == 0.5


def test_custom_reward_dotted_attribute(tmp_path: Path, clean_imports) -> None:
    (tmp_path / "rw_custom_cls.py").write_text(
        "class Scorer:\n    @staticmethod\n    def score(c, a, r):\n        return 0.25\n"
    )
    assert load_reward(RewardSpec(fn="rw_custom_cls:Scorer.score", path=str(tmp_path)))("", "", {}) == 0.25


@pytest.mark.parametrize(
    "source, fn, phrase",
    [
        (None, "rw_absent:score", "cannot import `rw_absent`"),
        ("x = 1\n", "rw_noattr:score", "has no attribute `score`"),
        ("score = 'not a function'\n", "rw_notcall:score", "is not callable (it is a str)"),
        ("def score(:\n", "rw_syntax:score", "SyntaxError"),
        ("import no_such_dep_xyz\n", "rw_dep:score", "ModuleNotFoundError: No module named 'no_such_dep_xyz'"),
    ],
)
def test_unimportable_custom_reward(tmp_path: Path, clean_imports, source: str | None, fn: str, phrase: str) -> None:
    if source is not None:
        (tmp_path / (fn.split(":")[0] + ".py")).write_text(source)
    with pytest.raises(RewardLoadError) as info:
        load_reward(RewardSpec(fn=fn, path=str(tmp_path)))
    assert phrase in str(info.value)
    assert "\n" not in str(info.value)


def test_two_reward_modules_with_one_name_are_not_confused(tmp_path: Path, clean_imports) -> None:
    for job, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / job).mkdir()
        (tmp_path / job / "rw_same_name.py").write_text(f"def score(c, a, r):\n    return {value}\n")
    assert load_reward(RewardSpec(fn="rw_same_name:score", path=str(tmp_path / "a")))("", "", {}) == 1.0
    with pytest.raises(RewardLoadError, match="already imported"):
        load_reward(RewardSpec(fn="rw_same_name:score", path=str(tmp_path / "b")))


# ---------------------------------------------------------------- failure handling


def test_safe_reward_turns_failures_into_failure_reward_and_counts_them() -> None:
    def flaky(completion: str, answer: str, record: dict) -> float:
        if completion == "raise":
            raise ValueError("bad completion")
        if completion == "nan":
            return math.nan
        if completion == "inf":
            return math.inf
        if completion == "none":
            return None  # type: ignore[return-value]
        return 0.75

    reward = safe_reward(flaky, failure_reward=-1.0)
    assert reward("ok", "", {}) == 0.75
    assert [reward(c, "", {}) for c in ("raise", "nan", "inf", "none")] == [-1.0] * 4
    assert reward.errors == 4
    assert reward("ok", "", {}) == 0.75 and reward.errors == 4


SANDBOXED_REWARD = """
import os, signal, socket, time
import numpy  # installed packages are importable in the sandbox
from helpers_rw import expected

def score(completion, answer, record):
    if completion == "pid":
        return float(os.getpid())
    if completion == "hang":
        while True:
            pass
    if completion == "sleep":
        time.sleep(60)
    if completion == "slow":  # clears the process's alarm first, as math_verify's own timeout does
        signal.alarm(0)
        time.sleep(2.5)
    if completion == "net":
        socket.create_connection(("10.255.255.1", 80), timeout=2)
    if completion == "write":
        with open(record["outside"], "w") as f:
            f.write("escaped")
    if completion == "raise":
        raise ValueError("bad completion")
    if completion == "nan":
        return float("nan")
    if completion == "exit":
        os._exit(3)
    return float(numpy.float64(expected(completion, answer)))
"""


def test_a_custom_reward_runs_in_the_sandbox_pool_and_each_failure_stays_its_samples(tmp_path: Path) -> None:
    from plexctl.rewards import SandboxedReward, make_scorer
    from plexctl.sandbox import SandboxPool

    repo = tmp_path / "repo"
    repo.mkdir(mode=0o700)  # private to the driver's user, as a home directory is
    (repo / "rw_sandboxed.py").write_text(SANDBOXED_REWARD)
    (repo / "helpers_rw.py").write_text("def expected(c, a):\n    return 1.0 if c.strip() == a else 0.0\n")
    outside = tmp_path / "outside.txt"
    with SandboxPool(max_workers=3) as pool:
        reward = make_scorer(RewardSpec(fn="rw_sandboxed:score", path=str(repo)), -1.0, pool, timeout_s=2)
        assert isinstance(reward, SandboxedReward)
        try:
            items = [
                ("4", "4", {}),
                ("5", "4", {}),
                ("pid", "", {}),
                ("hang", "", {}),
                ("net", "", {}),
                ("write", "", {"outside": str(outside)}),
                ("raise", "", {}),
                ("nan", "", {}),
                ("sleep", "", {}),
                ("slow", "", {}),
                (" 4 ", "4", {}),
            ]
            values = reward.score_many(items)
            assert values[:2] == [1.0, 0.0] and values[-1] == 1.0
            assert values[2] not in (-1.0, float(__import__("os").getpid()))  # another process scored it
            assert values[3:10] == [-1.0] * 7
            assert reward.errors == 7 and not outside.exists()
            # a process that dies fails its own chunk's samples only
            assert reward.score_many([("exit", "", {}), ("4", "4", {})]) == [-1.0, 1.0]
            assert reward.errors == 8 and "reward process failed" in reward.last_error
        finally:
            reward.close()
    assert "rw_sandboxed" not in sys.modules  # never imported into this process


def test_a_builtin_reward_scores_many_in_process() -> None:
    from plexctl.rewards import make_scorer

    reward = make_scorer(RewardSpec(name="arith"), -1.0)
    assert reward.score_many([("4", "4", {}), ("5", "4", {})]) == [1.0, 0.0]


# ---------------------------------------------------------------- data


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_records_reads_jsonl_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n')
    assert load_records(str(path), "prompt", "answer") == [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "2+2=", "answer": "4"},
    ]
    assert first_record(path) == {"prompt": "1+1=", "answer": "2"}


@pytest.mark.parametrize(
    "text, phrase",
    [
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', "record 2 (line 2): missing field `answer`"),
        ('{"prompt": "a", "answer": "1"}\n[1, 2]\n', "record 2 (line 2): not a JSON object"),
        ('{"prompt": "a", "answer": "1"}\n{oops\n', "record 2 (line 2): not valid JSON"),
        ("\n\n", "empty dataset"),
    ],
)
def test_load_records_errors_name_file_record_and_problem(tmp_path: Path, text: str, phrase: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(DataError) as info:
        load_records(str(path), "prompt", "answer")
    assert str(info.value).startswith(f"{path}:") and phrase in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file_and_parquet_without_pyarrow(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file not found"):
        load_records(str(tmp_path / "none.jsonl"), "prompt", "answer")
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="install it"):
            load_records(str(tmp_path / "d.parquet"), "prompt", "answer")


def records(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)]


def test_cursor_is_deterministic_and_covers_each_epoch() -> None:
    data = records(10)
    a, b = PromptCursor(data, seed=3), PromptCursor(data, seed=3)
    first = [r["prompt"] for r in a.next_batch(10)]
    assert first == [r["prompt"] for r in b.next_batch(10)]
    assert sorted(first) == sorted(r["prompt"] for r in data)  # one epoch: every record once
    assert first != [r["prompt"] for r in data]  # shuffled
    second = [r["prompt"] for r in a.next_batch(10)]
    assert sorted(second) == sorted(first) and second != first  # a new order each epoch
    assert [r["prompt"] for r in PromptCursor(data, seed=4).next_batch(10)] != first


def test_cursor_resumes_exactly_where_it_stopped() -> None:
    data = records(7)
    original = PromptCursor(data, seed=0)
    original.next_batch(3)
    original.next_batch(5)  # crosses into epoch 1
    state = json.loads(json.dumps(original.state()))
    resumed = PromptCursor.from_state(data, state)
    assert [resumed.next_batch(4) for _ in range(5)] == [original.next_batch(4) for _ in range(5)]


def test_cursor_refuses_a_state_from_another_dataset() -> None:
    state = PromptCursor(records(7), seed=0).state()
    with pytest.raises(DataError, match="7"):
        PromptCursor.from_state(records(8), state)


COUNTING_REWARD = """
import os, signal, sys, time
calls = 0

def score(completion, answer, record):
    global calls
    calls += 1
    print("PLEXRL-REWARDS [[99, null]]")  # what the function prints cannot pose as a reply
    if completion == "stdin":  # nor can it read the requests
        return float(len(sys.stdin.read()) + 7)
    if completion == "stuck":  # ignores the per-sample alarm: only the deadline ends it
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(60)
    return float(os.getpid() * 1000 + calls) if completion == "who" else 1.0
"""


def test_a_custom_reward_is_imported_once_per_process_and_a_stuck_process_is_replaced(tmp_path: Path) -> None:
    from plexctl.rewards import SandboxedReward, make_scorer
    from plexctl.sandbox import SandboxPool

    (tmp_path / "rw_counting.py").write_text(COUNTING_REWARD)
    with SandboxPool(max_workers=2) as pool:
        reward = make_scorer(RewardSpec(fn="rw_counting:score", path=str(tmp_path)), -1.0, pool, timeout_s=0.5)
        assert isinstance(reward, SandboxedReward)
        try:
            first = reward.score_many([("who", "", {}), ("who", "", {})])  # one sample per process
            second = reward.score_many([("who", "", {}), ("who", "", {})])
            assert [v % 1000 for v in first] == [1, 1] and [v % 1000 for v in second] == [2, 2]
            assert [v // 1000 for v in second] == [v // 1000 for v in first]  # the same two processes
            assert first[0] // 1000 != first[1] // 1000
            t0 = time.monotonic()
            assert reward.score_many([("stuck", "", {}), ("who", "", {})])[0] == -1.0
            assert time.monotonic() - t0 < 10 and "no reply within" in reward.last_error
            assert reward.score_many([("stdin", "", {}), ("stdin", "", {})]) == [7.0, 7.0]
            third = reward.score_many([("who", "", {}), ("who", "", {})])
            assert third[0] % 1000 == 2 and third[0] // 1000 != first[0] // 1000  # a new process (its 2nd call)
            assert third[1] % 1000 == 5 and third[1] // 1000 == first[1] // 1000  # the other one lives on
        finally:
            reward.close()
