"""Every `plexctl` command README and docs/ show still exists as shown: its verb and each option it
names are the CLI's (``tests/doc_commands.py``). The journeys run the commands a user types first;
this keeps the rest of the pages from drifting when an option is renamed. And CONTRIBUTING's worked
examples of adding things are the code they copy, line for line, from the files they name."""

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


# The "Adding things" items that must show a worked example, by their bold heading ("A loss" joins
# once the loss registry has one).
EXAMPLES = ("A cluster setting", "A loss", "A job kind", "A placement policy", "A state tier", "A service call")
PYTHON = re.compile(r"^[ \t]*```python\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)  # in a list item too
ITEM = re.compile(r"^- \*\*(.+?)\*\*", re.MULTILINE)  # a list item's bold heading
SOURCE = re.compile(r"#\s*([\w.][\w./-]*\.py)(?=$|[\s:,])")  # `# daemon/policies.py` (a note may follow)
ELIDED = "..."  # a block's line that stands for lines left out


def adding_things() -> dict[str, list[str]]:
    """The python blocks of CONTRIBUTING's "Adding things" section, by the heading of the item they are in."""
    text = (REPO / "CONTRIBUTING.md").read_text()
    section = text.split("\n## Adding things\n", 1)[1].split("\n## ", 1)[0]
    starts = [*ITEM.finditer(section)]
    ends = [m.start() for m in starts[1:]] + [len(section)]
    return {m[1]: PYTHON.findall(section, m.start(), end) for m, end in zip(starts, ends)}


def code_lines(text: str) -> list[str]:
    """The stripped lines that are code: neither blank nor a whole-line comment."""
    return [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]


def runs_of(lines: list[str]) -> list[list[str]]:
    """A chunk's code lines, cut at its ``...`` lines: each run is consecutive in the file."""
    runs: list[list[str]] = [[]]
    for line in lines:
        if line == ELIDED:
            runs.append([])
        elif line and not line.startswith("#"):
            runs[-1].append(line)
    return [run for run in runs if run]


def follow(run: list[str], code: list[str], at: int) -> tuple[int, str | None]:
    """``(end, None)`` where ``run`` is ``code[i:end]`` for the first ``i >= at``; else ``(at, line)``
    with ``line`` the run's first line that does not follow where the run matches furthest."""
    furthest = 0
    for i in range(at, len(code)):
        n = 0
        while n < len(run) and i + n < len(code) and code[i + n] == run[n]:
            n += 1
        if n == len(run):
            return i + n, None
        furthest = max(furthest, n)
    return at, run[furthest]


def block_problems(block: str, root: Path = REPO) -> list[str]:
    """What a worked example shows that is not the code: the block is cut at its ``# path.py`` comment
    lines into chunks, and each chunk's code lines (``...`` leaving lines out) must be that file's, in
    order, consecutive ones consecutive there. One line per chunk: its first line that is not."""
    lines = [line.strip() for line in block.splitlines()]
    if not lines or not SOURCE.match(lines[0]):
        return [f"a block that does not open with the file it shows (`# path/to/file.py`): {lines[:1]}"]
    cuts = [i for i, line in enumerate(lines) if SOURCE.match(line)] + [len(lines)]
    problems = []
    for start, end in zip(cuts, cuts[1:]):
        match = SOURCE.match(lines[start])
        assert match
        path = root / match[1]
        if not path.is_file():
            problems.append(f"{match[1]}: no such file")
            continue
        code, at = code_lines(path.read_text()), 0
        for run in runs_of(lines[start + 1 : end]):
            at, missing = follow(run, code, at)
            if missing is not None:
                problems.append(f"{match[1]}: not the code (or not in this order): {missing}")
                break
    return problems


def test_contributing_shows_an_example_of_each_thing_one_adds() -> None:
    shown = adding_things()
    missing = [heading for heading in EXAMPLES if not shown.get(heading)]
    assert not missing, f'CONTRIBUTING\'s "Adding things" shows no python example for: {missing}'


@pytest.mark.parametrize("heading", [heading for heading, blocks in adding_things().items() if blocks])
def test_every_example_in_adding_things_is_the_code_as_it_is(heading: str) -> None:
    """Each line a worked example shows is in the file it names, in order, so the example cannot drift."""
    problems = [problem for block in adding_things()[heading] for problem in block_problems(block)]
    assert not problems, f"CONTRIBUTING, {heading}:\n" + "\n".join(problems)


def test_an_example_that_drifted_from_the_code_is_caught(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "class Pack:\n    # a comment the example may leave out\n    name = 'pack'\n\n    def order(self):\n"
        "        return sorted(loads)\n\n    def size(self):\n        return 0\n\n\nLIMIT = 3\n"
    )
    shown = "# pkg/mod.py\nclass Pack:\n    name = 'pack'\n\n    def order(self):\n        return sorted(loads)\n"
    assert block_problems(shown, tmp_path) == []
    assert block_problems(shown + "...\nLIMIT = 3\n", tmp_path) == []
    changed = shown.replace("sorted(loads)", "sorted(loads, reverse=True)")
    assert block_problems(changed, tmp_path) == [
        "pkg/mod.py: not the code (or not in this order): return sorted(loads, reverse=True)"
    ]
    skipped = shown + "LIMIT = 3\n"  # lines apart in the file, shown together without `...`
    assert block_problems(skipped, tmp_path) == ["pkg/mod.py: not the code (or not in this order): LIMIT = 3"]
    assert block_problems("...\nLIMIT = 3\n", tmp_path) == [
        "a block that does not open with the file it shows (`# path/to/file.py`): ['...']"
    ]
    assert block_problems("# pkg/gone.py\nLIMIT = 3\n", tmp_path) == ["pkg/gone.py: no such file"]
    reordered = "# pkg/mod.py\nLIMIT = 3\n...\nclass Pack:\n"
    assert block_problems(reordered, tmp_path) == ["pkg/mod.py: not the code (or not in this order): class Pack:"]
