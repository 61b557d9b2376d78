"""The Slurm batch script and the allocation options, as pure functions (no Slurm needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plexctl import slurm as S
from plexctl.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"


def two_node_spec(**changes) -> S.SlurmSpec:
    fields = dict(name="research", state_dir="/shared/alice/.plexrl/clusters/research",
                  model="/shared/models/qwen2.5-7b", nodes=2, gpus_per_node=8, time="2-00:00:00",
                  partition="gpu", account="rl-lab", qos="high", exclusive=True, constraint="h100",
                  signal_grace=300, engines=["rollout,trainer"], scratch=None,
                  worker_args=["--max-loras=8"], python="/shared/alice/venv/bin/python")
    fields.update(changes)
    return S.SlurmSpec(**fields)


def test_the_batch_script_matches_its_golden_file() -> None:
    assert S.render_sbatch(two_node_spec()) == (GOLDEN / "sbatch-two-nodes.sh").read_text()


def test_a_joining_allocation_runs_workers_only() -> None:
    text = S.render_sbatch(two_node_spec(join=True, nodes=3))
    assert "#SBATCH --job-name=plexrl-research-join" in text and "#SBATCH --nodes=3" in text
    assert text.rstrip().endswith("--join --worker-arg=--max-loras=8")


def test_trusted_users_reach_the_daemon() -> None:
    text = S.render_sbatch(two_node_spec(trusted_users=["alice", "bob"]))
    assert "--trust-user-code=alice --trust-user-code=bob" in text


def test_the_metrics_port_reaches_the_daemon_of_the_first_allocation_only() -> None:
    assert "--metrics-port 9400" in S.render_sbatch(two_node_spec(metrics_port=9400))
    assert "--metrics-port" not in S.render_sbatch(two_node_spec(metrics_port=9400, join=True))


def test_paths_with_spaces_are_quoted_for_the_shell() -> None:
    text = S.render_sbatch(two_node_spec(state_dir="/shared/my cluster"))
    assert "--state-dir '/shared/my cluster'" in text
    assert '#SBATCH --output="/shared/my cluster/slurm/%j.out"' in text  # a directive, as sbatch reads it


def test_the_shipped_sbatch_file_is_the_rendered_template() -> None:
    assert (REPO / "slurm" / "plexrl.sbatch").read_text() == S.render_template(), \
        "regenerate with `python -m plexctl.slurm > slurm/plexrl.sbatch`"


def test_the_drain_leaves_a_margin_before_the_allocation_ends() -> None:
    assert S.drain_timeout(two_node_spec(signal_grace=300)) == 240
    assert S.drain_timeout(two_node_spec(signal_grace=60)) == 45
    assert S.drain_timeout(two_node_spec(signal_grace=20)) == 10
    assert S.drain_timeout(two_node_spec(drain_timeout=7.0)) == 7.0


@pytest.mark.parametrize("text, minutes", [("90", 90), ("01:30:00", 90), ("1-00:00:00", 1440), ("2-03", 3060),
                                           ("10:30", 11), ("0:0:59", 1)])
def test_slurm_time_formats(text: str, minutes: int) -> None:
    assert S.time_minutes(text) == minutes


@pytest.mark.parametrize("text", ["", "abc", "1h", "0", "-5"])
def test_a_bad_time_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="--time"):
        S.time_minutes(text)
