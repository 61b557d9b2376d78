"""Several LoRA jobs' train steps in shared passes on a real local cluster.

One module cluster with train grouping on (`--train-grouping`; a 200 ms window so that the steps of jobs
whose rollouts end a little apart still meet): four small jobs of the tiny model all succeed,
each step of each job trained, and the trainer's status shows passes of more than one job.
Equality of what a job learns in a pass with what it learns alone is ``test_trainer_grouped``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Cluster

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny-arith.yaml")
JOBS, STEPS = 4, 6


@pytest.fixture(scope="module")
def grouping(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("plexrl-passes")).up(tiny_model, "--train-grouping", "--group-window-ms", "200")
    yield c
    c.run("down", timeout=120)


def test_four_jobs_train_in_shared_passes_and_all_succeed(grouping: Cluster):
    ids = [
        grouping.run(
            "submit",
            TINY,
            "--set",
            f"seed={20 + i}",
            "--set",
            f"algo.steps={STEPS}",
            "--set",
            "checkpoint.every=50",
            "--name",
            f"pass-{i}",
            "-q",
            check=True,
        ).stdout.strip()
        for i in range(JOBS)
    ]
    waited = grouping.run("wait", *ids, "--timeout", "900", timeout=1000)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    groups = []
    for job in ids:
        info = grouping.job(job)
        assert info["state"] == "succeeded" and info["step"] == STEPS, info
        out = grouping.run("logs", job, "--metrics", check=True).stdout
        rows = [json.loads(line) for line in out.splitlines()]
        groups += [m["train/group"] for m in rows if "train/group" in m]
    assert groups and max(groups) > 1, groups  # steps reported the pass they shared
    trainer = next(e for e in grouping.status()["engines"] if e["kind"] == "trainer")
    assert trainer["shared_passes"] >= 1 and trainer["largest_pass"] > 1, trainer
    text = grouping.run("status", check=True).stdout
    assert "shared passes" in text.lower(), text
