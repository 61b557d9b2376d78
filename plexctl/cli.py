"""plexctl: the command line of a PlexRL cluster.

Verbs: ``up`` / ``down`` (a cluster), ``validate`` / ``submit`` (job specs), ``status``,
``ls``, ``logs``, ``cancel``, ``wait`` (jobs), ``keygen`` / ``share`` (keys; see ``plexctl.auth``)
and ``demo`` (the tiny end-to-end run).
Listing commands take ``--json``; ``ls -q`` prints bare ids for piping. Known errors become
one line on stderr and a distinct exit code (``plexctl.errors.ExitCode``); a traceback only
with ``PLEXRL_DEBUG=1``. This module never imports torch or vLLM: building the tiny model
runs in a child process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional, cast

import click
import msgspec
import typer
from rich.console import Console
from rich.live import Live

from daemon.scheduler import POLICIES
from plexctl import auth, inputs, views
from plexctl import slurm as S
from plexctl.client import Client, current_user
from plexctl.cluster import cluster_dir, endpoint_path, pid_alive, plexrl_home, read_endpoint
from plexctl.errors import DaemonUnreachable, ExitCode, KeyRefused, PlexError, StartFailed, Timeout, UsageError
from plexctl.protocol import JOB_STATES, JobInfo
from plexctl.sizes import fmt_bytes, parse_bytes
from plexctl.spec import SpecError, load_spec, model_dir_problem, spec_to_wire

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Run many RLVR fine-tuning jobs on shared, resident engines.",
)
console = Console()

REPO_ROOT = Path(__file__).resolve().parents[1]
TERMINAL = ("succeeded", "failed", "cancelled", "interrupted")  # interrupted: it resumes at the next `up`
WAIT_EXIT = {
    "succeeded": ExitCode.OK,
    "failed": ExitCode.JOB_FAILED,
    "cancelled": ExitCode.JOB_CANCELLED,
    "interrupted": ExitCode.INTERRUPTED,
}


class Ctx:
    def __init__(self, cluster: str | None, state_dir: Path | None) -> None:
        self.named = cluster is not None or state_dir is not None
        self.state_dir = state_dir or cluster_dir(cluster or _only_cluster())

    def client(self, timeout: float = 10.0) -> Client:
        ep = read_endpoint(self.state_dir)
        if ep.mode == "local" and ep.host == socket.gethostname() and not pid_alive(ep.pid):
            raise DaemonUnreachable(
                f"cluster at {self.state_dir} is not running (its daemon, pid {ep.pid}, "
                "has exited; start it with `plexctl up --local`)"
            )
        return Client(ep.address, timeout=timeout)


def _only_cluster() -> str | None:
    """With no --cluster: the one cluster that exists, if the default one does not."""
    if os.environ.get("PLEXRL_CLUSTER") or cluster_dir(None).exists():
        return None
    clusters = [d.name for d in (plexrl_home() / "clusters").glob("*") if d.is_dir()]
    return clusters[0] if len(clusters) == 1 else None


@app.callback()
def _global(
    ctx: typer.Context,
    cluster: Annotated[Optional[str], typer.Option("--cluster", "-c", help="cluster name")] = None,
    state_dir: Annotated[Optional[Path], typer.Option(help="cluster state directory")] = None,
) -> None:
    ctx.obj = Ctx(cluster, state_dir)


# ------------------------------------------------------------------------------ cluster


def _local_model_default() -> Path:
    return Path.cwd() / ".plexrl" / "models" / "tiny-arith"


@app.command()
def up(
    ctx: typer.Context,
    local: Annotated[bool, typer.Option("--local", help="embedded cluster on this machine (default)")] = True,
    slurm: Annotated[bool, typer.Option("--slurm", help="a Slurm allocation")] = False,
    model: Annotated[Optional[Path], typer.Option(help="base model the engines serve")] = None,
    workers: Annotated[int, typer.Option(min=1, max=8, help="local workers (1: both engines in one)")] = 2,
    policy: Annotated[
        str, typer.Option(help="placement: isolated | pack | spread | spread+backfill")
    ] = "spread+backfill",
    max_loras: Annotated[
        Optional[int],
        typer.Option(min=1, help="adapter slots in the rollout engine (default: 4 on CPU, sized for the jobs on GPUs)"),
    ] = None,
    max_lora_rank: Annotated[
        Optional[int], typer.Option(min=1, help="highest LoRA rank the rollout engines load (default 64)")
    ] = None,
    device: Annotated[
        str, typer.Option(help="where engines run: auto (a GPU when the worker sees one) | cpu | cuda")
    ] = "auto",
    dtype: Annotated[
        str,
        typer.Option(
            help="weight dtype of the engines: auto (bfloat16 on GPUs, float32 on CPU) | float32 | bfloat16 | float16"
        ),
    ] = "auto",
    gpu_memory_utilization: Annotated[
        Optional[float],
        typer.Option(min=0.05, max=1.0, help="share of its GPUs' memory a rollout engine takes (default 0.9)"),
    ] = None,
    micro_batch_tokens: Annotated[
        Optional[int], typer.Option(min=1, help="padded tokens of one trainer micro-batch (default 16384)")
    ] = None,
    rollout_gpus: Annotated[
        Optional[int],
        typer.Option(min=1, help="--slurm: GPUs of each node given to rollout engines (default: 3/4 of them)"),
    ] = None,
    trainer_gpus: Annotated[
        Optional[int],
        typer.Option(
            min=1, help="--slurm: GPUs of each node given to trainer engines, one each (default: 1/4 of them)"
        ),
    ] = None,
    tp: Annotated[int, typer.Option(min=1, help="--slurm: GPUs of one rollout engine (tensor parallel)")] = 1,
    max_model_len: Annotated[
        Optional[int],
        typer.Option(
            min=16,
            help="tokens of a sequence (prompt and completion) the rollout engine holds "
            "(default: the model's context, at most 4096)",
        ),
    ] = None,
    device_slots: Annotated[int, typer.Option(min=1, help="jobs whose state the trainer keeps on device")] = 4,
    host_mem: Annotated[
        str,
        typer.Option(
            help="host-memory tier for swapped-out job state; each trainer makes one arena (pinned on CUDA) "
            "of this plus its spill, write-behind and transit allowances, 13/8 of it by default"
        ),
    ] = "8G",
    nvme_dir: Annotated[Optional[Path], typer.Option(help="node-local NVMe tier (default: node scratch)")] = None,
    nvme_bytes: Annotated[str, typer.Option(help="capacity of the NVMe tier")] = "64G",
    write_behind: Annotated[
        Optional[str],
        typer.Option(
            help="host memory beyond --host-mem for job state on its way to NVMe, written while the "
            "trainer goes on (default: a quarter of --host-mem, at least 1G; 0: written first)"
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the engines")] = 900.0,
    drain_timeout: Annotated[
        Optional[float],
        typer.Option(
            help="seconds running jobs get to checkpoint when the cluster stops (default: 30 local; "
            "--slurm: the signal grace less a margin)"
        ),
    ] = None,
    name: Annotated[Optional[str], typer.Option(help="--slurm: the cluster's name (its state directory)")] = None,
    nodes: Annotated[int, typer.Option(min=1, help="--slurm: nodes, one worker each")] = 1,
    gpus_per_node: Annotated[int, typer.Option(min=0, help="--slurm: GPUs per node")] = 0,
    time_limit: Annotated[
        str, typer.Option("--time", help="--slurm: time limit (minutes, HH:MM:SS, D-HH:MM:SS)")
    ] = "24:00:00",
    partition: Annotated[Optional[str], typer.Option(help="--slurm: partition")] = None,
    account: Annotated[Optional[str], typer.Option(help="--slurm: account")] = None,
    qos: Annotated[Optional[str], typer.Option(help="--slurm: quality of service")] = None,
    exclusive: Annotated[bool, typer.Option("--exclusive", help="--slurm: whole nodes")] = False,
    constraint: Annotated[Optional[str], typer.Option(help="--slurm: node features")] = None,
    cpus_per_task: Annotated[Optional[int], typer.Option(min=1, help="--slurm: CPUs per node's task")] = None,
    mem: Annotated[Optional[str], typer.Option(help="--slurm: memory per node, e.g. 200G")] = None,
    signal_grace: Annotated[
        int, typer.Option(min=10, help="--slurm: seconds between the drain signal and the end of the allocation")
    ] = 300,
    engines: Annotated[
        Optional[list[str]], typer.Option(help="--slurm: engines of node i, cycled (default rollout,trainer on each)")
    ] = None,
    scratch: Annotated[
        Optional[str],
        typer.Option(help="--slurm: node-local directory for the NVMe tier (default $SLURM_TMPDIR, $TMPDIR)"),
    ] = None,
    join: Annotated[Optional[str], typer.Option(help="--slurm: add workers to the running cluster NAME")] = None,
    submit_with: Annotated[str, typer.Option(help="--slurm: submitit | sbatch")] = "submitit",
    no_wait: Annotated[bool, typer.Option("--no-wait", help="--slurm: return once submitted")] = False,
    trust_user_code: Annotated[
        Optional[list[str]],
        typer.Option(
            "--trust-user-code",
            metavar="USER",
            help="a user whose code runs with your rights (algo.loss_fn in the trainer, loops "
            "and environments unjailed); repeat for several",
        ),
    ] = None,
    metrics_port: Annotated[
        Optional[int], typer.Option(min=0, help="serve Prometheus metrics on this port (0: a free one; default: off)")
    ] = None,
    worker_grace: Annotated[
        Optional[float],
        typer.Option(
            min=1.0,
            help="seconds a worker that misses heartbeats (suspect: no new calls, its jobs kept) may "
            "stay silent before it is lost (default 60: a 30 s stall survives); a worker whose "
            "process exits is lost at once",
        ),
    ] = None,
) -> None:
    """Start a cluster: the daemon plus its workers, and wait until the engines are ready."""
    if policy not in POLICIES:
        raise UsageError(f"--policy {policy!r}: choose one of {', '.join(POLICIES)}")
    sizes: dict[str, int] = {}
    for option, value in (("--host-mem", host_mem), ("--nvme-bytes", nvme_bytes), ("--write-behind", write_behind)):
        if value is not None:
            try:
                sizes[option] = parse_bytes(value)
            except ValueError as exc:
                raise UsageError(f"{option}: {exc}") from None
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: choose auto, cpu or cuda")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype {dtype!r}: choose auto, float32, bfloat16 or float16")
    engine_args = [f"--device={device}", f"--dtype={dtype}"]
    for flag, setting in (
        ("--max-loras", max_loras),
        ("--max-lora-rank", max_lora_rank),
        ("--gpu-memory-utilization", gpu_memory_utilization),
        ("--micro-batch-tokens", micro_batch_tokens),
    ):
        if setting is not None:
            engine_args.append(f"{flag}={setting}")
    c: Ctx = ctx.obj
    model = (model or _local_model_default()).resolve()
    if not (model / "config.json").exists():
        raise UsageError(
            f"--model {model}: not a Hugging Face model directory (no config.json); "
            "build the tiny one with `python -m worker.tiny`"
        )
    problem = model_dir_problem(model)
    if problem:  # the engines would fail on it, after minutes of start-up on a real model
        raise StartFailed(f"--model: {problem}; nothing was started")
    if slurm or join:
        state_dir = c.state_dir if c.named or not (name or join) else cluster_dir(join or name)
        worker_args = [*engine_args, f"--device-slots={device_slots}", *(f"{k}={v}" for k, v in sizes.items())]
        if nvme_dir is not None:
            worker_args.append(f"--nvme-dir={nvme_dir}")
        if max_model_len is not None:
            worker_args.append(f"--max-model-len={max_model_len}")
        spec = S.SlurmSpec(
            name=join or name or state_dir.name,
            state_dir=str(state_dir.resolve()),
            model=str(model),
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            time=time_limit,
            partition=partition,
            account=account,
            qos=qos,
            exclusive=exclusive,
            constraint=constraint,
            cpus_per_task=cpus_per_task,
            mem=mem,
            signal_grace=signal_grace,
            engines=engines or ["rollout,trainer"],
            scratch=scratch,
            policy=policy,
            join=join is not None,
            worker_args=worker_args,
            drain_timeout=drain_timeout,
            trusted_users=list(trust_user_code or []),
            metrics_port=metrics_port,
            rollout_gpus=rollout_gpus,
            trainer_gpus=trainer_gpus,
            tp=tp,
            worker_grace=worker_grace,
        )
        _up_slurm(spec, submit_with, timeout, no_wait)
        return
    c.state_dir.mkdir(parents=True, exist_ok=True)
    auth.set_up_cluster(c.state_dir, plexrl_home(), current_user())
    if _alive(c.state_dir):
        console.print(f"cluster at {c.state_dir} is already up")
        return
    endpoint_path(c.state_dir).unlink(missing_ok=True)
    layouts = [["rollout", "trainer"]] if workers == 1 else [["rollout"]] + [["trainer"]] * (workers - 1)
    cmd = [sys.executable, "-m", "daemon.main", "--state-dir", str(c.state_dir), "--model", str(model)]
    for engines in layouts:
        cmd += ["--local-worker", ",".join(engines)]
    cmd += ["--policy", policy, "--drain-timeout", str(30.0 if drain_timeout is None else drain_timeout)]
    cmd += [f"--trust-user-code={user}" for user in trust_user_code or []]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    if worker_grace is not None:
        cmd += ["--worker-grace", f"{worker_grace:g}"]
    threads = max(1, (os.cpu_count() or 1) // len(layouts))  # the workers share this machine's cores
    worker_args = [
        *engine_args,
        f"--device-slots={device_slots}",
        f"--threads={threads}",
        *(f"{k}={v}" for k, v in sizes.items()),
    ]
    if nvme_dir is not None:
        worker_args.append(f"--nvme-dir={nvme_dir.resolve()}")
    if max_model_len is not None:
        worker_args.append(f"--max-model-len={max_model_len}")
    cmd += [f"--worker-arg={a}" for a in worker_args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    with open(c.state_dir / "daemon.log", "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            cwd=REPO_ROOT,
        )
    with _stopped_on_failure(proc), console.status("starting the daemon") as spinner:
        while True:
            elapsed = time.monotonic() - t0
            if proc.poll() is not None:
                last = _last_line(c.state_dir / "daemon.log")
                raise DaemonUnreachable(
                    f"the daemon exited with code {proc.returncode}"
                    + (f": {last}" if last.startswith("plexd: ") else "")
                    + f" (see {c.state_dir / 'daemon.log'})"
                )
            if elapsed > timeout:
                raise Timeout(f"engines not ready after {timeout:.0f} s, stopped (see {c.state_dir}/workers/*.log)")
            if endpoint_path(c.state_dir).exists():
                try:
                    pong = c.client().ping()
                except DaemonUnreachable:
                    pong = None
                if pong is not None:
                    if pong.problems:
                        raise StartFailed(f"cluster failed to start, stopped: {pong.problems[0]}")
                    spinner.update(
                        f"starting engines: {pong.engines_ready}/{pong.engines_total} ready ({elapsed:.0f} s)"
                    )
                    if pong.engines_total and pong.engines_ready == pong.engines_total and pong.workers == len(layouts):
                        break
            time.sleep(0.5)
    console.print(
        f"cluster up in {time.monotonic() - t0:.1f} s: {len(layouts)} workers, "
        f"model {model.name}, policy {policy}, state {c.state_dir}"
    )
    if metrics_port is not None and (c.state_dir / "metrics.json").exists():
        console.print(f"Prometheus metrics: {json.loads((c.state_dir / 'metrics.json').read_text())['url']}")


@contextlib.contextmanager
def _stopped_on_failure(daemon: subprocess.Popen) -> Iterator[None]:
    """Around `up`'s wait for the engines: whatever ends it early (an engine that failed, the
    daemon's exit, the timeout, Ctrl-C) stops the daemon and every process it started."""
    try:
        yield
    except BaseException:
        _stop_local(daemon)
        raise


