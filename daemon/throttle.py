"""Senders of bad messages, counted and throttled, so that a flood of them cannot starve the loop.

A message that does not decode, or whose handling raised, counts against its sender: its ZeroMQ
identity and its user name, each on its own (a user who opens many connections is still one
user, and one connection is one peer whatever user it is). A sender with ``limit`` bad messages
within ``window_s`` is throttled for ``penalty_s``: the server answers its messages with a
``throttled`` error and does not handle them. The cluster's own processes (drivers, workers, node
tasks: the internal key) are never throttled: a bad message from one of them is a bug to log,
and silencing it would stall every job it serves.

Plain code with an injected clock; the server (``daemon.main``) asks it before each message and
tells it of each bad one. A sender's record goes once its window and its penalty are over, so
the table holds recent offenders only.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

from plexctl.common import auth

BAD_MESSAGES = 20  # bad messages within BAD_WINDOW_S that throttle their sender
BAD_WINDOW_S = 10.0
THROTTLE_S = 10.0  # how long a throttled sender's messages go unhandled


class SenderThrottle:
    """Bad messages per sender (identity, user) over a sliding window; see the module docstring."""

    def __init__(
        self,
        limit: int = BAD_MESSAGES,
        window_s: float = BAD_WINDOW_S,
        penalty_s: float = THROTTLE_S,
        clock: Callable[[], float] = time.monotonic,
        exempt_users: Iterable[str] = (auth.INTERNAL_USER,),
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.penalty_s = penalty_s
        self.clock = clock
        self.exempt_users = frozenset(exempt_users)
        self._bad: dict[bytes | str, collections.deque[float]] = {}  # sender -> times of its latest bad messages
        self._until: dict[bytes | str, float] = {}  # throttled sender -> when it may be heard again
        self._swept_at = clock()

    def wait_s(self, identity: bytes, user: str) -> float:
        """Seconds before this sender's messages are handled again (0: now)."""
        if not self._until:  # the common case: nobody is throttled
            return 0.0
        now, wait = self.clock(), 0.0
        for sender in self._senders(identity, user):
            until = self._until.get(sender)
            if until is not None and until <= now:
                del self._until[sender]  # its penalty is over
            elif until is not None:
                wait = max(wait, until - now)
        return wait

    def count_bad(self, identity: bytes, user: str) -> bool:
        """Count one bad message of this sender; True when it throttled the identity or the user
        (it was the one too many), False otherwise."""
        now = self.clock()
        if now - self._swept_at > self.window_s + self.penalty_s:
            self._sweep(now)
        throttled = False
        for sender in self._senders(identity, user):
            times = self._bad.setdefault(sender, collections.deque(maxlen=self.limit))
            times.append(now)
            if len(times) == self.limit and now - times[0] <= self.window_s and now >= self._until.get(sender, 0.0):
                self._until[sender] = now + self.penalty_s
                times.clear()
                throttled = True
        return throttled

    def tracked(self) -> int:
        """Senders it holds a record of now (bad messages lately, or a penalty)."""
        return len(self._bad.keys() | self._until.keys())

    def _senders(self, identity: bytes, user: str) -> tuple[bytes | str, ...]:
        if user in self.exempt_users:
            return ()
        return (identity, user) if user else (identity,)  # bytes and str: an identity never names a user

    def _sweep(self, now: float) -> None:
        """Forget senders whose last bad message is out of the window and whose penalty is over."""
        self._swept_at = now
        self._until = {s: t for s, t in self._until.items() if t > now}
        self._bad = {s: q for s, q in self._bad.items() if (q and now - q[-1] <= self.window_s) or s in self._until}
