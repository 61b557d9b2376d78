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

import msgspec
import typer

from plexctl.cli.config_options import Style, config_options
from plexctl.cli.context import Ctx, console
from plexctl.common import cluster_config as K
from plexctl.common.errors import DaemonUnreachable, KeyRefused, PlexError, StartFailed, Timeout, UsageError

if TYPE_CHECKING:
    from plexctl.common.protocol import Pong

IMPORT_ROOT = Path(__file__).resolve().parents[2]  # holds the daemon package: the daemon starts from here


def _local_model_default() -> Path:
    return Path.cwd() / ".plexrl" / "models" / "tiny-arith"


UP_STYLES = {
    "models": Style(help_extra="; repeat for several", path=True),
    "nvme_dir": Style(path=True),
    "engines": Style(help_extra=", cycled"),
    "trusted_users": Style(help_extra="; repeat for several", metavar="USER"),
    "job_limits": Style(metavar="NAME=VALUE"),
}


@config_options(after="slurm", styles=UP_STYLES)
def up(
    ctx: typer.Context,
    local: Annotated[bool, typer.Option("--local", help="embedded cluster on this machine (default)")] = True,
    slurm: Annotated[bool, typer.Option("--slurm", help="a Slurm allocation")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the engines")] = 900.0,
    name: Annotated[Optional[str], typer.Option(help="--slurm: the cluster's name (its state directory)")] = None,
    join: Annotated[Optional[str], typer.Option(help="--slurm: add workers to the running cluster NAME")] = None,
    submit_with: Annotated[str, typer.Option(help="--slurm: submitit | sbatch")] = "submitit",
    no_wait: Annotated[bool, typer.Option("--no-wait", help="--slurm: return once submitted")] = False,
    config: K.ClusterConfig = K.DEFAULTS,
) -> None:
    """Start a cluster: the daemon plus its workers, and wait until the engines are ready."""
    on_slurm = bool(slurm or join)
    models = [Path(m) for m in config.models] or [_local_model_default()]
    config = msgspec.structs.replace(
        config,
        models=[str(m.resolve()) for m in dict.fromkeys(models)],
        nvme_dir=config.nvme_dir if config.nvme_dir is None or on_slurm else str(Path(config.nvme_dir).resolve()),
    )
    c: Ctx = ctx.obj
    _check(config, slurm=on_slurm)
    if on_slurm:
        _up_slurm(config, c, name, join, submit_with, timeout, no_wait)
    else:
        _up_local(config, c, timeout)


def _check(config: K.ClusterConfig, slurm: bool) -> None:
    """Refuse a config that cannot start: one line per bad value, then the models."""
    from plexctl.common.spec import model_dir_problem

    problems = K.config_problems(config)
    if slurm and (config.jobs_per_engine is not None):
        problems.append("--jobs-per-engine: local clusters only (a Slurm cluster's engines hold what memory holds)")
    if slurm and config.train_grouping:
        problems.append("--train-grouping, --group-window-ms: local clusters only for now")
    if problems:
        raise UsageError("\n".join(problems))
    for m in map(Path, config.models):
        if not (m / "config.json").exists():
            raise UsageError(
                f"--model {m}: not a Hugging Face model directory (no config.json); "
                "build the tiny one with `python -m plexctl.tiny_models`"
            )
        problem = model_dir_problem(m)
        if problem:  # the engines would fail on it, after minutes of start-up on a real model
            raise StartFailed(f"--model: {problem}; nothing was started")


def _up_local(config: K.ClusterConfig, c: Ctx, timeout: float) -> None:
    """Write the config into the state directory, start the daemon (which starts the workers) and
    wait until every engine is ready."""
    from plexctl.common import auth
    from plexctl.common.client import current_user
    from plexctl.common.cluster import endpoint_path, plexrl_home
    from plexctl.common.limits import parse_limits, set_limits

    c.state_dir.mkdir(parents=True, exist_ok=True)
    auth.set_up_cluster(c.state_dir, plexrl_home(), current_user())
    if config.job_limits:
        set_limits(c.state_dir, parse_limits(config.job_limits))
    if _alive(c.state_dir):
        console().print(f"cluster at {c.state_dir} is already up")
        return
    K.write_config(K.config_path(c.state_dir), config)
    endpoint_path(c.state_dir).unlink(missing_ok=True)
    n = config.workers
    layouts = [["rollout", "trainer"]] if n == 1 else [["rollout"]] + [["trainer"]] * (n - 1)
    cmd = [sys.executable, "-m", "daemon.main", "--state-dir", str(c.state_dir)]
    for engines in layouts:
        cmd += ["--local-worker", ",".join(engines)]
    if config.tinker_port is not None or config.openai_port is not None:  # one key per user serves both
        from plexctl.tinker.keys import ensure_key

        key_file = ensure_key(c.state_dir, current_user())
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
    models = [Path(m) for m in config.models]
    console().print(
        f"cluster up in {time.monotonic() - t0:.1f} s: {len(layouts)} workers, "
        f"{'model' if len(models) == 1 else 'models'} {', '.join(m.name for m in models)}, policy {config.policy}, "
        f"state {c.state_dir}"
    )
    if config.metrics_port is not None and (c.state_dir / "metrics.json").exists():
        console().print(f"Prometheus metrics: {json.loads((c.state_dir / 'metrics.json').read_text())['url']}")
    if config.tinker_port is not None:
        url = _wait_for_tinker(c.state_dir, proc, timeout)
        console().print(f"Tinker API: base_url={url}, api_key in {key_file}")
    if config.openai_port is not None:
        url = _wait_for_tinker(c.state_dir, proc, timeout, openai=True)
        console().print(f"OpenAI API: base_url={url}, api_key in {key_file}")


def _wait_for_tinker(state_dir: Path, daemon: subprocess.Popen, timeout: float, openai: bool = False) -> str:
    """The front end's URL once it listens (its ``tinker.json``): the Tinker API's, or the OpenAI API's."""
    from plexctl.common.cluster import openai_url, tinker_url

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        url = (openai_url if openai else tinker_url)(state_dir)
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


def _up_slurm(
    config: K.ClusterConfig, c: Ctx, name: str | None, join: str | None, via: str, timeout: float, no_wait: bool
) -> None:
    """Write the config where the allocation's node tasks read it, submit the allocation and wait
    until its workers are in."""
    from plexctl.common import auth
    from plexctl.common import slurm as S
    from plexctl.common.client import current_user
    from plexctl.common.cluster import cluster_dir, plexrl_home
    from plexctl.common.limits import parse_limits, set_limits

    if via not in ("submitit", "sbatch"):
        raise UsageError(f"--submit-with {via!r}: choose submitit or sbatch")
    S.time_minutes(config.time_limit)
    state_dir = (c.state_dir if c.named or not (name or join) else cluster_dir(join or name)).resolve()
    spec = S.SlurmSpec(
        name=join or name or state_dir.name,
        state_dir=str(state_dir),
        config=config,
        config_file=str(S.join_config_path(state_dir) if join else K.config_path(state_dir)),
        join=join is not None,
    )
    if (config.tinker_port is not None or config.openai_port is not None) and not join:
        from plexctl.tinker.keys import ensure_key

        state_dir.mkdir(parents=True, exist_ok=True)
        console().print(f"API key in {ensure_key(state_dir, current_user())} (the URLs: tinker.json)")
    if config.job_limits:
        state_dir.mkdir(parents=True, exist_ok=True)
        set_limits(state_dir, parse_limits(config.job_limits))
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
    K.write_config(Path(spec.config_file), config)
    job_id = S.submit_submitit(spec) if via == "submitit" else S.submit_sbatch(spec)
    drain = K.drain_timeout_s(config, slurm=True)
    S.record_allocation(state_dir, S.Allocation(job_id, config.nodes, spec.join, time.time(), via, drain))
    nodes = config.nodes
    console().print(f"submitted Slurm job {job_id} ({nodes} node{'s' * (nodes > 1)}, via {via}); state {state_dir}")
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
        f"{nodes} node{'s' * (nodes > 1)}" + (" joined" if spec.join else "")
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
    from plexctl.common import slurm as S

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
    from plexctl.common import slurm as S
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