def _stop_local(daemon: subprocess.Popen) -> None:
    """Stop a local daemon that failed to start and the workers it started (its session): the
    daemon stops its workers on SIGTERM; what is left of the session then is killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(daemon.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        daemon.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(daemon.pid, signal.SIGKILL)
    daemon.wait()


def _up_slurm(spec: S.SlurmSpec, via: str, timeout: float, no_wait: bool) -> None:
    if via not in ("submitit", "sbatch"):
        raise UsageError(f"--submit-with {via!r}: choose submitit or sbatch")
    S.time_minutes(spec.time)
    state_dir = Path(spec.state_dir)
    if not spec.join:
        state_dir.mkdir(parents=True, exist_ok=True)
        auth.set_up_cluster(state_dir, plexrl_home(), current_user())
    alive = _alive(state_dir)
    if spec.join and not alive:
        raise DaemonUnreachable(f"--join {spec.name}: no running cluster at {state_dir}")
    if not spec.join:
        if alive:
            console.print(f"cluster at {state_dir} is already up")
            return
        waiting = [
            a
            for a in S.read_allocations(state_dir)
            if not a.join and S.job_state(a.job_id)[0] in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED")
        ]
        if waiting:
            console.print(
                f"cluster {spec.name} already has Slurm job {waiting[0].job_id}; "
                f"`plexctl --state-dir {state_dir} status` follows it"
            )
            return
    state_dir.mkdir(parents=True, exist_ok=True)
    before = _ping_or_none(state_dir)
    workers_before = before.workers if (before and spec.join) else 0
    expected = S.planned_workers(spec)  # workers the allocation starts (one per engine on GPU nodes)
    job_id = S.submit_submitit(spec) if via == "submitit" else S.submit_sbatch(spec)
    S.record_allocation(state_dir, S.Allocation(job_id, spec.nodes, spec.join, time.time(), via, S.drain_timeout(spec)))
    console.print(
        f"submitted Slurm job {job_id} ({spec.nodes} node{'s' * (spec.nodes > 1)}, via {via}); state {state_dir}"
    )
    if no_wait:
        return
    t0 = time.monotonic()
    with console.status("waiting for Slurm") as spinner:
        while True:
            elapsed = time.monotonic() - t0
            state, reason = S.job_state(job_id)
            if state in ("GONE", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "COMPLETED"):
                raise DaemonUnreachable(
                    f"Slurm job {job_id} ended ({state}) before the cluster was up "
                    f"(see {state_dir}/slurm/, {state_dir}/daemon.log)"
                )
            if elapsed > timeout:
                raise Timeout(
                    f"cluster not ready after {timeout:.0f} s: Slurm job {job_id} is {state}"
                    + (f" ({reason})" if reason and reason != "None" else "")
                    + "; it stays submitted (`plexctl down` cancels it)"
                )
            pong = _ping_or_none(state_dir) if state == "RUNNING" else None
            if pong is None:
                spinner.update(
                    f"Slurm job {job_id}: {state}"
                    + (f" ({reason})" if reason and reason != "None" else "")
                    + f" ({elapsed:.0f} s)"
                )
            else:
                if pong.problems:  # the allocation's tasks are what this `up` started: cancelled
                    S.cancel(job_id)
                    raise StartFailed(f"cluster failed to start, Slurm job {job_id} cancelled: {pong.problems[0]}")
                spinner.update(
                    f"starting engines: {pong.engines_ready}/{pong.engines_total} ready, "
                    f"{pong.workers - workers_before}/{expected} workers ({elapsed:.0f} s)"
                )
                if pong.workers - workers_before >= expected and pong.engines_ready == pong.engines_total:
                    break
            time.sleep(1.0)
    console.print(
        f"cluster {spec.name} up in {time.monotonic() - t0:.1f} s on Slurm job {job_id}: "
        f"{spec.nodes} node{'s' * (spec.nodes > 1)}" + (" joined" if spec.join else "")
    )


def _ping_or_none(state_dir: Path):
    try:
        return Client(read_endpoint(state_dir).address).ping(timeout=2.0, retries=0)
    except PlexError:
        return None


def _slurm_note(state_dir: Path) -> str | None:
    """What Slurm says of this cluster's allocation while its daemon does not answer."""
    for alloc in reversed(S.read_allocations(state_dir)):
        if alloc.join:
            continue
        state, reason = S.job_state(alloc.job_id)
        if state in ("", "GONE"):
            return None
        why = f" ({reason})" if reason and reason != "None" else ""
        if state == "PENDING":
            return f"cluster {state_dir.name}: pending in Slurm as job {alloc.job_id}{why}"
        return f"cluster {state_dir.name}: Slurm job {alloc.job_id} is {state}{why}; the daemon is not up yet"
    return None


