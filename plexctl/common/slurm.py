"""A cluster on a Slurm allocation: the batch script, the submission, and what Slurm says of it.

``plexctl up --slurm`` submits one allocation (through submitit by default, or the same
batch script through ``sbatch``): ``srun`` starts one task per node running
``daemon.node`` — the daemon and the node's workers on the first node, workers on every
other (one per engine on a GPU node, ``plexctl.common.layout``) — and the allocation is asked for
``--requeue`` and a signal ``signal_grace`` seconds ahead of its end, so the daemon drains
and the allocation comes back. ``slurm/plexrl.sbatch`` is the same script as a bash file of its
own, taking its values from the environment, for those who call ``sbatch`` themselves (a test
holds its directives and its node command to ``sbatch_options`` and ``node_command``). A spec
that asks for GPUs also asks, unless told otherwise, for ``CPUS_PER_GPU`` CPUs per GPU and all
of each node's memory; the layout is checked before anything is submitted.

The cluster's state directory (on the shared filesystem) holds ``slurm.json``: which Slurm
jobs are this cluster's allocations, so ``status`` can say what Slurm says while the daemon
is not up (pending, with Slurm's reason) and ``down`` can end them. It is changed only under
its lock and written atomically (``update_allocations``): ``up --join`` and the daemon of an
elastic cluster (``submit_join``, ``daemon/allocations.py``) both write it. Nothing here imports
torch or vLLM; submitit is imported only when submitting.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from plexctl.common.atomic import write_json_atomic
from plexctl.common.cluster_config import ClusterConfig, config_path, write_config
from plexctl.common.errors import PlexError, UsageError
from plexctl.common.layout import engine_kinds, place_workers, placement_span, registers

IMPORT_ROOT = Path(__file__).resolve().parents[2]  # holds the daemon package: sbatch runs daemon.node from here
SLURM_FILE = "slurm.json"
SIGNAL = "USR1"
SQUEUE_TIMEOUT_S = 30.0  # a busy controller may take seconds; longer, and what it would say is unknown
SQUEUE_TRIES = 3
# Asked per node when GPUs are and the spec says nothing else (cpus_per_task, mem override them).
CPUS_PER_GPU = 8  # an engine's process, its tokenizer/detokenizer, the trainer's data and copy-I/O threads,
#                   and on the first node the daemon and the jobs' drivers (rewards run on CPU); GPU nodes
#                   have 12-16 cores per GPU (DGX A100/H100), so 8 fits almost everywhere
MEM_WITH_GPUS = "0"  # Slurm's "all of the node's memory": the pinned host tier of swapped-out job state
#                      wants all of it, and a per-GPU figure would fail on nodes with less


class SlurmUnavailable(PlexError):
    """No Slurm commands here, or Slurm refused the submission."""

    exit_code = 7


class SlurmSpec(msgspec.Struct, kw_only=True):
    """One allocation of a cluster: its settings, and where its node tasks read them."""

    name: str
    state_dir: str
    config: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    config_file: str = ""  # the config the node tasks read ("": the state directory's cluster.json)
    join: bool = False
    python: str = sys.executable


class Allocation(msgspec.Struct):
    job_id: str
    nodes: int
    join: bool
    submitted_at: float
    via: str  # submitit | sbatch
    drain_timeout: float  # seconds its daemon gives jobs to checkpoint when it stops
    # what the daemon of an elastic cluster (``max_nodes``) says of a joined allocation it manages
    elastic: bool = False  # the daemon asked for it, and gives it back
    state: str = ""  # starting | up | releasing | released ("": not followed)
    up_at: float | None = None  # its workers registered
    idle_since: float | None = None  # its engines have held no job since
    ended_at: float | None = None  # given back
    note: str = ""  # why it was asked for or given back


def join_config_path(state_dir: Path) -> Path:
    """Where a joining allocation's config goes (its own: the cluster's ``cluster.json`` is the daemon's)."""
    return state_dir / "slurm" / f"join-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"


# ---------------------------------------------------------------- parsing user input


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")


