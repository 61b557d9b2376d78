"""Typed errors a user can cause or meet, each with its own exit code.

The CLI's top-level handler turns a ``PlexError`` into one line on stderr and
``sys.exit(err.exit_code)``; tracebacks appear only with ``PLEXRL_DEBUG=1``.
"""

from __future__ import annotations


class ExitCode:
    OK = 0
    JOB_FAILED = 1  # `wait`: the job failed
    USAGE = 2  # bad arguments or bad job spec: nothing was queued
    UNREACHABLE = 3  # no daemon answers at the cluster's endpoint
    NOT_FOUND = 4  # no such job or cluster
    JOB_CANCELLED = 5  # `wait`: the job was cancelled
    TIMEOUT = 6  # `wait --timeout` ran out, or `up` did not become ready
    REFUSED = 7  # the daemon refused the request (e.g. no engine for this model)
    INTERRUPTED = 8  # `wait`: the job was interrupted (cluster went down)
    UNTRUSTED = 9  # the job runs code in the trainer and its user is not trusted (`up --trust-user-code`)
    KEY_REFUSED = 10  # the daemon refused this client's key (`plexctl share` grants one)
    START_FAILED = 11  # `up`: an engine could not start (a bad option for the node, a bad model); stopped


class PlexError(Exception):
    exit_code = ExitCode.USAGE


class UsageError(PlexError):
    exit_code = ExitCode.USAGE


class DaemonUnreachable(PlexError):
    exit_code = ExitCode.UNREACHABLE


class KeyRefused(DaemonUnreachable):
    """The daemon answered the connection but refused this client's CURVE key."""

    exit_code = ExitCode.KEY_REFUSED


class StartFailed(PlexError):
    """``up``: a worker could not start its engines; the cluster was stopped again."""

    exit_code = ExitCode.START_FAILED


class NotFound(PlexError):
    exit_code = ExitCode.NOT_FOUND


class Refused(PlexError):
    exit_code = ExitCode.REFUSED


class Timeout(PlexError):
    exit_code = ExitCode.TIMEOUT


class RemoteError(PlexError):
    """An error returned by the daemon as ``{code, message}``."""

    CODES = {
        "not_found": ExitCode.NOT_FOUND,
        "refused": ExitCode.REFUSED,
        "bad_request": ExitCode.USAGE,
        "untrusted": ExitCode.UNTRUSTED,
        "forbidden": ExitCode.REFUSED,
    }

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.exit_code = self.CODES.get(code, ExitCode.REFUSED)