def _alive(state_dir: Path) -> bool:
    try:
        ep = read_endpoint(state_dir)
    except PlexError:
        return False
    if ep.mode == "local" and ep.host in ("", socket.gethostname()) and not pid_alive(ep.pid):
        return False  # (a Slurm cluster's daemon runs on its first node: only a ping tells)
    try:
        Client(ep.address).ping(timeout=2.0, retries=1)
        return True
    except KeyRefused:
        raise  # it runs, but not for this user
    except DaemonUnreachable:
        return False


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


@app.command()
def down(
    ctx: typer.Context,
    timeout: Annotated[
        Optional[float],
        typer.Option(
            min=0, help="seconds to wait for the daemon to exit (default 60; on Slurm its drain timeout + 60)"
        ),
    ] = None,
) -> None:
    """Stop the cluster: each running job checkpoints at the end of its step (it resumes there at the next `up`)."""
    c: Ctx = ctx.obj
    allocations, pending = [], []
    for alloc in S.read_allocations(c.state_dir):
        state = S.job_state(alloc.job_id)[0]
        if state == "PENDING":  # nothing runs there yet: nothing to drain
            S.cancel(alloc.job_id)
            console.print(f"Slurm job {alloc.job_id} cancelled while pending")
            pending.append(alloc)
        elif state not in ("", "GONE"):
            allocations.append(alloc)
    if timeout is None:
        timeout = max([60.0] + [a.drain_timeout + 60.0 for a in allocations if not a.join])
    try:
        ep = read_endpoint(c.state_dir)
    except PlexError:
        if not allocations and not pending:
            raise
        ep = None
    deadline = time.monotonic() + timeout
    if ep is not None:
        try:
            Client(ep.address).down()
        except DaemonUnreachable:
            if not allocations and not pending:
                raise
        if ep.mode == "slurm":  # the daemon runs on another node: wait until it no longer answers
            while _ping_or_none(c.state_dir) is not None and time.monotonic() < deadline:
                time.sleep(0.5)
            if _ping_or_none(c.state_dir) is not None:  # still draining: cancelling now would lose its checkpoints
                raise Timeout(
                    f"the daemon is still draining after {timeout:.0f} s; run `plexctl down` again "
                    f"to wait on, or `scancel` its Slurm job to stop it now"
                )
        else:
            while pid_alive(ep.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid_alive(ep.pid):
                raise Timeout(f"daemon pid {ep.pid} still running after {timeout:.0f} s")
    for alloc in allocations:  # the allocation ends once its tasks exit; cancel what does not
        if not S.wait_gone(alloc.job_id, max(5.0, deadline - time.monotonic())):
            S.cancel(alloc.job_id)
            S.wait_gone(alloc.job_id, 30.0)
        console.print(f"Slurm job {alloc.job_id} ended")
    console.print("cluster down")


@app.command()
def keygen() -> None:
    """Make your own key pair (if missing) and print the public file to give a cluster's owner."""
    user = current_user()
    public = auth.ensure_user_keys(plexrl_home(), user)
    print(public)  # not wrapped: scripts take the path from the first line
    print(f"ask the cluster's owner to run: plexctl share {user} --key {public}")


@app.command()
def share(
    ctx: typer.Context,
    user: Annotated[str, typer.Argument(help="the user to let in")],
    key: Annotated[Path, typer.Option("--key", help="their public key file (`plexctl keygen` makes it)")],
) -> None:
    """Let another user's key into this cluster (owner only): they see and cancel their own jobs."""
    c: Ctx = ctx.obj
    if not (auth.keys_dir(c.state_dir) / "owner").exists():
        raise UsageError(f"no cluster keys at {auth.keys_dir(c.state_dir)} (start the cluster with `plexctl up`)")
    owner = auth.owner_of(c.state_dir)
    if current_user() != owner:
        raise UsageError(f"only the cluster's owner ({owner}) may share it")
    if user == owner:
        raise UsageError(f"{user} owns this cluster: `plexctl up` lets their key in")
    auth.grant(c.state_dir, user, key)
    console.print(f"{user} may now use the cluster at {c.state_dir}", markup=False, highlight=False)


# ------------------------------------------------------------------------------ specs


def _load(file: Path, overrides: list[str], name: str | None):
    try:
        return load_spec(file, overrides, name)
    except SpecError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        raise typer.Exit(ExitCode.USAGE) from None


@app.command()
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
def plan(
    files: Annotated[list[Path], typer.Argument(help="job spec YAML files (one base model)")],
    gpus: Annotated[str, typer.Option(help="the node's GPUs, e.g. 8x80G, 4x141G; 0 for a CPU node")] = "8x80G",
    node_mem: Annotated[str, typer.Option(help="the node's host memory")] = "256G",
    node_nvme: Annotated[str, typer.Option(help="the node's local NVMe")] = "1T",
    tp: Annotated[int, typer.Option(min=1, help="GPUs of one rollout engine (tensor parallel)")] = 1,
    rollout_gpus: Annotated[Optional[int], typer.Option(min=1, help="GPUs given to rollout engines")] = None,
    trainer_gpus: Annotated[Optional[int], typer.Option(min=1, help="GPUs given to trainers, one each")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="engine dtype (default: bfloat16 on GPUs)")] = None,
    max_lora_rank: Annotated[int, typer.Option(min=1, help="as `plexctl up --max-lora-rank`")] = 64,
    max_loras: Annotated[int, typer.Option(min=1, help="adapter slots of a rollout engine")] = 4,
    device_slots: Annotated[int, typer.Option(min=1, help="jobs whose state a trainer keeps on its GPU")] = 4,
    host_mem: Annotated[str, typer.Option(help="host tier of each trainer, as `up --host-mem`")] = "8G",
    nvme_bytes: Annotated[str, typer.Option(help="NVMe tier of each trainer, as `up --nvme-bytes`")] = "64G",
    gpu_memory_utilization: Annotated[float, typer.Option(min=0.05, max=1.0)] = 0.9,
    max_model_len: Annotated[Optional[int], typer.Option(min=16)] = None,
    micro_batch_tokens: Annotated[int, typer.Option(min=1)] = 16384,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a.b=c in every spec")] = None,
) -> None:
    """The memory plan of a node for these jobs, before any GPU-hour is spent: per engine the weights,
    KV cache, adapter slots and job state on each tier, and what does not fit (exit 7). Needs no cluster;
    a model directory that is not here is planned from its known shape (Qwen2.5, Llama 3.1)."""
    from plexctl import memplan as MP

    try:
        node = MP.NodeShape.parse(gpus, host=node_mem, nvme=node_nvme)
        options = MP.ClusterOptions(
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            device_slots=device_slots,
            host_tier_bytes=parse_bytes(host_mem),
            nvme_tier_bytes=parse_bytes(nvme_bytes),
            max_model_len=max_model_len,
            micro_batch_tokens=micro_batch_tokens,
        )
        specs = [load_spec(f, set_ or [], check_files=False) for f in files]
        engines = plan_engines(node.gpus, rollout_gpus, trainer_gpus, tp)
        result = MP.plan_for_specs(specs, node, engines, options)
    except SpecError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        raise typer.Exit(ExitCode.USAGE) from None
    except ValueError as exc:
        raise UsageError(f"--gpus {gpus!r}: {exc}" if "GPU shape" in str(exc) else str(exc)) from None
    print(MP.render_plan(result))
    if not result.fits:
        raise typer.Exit(ExitCode.REFUSED)


