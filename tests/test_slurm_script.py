"""The Slurm batch script and the allocation options, as pure functions (no Slurm needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plexctl.common import slurm as S
from plexctl.common.cluster_config import ClusterConfig, drain_timeout_s, read_config
from plexctl.common.errors import UsageError
from plexctl.common.layout import LayoutError

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"


def two_node_spec(state_dir: str = "/shared/alice/.plexrl/clusters/research", join: bool = False, **changes):
    settings = dict(
        models=["/shared/models/qwen2.5-7b"],
        nodes=2,
        gpus_per_node=8,
        time_limit="2-00:00:00",
        partition="gpu",
        account="rl-lab",
        qos="high",
        exclusive=True,
        constraint="h100",
        signal_grace=300,
        engines=["rollout,trainer"],
        scratch=None,
        max_loras=8,
    )
    settings.update(changes)
    return S.SlurmSpec(
        name="research",
        state_dir=state_dir,
        config=ClusterConfig(**settings),
        config_file=str(Path(state_dir) / ("slurm/join-1.json" if join else "cluster.json")),
        join=join,
        python="/shared/alice/venv/bin/python",
    )


def test_the_batch_script_matches_its_golden_file() -> None:
    assert S.render_sbatch(two_node_spec()) == (GOLDEN / "sbatch-two-nodes.sh").read_text()


def directives(text: str) -> dict[str, str | None]:
    """The ``#SBATCH`` options of a batch script (submitit's or ours), as sbatch reads them."""
    found: dict[str, str | None] = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --") :].partition("=")
            found[key] = value or None
    return found


def test_a_gpu_allocation_asks_for_gpus_cpus_and_memory_and_passes_the_layout() -> None:
    text = S.render_sbatch(two_node_spec(gpus_per_node=8, rollout_gpus=4, trainer_gpus=4, tp=2))
    opts = directives(text)
    assert (opts["gpus-per-node"], opts["cpus-per-task"], opts["mem"]) == (
        "8",
        "64",
        "0",
    )  # 8 CPUs a GPU, the node's memory
    assert "--tp" not in text  # the layout is the config's: each node checks what it got
    assert S.planned_workers(two_node_spec(gpus_per_node=8, rollout_gpus=4, trainer_gpus=4, tp=2)) == 2 * (2 + 4)


def test_a_trainer_engine_wider_than_a_node_registers_one_worker_for_all_its_nodes() -> None:
    # a rollout and a trainer GPU a node: the engine's rank on n2 runs under worker.ranks, no worker of its own
    assert S.planned_workers(two_node_spec(gpus_per_node=2, trainer_width=2)) == 3
    assert S.planned_workers(two_node_spec(gpus_per_node=2, trainer_width=1)) == 4
    assert S.planned_workers(two_node_spec(gpus_per_node=8, trainer_gpus=4, trainer_width=8)) == 2 * 4 + 1
    assert S.planned_workers(two_node_spec(gpus_per_node=8, trainer_gpus=4, trainer_width=4)) == 2 * 5


def test_the_users_cpus_and_memory_replace_the_gpu_defaults() -> None:
    opts = directives(S.render_sbatch(two_node_spec(gpus_per_node=4, cpus_per_task=12, mem="200G")))
    assert (opts["gpus-per-node"], opts["cpus-per-task"], opts["mem"]) == ("4", "12", "200G")


def test_without_gpus_nothing_of_the_gpu_defaults_is_asked() -> None:
    text = S.render_sbatch(two_node_spec(gpus_per_node=0))
    assert not {"gpus-per-node", "cpus-per-task", "mem"} & set(directives(text))
    assert "--gpus-per-node" not in text and "--tp" not in text and "-gpus " not in text
    assert S.planned_workers(two_node_spec(gpus_per_node=0, nodes=3)) == 3  # one worker a node, as before


def test_submitit_asks_for_what_the_batch_script_asks(tmp_path: Path) -> None:
    from submitit.slurm.slurm import _make_sbatch_string

    for spec in (two_node_spec(), two_node_spec(gpus_per_node=0, exclusive=False)):
        ours = directives(S.render_sbatch(spec))
        theirs = directives(_make_sbatch_string(command="true", folder=tmp_path, **S.submitit_parameters(spec)))
        keys = [
            "nodes",
            "ntasks-per-node",
            "gpus-per-node",
            "cpus-per-task",
            "mem",
            "partition",
            "account",
            "qos",
            "constraint",
            "exclusive",
            "requeue",
        ]
        assert {k: theirs.get(k) for k in keys} == {k: ours.get(k) for k in keys}
        assert theirs["signal"].endswith("@300")  # submitit's own signal (USR2), as far ahead


def test_a_layout_that_cannot_fit_is_refused_before_anything_is_submitted(tmp_path: Path) -> None:
    spec = two_node_spec(state_dir=str(tmp_path), gpus_per_node=8, rollout_gpus=6, trainer_gpus=4)
    for submit in (S.submit_sbatch, S.submit_submitit):
        with pytest.raises(LayoutError, match=r"^--rollout-gpus 6 \+ --trainer-gpus 4 = 10: more than the 8 GPUs"):
            submit(spec)
    assert not (tmp_path / "slurm").exists()
    with pytest.raises(LayoutError, match="^--tp 3 does not divide"):
        S.planned_workers(two_node_spec(engines=["rollout", "trainer"], gpus_per_node=8, tp=3))


def test_a_joining_allocation_runs_workers_only() -> None:
    text = S.render_sbatch(two_node_spec(join=True, nodes=3))
    assert "#SBATCH --job-name=plexrl-research-join" in text and "#SBATCH --nodes=3" in text
    # its own config (the cluster's cluster.json is the running daemon's)
    assert text.rstrip().endswith("--cluster-config /shared/alice/.plexrl/clusters/research/slurm/join-1.json --join")


