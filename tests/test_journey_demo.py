"""`make demo`, README's first command, run as a newcomer runs it: `make` in the checkout, a fresh
HOME, no cluster. Its quick mode (`--steps`) keeps every part of the journey (the tiny model, `up`,
two jobs live, their evaluation reward, `down`) and only shortens the training."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from conftest import REPO

RESULT = re.compile(r"^(j\d+) (\S+)\s+(\S+)\s+reward (\d\.\d{3}) → (\d\.\d{3})\s+\((\d+) steps", re.M)


def test_make_demo_runs_two_jobs_and_reports_their_eval_reward(tmp_path: Path, tiny_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}
    env["HOME"] = str(tmp_path)
    proc = subprocess.run(
        ["make", "demo", "DEMO_ARGS=--steps 3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    results = RESULT.findall(proc.stdout)
    assert [(name, state, steps) for _, name, state, _, _, steps in results] == [
        ("tiny-arith", "succeeded", "3"),
        ("tiny-arith-b", "succeeded", "3"),
    ], proc.stdout[-3000:]
    for *_, first, last, _ in results:
        assert 0.0 < float(first) < 1.0 and 0.0 <= float(last) <= 1.0  # the evaluation ran, at start and end
    # the cluster it started lived in the fresh HOME and is down again
    state = tmp_path / ".plexrl" / "clusters" / "default"
    assert (state / "journal.db").exists()
    status = subprocess.run(
        [str(REPO / ".venv" / "bin" / "plexctl"), "status"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert status.returncode == 3, status.stdout + status.stderr  # no daemon answers
