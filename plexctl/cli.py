"""plexctl: the command line of a PlexRL cluster.

Verbs: ``up`` / ``down`` (a cluster), ``validate`` / ``submit`` (job specs), ``status``,
``ls``, ``logs``, ``cancel``, ``wait`` (jobs), and ``demo`` (the tiny end-to-end run).
Listing commands take ``--json``; ``ls -q`` prints bare ids for piping. Known errors become
one line on stderr and a distinct exit code (``plexctl.errors.ExitCode``); a traceback only
with ``PLEXRL_DEBUG=1``. This module never imports torch or vLLM: building the tiny model
runs in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Optional

import click
import msgspec
import typer
from rich.console import Console
from rich.live import Live

from daemon.scheduler import POLICIES
from plexctl import views
from plexctl.client import Client
from plexctl.cluster import cluster_dir, endpoint_path, pid_alive, read_endpoint
from plexctl.errors import DaemonUnreachable, ExitCode, PlexError, Timeout, UsageError
from plexctl.protocol import JobInfo
from plexctl.sizes import parse_bytes
from plexctl.spec import SpecError, load_spec, spec_to_wire

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run many RLVR fine-tuning jobs on shared, resident engines.")
console = Console()

REPO_ROOT = Path(__file__).resolve().parents[1]
TERMINAL = ("succeeded", "failed", "cancelled")
WAIT_EXIT = {"succeeded": ExitCode.OK, "failed": ExitCode.JOB_FAILED, "cancelled": ExitCode.JOB_CANCELLED}


class Ctx:
    def __init__(self, cluster: str | None, state_dir: Path | None) -> None:
        self.state_dir = state_dir or cluster_dir(cluster)

    def client(self, timeout: float = 10.0) -> Client:
        ep = read_endpoint(self.state_dir)
        return Client(ep.address, timeout=timeout)


@app.callback()
def _global(ctx: typer.Context,
            cluster: Annotated[Optional[str], typer.Option("--cluster", "-c", help="cluster name")] = None,
            state_dir: Annotated[Optional[Path], typer.Option(help="cluster state directory")] = None) -> None:
    ctx.obj = Ctx(cluster, state_dir)


# ------------------------------------------------------------------------------ cluster


def _local_model_default() -> Path:
    return Path.cwd() / ".plexrl" / "models" / "tiny-arith"


@app.command()
def up(ctx: typer.Context,
       local: Annotated[bool, typer.Option("--local", help="embedded cluster on this machine (default)")] = True,
       slurm: Annotated[bool, typer.Option("--slurm", help="a Slurm allocation")] = False,
       model: Annotated[Optional[Path], typer.Option(help="base model the engines serve")] = None,
       workers: Annotated[int, typer.Option(min=1, max=8, help="local workers (1: both engines in one)")] = 2,
       policy: Annotated[str, typer.Option(help="placement: isolated | pack | spread | spread+backfill")]
       = "spread+backfill",
       max_loras: Annotated[int, typer.Option(min=1, help="adapter slots in the rollout engine")] = 4,
       device_slots: Annotated[int, typer.Option(min=1, help="jobs whose state the trainer keeps on device")] = 4,
       host_mem: Annotated[str, typer.Option(help="host-memory tier for swapped-out job state")] = "8G",
       nvme_dir: Annotated[Optional[Path], typer.Option(help="node-local NVMe tier (default: node scratch)")]
       = None,
       nvme_bytes: Annotated[str, typer.Option(help="capacity of the NVMe tier")] = "64G",
       timeout: Annotated[float, typer.Option(help="seconds to wait for the engines")] = 900.0) -> None:
    """Start a cluster: the daemon plus its workers, and wait until the engines are ready."""
    if slurm:
        raise UsageError("--slurm is not available in this version; use --local")
    if policy not in POLICIES:
        raise UsageError(f"--policy {policy!r}: choose one of {', '.join(POLICIES)}")
    try:
        sizes = {"--host-mem": parse_bytes(host_mem), "--nvme-bytes": parse_bytes(nvme_bytes)}
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    c: Ctx = ctx.obj
    model = (model or _local_model_default()).resolve()
    if not (model / "config.json").exists():
        raise UsageError(f"--model {model}: not a Hugging Face model directory (no config.json); "
                         "build the tiny one with `python -m worker.tiny`")
    if _alive(c.state_dir):
        console.print(f"cluster at {c.state_dir} is already up")
        return
    c.state_dir.mkdir(parents=True, exist_ok=True)
    endpoint_path(c.state_dir).unlink(missing_ok=True)
    layouts = [["rollout", "trainer"]] if workers == 1 else [["rollout"]] + [["trainer"]] * (workers - 1)
    cmd = [sys.executable, "-m", "daemon.main", "--state-dir", str(c.state_dir), "--model", str(model)]
    for engines in layouts:
        cmd += ["--local-worker", ",".join(engines)]
    cmd += ["--policy", policy]
    threads = max(1, (os.cpu_count() or 1) // len(layouts))  # the workers share this machine's cores
    worker_args = [f"--max-loras={max_loras}", f"--device-slots={device_slots}", f"--threads={threads}",
                   *(f"{k}={v}" for k, v in sizes.items())]
    if nvme_dir is not None:
        worker_args.append(f"--nvme-dir={nvme_dir.resolve()}")
    cmd += [f"--worker-arg={a}" for a in worker_args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    with open(c.state_dir / "daemon.log", "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, cwd=REPO_ROOT)
    with console.status("starting the daemon") as spinner:
        while True:
            elapsed = time.monotonic() - t0
            if proc.poll() is not None:
                raise DaemonUnreachable(f"the daemon exited with code {proc.returncode} "
                                        f"(see {c.state_dir / 'daemon.log'})")
            if elapsed > timeout:
                raise Timeout(f"engines not ready after {timeout:.0f} s (see {c.state_dir}/workers/*.log)")
            if endpoint_path(c.state_dir).exists():
                try:
                    pong = c.client().ping()
                except DaemonUnreachable:
                    pong = None
                if pong is not None:
                    if pong.problems:
                        raise DaemonUnreachable(f"cluster failed to start: {pong.problems[0]}")
                    spinner.update(f"starting engines: {pong.engines_ready}/{pong.engines_total} ready "
                                   f"({elapsed:.0f} s)")
                    if pong.engines_total and pong.engines_ready == pong.engines_total \
                            and pong.workers == len(layouts):
                        break
            time.sleep(0.5)
    console.print(f"cluster up in {time.monotonic() - t0:.1f} s: {len(layouts)} workers, "
                  f"model {model.name}, policy {policy}, state {c.state_dir}")


def _alive(state_dir: Path) -> bool:
    try:
        ep = read_endpoint(state_dir)
    except PlexError:
        return False
    if not pid_alive(ep.pid):
        return False
    try:
        Client(ep.address).ping(timeout=2.0, retries=1)
        return True
    except DaemonUnreachable:
        return False


@app.command()
def down(ctx: typer.Context,
         timeout: Annotated[float, typer.Option(help="seconds to wait for the daemon to exit")] = 60.0) -> None:
    """Stop the cluster: running jobs are interrupted (they resume from their checkpoint at the next `up`)."""
    c: Ctx = ctx.obj
    ep = read_endpoint(c.state_dir)
    Client(ep.address).down()
    deadline = time.monotonic() + timeout
    while pid_alive(ep.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(ep.pid):
        raise Timeout(f"daemon pid {ep.pid} still running after {timeout:.0f} s")
    console.print("cluster down")


# ------------------------------------------------------------------------------ specs


def _load(file: Path, overrides: list[str], name: str | None):
    try:
        return load_spec(file, overrides, name)
    except SpecError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        raise typer.Exit(ExitCode.USAGE) from None


@app.command()
def validate(files: Annotated[Optional[list[Path]], typer.Argument(help="job spec YAML files")] = None,
             explain: Annotated[Optional[str], typer.Option("--explain", help="describe a spec key, e.g. algo.lr")]
             = None,
             set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a.b=c")] = None,
             schema_only: Annotated[bool, typer.Option("--schema-only",
                                                       help="skip file checks (specs for another machine)")] = False,
             ) -> None:
    """Check job specs without queueing anything (or explain a spec key)."""
    if explain:
        from plexctl.spec_doc import explain as explain_key

        console.print(explain_key(explain), markup=False, highlight=False)
        return
    if not files:
        raise UsageError("give job spec files to validate, or --explain KEY")
    bad = False
    for f in files:
        try:
            load_spec(f, set_ or [], check_files=not schema_only)
            console.print(f"{f}: ok")
        except SpecError as exc:
            bad = True
            for issue in exc.issues:
                print(issue, file=sys.stderr)
    if bad:
        raise typer.Exit(ExitCode.USAGE)


@app.command()
def submit(ctx: typer.Context,
           file: Annotated[Path, typer.Argument(help="job spec YAML")],
           set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a.b=c")] = None,
           name: Annotated[Optional[str], typer.Option(help="job name (overrides the spec's)")] = None,
           quiet: Annotated[bool, typer.Option("-q", "--quiet", help="print the job id only")] = False) -> None:
    """Validate a job spec and queue it."""
    spec = _load(file, set_ or [], name)
    rep = ctx.obj.client().submit(spec_to_wire(spec), submit_id=uuid.uuid4().hex)
    console.print(rep.job_id if quiet else f"submitted {rep.job_id} ({spec.name})")


# ------------------------------------------------------------------------------ jobs


def _uptime(c: Ctx) -> float:
    try:
        return time.time() - read_endpoint(c.state_dir).started_at
    except PlexError:
        return 0.0


@app.command()
def status(ctx: typer.Context,
           job: Annotated[Optional[str], typer.Argument(help="job id or name (default: all)")] = None,
           watch: Annotated[bool, typer.Option("--watch", "-w", help="live view until interrupted")] = False,
           as_json: Annotated[bool, typer.Option("--json", help="JSON output")] = False,
           interval: Annotated[float, typer.Option(help="refresh seconds with --watch")] = 1.0) -> None:
    """Jobs (state, step, reward, policy version, engine) and engines."""
    c: Ctx = ctx.obj
    client = c.client()
    if watch and not as_json and console.is_terminal:
        _live(c, client, job, interval, until_done=False)
        return
    while True:
        rep = client.status(job)
        if as_json:
            print(json.dumps({"jobs": [views.job_row(j, rep.now) for j in rep.jobs],
                              "engines": msgspec.to_builtins(rep.engines)}, indent=2))
        elif console.is_terminal:
            console.print(views.status_view(rep, _uptime(c)))
        else:
            print(views.plain_status(rep, _uptime(c)), flush=True)
        if not watch:
            return
        time.sleep(interval)


def _live(c: Ctx, client: Client, job: str | None, interval: float, until_done: bool,
          job_ids: list[str] | None = None) -> list[JobInfo]:
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            rep = client.status(job)
            jobs = [j for j in rep.jobs if job_ids is None or j.job_id in job_ids]
            live.update(views.status_view(msgspec.structs.replace(rep, jobs=jobs), _uptime(c)))
            if until_done and all(j.state in TERMINAL for j in jobs):
                return jobs
            time.sleep(interval)


@app.command("ls")
def ls(ctx: typer.Context,
       quiet: Annotated[bool, typer.Option("-q", "--quiet", help="job ids only")] = False,
       as_json: Annotated[bool, typer.Option("--json", help="JSON output")] = False,
       state: Annotated[Optional[str], typer.Option(help="only jobs in this state")] = None) -> None:
    """List jobs."""
    rep = ctx.obj.client().status()
    jobs = [j for j in rep.jobs if state is None or j.state == state]
    if quiet:
        for j in jobs:
            print(j.job_id)
    elif as_json:
        print(json.dumps([views.job_row(j, rep.now) for j in jobs], indent=2))
    elif console.is_terminal:
        console.print(views.jobs_table(jobs, rep.now))
    else:
        print(views.plain_jobs(jobs, rep.now))


@app.command()
def logs(ctx: typer.Context,
         job: Annotated[str, typer.Argument(help="job id or name")],
         metrics: Annotated[bool, typer.Option("--metrics", help="the metrics JSONL instead of the log")] = False,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends")] = False) -> None:
    """A job's driver log (or its metrics)."""
    client = ctx.obj.client()
    offset = 0
    while True:
        rep = client.logs(job, "metrics" if metrics else "log", offset)
        sys.stdout.write(rep.data)
        sys.stdout.flush()
        offset = rep.offset
        if not follow or rep.finished:
            return
        if not rep.data:
            time.sleep(0.5)


