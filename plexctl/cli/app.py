"""The ``plexctl`` app: every verb registered in the order ``--help`` lists them, the global
options, and ``main``, which turns known errors into one line on stderr and a distinct exit code
(``plexctl.common.errors.ExitCode``; a traceback only with ``PLEXRL_DEBUG=1``).

Listing verbs take ``--json``; ``ls -q`` prints bare ids for piping. Help is click's plain text
(``rich_markup_mode=None``): typer's rich help alone takes ~0.15 s to import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from plexctl.cli import demo, jobs, keys, specs, start_stop, tinker
from plexctl.cli.context import Ctx
from plexctl.common.errors import ExitCode, PlexError


def _typer() -> typer.Typer:
    return typer.Typer(
        add_completion=True,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        help="Run many RLVR fine-tuning jobs on shared, resident engines.",
    )


def _global(
    ctx: typer.Context,
    cluster: Annotated[Optional[str], typer.Option("--cluster", "-c", help="cluster name")] = None,
    state_dir: Annotated[
        Optional[Path],
        typer.Option(
            readable=False,  # another user's is 0711: only its endpoint.json is read, by name
            help="cluster state directory (another user's: only its endpoint.json need be readable)",
        ),
    ] = None,
) -> None:
    ctx.obj = Ctx(cluster, state_dir)


VERBS = {
    verb.__name__.replace("_", "-"): verb  # as typer names the command
    for verb in (
        start_stop.up,
        start_stop.down,
        keys.keygen,
        keys.share,
        specs.validate,
        specs.plan,
        specs.submit,
        jobs.status,
        jobs.top,
        jobs.report,
        jobs.ls,
        jobs.logs,
        jobs.export,
        jobs.cancel,
        jobs.wait,
        demo.demo,
        demo.simulate,
        tinker.tinker_proxy,
    )
}
_GLOBAL_VALUED = {"--cluster", "-c", "--state-dir"}


def build(verbs: list[str] | None = None) -> typer.Typer:
    """The app with the given verbs (all, in ``--help`` order, by default): click builds every
    registered verb's parameters on each run, ~3 ms a verb, so a run registers only its own."""
    app = _typer()
    app.callback()(_global)
    for name in verbs or list(VERBS):
        extra = {"allow_extra_args": True, "ignore_unknown_options": True} if name == "simulate" else {}
        app.command(context_settings=extra or None)(VERBS[name])
    return app


def verb_of(argv: list[str]) -> str | None:
    """The verb a command line names, if it names one this app has (after the global options)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _GLOBAL_VALUED:
            i += 2
        elif arg.startswith("-"):
            i += 1
        else:
            return arg if arg in VERBS else None
    return None


app = build()


# typer (0.27 and later) parses with a copy of click of its own, whose errors are TyperExceptions
_EXITS = (typer.Exit,)
_USAGE_ERRORS = (typer.TyperException,)
_ABORTS = (typer.Abort, KeyboardInterrupt)


def main() -> None:
    try:
        verb = None if os.environ.get("_PLEXCTL_COMPLETE") else verb_of(sys.argv[1:])
        rv = (build([verb]) if verb else app)(standalone_mode=False)
    except PlexError as exc:
        if os.environ.get("PLEXRL_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except _EXITS as exc:
        sys.exit(exc.exit_code)
    except _USAGE_ERRORS as exc:
        show = getattr(exc, "show", None)
        show() if show else print(f"error: {exc}", file=sys.stderr)
        sys.exit(ExitCode.USAGE)
    except _ABORTS:
        sys.exit(130)
    except OSError as exc:  # a path the user gave that is not what it should be
        if os.environ.get("PLEXRL_DEBUG"):
            raise
        where = f": {exc.filename}" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        sys.exit(ExitCode.USAGE)
    sys.exit(rv if isinstance(rv, int) else 0)
