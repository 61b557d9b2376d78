"""``bench/cli_startup.py`` still runs, in ``--quick`` mode, and writes its JSON. Benchmarks are
programs, not tests: nothing here asserts on a time, only that every row is there and sane."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cli_startup_quick_times_every_command_beside_python(tmp_path: Path) -> None:
    out = tmp_path / "cli_startup.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cli_startup.py"), "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["command"]: r for r in result["rows"]}
    assert result["quick"] is True and result["reps"] == 3
    assert {"python -c pass", "import plexctl.cli", "plexctl --help", "plexctl status (no cluster)"} <= set(rows)
    assert "plexctl validate configs/tiny-arith.yaml" in rows
    for row in rows.values():
        assert len(row["seconds"]) == 3 and 0 < row["min_s"] <= row["median_s"], row
    assert rows["plexctl --help"]["exit_code"] == 0
    assert rows["plexctl status (no cluster)"]["exit_code"] == 4  # no cluster: one line, exit 4
