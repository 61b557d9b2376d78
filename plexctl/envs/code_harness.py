"""The sandboxed program of the ``code`` environment: the model's program, then each test.

``plexctl.envs.code.harness`` sends this file's text to ``run_python`` (it runs as the sandbox's
``main.py``; it is never imported there) with one line appended that calls ``run_tests`` on the
model's program and the sample's tests. The nonce comes on stdin; the report, ``<nonce> <passed>
<total>``, goes to the real stdout, the program's own prints to a buffer, and each failure's
one-line reason to stderr. The program runs in a fresh namespace, each test in a copy of it,
each under its own SIGALRM of ``test_seconds``.

Standard library only (``typing`` neither, at run time): the sandbox gives the program no packages.
"""

from __future__ import annotations

import io
import os
import signal
import sys

TYPE_CHECKING = False  # typing is not imported at run time
if TYPE_CHECKING:
    from types import FrameType
    from typing import Any


def run_tests(program: str, tests: list[str], test_seconds: float) -> None:
    """Run ``program``, then each of ``tests`` against it; write the report line."""
    nonce = sys.stdin.readline().strip()
    report = os.fdopen(os.dup(1), "w")
    sys.stdout = io.StringIO()  # the program's prints stay out of the report

    def too_slow(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError("took longer than %ss" % test_seconds)

    signal.signal(signal.SIGALRM, too_slow)

    def run(source: str, name: str, namespace: dict[str, Any]) -> str | None:
        signal.setitimer(signal.ITIMER_REAL, test_seconds)
        try:
            exec(compile(source, name, "exec"), namespace)
            return None
        except BaseException as e:  # noqa: BLE001 - whatever the model's code raises fails that test
            return "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    namespace: dict[str, Any] = {"__name__": "__main__"}
    failure = run(program, "solution.py", namespace)
    passed = 0
    if failure is not None:
        print("solution: " + failure, file=sys.stderr)
    else:
        for i, test in enumerate(tests):
            failure = run(test, "test_%d.py" % i, dict(namespace))
            if failure is None:
                passed += 1
            else:
                print("test %d: %s" % (i, failure), file=sys.stderr)
    report.write("%s %d %d\n" % (nonce, passed, len(tests)))
    report.flush()