def plan_engines(gpus: int, rollout_gpus: int | None, trainer_gpus: int | None, tp: int) -> list:
    """The engines of a node as `up --slurm` places them (``plexctl.layout``), as the plan's shapes."""
    from plexctl import memplan as MP
    from plexctl.layout import place_workers

    workers = place_workers(
        "(--gpus)",
        [str(i) for i in range(gpus)],
        ["rollout", "trainer"],
        rollout_gpus=rollout_gpus,
        trainer_gpus=trainer_gpus,
        tp=tp,
    )
    return [MP.EngineShape(cast(MP.EngineKind, kind), len(w.devices)) for w in workers for kind in w.engines]


@app.command()
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
    spec = _load(file, set_ or [], name)
    rep = inputs.submit(ctx.obj.client(), spec_to_wire(spec), uuid.uuid4().hex, replace=replace)
    replaced = f", replacing {', '.join(rep.replaced)} (cancelled)" if rep.replaced else ""
    console.print(rep.job_id if quiet else f"submitted {rep.job_id} ({spec.name}){replaced}")


# ------------------------------------------------------------------------------ jobs


def _uptime(c: Ctx) -> float:
    try:
        return time.time() - read_endpoint(c.state_dir).started_at
    except PlexError:
        return 0.0


@app.command()
def status(
    ctx: typer.Context,
    job: Annotated[Optional[str], typer.Argument(help="job id or name (default: all)")] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="live view until interrupted")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON output")] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="refresh seconds with --watch")] = 1.0,
) -> None:
    """Jobs (state, step, reward, policy version, engine) and engines."""
    c: Ctx = ctx.obj
    if (c.state_dir / S.SLURM_FILE).exists() and _ping_or_none(c.state_dir) is None:
        note = _slurm_note(c.state_dir)
        if note is not None:
            if as_json:
                print(json.dumps({"jobs": [], "engines": [], "slurm": note}, indent=2))
            else:
                print(note)
            return
    client = c.client()
    if watch and not as_json and console.is_terminal:
        _live(c, client, job, interval, until_done=False)
        return
    while True:
        rep = client.status(job)
        if as_json:
            print(
                json.dumps(
                    {
                        "jobs": [views.job_row(j, rep.now) for j in rep.jobs],
                        "engines": msgspec.to_builtins(rep.engines),
                    },
                    indent=2,
                )
            )
        elif console.is_terminal:
            console.print(views.status_view(rep, _uptime(c)))
        else:
            print(views.plain_status(rep, _uptime(c)), flush=True)
        if not watch:
            return
        time.sleep(interval)


