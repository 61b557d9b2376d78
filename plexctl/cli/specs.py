"""`plexctl validate`, `plan` and `submit`: job specs checked, planned against a node's memory, queued."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, cast

import typer

from plexctl.cli.context import console
from plexctl.cli.start_stop import setting_option
from plexctl.common.cluster_config import DEFAULTS as D
from plexctl.common.errors import ExitCode, UsageError
from plexctl.common.sizes import parse_bytes

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


def plan(
    files: Annotated[list[Path], typer.Argument(help="job spec YAML files (one base model)")],
    gpus: Annotated[str, typer.Option(help="the node's GPUs, e.g. 8x80G, 4x141G; 0 for a CPU node")] = "8x80G",
    node_mem: Annotated[str, typer.Option(help="the node's host memory")] = "256G",
    node_nvme: Annotated[str, typer.Option(help="the node's local NVMe")] = "1T",
    tp: Annotated[int, setting_option("tp", scoped=False)] = D.tp,
    rollout_gpus: Annotated[Optional[int], setting_option("rollout_gpus", scoped=False)] = D.rollout_gpus,
    trainer_gpus: Annotated[Optional[int], setting_option("trainer_gpus", scoped=False)] = D.trainer_gpus,
    dtype: Annotated[str, setting_option("dtype")] = D.dtype,
    max_lora_rank: Annotated[Optional[int], setting_option("max_lora_rank")] = D.max_lora_rank,
    max_loras: Annotated[Optional[int], setting_option("max_loras")] = D.max_loras,
    device_slots: Annotated[int, setting_option("device_slots")] = D.device_slots,
    host_mem: Annotated[str, setting_option("host_mem")] = D.host_mem,
    nvme_bytes: Annotated[str, setting_option("nvme_bytes")] = D.nvme_bytes,
    gpu_memory_utilization: Annotated[Optional[float], setting_option("gpu_memory_utilization")] = (
        D.gpu_memory_utilization
    ),
    max_model_len: Annotated[Optional[int], setting_option("max_model_len")] = D.max_model_len,
    micro_batch_tokens: Annotated[Optional[int], setting_option("micro_batch_tokens")] = D.micro_batch_tokens,
    gradient_checkpointing: Annotated[str, setting_option("gradient_checkpointing")] = D.gradient_checkpointing,
    json_: Annotated[bool, typer.Option("--json", help="the plans as JSON (per trainer its step)")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a.b=c in every spec")] = None,
) -> None:
    """The memory plan of a node for these jobs, before any GPU-hour is spent: per engine the weights,
    KV cache, adapter slots and job state on each tier, and what does not fit (exit 7); one plan per base
    model when the jobs use several (each counts the others' weights). Needs no cluster; a model
    directory that is not here is planned from its known shape (Qwen2.5, Llama 3.1)."""
    from plexctl.common import memplan as MP
    from plexctl.common.spec import SpecError
    from plexctl.common.step_memory import CHECKPOINTING
    from plexctl.spec_files import load_spec

    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype {dtype!r}: choose one of auto, float32, bfloat16, float16")
    if gradient_checkpointing not in CHECKPOINTING:
        raise UsageError(
            f"--gradient-checkpointing {gradient_checkpointing!r}: choose one of {', '.join(CHECKPOINTING)}"
        )
    try:
        node = MP.NodeShape.parse(gpus, host=node_mem, nvme=node_nvme)
        derived: dict[str, Any] = {  # left to the platform: the plan's GPU defaults (``memplan.ClusterOptions``)
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_lora_rank": max_lora_rank,
            "max_loras": max_loras,
            "micro_batch_tokens": micro_batch_tokens,
        }
        options = MP.ClusterOptions(
            dtype=None if dtype == "auto" else dtype,
            device_slots=device_slots,
            host_tier_bytes=parse_bytes(host_mem),
            nvme_tier_bytes=parse_bytes(nvme_bytes),
            max_model_len=max_model_len,
            gradient_checkpointing=gradient_checkpointing,
            **{k: v for k, v in derived.items() if v is not None},
        )
        specs = [load_spec(f, set_ or [], check_files=False) for f in files]
        engines = plan_engines(node.gpus, rollout_gpus, trainer_gpus, tp)
        results = MP.plans_for_specs(specs, node, engines, options)
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
