"""``pip install plexrl`` works away from the checkout: the wheel, installed into a fresh venv
and run from an empty directory, has the CLI, the packaged example specs and the simulator.

The venv reuses this environment's installed dependencies through a ``.pth`` line (nothing is
downloaded); the checkout is not on its ``sys.path`` (the editable install's hook is a ``.pth``
file of this environment's own, which a path added that way does not run)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PLEXRL_CLUSTER")}
    env["PLEXRL_HOME"] = str(cwd / "home")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_the_wheel_runs_help_validate_and_simulate_away_from_the_checkout(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ behind, whose stale files leak into wheels
    for part in ("plexctl", "daemon", "worker", "configs"):
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, src / part)
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)], src)
    wheel = next(dist.glob("plexrl-*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    py = venv / "bin" / "python"
    purelib = Path(
        run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).stdout.strip()
    )
    deps = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (purelib / "plexrl-test-deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        tmp_path,
    )

    work = tmp_path / "work"
    work.mkdir()
    where = run(
        [str(py), "-c", "import plexctl, daemon, worker; print(plexctl.__file__, daemon.__file__)"], work
    ).stdout
    assert str(REPO) not in where and str(venv) in where, where
    plexctl = str(venv / "bin" / "plexctl")
    assert "simulate" in run([plexctl, "--help"], work).stdout
    examples = Path(where.split()[0]).parent / "examples"
    for spec in ("tiny-arith.yaml", "qwen2.5-7b-math.yaml"):
        assert "ok" in run([plexctl, "validate", "--schema-only", str(examples / spec)], work).stdout
    run([plexctl, "simulate", "--quick", "--workers", "1"], work, timeout=600)
    result = json.loads((work / "simulate.json").read_text())
    assert result["trace"]["jobs"] == 50 and result["calibration"] is None
