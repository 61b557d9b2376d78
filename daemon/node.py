"""What runs on each node of a Slurm allocation (one task per node, under ``srun``).

Its command line names the state directory (and a joining allocation's own config); every
setting comes from the cluster's config file (``plexctl.common.cluster_config``), which ``plexctl
up`` wrote and the daemon and workers this task starts read too. Task 0 starts the daemon, then
the node's workers; the others start their workers once the daemon's endpoint answers; a joining
allocation's tasks (``--join``) start workers only.

Workers (``plexctl.common.layout``): one per node without GPUs, named after the node, with the
node's scratch; on a GPU node one per GPU group, ``NODE-gI``, each with its own GPUs and scratch
(a joining allocation's ids carry its job id). A worker that fails is logged, the others go on;
the task stops them all when it ends and removes their scratch.

Signals: on task 0, Slurm's SIGUSR1/SIGUSR2 (preemption, the time limit) drain the daemon, then
requeue the allocation (``scontrol requeue``), whose daemon resumes every job from its checkpoint;
``scancel``'s SIGTERM drains and ends it. Other tasks ignore the signal (their workers exit when
the daemon says so; a joining allocation's leave at once). ``plexctl down`` requeues nothing. A
daemon that crashes is started again (``DAEMON_RESTARTS``) on the same port and state directory.
Exit codes: 0 clean (down or drained), else the code of the daemon or worker that failed.
See docs/slurm.md for the whole sequence.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from daemon.main import REPO_ROOT, child_env, wait_or_kill
from plexctl.common import auth
from plexctl.common import protocol as P
from plexctl.common.client import Client
from plexctl.common.cluster import endpoint_path, read_endpoint
from plexctl.common.cluster_config import ConfigError, config_path, read_config
from plexctl.common.errors import ExitCode, PlexError
from plexctl.common.layout import (
    LayoutError,
    TrainerSpan,
    WorkerPlacement,
    check_gpus,
    engine_kinds,
    node_gpus,
    place_workers,
    placement_span,
    registers,
)

log = logging.getLogger("plexrl-node")

DRAIN_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
REQUEUE_SIGNALS = ("SIGUSR1", "SIGUSR2")  # the allocation's --signal: it ends soon, come back after
DAEMON_RESTARTS = 3  # a daemon that crashes is started again this many times


def slurm_env() -> dict[str, str]:
    """The allocation as Slurm describes it to this task (defaults for a run outside Slurm)."""
    e = os.environ
    return {
        "job_id": e.get("SLURM_JOB_ID", "0"),
        "procid": e.get("SLURM_PROCID", "0"),
        "node": e.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0],
        "restart_count": e.get("SLURM_RESTART_COUNT", "0"),
    }


def node_scratch(configured: str | None, job_id: str, node: str) -> Path:
    """The node-local directory for the NVMe tier: configured, else the job's scratch, else /tmp."""
    if configured:
        return Path(configured)
    base = os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(base) / f"plexrl-{job_id}-{node}"


def advertise_address() -> str:
    """An address of this node that the other nodes can reach: its name's address, unless that
    is a loopback one (Debian maps the host name to 127.0.1.1); then the address this node
    sends from towards the submitting host; else the name."""
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        addr = ""
    if addr and not addr.startswith("127."):
        return addr
    toward = os.environ.get("SLURM_SUBMIT_HOST") or os.environ.get("SLURM_LAUNCH_NODE_IPADDR")
    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((toward, 9))  # no packet is sent: the kernel picks the route's source address
                routed = probe.getsockname()[0]
            if not routed.startswith("127."):
                return routed
        except OSError:
            pass
    return addr or name


def task_cpus() -> int:
    """The CPUs this task may use: what Slurm gave it, else what the process may run on."""
    given = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE")
    if given and given.isdigit():
        return int(given)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass
class Worker:
    """A worker process this task started, and where it keeps its files."""

    placement: WorkerPlacement
    proc: subprocess.Popen
    scratch: Path
    log_path: Path
    reported: bool = False  # its exit has been logged


def worker_command(
    p: WorkerPlacement,
    address: str,
    node: str,
    model: str | list[str],
    scratch: Path,
    tp: int,
    threads: int | None,
    config_file: Path,
) -> list[str]:
    """``python -m worker.main ...`` for one placement: what identifies the worker (its settings
    are in ``config_file``); the tensor-parallel size only when > 1."""
    cmd = [
        sys.executable,
        "-m",
        "worker.main",
        "--endpoint",
        address,
        "--worker-id",
        p.worker_id,
        "--node",
        node,
        "--engines",
        ",".join(p.engines),
        *(arg for m in ([model] if isinstance(model, str) else model) for arg in ("--model", m)),
        "--scratch",
        str(scratch),
        "--cluster-config",
        str(config_file),
    ]
    if "rollout" in p.engines and tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    return cmd


