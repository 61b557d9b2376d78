"""`plexctl up` and `plexctl down`: a cluster started on this machine or on a Slurm allocation,
and stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from plexctl.cli.context import Ctx, console
from plexctl.common.errors import DaemonUnreachable, KeyRefused, PlexError, StartFailed, Timeout, UsageError
from plexctl.common.scheduling import POLICIES
from plexctl.common.sizes import parse_bytes

if TYPE_CHECKING:
    from plexctl.cli.slurm import SlurmSpec
    from plexctl.common.protocol import Pong

IMPORT_ROOT = Path(__file__).resolve().parents[2]  # holds the daemon package: the daemon starts from here


def _local_model_default() -> Path:
    return Path.cwd() / ".plexrl" / "models" / "tiny-arith"


def up(
    ctx: typer.Context,
    local: Annotated[bool, typer.Option("--local", help="embedded cluster on this machine (default)")] = True,
    slurm: Annotated[bool, typer.Option("--slurm", help="a Slurm allocation")] = False,
    model: Annotated[
        Optional[list[Path]],
        typer.Option(help="a base model the engines serve (Hugging Face directory); repeat for several"),
    ] = None,
    workers: Annotated[int, typer.Option(min=1, max=8, help="local workers (1: both engines in one)")] = 2,
    policy: Annotated[
        str, typer.Option(help="placement: isolated | pack | spread | spread+backfill")
    ] = "spread+backfill",
    jobs_per_engine: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="cap on the jobs one engine is home to; more wait (default: as many as the engines' memory "
            "holds: a rollout engine's adapter slots, a trainer's host and NVMe tiers)",
        ),
    ] = None,
    train_grouping: Annotated[
        bool,
        typer.Option(
            "--train-grouping",
            help="train the steps of several LoRA jobs of one base in shared passes (each job's update equal "
            "to alone within float rounding, not to the bit; off by default: bench/train_batching.py)",
        ),
    ] = False,
    group_window_ms: Annotated[
        Optional[float],
        typer.Option(min=0.0, help="how long a trainer waits at most for more jobs' steps to share a pass (5 ms)"),
    ] = None,
    max_loras: Annotated[
        Optional[int],
        typer.Option(min=1, help="adapter slots in the rollout engine (default: 4 on CPU, sized for the jobs on GPUs)"),
    ] = None,
    max_lora_rank: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="highest LoRA rank the rollout engines load (default 64 on GPUs, 16 on CPU; with "
            "--tinker-port at least 32, the Tinker SDK's default rank)",
        ),
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
    job_limit: Annotated[
        Optional[list[str]],
        typer.Option(
            "--job-limit",
            metavar="NAME=VALUE",
            help="what each jailed job may take: memory=8G, processes=256, job-dir=2G, tmp=1G, cpu=0 (the "
            "defaults; cpu in CPU seconds; 0: no limit); per user: `plexctl share USER --limit`",
        ),
    ] = None,
    metrics_port: Annotated[
        Optional[int], typer.Option(min=0, help="serve Prometheus metrics on this port (0: a free one; default: off)")
    ] = None,
    tinker_port: Annotated[
        Optional[int],
        typer.Option(
            min=0,
            help="serve the Tinker API on this port (0: a free one; default: off): Tinker SDK code runs "
            "here with base_url and the API key `up` prints the path of",
        ),
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
    from plexctl.cli import slurm as S
    from plexctl.common import auth
    from plexctl.common.client import current_user
    from plexctl.common.cluster import cluster_dir, endpoint_path, plexrl_home
    from plexctl.common.limits import parse_limits, set_limits
    from plexctl.common.spec import model_dir_problem

    limits = parse_limits(job_limit or [])
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
    if tinker_port is not None and max_lora_rank is None:  # a training client at the SDK's default rank fits
        from plexctl.tinker.backend import SDK_DEFAULT_RANK

        engine_args.append(f"--min-lora-rank={SDK_DEFAULT_RANK}")
    c: Ctx = ctx.obj
    models = list(dict.fromkeys(m.resolve() for m in (model or [_local_model_default()])))
    for m in models:
        if not (m / "config.json").exists():
            raise UsageError(
                f"--model {m}: not a Hugging Face model directory (no config.json); "
                "build the tiny one with `python -m worker.tiny_models`"
            )
        problem = model_dir_problem(m)
        if problem:  # the engines would fail on it, after minutes of start-up on a real model
            raise StartFailed(f"--model: {problem}; nothing was started")
    if jobs_per_engine is not None:
        if slurm or join:
            raise UsageError(
                "--jobs-per-engine: local clusters only (a Slurm cluster's engines hold what memory holds)"
            )
        engine_args.append(f"--expected-jobs={jobs_per_engine}")  # the rollout engine keeps their adapters loaded
    if (slurm or join) and (train_grouping or group_window_ms is not None):
        raise UsageError("--train-grouping, --group-window-ms: local clusters only for now")
    if slurm or join:
        state_dir = c.state_dir if c.named or not (name or join) else cluster_dir(join or name)
        worker_args = [*engine_args, f"--device-slots={device_slots}", *(f"{k}={v}" for k, v in sizes.items())]
        if nvme_dir is not None:
            worker_args.append(f"--nvme-dir={nvme_dir}")
        if max_model_len is not None:
            worker_args.append(f"--max-model-len={max_model_len}")
        if tinker_port is not None and not join:
            from plexctl.tinker.keys import ensure_key

            state_dir.mkdir(parents=True, exist_ok=True)
            console().print(f"Tinker API key in {ensure_key(state_dir, current_user())} (the URL: tinker.json)")
        if limits:
            state_dir.mkdir(parents=True, exist_ok=True)
            set_limits(state_dir, limits)
        spec = S.SlurmSpec(
            name=join or name or state_dir.name,
            state_dir=str(state_dir.resolve()),
            model=str(models[0]),
            more_models=[str(m) for m in models[1:]],
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
            tinker_port=tinker_port,
            rollout_gpus=rollout_gpus,
            trainer_gpus=trainer_gpus,
            tp=tp,
            worker_grace=worker_grace,
        )
        _up_slurm(spec, submit_with, timeout, no_wait)
        return
    c.state_dir.mkdir(parents=True, exist_ok=True)
    auth.set_up_cluster(c.state_dir, plexrl_home(), current_user())
    if limits:
        set_limits(c.state_dir, limits)
    if _alive(c.state_dir):
        console().print(f"cluster at {c.state_dir} is already up")
        return
    endpoint_path(c.state_dir).unlink(missing_ok=True)
    layouts = [["rollout", "trainer"]] if workers == 1 else [["rollout"]] + [["trainer"]] * (workers - 1)
    cmd = [sys.executable, "-m", "daemon.main", "--state-dir", str(c.state_dir)]
    cmd += [arg for m in models for arg in ("--model", str(m))]
    for engines in layouts:
        cmd += ["--local-worker", ",".join(engines)]
    cmd += ["--policy", policy, "--drain-timeout", str(30.0 if drain_timeout is None else drain_timeout)]
    if jobs_per_engine is not None:
        cmd += ["--jobs-per-engine", str(jobs_per_engine)]
    if train_grouping:
        cmd += ["--train-grouping"]
    if group_window_ms is not None:
        cmd += ["--group-window-ms", f"{group_window_ms:g}"]
    cmd += [f"--trust-user-code={user}" for user in trust_user_code or []]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    if tinker_port is not None:
        from plexctl.tinker.keys import ensure_key

        key_file = ensure_key(c.state_dir, current_user())
        cmd += ["--tinker-port", str(tinker_port)]
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
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(IMPORT_ROOT), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    with open(c.state_dir / "daemon.log", "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            cwd=IMPORT_ROOT,
        )
    with _stopped_on_failure(proc), console().status("starting the daemon") as spinner:
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
    console().print(
        f"cluster up in {time.monotonic() - t0:.1f} s: {len(layouts)} workers, "
        f"{'model' if len(models) == 1 else 'models'} {', '.join(m.name for m in models)}, policy {policy}, "
        f"state {c.state_dir}"
    )
    if metrics_port is not None and (c.state_dir / "metrics.json").exists():
        console().print(f"Prometheus metrics: {json.loads((c.state_dir / 'metrics.json').read_text())['url']}")
    if tinker_port is not None:
        url = _wait_for_tinker(c.state_dir, proc, timeout)
        console().print(f"Tinker API: base_url={url}, api_key in {key_file}")


def _wait_for_tinker(state_dir: Path, daemon: subprocess.Popen, timeout: float) -> str:
    """The Tinker front end's URL once it listens (its ``tinker.json``)."""
    from plexctl.common.cluster import tinker_url

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        url = tinker_url(state_dir)
        if url is not None:
            return url
        if daemon.poll() is not None:
            break
        time.sleep(0.3)
    _stop_local(daemon)
    raise StartFailed(f"the Tinker API front end did not start, stopped (see {state_dir / 'tinker.log'})")


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


