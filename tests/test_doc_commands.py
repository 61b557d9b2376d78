"""Every `plexctl` command README and docs/ show still exists as shown: its verb and each option it
names are the CLI's (``tests/doc_commands.py``). The journeys run the commands a user types first;
this keeps the rest of the pages from drifting when an option is renamed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from doc_commands import check_command, shell_commands

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)  # each block, opening to closing


def page_commands(text: str) -> list[list[str]]:
    """The page's shell blocks' commands, and the `plexctl` lines of its unlabelled blocks (which also
    hold diagrams and output)."""
    plain = "\n".join(
        f"```bash\n{line}\n```"
        for lang, block in FENCE.findall(text)
        if not lang
        for line in block.replace("\\\n", " ").splitlines()
        if re.match(r"(\$ )?plexctl -*[a-z]", line.lstrip())  # a command, not a diagram's box
    )
    return shell_commands(text) + shell_commands(plain)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_plexctl_command_a_page_shows_exists(page: Path) -> None:
    problems = [f"{page.name}: {p}" for argv in page_commands(page.read_text()) for p in check_command(argv)]
    assert not problems, "\n".join(problems)


def test_the_pages_show_commands_and_a_renamed_option_is_caught() -> None:
    readme = page_commands((REPO / "README.md").read_text())
    assert ["up", "--local"] in readme and any(argv[:1] == ["plan"] for argv in readme)  # both kinds of block
    assert check_command(["submit", "job.yaml", "--no-such-option"]) == [
        "plexctl submit --no-such-option: no such option"
    ]
    assert check_command(["launch"]) == ["plexctl launch: no such command"]


def test_contributings_service_call_example_is_the_code_as_it_is() -> None:
    """CONTRIBUTING shows adding a service call with ``publish``: each class and handler line it
    shows is, line for line, in ``calls.py`` or ``worker/servers.py``, so the example cannot drift."""
    fence = re.compile(r"^[ \t]*```python\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)  # in a list item too
    blocks = fence.findall((REPO / "CONTRIBUTING.md").read_text())
    shown = [block for block in blocks if "class Publish(Method)" in block]
    assert len(shown) == 1, "CONTRIBUTING shows the publish call once"
    sources = (REPO / "plexctl" / "common" / "calls.py").read_text() + (REPO / "worker" / "servers.py").read_text()
    code = [line.strip() for line in shown[0].splitlines() if line.strip() and not line.lstrip().startswith("#")]
    missing = [line for line in code if line not in {s.strip() for s in sources.splitlines()}]
    assert not missing, missing
    assert len(code) > 15
