"""Reward functions: the built-ins, loading a user's ``module:function``, and a safety wrapper.

A reward function has the signature ``RewardFn``: it takes the completion text, the
reference answer and the whole sample record, and returns a float. This module owns

* the built-in rewards ``arith`` (exact match after stripping) and ``math`` (final-answer
  extraction, then ``math_verify``; imported lazily, so plexctl starts without it);
* ``load_reward``, which turns a job spec's ``reward`` section into a ``RewardFn`` and raises
  a one-line ``RewardLoadError`` when a custom function cannot be imported or is not callable;
* ``safe_reward``, which turns a reward that raises or returns a non-finite value into the
  job's ``failure_reward`` and counts how often that happened.

* ``SandboxedReward``, which runs a user's ``module:function`` (never the driver's own
  interpreter) in long-lived contained processes (``SandboxSession``, one per worker of the
  sandbox pool, each running ``plexctl/reward_server.py``, the function imported once), a
  step's samples split over them, each sample under its own time limit, enforced from outside
  the function: a sample that overruns it (its code ignored or caught the alarm) has its process
  killed. The user's directory is staged once (its Python and small data files, copied private
  to the driver's user; each sandbox process of another uid gets its own copy); the driver's
  site-packages are readable too, so the function may import what is installed (math_verify,
  numpy, ...).

Built-in rewards are the project's own code and run in the driver's threads. Importing the
same module name from two different directories in one process is refused.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import site
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from plexctl import reward_server
from plexctl.common.user_code import import_object, one_line

if TYPE_CHECKING:
    from plexctl.sandbox import SandboxSession

RewardFn = Callable[[str, str, dict], float]

BUILTIN_REWARDS = ("arith", "math")
MATH_VERIFY_TIMEOUT_S = 5


class RewardLoadError(Exception):
    """A reward that cannot be loaded; ``str()`` is one line for the user."""


class RewardSource(Protocol):
    """What ``load_reward`` reads: the ``reward`` section of a job spec."""

    @property
    def name(self) -> str | None: ...
    @property
    def fn(self) -> str | None: ...
    @property
    def path(self) -> str | None: ...


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
    except Exception:  # noqa: BLE001 - math_verify raises on unparsable answers: scored 0
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
        except Exception as e:  # noqa: BLE001 - the user's reward may raise anything: that sample's error
            return self._failed(f"{type(e).__name__}: {one_line(e)}")
        if not math.isfinite(value):
            return self._failed(f"non-finite reward {value}")
        return value

    def score_many(self, items: list[tuple[str, str, dict]]) -> list[float]:
        return [self(c, a, r) for c, a, r in items]

    def _failed(self, reason: str) -> float:
        self.errors += 1
        self.last_error = reason
        return self.failure_reward


def safe_reward(fn: RewardFn, failure_reward: float) -> SafeReward:
    return SafeReward(fn, failure_reward)


class Scorer(Protocol):
    """What the algorithms hold: scores many samples at once, never raises, counts failures."""

    errors: int
    last_error: str | None

    def score_many(self, items: list[tuple[str, str, dict]]) -> list[float]: ...


# ---------------------------------------------------------------- user rewards in the sandbox

_STAGE_SUFFIXES = {".py", ".json", ".jsonl", ".txt", ".yaml", ".yml", ".csv", ".tsv"}
_STAGE_MAX_BYTES = 64 * 2**20
_STAGE_SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache"}


def stage_user_dir(path: str) -> Path:
    """A copy of ``path``'s Python and small data files (what the sandbox imports), private to
    this process's user (0700); the sandbox gives each run of another uid a copy of its own."""
    src = Path(path).resolve()
    dst = Path(tempfile.mkdtemp(prefix="plexrl-user-"))  # mkdtemp: 0700
    total = 0
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in _STAGE_SKIP_DIRS)
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(mode=0o700, exist_ok=True)
        for name in sorted(files):
            f = Path(root) / name
            if f.suffix not in _STAGE_SUFFIXES or not f.is_file():
                continue
            total += f.stat().st_size
            if total > _STAGE_MAX_BYTES:
                shutil.rmtree(dst, ignore_errors=True)
                raise RewardLoadError(
                    f"reward path {path} holds more than {_STAGE_MAX_BYTES >> 20} MiB of "
                    "Python and data files; point `path` at the reward's own directory"
                )
            shutil.copyfile(f, dst / rel / name)
            (dst / rel / name).chmod(0o600)
    return dst


@functools.cache
def reward_server_source() -> str:
    """The program each ``SandboxSession`` of a ``SandboxedReward`` runs: ``plexctl/reward_server.py``'s text."""
    return Path(reward_server.__file__).read_text(encoding="utf-8")


def _import_paths() -> list[str]:
    """The driver's installed packages and the project itself, for the sandboxed program."""
    paths = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if os.path.isdir(p)]
    project = str(Path(__file__).resolve().parents[1])
    return [p for p in dict.fromkeys([project, *paths, *[q for q in sys.path if q.endswith("site-packages")]])]


