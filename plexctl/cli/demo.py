"""`plexctl demo` (the tiny end-to-end run) and `plexctl simulate` (the scheduler on a simulated clock)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from plexctl.cli.context import TERMINAL, Ctx, console
from plexctl.common.errors import ExitCode

if TYPE_CHECKING:
    from plexctl.common.client import Client
    from plexctl.common.protocol import JobInfo

IMPORT_ROOT = Path(__file__).resolve().parents[2]  # holds the daemon and worker packages
DEMO_SPECS = ("tiny-arith.yaml", "tiny-arith-b.yaml")


def examples_dir() -> Path:
    """The example job specs: ``plexctl/examples`` in an installed wheel, ``configs/`` in a checkout."""
    packaged = Path(__file__).resolve().parents[1] / "examples"
    return packaged if packaged.is_dir() else IMPORT_ROOT / "configs"


def stage_example(name: str, into: Path) -> Path:
    """Copy the example spec ``name`` into ``into`` (a folder beside ``./.plexrl``), where its
    paths (``../.plexrl/models/...``, relative to the file) reach what the demo builds here."""
    into.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copyfile(examples_dir() / name, into / name))


def _child_env() -> dict[str, str]:
    """This environment, with the folder that holds the daemon and worker packages importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(IMPORT_ROOT), env.get("PYTHONPATH")]))
    return env


def demo(
    ctx: typer.Context,
    configs: Annotated[Optional[list[Path]], typer.Argument(help="job specs to run")] = None,
    keep: Annotated[bool, typer.Option(help="leave the cluster up afterwards")] = False,
    steps: Annotated[
        Optional[int], typer.Option(min=1, help="optimizer steps of each job (default: each spec's own, 200)")
    ] = None,
) -> None:
    """The end-to-end demo: build the tiny model, start a local cluster, run two tiny jobs live."""
    from plexctl.cli import views
    from plexctl.cli.specs import load_or_exit
    from plexctl.cli.start_stop import down, up
    from plexctl.common.spec import spec_to_wire

    c: Ctx = ctx.obj
    root = Path.cwd() / ".plexrl"
    only = [] if configs else ["--only", "tiny-arith"]  # the default jobs' model; given specs may name either
    configs = configs or [stage_example(name, Path.cwd() / ".plexrl-examples") for name in DEMO_SPECS]
    console().rule("building the tiny model (cached)")
    subprocess.run(
        [sys.executable, "-m", "plexctl.tiny_models", "--root", str(root), *only], check=True, env=_child_env()
    )
    overrides = [f"algo.steps={steps}"] if steps else []
    specs = [load_or_exit(f, overrides, None) for f in configs]
    models = list(dict.fromkeys(Path(s.model.path) for s in specs))  # each base the jobs name, once
    console().rule("starting the local cluster")
    ctx.invoke(up, ctx=ctx, models=models)
    client = c.client()
    ids = [client.submit(spec_to_wire(s), submit_id=uuid.uuid4().hex).job_id for s in specs]
    console().rule(f"running {', '.join(ids)}")
    t0 = time.monotonic()
    if console().is_terminal:
        from plexctl.cli.jobs import live

        final = live(c, client, None, 1.0, until_done=True, job_ids=ids)
    else:
        final = _poll_plain(client, ids)
    minutes = (time.monotonic() - t0) / 60
    console().rule("result")
    for j in final:
        console().print(
            f"{j.job_id} {j.name:<13} {j.state:<9} reward {views.eval_text(j)}  "
            f"({j.step} steps, {j.step / minutes:.0f}/min)"
        )
    if not keep:
        ctx.invoke(down, ctx=ctx)
    if any(j.state != "succeeded" for j in final):
        raise typer.Exit(ExitCode.JOB_FAILED)


def _poll_plain(client: Client, ids: list[str]) -> list[JobInfo]:
    from plexctl.cli import views

    last = ""
    while True:
        rep = client.status()
        jobs = [j for j in rep.jobs if j.job_id in ids]
        text = views.plain_jobs(jobs, rep.now)
        if text != last:
            print(text, flush=True)
            last = text
        if all(j.state in TERMINAL for j in jobs):
            return jobs
        time.sleep(2.0)


def simulate(
    ctx: typer.Context,
    trace: Annotated[Optional[Path], typer.Argument(help="trace file (.json/.jsonl); default: generated")] = None,
) -> None:
    """Replay a job trace on the daemon's own scheduler with a simulated clock, under every policy.

    Extra options go to the simulator (see `plexctl simulate --help-sim`), e.g. --quick, --jobs N, --gpus G,
    --multiplex FILE (calibrate against a bench/multiplex.py result). The results go to ./simulate.json
    unless --out says where.
    """
    # an unknown option before any trace (`simulate --quick`) arrives as the trace: it goes on as given
    if trace is None:
        args = []
    else:
        args = [str(trace) if str(trace).startswith("-") else str(trace.resolve())]  # messages name the file in full
    extra = ["--help" if a == "--help-sim" else a for a in ctx.args]
    extra = [str(Path(a).resolve()) if prev in ("--out", "--trace") else a for prev, a in zip(["", *extra], extra)]
    proc = subprocess.run([sys.executable, "-m", "daemon.simulate", *args, *extra], env=_child_env())
    if proc.returncode:
        raise typer.Exit(proc.returncode)