@app.command()
def cancel(ctx: typer.Context, jobs: Annotated[list[str], typer.Argument(help="job ids or names")]) -> None:
    """Cancel jobs: each stops at its next call boundary and keeps its last checkpoint."""
    client = ctx.obj.client()
    for job in jobs:
        info = client.cancel(job)
        console.print(f"{info.job_id}: {'cancelling' if info.state == 'running' else info.state}")


@app.command()
def wait(ctx: typer.Context,
         jobs: Annotated[list[str], typer.Argument(help="job ids or names")],
         timeout: Annotated[Optional[float], typer.Option(help="give up after this many seconds")] = None) -> None:
    """Wait until jobs end; the exit code says how (0 succeeded, 1 failed, 5 cancelled)."""
    client = ctx.obj.client()
    deadline = None if timeout is None else time.monotonic() + timeout
    final: dict[str, JobInfo] = {}
    while len(final) < len(jobs):
        for job in jobs:
            if job in final:
                continue
            info = client.status(job).jobs[0]
            if info.state in TERMINAL:
                final[job] = info
        if len(final) < len(jobs):
            if deadline is not None and time.monotonic() > deadline:
                raise Timeout(f"still running after {timeout:.0f} s: "
                              f"{', '.join(j for j in jobs if j not in final)}")
            time.sleep(0.5)
    for info in final.values():
        console.print(f"{info.job_id}: {info.state}" + (f" ({info.error})" if info.error else ""))
    code = max(WAIT_EXIT[i.state] for i in final.values())
    if code:
        raise typer.Exit(code)