def _live(
    c: Ctx, client: Client, job: str | None, interval: float, until_done: bool, job_ids: list[str] | None = None
) -> list[JobInfo]:
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            rep = client.status(job)
            jobs = [j for j in rep.jobs if job_ids is None or j.job_id in job_ids]
            live.update(views.status_view(msgspec.structs.replace(rep, jobs=jobs), _uptime(c)))
            if until_done and all(j.state in TERMINAL for j in jobs):
                return jobs
            time.sleep(interval)


@app.command()
def top(
    ctx: typer.Context,
    job: Annotated[Optional[str], typer.Argument(help="job id or name (default: all)")] = None,
    interval: Annotated[
        Optional[float],
        typer.Option(min=0.1, help="refresh seconds (live view: default 2; plain text: one frame unless given)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON frame")] = False,
) -> None:
    """Live view: jobs (progress, ETA, reward sparkline, staleness) and engines (utilization, swaps, tiers)."""
    from plexctl import top as T

    c: Ctx = ctx.obj
    feed = T.Top(c.client(), job, uptime_fallback=_uptime(c))
    if as_json:
        print(json.dumps(T.top_json(feed.frame()), indent=2))
    elif console.is_terminal:
        with Live(console=console, refresh_per_second=4, screen=False) as live:
            while True:
                live.update(T.top_view(feed.frame()))
                time.sleep(interval or 2.0)
    else:
        T.watch_plain(feed, interval)


