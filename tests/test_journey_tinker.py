"""docs/tinker.md's quick start, run as a newcomer runs it: a fresh HOME, `plexctl up` as the doc
writes it (on a free port instead of 8000), then the doc's Python block verbatim in a process of its
own with the network absent (the hub offline, no proxy), reading the key where the doc says;
what it prints is checked; then `plexctl down`. The doc and this test change together."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytest.importorskip("tinker")

DOC = REPO / "docs" / "tinker.md"


def quick_start() -> tuple[str, str]:
    """The doc's first bash line (comments stripped) and its first Python block."""
    text = DOC.read_text()
    bash = re.search(r"```bash\n(.*?)```", text, re.S)
    python = re.search(r"```python\n(.*?)```", text, re.S)
    assert bash and python, "docs/tinker.md has no bash and python blocks"
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in bash.group(1).splitlines()]
    return next(line for line in lines if line), python.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_docs_quick_start_runs_as_written(tmp_path: Path, tiny_model: Path) -> None:
    command, snippet = quick_start()
    assert command.startswith("plexctl up --local") and "--tinker-port 8000" in command, command
    assert 'base_url="http://127.0.0.1:8000"' in snippet
    port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLEXRL_", "TINKER_", "HF_"))}
    env |= {"HOME": str(home), "PLEXRL_HOME": str(home / ".plexrl"), "TINKER_TELEMETRY": "0"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `plexctl` of this venv
    up = subprocess.run(
        command.replace("8000", str(port)), shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        key_file = home / ".plexrl" / "tinker-api-key"
        printed = up.stdout.replace("\n", "")  # rich wraps long lines at the terminal's width
        assert f"Tinker API: base_url=http://127.0.0.1:{port}, api_key in {key_file}" in printed, up.stdout
        offline = {k: v for k, v in env.items() if "proxy" not in k.lower()} | {"HF_HUB_OFFLINE": "1"}
        script = tmp_path / "quick_start.py"
        script.write_text(snippet.replace("8000", str(port)))
        run = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=offline, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stdout + run.stderr
        losses = [float(x) for x in re.findall(r"^step \d: loss (\S+)$", run.stdout, re.M)]
        assert len(losses) == 3 and losses[-1] < losses[0], run.stdout
        samples = re.findall(r"^sample: '.*' (\d) log-probs$", run.stdout, re.M)
        assert len(samples) == 4 and all(1 <= int(n) <= 4 for n in samples), run.stdout
        assert "Traceback" not in run.stderr, run.stderr
    finally:
        down = subprocess.run(["plexctl", "down"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
