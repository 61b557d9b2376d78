"""The cluster's settings are declared once (``ClusterConfig``): one default each, `up` and `plan` take
theirs from it, no process re-declares one, and what `up` writes is what the daemon and a worker read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest
import typer.main
from typer.testing import CliRunner

from plexctl.cli import app as A
from plexctl.cli import start_stop
from plexctl.cli.spec_doc import CLUSTER_REGENERATE, render_cluster_reference
from plexctl.common import cluster_config as K
from plexctl.common.errors import UsageError
from plexctl.common.scheduling import POLICIES

REPO = Path(__file__).resolve().parents[1]
PROCESSES = ("daemon/main.py", "daemon/node.py", "worker/main.py")
# a worker's own engines and directory (one entry of the `engines` setting; under the `scratch` one)
IDENTITY = {"worker/main.py: --engines", "worker/main.py: --scratch"}


def _options(verb: str) -> dict[str, Any]:
    """A verb's options by name (typer parses with a click of its own: its options are duck-typed)."""
    cmd = typer.main.get_command(A.build([verb])).commands[verb]  # type: ignore[attr-defined]
    return {opt: p for p in cmd.params if p.param_type_name == "option" for opt in p.opts}


def test_the_committed_reference_matches_the_settings() -> None:
    assert (REPO / "docs" / "cluster-reference.md").read_text() == render_cluster_reference(), (
        f"docs/cluster-reference.md is stale; regenerate it: {CLUSTER_REGENERATE}"
    )


def test_every_setting_is_an_up_option_with_its_default_and_its_help() -> None:
    options = _options("up")
    for setting in K.settings():
        option = options.get(K.option_name(setting))
        assert option is not None, f"{setting}: no `up {K.option_name(setting)}`"
        assert option.help == K.help_text(setting) or option.help.startswith(K.help_text(setting)), setting
        default = K.default(setting)
        if isinstance(default, list):  # a repeated option: none given is the setting's default
            assert option.default in (None, default), setting
        else:
            assert option.default == default, setting
    help_text = CliRunner().invoke(A.build(["up"]), ["up", "--help"], terminal_width=200).output
    assert all(K.option_name(s) in help_text for s in K.settings())


def test_a_bad_choice_is_refused_in_the_line_the_config_check_says() -> None:
    result = CliRunner().invoke(A.build(["up"]), ["up", "--policy", "nope"])
    assert isinstance(result.exception, UsageError)  # exit 2, one line
    assert str(result.exception) == (
        "--policy 'nope': choose one of isolated, pack, spread, spread+backfill, pack+backfill"
    )


def test_max_nodes_below_nodes_is_refused_in_one_line() -> None:
    problems = K.config_problems(K.ClusterConfig(nodes=3, max_nodes=2))
    assert problems == ["--max-nodes 2: fewer than --nodes 3, the nodes the cluster never goes below"]
    assert K.config_problems(K.ClusterConfig(nodes=2, max_nodes=2)) == []


def test_plan_takes_its_shared_settings_from_the_config() -> None:
    options = _options("plan")
    shared = [s for s in K.settings() if K.option_name(s) in options]
    assert {"tp", "dtype", "max_lora_rank", "host_mem", "gradient_checkpointing"} <= set(shared)
    for setting in shared:
        option = options[K.option_name(setting)]
        assert option.default == K.default(setting), setting
        assert option.help == K.help_text(setting, scoped=False), setting