def test_the_node_tasks_are_told_where_the_cluster_is_and_nothing_of_its_settings() -> None:
    spec = two_node_spec(trusted_users=["alice"], metrics_port=9400, policy="pack", drain_timeout=100.0)
    assert S.node_command(spec)[1:] == ["-m", "daemon.node", "--state-dir", spec.state_dir]


def test_paths_with_spaces_are_quoted_for_the_shell() -> None:
    text = S.render_sbatch(two_node_spec(state_dir="/shared/my cluster"))
    assert "--state-dir '/shared/my cluster'" in text
    assert '#SBATCH --output="/shared/my cluster/slurm/%j.out"' in text  # a directive, as sbatch reads it


SHIPPED = REPO / "slurm" / "plexrl.sbatch"


def test_the_shipped_sbatch_file_asks_for_what_up_asks_for() -> None:
    """Its directives are the ones ``up --slurm`` writes for a default config (but for the job's
    name, size and log file, which its user picks), and it is valid bash."""
    default = S.SlurmSpec(name="plexrl", state_dir="/s", config=ClusterConfig(nodes=2))
    expected = [
        f"#SBATCH --{k}" + (f"={v}" if v is not None else "")
        for k, v in S.sbatch_options(default)
        if k not in ("job-name", "nodes", "output")
    ]
    directives = [ln for ln in SHIPPED.read_text().splitlines() if ln.startswith("#SBATCH")]
    assert [
        d for d in directives if d.split("=")[0] not in ("#SBATCH --job-name", "#SBATCH --nodes", "#SBATCH --output")
    ] == expected
    subprocess.run(["bash", "-n", str(SHIPPED)], check=True)


def test_the_shipped_sbatch_file_writes_the_settings_and_starts_the_node_tasks(tmp_path: Path) -> None:
    """Run as sbatch would (its environment, a job id), with ``srun`` recording what it is asked to run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    (bin_dir / "srun").chmod(0o755)
    state = tmp_path / "cluster"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SRUN_ARGS": str(tmp_path / "srun.args"),
        "SLURM_JOB_ID": "77",
        "PLEXRL_STATE_DIR": str(state),
        "PLEXRL_MODEL": "/shared/models/qwen2.5-7b",
        "PLEXRL_PYTHON": sys.executable,
        "PLEXRL_ENGINES": "rollout trainer",
        "PLEXRL_SETTINGS": "policy=pack tp=2",
    }
    subprocess.run(["bash", str(SHIPPED)], env=env, cwd=REPO, check=True, capture_output=True)
    config = read_config(state / "slurm" / "cluster-77.json")
    assert (config.models, config.engines, config.policy, config.tp) == (
        ["/shared/models/qwen2.5-7b"],
        ["rollout", "trainer"],
        "pack",
        2,
    )
    args = (tmp_path / "srun.args").read_text().split()
    node = args[args.index(sys.executable) :]
    assert node == [
        sys.executable,
        "-m",
        "daemon.node",
        "--state-dir",
        str(state),
        "--cluster-config",
        str(state / "slurm" / "cluster-77.json"),
    ]


def test_the_drain_leaves_a_margin_before_the_allocation_ends() -> None:
    def drain(**settings) -> float:
        return drain_timeout_s(two_node_spec(**settings).config, slurm=True)

    assert drain(signal_grace=300) == 240
    assert drain(signal_grace=60) == 45
    assert drain(signal_grace=20) == 10
    assert drain(drain_timeout=7.0) == 7.0
    assert drain_timeout_s(two_node_spec().config, slurm=False) == 30  # a local cluster's


@pytest.mark.parametrize(
    "text, minutes", [("90", 90), ("01:30:00", 90), ("1-00:00:00", 1440), ("2-03", 3060), ("10:30", 11), ("0:0:59", 1)]
)
def test_slurm_time_formats(text: str, minutes: int) -> None:
    assert S.time_minutes(text) == minutes


@pytest.mark.parametrize("text", ["", "abc", "1h", "0", "-5"])
def test_a_bad_time_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="--time"):
        S.time_minutes(text)


@pytest.mark.parametrize(
    ("rc", "out", "err", "said"),
    [
        (0, "PENDING|BeginTime\n", "", ("PENDING", "BeginTime")),
        (0, "", "", ("GONE", "")),  # left the queue
        (1, "", "slurm_load_jobs error: Invalid job id specified\n", ("GONE", "")),
        # the controller busy or away says nothing of the job: not its end
        (
            1,
            "",
            "slurm_load_jobs error: Socket timed out on send/recv operation\n",
            ("", "slurm_load_jobs error: Socket timed out on send/recv operation"),
        ),
    ],
)
def test_a_job_is_gone_only_when_slurm_says_so(tmp_path, monkeypatch, rc, out, err, said):
    squeue = tmp_path / "squeue"
    squeue.write_text(f"#!/bin/sh\nprintf '%s' '{out}'\nprintf '%s' '{err}' >&2\nexit {rc}\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert S.job_state("42") == said


def test_status_says_slurm_did_not_answer_rather_than_failing(tmp_path, monkeypatch):
    from plexctl.cli.start_stop import slurm_note

    S.record_allocation(tmp_path, S.Allocation("42", 1, False, 0.0, "sbatch", 60.0))
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\nexit 1\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert slurm_note(tmp_path) == (
        f"cluster {tmp_path.name}: the daemon does not answer, and Slurm did not say where job 42 is "
        "(slurm_load_jobs error: Unable to contact slurm controller)"
    )