def _spawn(cmd: list[str], log_path: Path, devices: list[str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` with its output in ``log_path``; ``devices``: its ``CUDA_VISIBLE_DEVICES``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = child_env()
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT
        )


def _wait_for_daemon(state_dir: Path, timeout: float, daemon: subprocess.Popen | None) -> str:
    """The address of the daemon once it answers (a stale endpoint file never does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon is not None and daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with code {daemon.returncode} (see {state_dir}/daemon.log)")
        if endpoint_path(state_dir).exists():
            try:
                ep = read_endpoint(state_dir)
                Client(ep.address, keys=auth.internal_keys(auth.keys_dir(state_dir))).ping(timeout=2.0, retries=1)
                return ep.address
            except PlexError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"no daemon answered at {endpoint_path(state_dir)} within {timeout:.0f} s")


def report_exit(address: str, state_dir: Path, worker: Worker) -> None:
    """Tell the daemon that a worker's process exited, so that it is lost now rather than
    suspect until the worker grace ends (a silent worker whose process lives may be stalled)."""
    client = Client(address, keys=auth.internal_keys(auth.keys_dir(state_dir)))
    try:
        client.request(
            P.Op.WORKER_EXITED,
            P.WorkerExited(worker.placement.worker_id, worker.proc.pid, worker.proc.returncode),
            timeout=2.0,
            retries=1,
        )
    except PlexError as exc:
        log.warning("could not tell the daemon that worker %s exited: %s", worker.placement.worker_id, exc)
    finally:
        client.close()


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, wait: float = 30.0) -> None:
    _stop_all([proc] if proc is not None else [], sig, wait)


def _stop_all(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, wait: float = 30.0) -> None:
    """Signal every live process at once, then give them ``wait`` seconds together before SIGKILL."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        proc.send_signal(sig)
    deadline = time.monotonic() + wait
    for proc in live:
        wait_or_kill(proc, max(0.0, deadline - time.monotonic()))


def start_ranks(
    span: TrainerSpan,
    rendezvous: Path,
    config_file: Path,
    scratch: Path,
    state_dir: Path,
    p: WorkerPlacement,
    node: str,
) -> subprocess.Popen:
    """This node's ranks of a trainer engine whose rank 0 runs on another node (``worker.ranks``),
    on the placement's GPUs, their stores under ``scratch``."""
    cmd = [sys.executable, "-m", "worker.ranks", "--rendezvous", str(rendezvous)]
    cmd += ["--ranks", ",".join(map(str, span.ranks)), "--cluster-config", str(config_file), "--scratch", str(scratch)]
    proc = _spawn(cmd, state_dir / "workers" / f"{p.worker_id}-ranks.log", p.devices)
    log.info(
        "trainer ranks %s of engine %d (rank 0 on another node) devices %s on %s pid %d",
        ",".join(map(str, span.ranks)),
        span.engine,
        ",".join(p.devices) or "none",
        node,
        proc.pid,
    )
    return proc


def requeue(job_id: str) -> bool:
    scontrol = shutil.which("scontrol")
    if scontrol is None or job_id == "0":
        return False
    result = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, result.stderr.strip())
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="plexrl-node",
        description="One PlexRL task of a Slurm allocation; the cluster's settings are in its config file.",
    )
    ap.add_argument("--state-dir", required=True, type=Path)
    ap.add_argument(
        "--cluster-config", type=Path, default=None, help="the cluster's settings (default: STATE_DIR/cluster.json)"
    )
    ap.add_argument("--join", action="store_true", help="workers only, for a daemon that already runs")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--wait-daemon", type=float, default=600.0, help="seconds a worker waits for the daemon")
    args = ap.parse_args(argv)
    os.umask(0o077)  # the workers' scratch and logs are the cluster owner's alone
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    env = slurm_env()
    state_dir = args.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    config_file = (args.cluster_config or config_path(state_dir)).resolve()
    try:
        config = read_config(config_file)
    except ConfigError as exc:
        log.error("%s", exc)
        return ExitCode.USAGE
    if not config.models:
        log.error("%s: no models to serve", config_file)
        return ExitCode.USAGE
    os.environ[auth.KEYS_ENV] = str(auth.keys_dir(state_dir))  # this task and its worker present the internal key
    first = env["procid"] == "0" and not args.join
    node_index = int(os.environ.get("SLURM_NODEID", env["procid"]))
    engines = config.engines[node_index % len(config.engines)]
    base_id = env["node"] if not args.join else f"{env['node']}-{env['job_id']}"
    try:
        gpus = check_gpus(env["node"], node_gpus(os.environ), config.gpus_per_node)
        placements = place_workers(
            base_id,
            gpus,
            engine_kinds(engines),
            rollout_gpus=config.rollout_gpus,
            trainer_gpus=config.trainer_gpus,
            tp=config.tp,
            trainer_width=config.trainer_width or 1,
        )
    except LayoutError as exc:
        log.error("%s", exc)
        return ExitCode.USAGE
    n = len(placements)
    log.info(
        "task %s of Slurm job %s on %s (restart %s): %s, GPUs %s",
        env["procid"],
        env["job_id"],
        env["node"],
        env["restart_count"],
        ("daemon + " if first else "") + f"{n} worker" + "s" * (n > 1),
        ",".join(gpus) or "none",
    )

    signalled: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if signalled:
            return
        signalled.append(name)
        log.info("got %s", name)
        if first and daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGUSR1)  # drain: checkpoint every job, stop the workers
        elif args.join:
            for w in workers:  # each tells the daemon it leaves, then exits
                if w.proc.poll() is None:
                    w.proc.send_signal(signal.SIGTERM)

    daemon: subprocess.Popen | None = None
    workers: list[Worker] = []
    for sig in DRAIN_SIGNALS:
        signal.signal(sig, on_signal)

    def start_daemon(port: int) -> subprocess.Popen:
        endpoint_path(state_dir).unlink(missing_ok=True)  # a previous run's, on this node: its daemon is gone
        return _spawn(
            [
                sys.executable,
                "-m",
                "daemon.main",
                "--state-dir",
                str(state_dir),
                "--cluster-config",
                str(config_file),
                "--host",
                "0.0.0.0",
                "--port",
                str(port),
                "--mode",
                "slurm",
                "--advertise-host",
                advertise_address(),
            ],
            state_dir / "daemon.log",
        )

    if first:
        daemon = start_daemon(args.port)
    try:
        address = _wait_for_daemon(state_dir, args.wait_daemon, daemon)
    except RuntimeError as exc:
        log.error("%s", exc)
        _stop(daemon)
        return 1
    scratch = node_scratch(config.scratch, env["job_id"], env["node"])
    threads = max(1, task_cpus() // n) if n > 1 else None  # the node's cores, shared out
    ranks: list[subprocess.Popen] = []  # a wide trainer engine's ranks here, its rank 0 on another node
    for p in placements:
        w_scratch = scratch / p.scratch_name if p.scratch_name else scratch
        span = placement_span(p, config.trainer_width or 1, node_index) if not args.join else None
        command_extra: list[str] = []
        if span is not None:
            rendezvous = state_dir / "groups" / f"{env['job_id']}-trainer{span.engine}.json"
            if span.part == 0:  # rank 0 here: this worker speaks for the engine
                command_extra = ["--trainer-rendezvous", str(rendezvous), "--local-ranks", str(len(span.ranks))]
                command_extra += ["--group-host", advertise_address()]
            else:
                ranks.append(start_ranks(span, rendezvous, config_file, w_scratch / "ranks", state_dir, p, env["node"]))
                if not registers(p, span):
                    continue
                p = msgspec.structs.replace(p, engines=[e for e in p.engines if e != "trainer"])
        log_path = state_dir / "workers" / f"{p.worker_id}.log"
        proc = _spawn(
            worker_command(p, address, env["node"], config.models, w_scratch, config.tp, threads, config_file)
            + command_extra,
            log_path,
            p.devices,
        )
        workers.append(Worker(p, proc, w_scratch, log_path))
        log.info(
            "worker %s (%s) devices %s scratch %s pid %d, daemon at %s",
            p.worker_id,
            ",".join(p.engines),
            ",".join(p.devices) or "none",
            w_scratch,
            proc.pid,
            address,
        )

    code, daemon_restarts = 0, 0
    while True:
        if daemon is not None and daemon.poll() is not None:
            code = daemon.returncode
            log.info("daemon exited with code %d", code)
            if code != 0 and not signalled and daemon_restarts < DAEMON_RESTARTS:
                # it crashed: start it again on the same port and state; the workers here and on the
                # other nodes reconnect, and so do the jobs' drivers (the new daemon adopts them)
                daemon_restarts += 1
                log.warning("restarting the daemon (%d/%d)", daemon_restarts, DAEMON_RESTARTS)
                daemon = start_daemon(int(address.rsplit(":", 1)[1]))
                continue
            _stop_all([w.proc for w in workers] + ranks, wait=15)
            break
        for w in workers:
            if w.reported or w.proc.poll() is None:
                continue
            w.reported, exit_code = True, w.proc.returncode
            code = code or exit_code  # a task of workers only exits with its first failure's code
            if exit_code != 0 and not signalled:  # the daemon goes on without this worker's engines
                log.error("worker %s failed with code %d; see %s", w.placement.worker_id, exit_code, w.log_path)
                report_exit(address, state_dir, w)
            else:
                log.info("worker %s exited with code %d", w.placement.worker_id, exit_code)
        if daemon is None and all(w.reported for w in workers):
            _stop_all(ranks, wait=15)
            break
        time.sleep(0.2)
    for w in workers:
        shutil.rmtree(w.scratch, ignore_errors=True)
    if not config.scratch:  # ours: the job's directory on this node
        shutil.rmtree(scratch, ignore_errors=True)
    if first and signalled and signalled[0] in REQUEUE_SIGNALS and code == 0:
        ok = requeue(env["job_id"])
        log.info("drained on %s; %s", signalled[0], "requeued" if ok else "not requeued")
    return code


if __name__ == "__main__":
    sys.exit(main())
