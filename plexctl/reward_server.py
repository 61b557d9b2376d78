"""The sandboxed program that scores a user's reward function, for as long as its session.

``plexctl.rewards.SandboxedReward`` sends this file's text to a ``SandboxSession`` (it runs as
the sandbox's ``main.py``; it is never imported there). Each line on stdin is a request
{"target", "timeout_s", "items"}, answered by one line on stdout, ``MARKER`` then a JSON list of
[value, error] per item (no items: import the function, answer []). Each item has its own alarm,
so one hanging sample fails alone and the process goes on; the driver sends one item per request
and kills the process of one that does not answer in time (``SandboxedReward.KILL_SLACK_S``). The
function itself reads an empty stdin and prints to stderr: the protocol's pipes are not its.

Standard library only (``typing`` neither, at run time): it runs before the user's function is
imported, whatever the sandbox's import paths hold.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import sys
import time

TYPE_CHECKING = False  # typing is not imported at run time
if TYPE_CHECKING:
    from types import FrameType
    from typing import Any

MARKER = "PLEXRL-REWARDS "  # starts each reply line (other output on stdout is dropped)


class _Timeout(BaseException):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _Timeout()


def load(target: str, loaded: dict[str, tuple[Any, str | None]]) -> tuple[Any, str | None]:
    """``module:function`` imported (once per target, kept in ``loaded``), or None and why not."""
    if target not in loaded:
        module_name, _, attr_path = target.partition(":")
        try:
            fn: Any = importlib.import_module(module_name)
            for part in attr_path.split("."):
                fn = getattr(fn, part)
            loaded[target] = (fn, None)
        except BaseException as e:  # noqa: BLE001 - the user's module may raise anything: told per sample
            text = str(e).strip()
            first = text.splitlines()[0] if text else ""
            loaded[target] = (None, "cannot import %s: %s: %s" % (target, type(e).__name__, first))
    return loaded[target]


def score(fn: Any, load_error: str | None, items: list[list[Any]], timeout_s: float) -> list[list[Any]]:
    """``[value, error]`` per ``[completion, answer, record]`` item, each under its own alarm."""
    out: list[list[Any]] = []
    for completion, answer, record in items:
        if load_error:
            out.append([None, load_error])
            continue
        started = time.monotonic()
        signal.signal(signal.SIGALRM, _alarm)  # again: an earlier sample may have replaced it
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            value = float(fn(completion, answer, record))
            if time.monotonic() - started > timeout_s:  # its own alarm (math_verify's) cleared ours
                raise _Timeout()
            out.append([value, None] if math.isfinite(value) else [None, "non-finite reward %r" % value])
        except _Timeout:
            out.append([None, "timed out after %gs" % timeout_s])
        except BaseException as e:  # noqa: BLE001 - the user's function may raise anything: that sample's error
            text = str(e).strip()
            out.append([None, "%s: %s" % (type(e).__name__, text.splitlines()[0] if text else "")])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return out


def serve() -> None:
    """Answer requests until stdin closes; the function's own stdin is empty, its stdout stderr."""
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    empty, closed = os.pipe()
    os.close(closed)
    os.dup2(empty, 0)
    os.dup2(2, 1)
    signal.signal(signal.SIGALRM, _alarm)
    loaded: dict[str, tuple[Any, str | None]] = {}
    while True:
        line = requests.readline()
        if not line:
            break
        job = json.loads(line)
        fn, load_error = load(job["target"], loaded)
        out = score(fn, load_error, job["items"], job["timeout_s"])
        sys.stdout.flush()
        replies.write(MARKER + json.dumps(out) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