@app.command()
def report(
    ctx: typer.Context,
    job: Annotated[Optional[str], typer.Argument(help="job id or name")] = None,
    vs: Annotated[Optional[str], typer.Option("--vs", help="a second job, overlaid")] = None,
    cluster: Annotated[bool, typer.Option("--cluster", help="the engine timeline")] = False,
    out: Annotated[Path, typer.Option(help="directory for the PNG files")] = Path("plexrl-report"),
    last: Annotated[Optional[float], typer.Option(min=0, help="--cluster: only the last SECONDS")] = None,
) -> None:
    """PNG plots: a job's reward and loss curves (--vs: two jobs overlaid), or the engine timeline (--cluster)."""
    from plexctl import report as R

    if job is None and not cluster:
        raise UsageError("give a JOB (and --vs OTHER) or --cluster")
    R.pyplot()  # a missing matplotlib fails here, before any request
    client = ctx.obj.client()
    paths = []
    if job is not None:
        runs, ids = {}, []
        for ref in [job] + ([vs] if vs else []):
            info = client.status(ref).jobs[0]
            text, offset = "", 0
            while True:
                rep = client.logs(info.job_id, "metrics", offset)
                text, offset = text + rep.data, rep.offset
                if not rep.data:
                    break
            runs[f"{info.job_id} {info.name}"] = R.parse_metrics(text)
            ids.append(info.job_id)
        paths += R.job_plots(runs, out, "-vs-".join(ids))
    if cluster:
        paths.append(R.cluster_timeline(client.status(timeline=True), out / "cluster-timeline.png", last))
    for path in paths:
        print(path)


