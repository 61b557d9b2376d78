"""Several LoRA jobs' train steps in shared passes on a real local cluster.

One module cluster with train grouping on (`--train-grouping`; a 200 ms window so that the steps of jobs
whose rollouts end a little apart still meet): four small jobs of the tiny model all succeed,
each step of each job trained, and the trainer's status shows passes of more than one job; 32
small jobs submitted together all run at the same moment on its one engine pair.
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


MANY = 32


def test_thirty_two_jobs_run_at_once_on_one_engine_pair(grouping: Cluster, monkeypatch: pytest.MonkeyPatch):
    """Capacity follows the engines' declared room (a CPU rollout engine caches 64 adapters, the
    trainer's tiers hold far more than 32 tiny states): 32 small jobs submitted together are all
    running at the same moment on the one rollout engine and the one trainer, and all succeed."""
    import uuid

    from plexctl.common.client import Client
    from plexctl.common.cluster import read_endpoint
    from plexctl.common.spec import spec_to_wire
    from plexctl.spec_files import load_spec

    monkeypatch.setenv("PLEXRL_HOME", str(grouping.home))  # the owner's keys
    sets = ["algo.steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "checkpoint.every=0", "data.eval_path=null"]
    client = Client(read_endpoint(grouping.state_dir).address, timeout=30.0)
    ids = [
        client.submit(spec_to_wire(load_spec(TINY, [*sets, f"seed={i}"], f"many-{i}")), uuid.uuid4().hex).job_id
        for i in range(MANY)
    ]
    waited = grouping.run("wait", *ids, "--timeout", "900", timeout=1000)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    shown = grouping.status()
    jobs = [j for j in shown["jobs"] if j["job_id"] in ids]
    assert len(jobs) == MANY and all(j["state"] == "succeeded" and j["step"] == 2 for j in jobs), jobs
    last_start, first_end = max(j["started_at"] for j in jobs), min(j["ended_at"] for j in jobs)
    assert last_start < first_end, "some job started only after another had ended: they did not all run at once"
    assert sorted(e["kind"] for e in shown["engines"]) == ["rollout", "trainer"]  # one engine pair