def _up_slurm(spec: SlurmSpec, via: str, timeout: float, no_wait: bool) -> None:
    from plexctl.cli import slurm as S
    from plexctl.common import auth
    from plexctl.common.client import current_user
    from plexctl.common.cluster import plexrl_home

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
            console().print(f"cluster at {state_dir} is already up")
            return
        waiting = [
            a
            for a in S.read_allocations(state_dir)
            if not a.join and S.job_state(a.job_id)[0] in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED")
        ]
        if waiting:
            console().print(
                f"cluster {spec.name} already has Slurm job {waiting[0].job_id}; "
                f"`plexctl --state-dir {state_dir} status` follows it"
            )
            return
    state_dir.mkdir(parents=True, exist_ok=True)
    before = ping_or_none(state_dir)
    workers_before = before.workers if (before and spec.join) else 0
    expected = S.planned_workers(spec)  # workers the allocation starts (one per engine on GPU nodes)
    job_id = S.submit_submitit(spec) if via == "submitit" else S.submit_sbatch(spec)
    S.record_allocation(state_dir, S.Allocation(job_id, spec.nodes, spec.join, time.time(), via, S.drain_timeout(spec)))
    console().print(
        f"submitted Slurm job {job_id} ({spec.nodes} node{'s' * (spec.nodes > 1)}, via {via}); state {state_dir}"
    )
    if no_wait:
        return
    t0 = time.monotonic()
    with console().status("waiting for Slurm") as spinner:
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
            pong = ping_or_none(state_dir) if state == "RUNNING" else None
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
    console().print(
        f"cluster {spec.name} up in {time.monotonic() - t0:.1f} s on Slurm job {job_id}: "
        f"{spec.nodes} node{'s' * (spec.nodes > 1)}" + (" joined" if spec.join else "")
    )