@app.command("ls")
def ls(
    ctx: typer.Context,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="job ids only")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON output")] = False,
    state: Annotated[Optional[str], typer.Option(help="only jobs in this state")] = None,
) -> None:
    """List jobs."""
    if state is not None and state not in JOB_STATES:
        raise UsageError(f"--state {state!r}: choose one of {', '.join(JOB_STATES)}")
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
def logs(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="job id or name")],
    metrics: Annotated[bool, typer.Option("--metrics", help="the metrics JSONL instead of the log")] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends")] = False,
) -> None:
    """A job's driver log (or its metrics), all of it; with -f, then what follows until the job ends."""
    client = ctx.obj.client()
    job_id = client.status(job).jobs[0].job_id  # a name may pass to a newer job (`submit --replace`) meanwhile
    offset = 0
    while True:  # each reply: a chunk from the offset asked, ending on a whole line where the file goes on
        rep = client.logs(job_id, "metrics" if metrics else "log", offset)
        sys.stdout.write(rep.data)
        sys.stdout.flush()
        offset = rep.offset
        if rep.finished or (not rep.data and not follow):
            return
        if not rep.data:
            time.sleep(0.5)


@app.command()
def export(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="job id or name")],
    checkpoint: Annotated[
        bool,
        typer.Option(
            "--checkpoint", help="the latest checkpoint (adapter, optimizer, data cursor) instead of the latest adapter"
        ),
    ] = False,
    to: Annotated[Path, typer.Option("--to", help="directory to write it in (default: here)")] = Path("."),
) -> None:
    """Copy a job's latest adapter (or checkpoint) out of the cluster, through the daemon, into a
    directory of yours: written with your rights, never read from the owner's files by you."""
    client = ctx.obj.client()
    what = "checkpoint" if checkpoint else "adapter"
    job_id = client.status(job).jobs[0].job_id
    listing = client.export(job_id, what)
    dest = to / f"{job_id}-{listing.source.replace(' ', '-')}"
    if dest.exists():
        raise UsageError(f"{dest} exists; remove it or choose another --to")
    to.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=to))
    try:
        for f in listing.files:
            target = tmp / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                while out.tell() < f.size:
                    chunk = client.export(job_id, what, f.path, out.tell()).data
                    if not chunk:
                        break
                    out.write(chunk)
            if target.stat().st_size != f.size:
                raise PlexError(f"{f.path}: got {target.stat().st_size} of {f.size} bytes (it changed on the cluster?)")
        _verify_manifest(tmp)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    console.print(
        f"{listing.source} of {job_id}: {len(listing.files)} files, "
        f"{fmt_bytes(sum(f.size for f in listing.files))} -> {dest}"
    )


