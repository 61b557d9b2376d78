"""README's "Using it" block, run as a newcomer types it: each line in its own shell, the venv
activated by the line that activates it, a fresh HOME, from a folder that has the checkout's
`configs/`, `.plexrl/` and `.venv/` where README assumes them. What each line prints is checked for
what a user would look for; a README line this test does not know fails it, so the block and the
test change together."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO


def using_it_lines() -> list[str]:
    """The shell lines of README's "Using it" block, comments stripped."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"^## Using it\n\n```bash\n(.*?)^```", text, re.M | re.S)
    assert block, "README has no fenced bash block under '## Using it'"
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    """A working folder laid out as the checkout (links to it) and a fresh HOME."""
    work = tmp_path_factory.mktemp("checkout")
    for name in ("configs", ".plexrl", ".venv"):
        (work / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLEXRL_", "VIRTUAL_ENV"))}
    env["HOME"] = str(tmp_path_factory.mktemp("home"))
    yield work, env
    subprocess.run(["bash", "-c", ". .venv/bin/activate && plexctl down"], cwd=work, env=env, capture_output=True)


def shell(work: Path, env: dict[str, str], line: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f". .venv/bin/activate && {line}"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _as_in_a_terminal() -> None:
    """Ctrl-C's default meaning, as a terminal's shell gives it: a suite started in the background
    (``cmd &`` without job control) hands its children SIGINT ignored, and an ignored SIGINT
    stays ignored across exec (Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def watch_until_interrupted(work: Path, env: dict[str, str], line: str, expect: str) -> str:
    """A live view: runs until Ctrl-C (SIGINT to its process group), once it has shown ``expect``."""
    proc = subprocess.Popen(
        ["bash", "-c", f". .venv/bin/activate && exec {line}"],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_as_in_a_terminal,
    )
    seen = ""
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while expect not in seen and time.monotonic() < deadline:
        seen += proc.stdout.readline()
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    seen += rest
    assert expect in seen, seen[-2000:]
    assert "Traceback" not in seen, seen[-2000:]
    assert proc.returncode != 0 or seen  # interrupted, as a user ends it
    return seen


def test_using_it_block_runs_line_by_line(newcomer) -> None:
    work, env = newcomer
    lines = using_it_lines()
    assert lines[0] == ". .venv/bin/activate"
    ids: dict[str, str] = {}
    for line in lines[1:]:
        verb = line.split()[1] if line.startswith("plexctl ") else line
        if line == "plexctl status --watch":
            watch_until_interrupted(work, env, line, "mine")
            continue
        proc = shell(work, env, line)
        out = proc.stdout + proc.stderr
        assert "Traceback" not in out, f"{line}\n{out[-3000:]}"
        expected_rc = 5 if line == "plexctl wait other" else 0  # README: 5, cancelled
        assert proc.returncode == expected_rc, f"{line} -> {proc.returncode}\n{out[-3000:]}"
        if line.startswith("python -m plexctl.tiny_models"):
            assert (work / ".plexrl" / "models" / "tiny-arith" / "config.json").exists()
        elif verb == "up":
            assert "cluster up" in proc.stdout
        elif verb == "submit":
            name = line.split("--name ")[1].split()[0]
            found = re.search(r"\bj\d{4}\b", out)
            assert found, out
            ids[name] = found.group(0)
        elif line == "plexctl status":
            assert "mine" in proc.stdout and "other" in proc.stdout
        elif verb == "top":
            assert "mine" in proc.stdout and "other" in proc.stdout
        elif line == "plexctl logs mine -f":  # followed until the job ended: it has
            job = json.loads(shell(work, env, "plexctl status mine --json").stdout)["jobs"][0]
            assert job["state"] == "succeeded" and job["step"] == 20, job
            assert proc.stdout.strip(), "the driver log is empty"
        elif line == "plexctl logs mine --metrics":
            rows = [json.loads(r) for r in proc.stdout.splitlines() if r.strip()]
            assert rows and max(r.get("step", 0) for r in rows) == 20
        elif verb == "report":
            stem = f"{ids['mine']}-vs-{ids['other']}"  # README: JOB-vs-OTHER-reward.png
            for plot in (f"{stem}-reward.png", f"{stem}-loss.png"):
                assert (work / "plots" / plot).stat().st_size > 1000, (plot, out)
        elif verb == "ls":
            assert proc.stdout.split() == sorted(ids.values())
        elif line == "plexctl export mine --to exported/":
            files = {p.name for p in (work / "exported").rglob("*") if p.is_file()}
            assert "adapter_model.safetensors" in files, files
        elif line == "plexctl export mine --checkpoint --to exported/":
            assert any("ckpt" in p.name or "step" in p.name for p in (work / "exported").iterdir())
        elif verb == "cancel":
            assert ids["other"] in out or "other" in out
        elif verb == "wait":
            pass  # its exit code, checked above
        elif verb == "down":
            assert shell(work, env, "plexctl status").returncode == 3  # no daemon answers
        else:
            raise AssertionError(f"README's 'Using it' has a line this test does not check: {line}")
