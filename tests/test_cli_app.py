"""The CLI registers only the verb a command line names: it must parse exactly as the full app does."""

from __future__ import annotations

import pytest
import typer.main

from plexctl.cli import app as A


@pytest.mark.parametrize(
    ("argv", "verb"),
    [
        (["status"], "status"),
        (["status", "j1", "--json"], "status"),
        (["--cluster", "lab", "logs", "j1"], "logs"),
        (["-c", "lab", "--state-dir", "/tmp/x", "submit", "a.yaml"], "submit"),
        (["--cluster=lab", "wait", "j1"], "wait"),
        (["--help"], None),
        ([], None),
        (["stauts"], None),  # a typo goes to the full app, which suggests the verb
        (["--cluster", "status", "ls"], "ls"),  # a cluster named like a verb is the option's value
        (["-c", "lab", "tinker-proxy", "--port", "8001"], "tinker-proxy"),
    ],
)
def test_the_verb_of_a_command_line(argv: list[str], verb: str | None) -> None:
    assert A.verb_of(argv) == verb


def _params(group: typer.Typer, name: str) -> list[tuple[str, tuple[str, ...], object, bool]]:
    cmd = typer.main.get_command(group).commands[name]  # type: ignore[attr-defined]
    return [(p.name, tuple(p.opts), p.default, p.required) for p in cmd.params]


@pytest.mark.parametrize("verb", list(A.VERBS))
def test_a_verb_alone_parses_as_in_the_full_app(verb: str) -> None:
    assert _params(A.build([verb]), verb) == _params(A.app, verb)
    alone = typer.main.get_command(A.build([verb]))
    assert list(alone.commands) == [verb]  # type: ignore[attr-defined]
    assert [p.name for p in alone.params] == [p.name for p in typer.main.get_command(A.app).params]


def test_the_full_app_lists_every_verb_in_order() -> None:
    assert list(typer.main.get_command(A.app).commands) == list(A.VERBS)  # type: ignore[attr-defined]