def _verify_manifest(directory: Path) -> None:
    """A checkpoint's files against the sha256 its manifest records (an adapter has none)."""
    manifest = directory / "manifest.json"
    if not manifest.exists():
        return
    for name, record in json.loads(manifest.read_text()).get("files", {}).items():
        digest = hashlib.sha256((directory / name).read_bytes()).hexdigest()
        if digest != record.get("sha256"):
            raise PlexError(f"{name}: does not match the checkpoint's sha256 (corrupt copy)")


@app.command()
def cancel(ctx: typer.Context, jobs: Annotated[list[str], typer.Argument(help="job ids or names")]) -> None:
    """Cancel jobs: each stops at its next call boundary and keeps its last checkpoint."""
    client = ctx.obj.client()
    for job in jobs:
        info = client.cancel(job)
        console.print(f"{info.job_id}: {'cancelling' if info.state == 'running' else info.state}")


@app.command()
def wait(
    ctx: typer.Context,
    jobs: Annotated[list[str], typer.Argument(help="job ids or names")],
    timeout: Annotated[Optional[float], typer.Option(help="give up after this many seconds")] = None,
) -> None:
    """Wait until jobs end; the exit code says how (0 succeeded, 1 failed, 5 cancelled, 8 interrupted:
    stopped with the cluster, they resume at the next `up`)."""
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
                raise Timeout(f"still running after {timeout:.0f} s: {', '.join(j for j in jobs if j not in final)}")
            time.sleep(0.5)
    for info in final.values():
        console.print(f"{info.job_id}: {info.state}" + (f" ({info.error})" if info.error else ""))
    code = max(WAIT_EXIT[i.state] for i in final.values())
    if code:
        raise typer.Exit(code)


# ------------------------------------------------------------------------------ demo


@app.command()
def demo(
    ctx: typer.Context,
    configs: Annotated[Optional[list[Path]], typer.Argument(help="job specs to run")] = None,
    keep: Annotated[bool, typer.Option(help="leave the cluster up afterwards")] = False,
) -> None:
    """The end-to-end demo: build the tiny model, start a local cluster, run two tiny jobs live."""
    c: Ctx = ctx.obj
    root = Path.cwd() / ".plexrl"
    only = [] if configs else ["--only", "tiny-arith"]  # the default jobs' model; given specs may name either
    configs = configs or [REPO_ROOT / "configs" / "tiny-arith.yaml", REPO_ROOT / "configs" / "tiny-arith-b.yaml"]
    console.rule("building the tiny model (cached)")
    subprocess.run([sys.executable, "-m", "worker.tiny", "--root", str(root), *only], check=True, cwd=REPO_ROOT)
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
        console.print(
            f"{j.job_id} {j.name:<13} {j.state:<9} reward {views.fmt_reward(j.eval_first)} → "
            f"{views.fmt_reward(j.eval_last)}  ({j.step} steps, {j.step / minutes:.0f}/min)"
        )
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
def simulate(
    ctx: typer.Context,
    trace: Annotated[Optional[Path], typer.Argument(help="trace file (.json/.jsonl); default: generated")] = None,
) -> None:
    """Replay a job trace on the daemon's own scheduler with a simulated clock, under every policy.

    Extra options go to the simulator (see `plexctl simulate --help-sim`), e.g. --quick, --jobs N, --gpus G.
    The results go to ./simulate.json unless --out says where.
    """
    args = [str(trace.resolve())] if trace else []  # the simulator runs in the repository: paths are the user's
    extra = ["--help" if a == "--help-sim" else a for a in ctx.args]
    if not any(a == "--out" or a.startswith("--out=") for a in extra):
        extra += ["--out", str(Path.cwd() / "simulate.json")]
    extra = [str(Path(a).resolve()) if prev in ("--out", "--trace") else a for prev, a in zip(["", *extra], extra)]
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "simulate.py"), *args, *extra], cwd=REPO_ROOT)
    if proc.returncode:
        raise typer.Exit(proc.returncode)


# ------------------------------------------------------------------------------ entry


# typer >= 0.20 parses with its own copy of click, whose exceptions are not click's
_EXITS: tuple[type[click.exceptions.Exit] | type[typer.Exit], ...] = tuple({click.exceptions.Exit, typer.Exit})
_USAGE_ERRORS = tuple({click.ClickException, getattr(typer, "TyperException", click.ClickException)})
_ABORTS = tuple({click.exceptions.Abort, typer.Abort, KeyboardInterrupt})


def main() -> None:
    try:
        rv = app(standalone_mode=False)
    except PlexError as exc:
        if os.environ.get("PLEXRL_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except _EXITS as exc:
        sys.exit(exc.exit_code)
    except _USAGE_ERRORS as exc:
        show = getattr(exc, "show", None)
        show() if show else print(f"error: {exc}", file=sys.stderr)
        sys.exit(ExitCode.USAGE)
    except _ABORTS:
        sys.exit(130)
    except OSError as exc:  # a path the user gave that is not what it should be
        if os.environ.get("PLEXRL_DEBUG"):
            raise
        where = f": {exc.filename}" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        sys.exit(ExitCode.USAGE)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