def _declared_defaults(path: Path) -> list[str]:
    """The ``--flag``s of ``path``'s argparse parsers that are settings and declare a default."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        settings = [s for s in K.settings() if K.option_name(s) in flags or "--" + s.replace("_", "-") in flags]
        if settings and any(k.arg == "default" for k in node.keywords):
            found.append(f"{path.parent.name}/{path.name}: {flags[0]}")
    return found


def test_no_process_declares_a_default_of_its_own_for_a_setting() -> None:
    assert [d for p in PROCESSES for d in _declared_defaults(REPO / p) if d not in IDENTITY] == []


def test_the_worker_takes_no_setting_on_its_command_line() -> None:
    from worker.main import build_parser

    flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    named = {K.option_name(s) for s in K.settings()} | {"--" + s.replace("_", "-") for s in K.settings()}
    # its own engines, the models they serve and its directory (one entry of `engines`, `models` as its launcher
    # gives them, under `scratch`): what identifies this worker
    assert flags & named <= {"--engines", "--model", "--scratch"}, "a setting comes from the worker's --cluster-config"


def test_one_default_each_and_the_derived_ones_in_one_place() -> None:
    assert tuple(K.DEFAULTS.__struct_fields__) == K.settings()
    assert K.drain_timeout_s(K.DEFAULTS, slurm=False) == K.LOCAL_DRAIN_TIMEOUT_S == 30
    assert K.drain_timeout_s(K.DEFAULTS, slurm=True) == 240  # the default signal grace of 300 s, less its margin
    assert K.drain_timeout_s(K.ClusterConfig(drain_timeout=5), slurm=True) == 5
    assert K.min_lora_rank(K.DEFAULTS) == 0 and K.min_lora_rank(K.ClusterConfig(tinker_port=0)) == 32


def test_the_policies_are_the_schedulers() -> None:
    field = next(f for f in msgspec.structs.fields(K.ClusterConfig) if f.name == "policy")
    assert get_args(get_args(field.type)[0]) == POLICIES


def test_the_core_constants_agree_until_the_core_reads_the_config() -> None:
    from daemon.core import PASS_WINDOW_S, WORKER_GRACE_S

    assert WORKER_GRACE_S == K.DEFAULTS.worker_grace and PASS_WINDOW_S * 1000 == K.DEFAULTS.group_window_ms


def test_bad_values_are_one_line_each_naming_the_option() -> None:
    problems = K.config_problems(K.ClusterConfig(policy="x", nodes=0, host_mem="abc", job_limits=["bogus=1"]))  # type: ignore[arg-type]
    assert problems == [
        "--policy 'x': choose one of isolated, pack, spread, spread+backfill, pack+backfill",
        "--nodes 0: expected `int` >= 1",
        "--host-mem: not a size: 'abc' (examples: 4096, 512M, 8G)",
        "--job-limit 'bogus=1': expected NAME=VALUE with NAME one of memory, processes, job-dir, tmp, cpu, "
        "tinker-disk, tinker-saves, running, submits",
    ]


def test_the_config_file_writer_of_the_batch_script(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    argv = [str(out), 'models=["/m"]', 'engines=["rollout", "trainer"]', "tp=2", "policy=pack"]
    assert K.main(argv) == 0
    assert K.read_config(out) == K.ClusterConfig(models=["/m"], engines=["rollout", "trainer"], tp=2, policy="pack")
    proc = subprocess.run(
        [sys.executable, "-m", "plexctl.common.cluster_config", str(out), "tp=0", "bogus=1"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: 'bogus=1': expected KEY=VALUE")
    assert K.read_config(tmp_path / "none.json") == K.DEFAULTS  # no file: every default


def test_what_up_writes_is_what_the_daemon_and_a_worker_read(tiny_model, tmp_path, monkeypatch) -> None:
    from daemon.main import Daemon
    from plexctl.common import auth
    from worker.main import parse_args

    monkeypatch.setenv("PLEXRL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(auth.KEYS_ENV, raising=False)
    started: list[list[str]] = []
    real_popen = subprocess.Popen

    def popen(cmd, **kw):  # the daemon's command recorded; a process that exits at once stands in for it
        started.append(cmd)
        return real_popen([sys.executable, "-c", "pass"], **kw)

    monkeypatch.setattr(start_stop.subprocess, "Popen", popen)
    state = tmp_path / "state"
    argv = ["--state-dir", str(state), "up", "--model", str(tiny_model), "--policy", "pack", "--host-mem", "1G"]
    argv += ["--drain-timeout", "12", "--worker-grace", "9", "--trust-user-code", "carol", "--max-model-len", "64"]
    result = CliRunner().invoke(A.build(["up"]), argv)
    assert "the daemon exited" in str(result.exception), result.output
    (cmd,) = started
    assert cmd[2:] == [
        "daemon.main",
        "--state-dir",
        str(state),
        "--local-worker",
        "rollout",
        "--local-worker",
        "trainer",
    ]

    config = K.read_config(K.config_path(state))
    assert config == K.ClusterConfig(
        models=[str(tiny_model.resolve())],
        policy="pack",
        host_mem="1G",
        drain_timeout=12.0,
        worker_grace=9.0,
        trusted_users=["carol"],
        max_model_len=64,
    )
    d = Daemon(state, config.models, [], config=config)
    try:
        core = d.core
        assert (core.settings.policy, core.settings.drain_timeout, core.settings.worker_grace) == ("pack", 12.0, 9.0)
        assert "carol" in core.settings.trusted_users
    finally:
        d.shutdown()
    args, worker_config = parse_args(
        ["--endpoint", "tcp://x:1", "--model", config.models[0], "--cluster-config", str(K.config_path(state))]
    )
    assert worker_config == config and args.model == config.models
    with pytest.raises(SystemExit):  # a setting is the cluster's, never one worker's flag
        parse_args(
            ["--endpoint", "e", "--model", "m", "--cluster-config", str(K.config_path(state)), "--host-mem", "2G"]
        )


@pytest.mark.parametrize("slurm", [False, True])
def test_local_and_slurm_only_settings_are_marked(slurm: bool) -> None:
    scoped = {s for s in K.settings() if K.scope(s) == (K.SLURM if slurm else K.LOCAL)}
    assert ({"nodes", "tp", "signal_grace"} if slurm else {"workers", "train_grouping"}) <= scoped
    assert all(K.help_text(s).startswith("--slurm: " if slurm else "--local: ") for s in scoped)


def test_a_setting_with_a_leading_zero_is_refused_in_one_line_naming_it() -> None:
    with pytest.raises(K.ConfigError) as refused:
        K.with_settings(K.ClusterConfig(), ["nodes=010"])
    assert (
        str(refused.value)
        == "nodes: '010' has a leading zero; write 10 for the number, 0o10 for octal, or quote it for a string"
    )
    assert K.with_settings(K.ClusterConfig(), ["nodes=10"]).nodes == 10


# ---------------------------------------------------------------- trainer_width


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"trainer_width": 2, "gpus_per_node": 8}, None),  # the default split: 2 trainer GPUs a node
        ({"trainer_width": 4, "gpus_per_node": 8, "trainer_gpus": 4}, None),
        ({"trainer_width": 16, "gpus_per_node": 8, "nodes": 2, "engines": ["trainer"]}, None),  # two whole nodes
        ({"trainer_width": 2, "gpus_per_node": 2, "nodes": 2}, None),  # one trainer GPU on each of two nodes
        ({"trainer_width": 4, "gpus_per_node": 0}, None),  # a local cluster: the plan checks it on its node
        ({"trainer_width": 3, "gpus_per_node": 8, "trainer_gpus": 4}, "widths that do: 1, 2, 4"),
        (
            {"trainer_width": 12, "gpus_per_node": 8, "nodes": 4, "engines": ["trainer"]},
            "spans whole nodes: a multiple of 8",
        ),
        (
            {"trainer_width": 64, "gpus_per_node": 8, "nodes": 4, "engines": ["trainer"]},
            "more than the allocation's 4 x 8 trainer GPUs",
        ),
        ({"trainer_width": 16, "gpus_per_node": 8, "nodes": 4}, "more than the allocation's 4 x 2 trainer GPUs"),
        (
            {"trainer_width": 3, "gpus_per_node": 8, "nodes": 4, "engines": ["trainer"]},
            "--trainer-width 3: does not divide the 8 trainer GPUs of a node",
        ),
        ({"trainer_width": 0}, "--trainer-width 0: expected `int` >= 1"),
    ],
)
def test_trainer_width_divides_a_nodes_trainer_gpus_or_spans_whole_nodes(
    settings: dict[str, Any], problem: str | None
) -> None:
    problems = K.config_problems(msgspec.structs.replace(K.ClusterConfig(), **settings))
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0] and problems[0].startswith("--trainer-width")


def test_trainer_width_is_an_option_of_up_and_plan() -> None:
    for verb in ("up", "plan"):
        out = CliRunner().invoke(A.build([verb]), [verb, "--help"], terminal_width=200).output
        assert "--trainer-width" in out, verb


def test_a_command_called_from_code_gets_the_defaults_of_the_settings_it_was_not_given() -> None:
    """``demo`` calls ``up`` as a function with only its own arguments: every setting not given is
    its default, as on the command line."""
    from plexctl.cli.config_options import config_options

    seen: list[K.ClusterConfig] = []

    @config_options(only=["policy", "trainer_width", "tp"])
    def command(name: str, config: K.ClusterConfig) -> None:
        seen.append(config)

    command(name="x", tp=2)
    assert seen[0].policy == K.DEFAULTS.policy and seen[0].trainer_width is None and seen[0].tp == 2
