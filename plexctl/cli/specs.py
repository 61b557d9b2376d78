"""`plexctl validate`, `plan` and `submit`: job specs checked, planned against a node's memory, queued."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional, cast

import typer

from plexctl.cli.config_options import config_options
from plexctl.cli.context import console
from plexctl.common.cluster_config import DEFAULTS, ClusterConfig, config_problems
from plexctl.common.errors import ExitCode, UsageError

if TYPE_CHECKING:
    from plexctl.common.memplan import EngineShape
    from plexctl.common.spec import JobSpec


def load_or_exit(file: Path, overrides: list[str], name: str | None) -> JobSpec:
    """The job spec in ``file``; its issues on stderr and exit code 2 when it is not valid."""
    from plexctl.common.spec import SpecError
    from plexctl.spec_files import load_spec

    try:
        return load_spec(file, overrides, name)
    except SpecError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        raise typer.Exit(ExitCode.USAGE) from None


def validate(
    files: Annotated[Optional[list[Path]], typer.Argument(help="job spec YAML files")] = None,
    explain: Annotated[Optional[str], typer.Option("--explain", help="describe a spec key, e.g. algo.lr")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a.b=c")] = None,
    schema_only: Annotated[
        bool, typer.Option("--schema-only", help="skip file checks (specs for another machine)")
    ] = False,
) -> None:
    """Check job specs without queueing anything (or explain a spec key)."""
    if explain is not None:
        from plexctl.cli.spec_doc import explain as explain_key

        console().print(explain_key(explain), markup=False, highlight=False)
        return
    if not files:
        raise UsageError("give job spec files to validate, or --explain KEY")
    from plexctl.common.spec import SpecError
    from plexctl.spec_files import load_spec

    bad = False
    for f in files:
        try:
            load_spec(f, set_ or [], check_files=not schema_only)
            console().print(f"{f}: ok")
        except SpecError as exc:
            bad = True
            for issue in exc.issues:
                print(issue, file=sys.stderr)
    if bad:
        raise typer.Exit(ExitCode.USAGE)


PLAN_SETTINGS = (  # the settings a node's memory plan depends on
    "dtype",
    "max_loras",
    "max_lora_rank",
    "gpu_memory_utilization",
    "micro_batch_tokens",
    "max_model_len",
    "gradient_checkpointing",
    "device_slots",
    "host_mem",
    "nvme_bytes",
    "rollout_gpus",
    "trainer_gpus",
    "tp",
    "trainer_width",
)


@config_options(only=PLAN_SETTINGS, after="node_nvme", scoped=False)
def plan(
    files: Annotated[list[Path], typer.Argument(help="job spec YAML files (one base model)")],
    gpus: Annotated[str, typer.Option(help="the node's GPUs, e.g. 8x80G, 4x141G; 0 for a CPU node")] = "8x80G",
    node_mem: Annotated[str, typer.Option(help="the node's host memory")] = "256G",
    node_nvme: Annotated[str, typer.Option(help="the node's local NVMe")] = "1T",
    json_: Annotated[bool, typer.Option("--json", help="the plans as JSON (per trainer its step)")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a.b=c in every spec")] = None,
    config: ClusterConfig = DEFAULTS,
) -> None:
    """The memory plan of a node for these jobs, before any GPU-hour is spent: per engine the weights,
    KV cache, adapter slots and job state on each tier, and what does not fit (exit 7); one plan per base
    model when the jobs use several (each counts the others' weights). Needs no cluster; a model
    directory that is not here is planned from its known shape (Qwen2.5, Llama 3.1)."""
    from plexctl.common import memplan as MP
    from plexctl.common.spec import SpecError
    from plexctl.spec_files import load_spec

    problems = config_problems(config)
    if problems:
        raise UsageError("\n".join(problems))
    try:
        node = MP.NodeShape.parse(gpus, host=node_mem, nvme=node_nvme)
        specs = [load_spec(f, set_ or [], check_files=False) for f in files]
        engines = plan_engines(node.gpus, config.rollout_gpus, config.trainer_gpus, config.tp)
        results = MP.plans_for_specs(specs, node, engines, config)
    except SpecError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        raise typer.Exit(ExitCode.USAGE) from None
    except ValueError as exc:
        raise UsageError(f"--gpus {gpus!r}: {exc}" if "GPU shape" in str(exc) else str(exc)) from None
    if json_:
        print(json.dumps({"plans": [MP.plan_json(r) for r in results]}, indent=2))
    else:
        print("\n\n".join(MP.render_plan(result) for result in results))
    if not all(result.fits for result in results):
        raise typer.Exit(ExitCode.REFUSED)


def plan_engines(gpus: int, rollout_gpus: int | None, trainer_gpus: int | None, tp: int) -> list[EngineShape]:
    """The engines of a node as `up --slurm` places them (``plexctl.common.layout``), as the plan's shapes."""
    from plexctl.common import memplan as MP
    from plexctl.common.layout import place_workers

    workers = place_workers(
        "(--gpus)",
        [str(i) for i in range(gpus)],
        ["rollout", "trainer"],
        rollout_gpus=rollout_gpus,
        trainer_gpus=trainer_gpus,
        tp=tp,
        trainer_width=1,  # the plan chooses trainer widths itself
    )
    return [MP.EngineShape(cast(MP.EngineKind, kind), len(w.devices)) for w in workers for kind in w.engines]


def submit(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="job spec YAML")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a.b=c")] = None,
    name: Annotated[Optional[str], typer.Option(help="job name (overrides the spec's)")] = None,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="print the job id only")] = False,
    replace: Annotated[
        bool,
        typer.Option(
            "--replace", help="cancel your queued or running job of this name first (else the name is refused)"
        ),
    ] = False,
) -> None:
    """Validate a job spec and queue it."""
    from plexctl import inputs
    from plexctl.common.spec import spec_to_wire

    spec = load_or_exit(file, set_ or [], name)
    rep = inputs.submit(ctx.obj.client(), spec_to_wire(spec), uuid.uuid4().hex, replace=replace)
    replaced = f", replacing {', '.join(rep.replaced)} (cancelled)" if rep.replaced else ""
    console().print(rep.job_id if quiet else f"submitted {rep.job_id} ({spec.name}){replaced}")