# ------------------------------------------------------------------------------ demo


@app.command()
def demo(ctx: typer.Context,
         configs: Annotated[Optional[list[Path]], typer.Argument(help="job specs to run")] = None,
         keep: Annotated[bool, typer.Option(help="leave the cluster up afterwards")] = False) -> None:
    """The end-to-end demo: build the tiny model, start a local cluster, run two tiny jobs live."""
    c: Ctx = ctx.obj
    root = Path.cwd() / ".plexrl"
    configs = configs or [REPO_ROOT / "configs" / "tiny-arith.yaml", REPO_ROOT / "configs" / "tiny-arith-b.yaml"]
    console.rule("building the tiny model (cached)")
    subprocess.run([sys.executable, "-m", "worker.tiny", "--root", str(root)], check=True, cwd=REPO_ROOT)
    specs = [_load(f, [], None) for f in configs]
    console.rule("starting the local cluster")
    ctx.invoke(up, ctx=ctx, model=Path(specs[0].model.path))
    client = c.client()
    ids = [client.submit(spec_to_wire(s), submit_id=uuid.uuid4().hex).job_id for s in specs]
    console.rule(f"running {', '.join(ids)}")
    t0 = time.monotonic()
    if console.is_terminal:
        final = _live(c, client, None, 1.0, until_done=True, job_ids=ids)
    else:
        final = _poll_plain(client, ids)
    minutes = (time.monotonic() - t0) / 60
    console.rule("result")
    for j in final:
        console.print(f"{j.job_id} {j.name:<13} {j.state:<9} reward {views.fmt_reward(j.eval_first)} → "
                      f"{views.fmt_reward(j.eval_last)}  ({j.step} steps, {j.step / minutes:.0f}/min)")
    if not keep:
        ctx.invoke(down, ctx=ctx)
    if any(j.state != "succeeded" for j in final):
        raise typer.Exit(ExitCode.JOB_FAILED)


def _poll_plain(client: Client, ids: list[str]) -> list[JobInfo]:
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


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def simulate(ctx: typer.Context,
             trace: Annotated[Optional[Path], typer.Argument(help="trace file (.json/.jsonl); default: generated")]
             = None) -> None:
    """Replay a job trace on the daemon's own scheduler with a simulated clock, under every policy.

    Extra options go to the simulator (see `plexctl simulate --help-sim`), e.g. --quick, --jobs N, --gpus G.
    """
    args = [str(trace)] if trace else []
    extra = ["--help" if a == "--help-sim" else a for a in ctx.args]
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "simulate.py"), *args, *extra], cwd=REPO_ROOT)
    if proc.returncode:
        raise typer.Exit(proc.returncode)


# ------------------------------------------------------------------------------ entry


def main() -> None:
    try:
        rv = app(standalone_mode=False)
    except PlexError as exc:
        if os.environ.get("PLEXRL_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(ExitCode.USAGE)
    except (click.exceptions.Abort, KeyboardInterrupt):
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