def time_minutes(text: str) -> int:
    """Slurm's time formats (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) in whole minutes."""
    m = _TIME.match(text.strip())
    if not m:
        raise UsageError(f"--time {text!r}: use minutes, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
    elif c is not None:  # HH:MM:SS
        hours, minutes, seconds = int(a), int(b), int(c)
    else:  # MM or MM:SS
        hours, minutes, seconds = 0, int(a), int(b or 0)
    total = (int(days or 0) * 24 + hours) * 60 + minutes + (1 if seconds else 0)
    if total <= 0:
        raise UsageError(f"--time {text!r}: must be more than 0")
    return total


def task_resources(spec: SlurmSpec) -> tuple[int | None, str | None]:
    """(CPUs, memory) each node's task asks for: the spec's, else the GPU defaults (none without GPUs)."""
    c = spec.config
    cpus = c.cpus_per_task or (CPUS_PER_GPU * c.gpus_per_node if c.gpus_per_node else None)
    mem = c.mem or (MEM_WITH_GPUS if c.gpus_per_node else None)
    return cpus, mem


def planned_workers(spec: SlurmSpec) -> int:
    """How many workers the allocation starts, if each node gets the GPUs asked for; raises
    ``plexctl.common.layout.LayoutError`` where the GPU options do not fit a node."""
    c = spec.config
    gpus = [str(i) for i in range(c.gpus_per_node)]
    width = c.trainer_width or 1
    count = 0
    for i in range(c.nodes):
        placements = place_workers(
            f"#{i}",
            gpus,
            engine_kinds(c.engines[i % len(c.engines)]),
            rollout_gpus=c.rollout_gpus,
            trainer_gpus=c.trainer_gpus,
            tp=c.tp,
            trainer_width=width,
        )
        count += sum(registers(p, None if spec.join else placement_span(p, width, i)) for p in placements)
    return count


# ---------------------------------------------------------------- the batch script


def node_command(spec: SlurmSpec) -> list[str]:
    """The command each task runs (``python -m daemon.node ...``), unquoted: what identifies the
    allocation; its settings are in its config file."""
    cmd = [spec.python, "-m", "daemon.node", "--state-dir", spec.state_dir]
    if spec.config_file and Path(spec.config_file) != config_path(Path(spec.state_dir)):
        cmd += ["--cluster-config", spec.config_file]
    if spec.join:
        cmd.append("--join")
    return cmd


def sbatch_options(spec: SlurmSpec) -> list[tuple[str, str | None]]:
    c = spec.config
    opts: list[tuple[str, str | None]] = [
        ("job-name", f"plexrl-{spec.name}" + ("-join" if spec.join else "")),
        ("nodes", str(c.nodes)),
        ("ntasks-per-node", "1"),
    ]
    cpus, mem = task_resources(spec)
    if c.gpus_per_node:
        opts.append(("gpus-per-node", str(c.gpus_per_node)))
    if cpus:
        opts.append(("cpus-per-task", str(cpus)))
    if mem:
        opts.append(("mem", mem))
    opts.append(("time", c.time_limit))
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(c, key)
        if value:
            opts.append((key, value))
    if c.exclusive:
        opts.append(("exclusive", None))
    opts += [
        ("requeue", None),
        ("signal", f"{SIGNAL}@{c.signal_grace}"),
        ("open-mode", "append"),
        ("output", f"{spec.state_dir}/slurm/%j.out"),
    ]
    return opts


def render_sbatch(spec: SlurmSpec) -> str:
    """The batch script of one allocation (pure: the same spec gives the same text)."""
    lines = [
        "#!/bin/bash",
        f"# PlexRL cluster {spec.name!r}: "
        + ("workers joining its daemon" if spec.join else "the daemon on the first node, workers on every node")
        + ".",
        "# Written by `plexctl up --slurm`; see slurm/plexrl.sbatch to submit it with plain sbatch.",
    ]
    lines += [f"#SBATCH --{k}" + (f"={_directive_value(v)}" if v is not None else "") for k, v in sbatch_options(spec)]
    lines += [
        "set -euo pipefail",
        f"mkdir -p {shlex.quote(spec.state_dir)}/slurm",
        "# one task per node; the signal reaches every task, the first drains the daemon and requeues",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=0 " + shlex.join(node_command(spec)),
        "",
    ]
    return "\n".join(lines)


def _directive_value(value: str) -> str:
    """A ``#SBATCH`` option's value, in double quotes when it holds spaces or quotes (sbatch
    splits a directive's words as a shell would)."""
    return value if re.fullmatch(r"[\w@%/.:,=+-]*", value) else '"' + value.replace('"', '\\"') + '"'


# ---------------------------------------------------------------- submitting


def _need(command: str) -> str:
    path = shutil.which(command)
    if path is None:
        raise SlurmUnavailable(f"`{command}` not found: run this on a Slurm login node (or install slurm-client)")
    return path


def submit_sbatch(spec: SlurmSpec) -> str:
    """Write the batch script into the state directory and submit it; the Slurm job id."""
    planned_workers(spec)  # a layout that cannot fit fails here, not on the nodes
    sbatch = _need("sbatch")
    slurm_dir = Path(spec.state_dir) / "slurm"
    slurm_dir.mkdir(parents=True, exist_ok=True)
    script = slurm_dir / ("join.sbatch" if spec.join else "plexrl.sbatch")
    tmp = script.with_suffix(".tmp")
    tmp.write_text(render_sbatch(spec))
    tmp.replace(script)
    result = subprocess.run(
        [sbatch, "--parsable", str(script)],
        capture_output=True,
        text=True,
        cwd=IMPORT_ROOT,
        env=submission_env(),
        timeout=SQUEUE_TIMEOUT_S * SQUEUE_TRIES,
    )
    if result.returncode != 0:
        raise SlurmUnavailable(f"sbatch refused the allocation: {_last_line(result.stderr)}")
    return result.stdout.strip().split(";")[0]


def submission_env() -> dict[str, str]:
    """The environment to submit from: this one without the variables of a Slurm job it may run
    in (the daemon submits joining allocations from inside its own; sbatch would read them as
    options of the new one), ``SLURM_CONF`` and ``SBATCH_*`` defaults kept."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def submit_join(state_dir: Path, config: ClusterConfig, note: str) -> Allocation:
    """Submit one joining allocation of one node for the cluster in ``state_dir`` (its config
    but ``nodes``), through ``sbatch``, and record it as the daemon's to give back."""
    spec = SlurmSpec(
        name=state_dir.name,
        state_dir=str(state_dir),
        config=msgspec.structs.replace(config, nodes=1, max_nodes=None),
        config_file=str(join_config_path(state_dir)),
        join=True,
    )
    write_config(Path(spec.config_file), spec.config)
    job_id = submit_sbatch(spec)
    alloc = Allocation(job_id, 1, True, time.time(), "sbatch", 0.0, elastic=True, state="starting", note=note)
    record_allocation(state_dir, alloc)
    return alloc


def run_module(module: str, argv: list[str]) -> int:
    """What submitit runs on every task: ``python -m MODULE ARGV`` in its own process (the module
    is named, never imported here, so the CLI imports nothing of the daemon); a failure raises."""
    import runpy

    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code:
            raise
    return 0


def submitit_parameters(spec: SlurmSpec) -> dict[str, object]:
    """``SlurmExecutor.update_parameters`` for the allocation: what ``sbatch_options`` asks for."""
    additional: dict[str, object] = {"requeue": True, "open-mode": "append"}
    c = spec.config
    for key in ("account", "qos", "constraint"):
        if getattr(c, key):
            additional[key] = getattr(c, key)
    if c.exclusive:
        additional["exclusive"] = True
    params: dict[str, object] = dict(
        job_name=f"plexrl-{spec.name}" + ("-join" if spec.join else ""),
        nodes=c.nodes,
        ntasks_per_node=1,
        time=time_minutes(c.time_limit),
        signal_delay_s=c.signal_grace,
        additional_parameters=additional,
    )
    cpus, mem = task_resources(spec)
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    if cpus:
        params["cpus_per_task"] = cpus
    if mem:
        params["mem"] = mem
    if c.partition:
        params["partition"] = c.partition
    return params


def submit_submitit(spec: SlurmSpec) -> str:
    """Submit the allocation through submitit (one task per node, each runs ``daemon.node``)."""
    planned_workers(spec)  # a layout that cannot fit fails here, not on the nodes
    _need("sbatch")
    import submitit

    folder = Path(spec.state_dir) / "slurm" / "submitit"
    executor = submitit.SlurmExecutor(folder=str(folder), python=shlex.quote(spec.python))
    executor.update_parameters(**submitit_parameters(spec))
    module, argv = node_command(spec)[2], node_command(spec)[3:]  # `python -m daemon.node ARGV`
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr as well
            job = executor.submit(run_module, module, argv)
    except Exception as exc:  # noqa: BLE001 - submitit raises sbatch's failure as a plain error
        raise SlurmUnavailable(f"Slurm refused the allocation: {_last_line(str(exc))}") from None
    return str(job.job_id)


def record_allocation(state_dir: Path, alloc: Allocation) -> None:
    def record(allocations: list[Allocation]) -> list[Allocation]:
        kept = [a for a in allocations if a.job_id != alloc.job_id]
        if not alloc.join:  # a new main allocation replaces the previous one (its joins end with it)
            kept = [a for a in kept if a.join and job_state(a.job_id)[0] not in ("", "GONE")]
        return [*kept, alloc]

    update_allocations(state_dir, record)


def update_allocations(state_dir: Path, change: Callable[[list[Allocation]], list[Allocation]]) -> list[Allocation]:
    """Read, change and write ``slurm.json`` under a lock (``up --join`` and the daemon both
    write it), atomically; what was written."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / (SLURM_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        allocations = change(read_allocations(state_dir))
        write_json_atomic(state_dir / SLURM_FILE, {"allocations": msgspec.to_builtins(allocations)})
    return allocations


def read_allocations(state_dir: Path) -> list[Allocation]:
    try:
        data = json.loads((state_dir / SLURM_FILE).read_text())
    except (OSError, ValueError):
        return []
    return msgspec.convert(data.get("allocations", []), list[Allocation])


RELEASED_SHOWN_S = 600.0  # how long `status` still shows a joined allocation given back


def allocation_rows(allocations: list[Allocation], now: float) -> list[dict[str, object]]:
    """What ``status`` shows of a cluster's allocations (``--json``: ``allocations``): each live
    one, and the joined ones given back in the last ``RELEASED_SHOWN_S``."""
    rows: list[dict[str, object]] = []
    for a in allocations:
        if a.state == "released" and now - (a.ended_at or now) > RELEASED_SHOWN_S:
            continue
        rows.append(
            {
                "job_id": a.job_id,
                "nodes": a.nodes,
                "role": "joined" if a.join else "base",
                "state": a.state or "up",
                "age_s": now - (a.up_at or a.submitted_at),
                "idle_s": now - a.idle_since if a.idle_since is not None else None,
                "note": a.note,
            }
        )
    return rows


def allocation_line(row: dict[str, object]) -> str:
    """One allocation in ``status``'s text: ``Slurm job 124: joined, 1 node, up 40 s, idle 3 s``."""
    nodes = int(str(row["nodes"]))
    text = f"Slurm job {row['job_id']}: {row['role']}, {nodes} node{'s' * (nodes != 1)}, {row['state']}"
    if row["state"] in ("up", "starting"):
        text += f" {float(str(row['age_s'])):.0f} s"
    if row["idle_s"] is not None:
        text += f", idle {float(str(row['idle_s'])):.0f} s"
    return text + (f" ({row['note']})" if row["note"] else "")


# ---------------------------------------------------------------- what Slurm says


def job_state(job_id: str) -> tuple[str, str]:
    """(state, reason) of a Slurm job: ``PENDING``/``RUNNING``/... or ``GONE`` once it left the
    queue; ``""`` and why when Slurm did not say (its controller busy or away: not the job's end)."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return "", "squeue not found"
    for _ in range(SQUEUE_TRIES - 1):  # a controller busy for a moment answers the next ask
        state, reason = _squeue_state(squeue, job_id)
        if state:
            return state, reason
        time.sleep(1.0)
    return _squeue_state(squeue, job_id)


def _squeue_state(squeue: str, job_id: str) -> tuple[str, str]:
    try:
        result = subprocess.run(
            [squeue, "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return "", f"squeue did not answer within {SQUEUE_TIMEOUT_S:.0f} s"
    if result.returncode == 0 and result.stdout.strip():
        state, _, reason = result.stdout.strip().splitlines()[0].partition("|")
        return state, reason
    if result.returncode == 0 or "invalid job id" in result.stderr.lower():
        return "GONE", ""
    return "", (result.stderr.strip().splitlines() or [f"squeue exited {result.returncode}"])[-1]


def cancel(job_id: str) -> None:
    scancel = shutil.which("scancel")
    if scancel is not None:
        subprocess.run([scancel, job_id], capture_output=True)


def wait_gone(job_id: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_state(job_id)[0] in ("GONE", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL"):
            return True
        time.sleep(0.5)
    return False


def _last_line(text: str) -> str:
    """The last line of Slurm's message (its reason), without the ``sbatch: error:`` prefix."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return re.sub(r"^(\w+: )?error: ", "", lines[-1]) if lines else "(no message)"