def ping_or_none(state_dir: Path) -> Pong | None:
    from plexctl.common.client import Client
    from plexctl.common.cluster import read_endpoint

    try:
        return Client(read_endpoint(state_dir).address).ping(timeout=2.0, retries=0)
    except PlexError:
        return None


def slurm_note(state_dir: Path) -> str | None:
    """What Slurm says of this cluster's allocation while its daemon does not answer."""
    from plexctl.cli import slurm as S

    for alloc in reversed(S.read_allocations(state_dir)):
        if alloc.join:
            continue
        state, reason = S.job_state(alloc.job_id)
        if state == "GONE":
            return None
        if state == "":
            return (
                f"cluster {state_dir.name}: the daemon does not answer, and Slurm did not say "
                f"where job {alloc.job_id} is ({reason})"
            )
        why = f" ({reason})" if reason and reason != "None" else ""
        if state == "PENDING":
            return f"cluster {state_dir.name}: pending in Slurm as job {alloc.job_id}{why}"
        return f"cluster {state_dir.name}: Slurm job {alloc.job_id} is {state}{why}; the daemon is not up yet"
    return None


def _alive(state_dir: Path) -> bool:
    from plexctl.common.client import Client
    from plexctl.common.cluster import pid_alive, read_endpoint

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
    from plexctl.cli import slurm as S
    from plexctl.common.client import Client
    from plexctl.common.cluster import pid_alive, read_endpoint

    c: Ctx = ctx.obj
    allocations, pending = [], []
    for alloc in S.read_allocations(c.state_dir):
        state = S.job_state(alloc.job_id)[0]
        if state == "PENDING":  # nothing runs there yet: nothing to drain
            S.cancel(alloc.job_id)
            console().print(f"Slurm job {alloc.job_id} cancelled while pending")
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
            while ping_or_none(c.state_dir) is not None and time.monotonic() < deadline:
                time.sleep(0.5)
            if ping_or_none(c.state_dir) is not None:  # still draining: cancelling now would lose its checkpoints
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
        console().print(f"Slurm job {alloc.job_id} ended")
    console().print("cluster down")
