"""The `plexctl` command lines a Markdown page shows in its fenced shell blocks, and what in each
the CLI no longer has (a verb, an option): a renamed option then fails a test, not a reader.

``shell_commands`` reads the blocks as a shell would split them (comments dropped, ``\\``
continuations joined, ``&&`` / ``|`` / ``;`` / ``$( )`` separating commands); ``check_command``
checks one line against the registered app (``plexctl.cli.app``). Deliberately not checked:
arguments (placeholders such as ``STATE_DIR``), option values, and whether an option fits its
verb's other options.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

SHELL_FENCE = re.compile(r"^```(?:bash|sh|shell)[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SEPARATORS = set("();<>|&")  # a token made of these ends one command and starts the next


def shell_commands(markdown_text: str) -> list[list[str]]:
    """Each ``plexctl`` command line of the page's shell blocks, as its argv after ``plexctl``."""
    commands: list[list[str]] = []
    for block in SHELL_FENCE.findall(markdown_text):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            command: list[str] = []
            for token in [*lexer, ";"]:
                if set(token) <= SEPARATORS:
                    if command:
                        commands.append(command)
                    command = []
                elif command or token == "plexctl":
                    command.append(token)  # before `plexctl`: variable assignments, `env`, `sudo -u`
    return [argv[1:] for argv in commands]


def _options(command: Any) -> dict[str, bool]:
    """Each option name of a click command -> whether it takes a value (a flag does not)."""
    names = {"--help": False}
    for param in command.params:
        if param.param_type_name == "option":
            for name in [*param.opts, *param.secondary_opts]:
                names[name] = not param.is_flag and not param.count
    return names


def check_command(argv: list[str]) -> list[str]:
    """What in ``plexctl ARGV`` the CLI does not have: an unknown global option, verb or option of
    its verb (one line each; empty when all are there)."""
    from typer.main import get_command

    from plexctl.cli.app import app

    group = get_command(app)
    problems: list[str] = []
    i = 0
    takes_value = _options(group)
    while i < len(argv) and argv[i].startswith("-"):  # the global options, before the verb
        name = argv[i].split("=", 1)[0]
        if name not in takes_value:
            problems.append(f"plexctl {name}: no such global option")
        i += 2 if takes_value.get(name) and "=" not in argv[i] else 1
    if i == len(argv):
        return problems
    verb = argv[i]
    command = group.commands.get(verb)  # type: ignore[attr-defined]
    if command is None:
        return [*problems, f"plexctl {verb}: no such command"]
    takes_value = _options(command)
    passes_unknown = command.context_settings.get("ignore_unknown_options", False)
    rest = iter(argv[i + 1 :])
    for arg in rest:
        if not arg.startswith("-") or arg == "-":
            continue
        name = arg.split("=", 1)[0]
        if name not in takes_value:
            if not passes_unknown:
                problems.append(f"plexctl {verb} {name}: no such option")
        elif takes_value[name] and "=" not in arg:
            next(rest, None)  # its value, which may start with '-'
    return problems