class SandboxedReward:
    """A user's reward function run in sandboxed processes; same counters as ``SafeReward``.

    A step's samples are split over up to ``MAX_PROCESSES`` chunks (at most the pool's workers),
    scored at once, each chunk by its own long-lived ``SandboxSession`` that imported the
    function once (a fresh interpreter and import per chunk and step cost more than cheap
    rewards themselves), one sample per request. A sample gets ``timeout_s``: an alarm inside
    the process ends it then, and if the function defeats the alarm (ignores SIGALRM, catches
    the exception, runs native code that holds on) the driver kills the process
    ``KILL_SLACK_S`` later. A sample whose process died or was killed fails alone, with the
    reason; the chunk's next sample starts a new process.
    """

    MAX_PROCESSES = 8  # each keeps the function's imports resident (math-verify: ~100 MB)
    FIRST_REQUEST_SLACK_S = 20.0  # a new process imports the function first
    KILL_SLACK_S = 1.0  # past its timeout, a sample's process is killed (its own alarm normally answers first)

    def __init__(
        self,
        target: str,
        path: str | None,
        failure_reward: float,
        pool,
        timeout_s: float = 10.0,
        memory_bytes: int = 4 * 2**30,
    ) -> None:
        from plexctl.sandbox import Limits

        self.target = target
        self.failure_reward = failure_reward
        self.pool = pool
        self.timeout_s = timeout_s
        self.errors = 0
        self.last_error: str | None = None
        self._staged = stage_user_dir(path) if path else None
        self.paths = tuple(([str(self._staged)] if self._staged else []) + _import_paths())
        # the alarms bound each sample's time; the CPU limit only stops a process left spinning
        self._limits = Limits(
            cpu_seconds=10**6,
            wall_seconds=0.0,
            memory_bytes=memory_bytes,
            processes=64,
            open_files=256,
            output_bytes=4 * 2**20,
        )
        self._sessions: list = [None] * min(pool.max_workers, self.MAX_PROCESSES)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for i, session in enumerate(self._sessions):
                if session is not None:
                    session.close()
                    self._sessions[i] = None
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None

    def score_many(self, items: list[tuple[str, str, dict]]) -> list[float]:
        """Score ``items`` over the sessions at once; a failed sample gets ``failure_reward``."""
        if not items:
            return []
        with self._lock:
            chunks = min(len(items), len(self._sessions))
            bounds = [round(i * len(items) / chunks) for i in range(chunks + 1)]
            parts = [items[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
            futures = [self.pool.call(self._score_part, i, part) for i, part in enumerate(parts)]
            values: list[float] = []
            for future in futures:
                values.extend(self._collect(future.result()))
            return values

    def _score_part(self, i: int, part: list[tuple[str, str, dict]]) -> list[list]:
        """One chunk on session ``i``, a sample at a time: a ``[value, error]`` row per sample.
        Never raises; a session that cannot start fails the chunk's samples left."""
        from plexctl.sandbox import SessionFailed

        rows: list[list] = []
        for item in part:
            try:
                session = self._session(i)
            except Exception as e:  # noqa: BLE001 - the sandbox machinery failed: this chunk's samples only
                detail = str(e) if isinstance(e, SessionFailed) else f"sandbox error: {type(e).__name__}: {e}"
                return rows + [[None, f"reward process failed: {detail}"] for _ in range(len(part) - len(rows))]
            rows.append(self._score_one(session, item))
        return rows

    def _session(self, i: int) -> SandboxSession:
        """Session ``i``, started and the function imported if it was not (``SessionFailed``
        when its process dies on the way: an import error is told per sample instead)."""
        from plexctl.sandbox import SandboxSession, SessionFailed

        session = self._sessions[i]
        if session is not None and session.proc is not None:
            return session
        session = self._sessions[i] = SandboxSession(
            reward_server_source(), self._limits, self.paths, marker=reward_server.MARKER
        )
        try:
            session.request(
                json.dumps({"target": self.target, "timeout_s": self.timeout_s, "items": []}),
                self.FIRST_REQUEST_SLACK_S,
            )
        except SessionFailed:
            self._sessions[i] = None
            raise
        return session

    def _score_one(self, session: SandboxSession, item: tuple[str, str, dict]) -> list:
        """One sample's ``[value, error]``; its process is killed if it overruns its timeout."""
        from plexctl.sandbox import SessionFailed

        deadline = self.timeout_s + self.KILL_SLACK_S
        line = json.dumps({"target": self.target, "timeout_s": self.timeout_s, "items": [item]})
        try:
            rows = json.loads(session.request(line, deadline))
        except SessionFailed as e:  # the session is closed: the next sample starts another
            if str(e).startswith("no reply within"):
                return [None, f"timed out after {self.timeout_s:g}s: its process was killed ({e})"]
            return [None, f"reward process failed: {e}"]
        except ValueError:
            return [None, "reward process failed: a malformed reply"]
        if not (isinstance(rows, list) and len(rows) == 1 and isinstance(rows[0], list) and len(rows[0]) == 2):
            return [None, "reward process failed: a malformed reply"]
        return rows[0]

    def _collect(self, rows: list[list]) -> list[float]:
        return [self._failed(error) if error is not None else float(value) for value, error in rows]

    def _failed(self, reason: str) -> float:
        self.errors += 1
        self.last_error = reason
        return self.failure_reward


def make_scorer(reward_spec: RewardSource, failure_reward: float, pool=None, timeout_s: float = 10.0) -> Scorer:
    """Built-ins run in the driver; a user's ``fn`` runs in the sandbox ``pool``."""
    if reward_spec.fn and pool is not None:
        return SandboxedReward(reward_spec.fn, reward_spec.path, failure_reward, pool, timeout_s)
    return safe_reward(load_reward(reward_spec), failure_reward)
