"""How jobs and engines look in the terminal: rich tables, plain text and JSON rows.

Pure rendering: every function takes the daemon's ``StatusRep`` (or parts of it) and returns
something printable. The CLI decides where it goes (live view on a TTY, plain otherwise). rich
is imported by the functions that build its tables, so plain text and JSON start without it.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import msgspec

from plexctl.common.sizes import fmt_bytes

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table

    from plexctl.common.protocol import EngineInfo, JobInfo, StatusRep

STATE_STYLE = {
    "queued": "yellow",
    "running": "cyan",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
    "interrupted": "yellow",
}


def fmt_reward(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def elapsed(job: JobInfo, now: float) -> float | None:
    if job.started_at is None:
        return None
    return (job.ended_at or now) - job.started_at


def job_row(job: JobInfo, now: float) -> dict[str, Any]:
    """The JSON form of a job (what ``--json`` prints)."""
    return {**msgspec.to_builtins(job), "elapsed_s": elapsed(job, now)}


def jobs_table(jobs: list[JobInfo], now: float | None = None) -> Table:
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    now = now or time.time()
    t = Table(title="jobs", title_justify="left", expand=False)
    for col in (
        "JOB",
        "NAME",
        "MODEL",
        "TRAINS",
        "USER",
        "STATE",
        "STEP",
        "",
        "REWARD",
        "EVAL first→last",
        "POLICY",
        "ENGINE",
        "ELAPSED",
    ):
        t.add_column(col, no_wrap=True)
    for j in jobs:
        frac = j.step / j.steps if j.steps else 0.0
        state = Text(j.state, style=STATE_STYLE.get(j.state, ""))
        if j.error or j.reason:
            state.append(f" ({(j.error or j.reason)[:60]})", style="dim")
        t.add_row(
            j.job_id,
            j.name,
            model_name(j.model),
            j.trains or "-",
            j.user,
            state,
            f"{j.step}/{j.steps}",
            ProgressBar(total=1.0, completed=frac, width=16),
            fmt_reward(j.reward),
            f"{fmt_reward(j.eval_first)} → {fmt_reward(j.eval_last)}",
            f"v{j.policy_version}",
            j.state_tier or j.engine or "-",
            fmt_duration(elapsed(j, now)),
        )
    return t


def engines_table(engines: list[EngineInfo], uptime: float) -> Table:
    from rich.table import Table

    t = Table(title="engines", title_justify="left")
    for col in (
        "ENGINE",
        "KIND",
        "MODEL",
        "ON",
        "READY",
        "SERVING",
        "RESIDENT JOBS",
        "BUSY",
        "TASKS",
        "STATE TIERS",
        "SWAPS",
        "SWITCHES",
        "SHARED PASSES",
    ):
        t.add_column(col, no_wrap=True)
    for e in engines:
        busy = f"{100 * e.busy_seconds / uptime:.0f}%" if uptime > 0 else "-"
        t.add_row(
            e.engine_id,
            e.kind,
            engine_model(e),
            placement_text(e),
            ready_text(e),
            ",".join(e.running) or "-",
            ",".join(e.resident) or "-",
            busy,
            str(e.tasks_done),
            tiers_text(e),
            swaps_text(e),
            str(e.switches) if e.switches else "-",
            passes_text(e),
        )
    return t


def model_name(path: str) -> str:
    """A model as tables show it: its directory's name."""
    return os.path.basename(path.rstrip("/")) or "-"


def engine_model(e: EngineInfo) -> str:
    """An engine's model, and whether it is awake or asleep where its worker's engines take turns."""
    name = model_name(e.model)
    return f"{name} ({e.weights})" if e.weights in ("awake", "asleep") else name


DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def ready_text(e: EngineInfo) -> str:
    """``yes``, ``starting``, or ``suspect (12 s silent)`` while its worker misses heartbeats."""
    if e.suspect:
        return f"suspect ({e.silent_s:.0f} s silent)"
    return "yes" if e.ready else "starting"


def placement_text(e: EngineInfo) -> str:
    """``gpu 0,1 bf16`` (its worker's GPU ids), ``cpu fp32``; ``-`` when the worker did not say."""
    if not e.device:
        return "-"
    where = f"gpu {','.join(e.devices)}" if e.device == "cuda" and e.devices else e.device
    return f"{where} {DTYPE_SHORT.get(e.dtype, e.dtype)}".strip()


def tiers_text(e: EngineInfo) -> str:
    """``device 2/2 ckpt on · host 3 (1.2 MiB) · nvme 0`` for a trainer (``ckpt on|off``: its gradient
    checkpointing, as the memory plan decided it; ``nvme 1 (4.0 MiB, full)`` when its disk ran out
    of space); ``-`` otherwise."""
    if not e.tiers:
        return "-"
    parts = []
    for tier, info in e.tiers.items():
        jobs = len(info.get("jobs", []))
        if info.get("unit") == "slots":
            step = info.get("step") or {}
            ckpt = ""
            if "gradient_checkpointing" in step:
                ckpt = " ckpt on" if step["gradient_checkpointing"] else " ckpt off"
            parts.append(f"{tier} {jobs}/{info.get('capacity')}{ckpt}")
        else:
            full = ", full" if info.get("full") else ""
            parts.append(f"{tier} {jobs} ({fmt_bytes(info.get('used_bytes', 0))}{full})")
    return " · ".join(parts)


def passes_text(e: EngineInfo) -> str:
    """A trainer's shared passes: how many, their mean and largest size (jobs), the latest's."""
    if not e.shared_passes:
        return "-"
    mean = e.shared_tasks / e.shared_passes
    return f"{e.shared_passes} x {mean:.1f} jobs (max {e.largest_pass}, last {e.last_pass})"


def swaps_text(e: EngineInfo) -> str:
    if not e.swaps:
        return "-"
    count = sum(s.get("count", 0) for s in e.swaps.values())
    nbytes = sum(s.get("bytes", 0) for s in e.swaps.values())
    seconds = sum(s.get("seconds", 0.0) for s in e.swaps.values())
    text = f"{count} ({fmt_bytes(nbytes)}, {seconds:.2f} s)"
    kinds = {k: s for k, s in e.swaps_by_kind.items() if s.get("count")}
    if "model" in kinds:  # whole models moved: say how much of it was which
        text += ": " + ", ".join(
            f"{s['count']} {'whole-model' if k == 'model' else k} ({fmt_bytes(s.get('bytes', 0))})"
            for k, s in sorted(kinds.items())
        )
    return text


def cluster_line(rep: StatusRep) -> str:
    bubble = "-" if rep.bubble_ratio is None else f"{rep.bubble_ratio:.0%}"
    return f"policy {rep.policy or '-'} · engine bubble (idle share) {bubble}"


def tinker_line(url: str | None, note: str = "") -> str:
    """The Tinker API's line: its URL, else why it has none now (``cluster.tinker_state``)."""
    if url is not None:
        return f"\nTinker API: base_url={url}"
    return f"\nTinker API: {note}" if note else ""


def status_view(rep: StatusRep, uptime: float, tinker: str | None = None, tinker_note: str = "") -> Group:
    from rich.console import Group
    from rich.text import Text

    table = Text(cluster_line(rep) + tinker_line(tinker, tinker_note))
    return Group(jobs_table(rep.jobs, rep.now), engines_table(rep.engines, uptime), table)


def plain_jobs(jobs: list[JobInfo], now: float) -> str:
    lines = [
        f"{'JOB':<6} {'NAME':<20} {'MODEL':<14} {'TRAINS':<11} {'STATE':<11} {'STEP':>9} {'REWARD':>7} {'EVAL':>13} "
        f"{'POLICY':>6}  ENGINE"
    ]
    for j in jobs:
        lines.append(
            f"{j.job_id:<6} {j.name[:20]:<20} {model_name(j.model)[:14]:<14} {j.trains or '-':<11} {j.state:<11} "
            f"{f'{j.step}/{j.steps}':>9} "
            f"{fmt_reward(j.reward):>7} {fmt_reward(j.eval_first):>6}→{fmt_reward(j.eval_last):<6} "
            f"{'v' + str(j.policy_version):>6}  {j.state_tier or j.engine or '-'}"
            + (f"  error: {j.error}" if j.error else "")
            + (f"  waiting: {j.reason}" if j.reason else "")
        )
    return "\n".join(lines)


def plain_engines(engines: list[EngineInfo], uptime: float) -> str:
    lines = [
        f"{'ENGINE':<14} {'KIND':<8} {'MODEL':<14} {'ON':<12} {'READY':<8} {'BUSY':>5} {'TASKS':>6}  SERVING / RESIDENT"
    ]
    for e in engines:
        busy = f"{100 * e.busy_seconds / uptime:.0f}%" if uptime > 0 else "-"
        lines.append(
            f"{e.engine_id:<14} {e.kind:<8} {engine_model(e)[:14]:<14} {placement_text(e):<12} {ready_text(e):<8} "
            f"{busy:>5} "
            f"{e.tasks_done:>6}  {','.join(e.running) or '-'} / {','.join(e.resident) or '-'}"
            + (f"  tiers: {tiers_text(e)}  swaps: {swaps_text(e)}" if e.tiers else "")
            + (f"  switches: {e.switches}" if e.switches else "")
            + (f"  shared passes: {passes_text(e)}" if e.shared_passes else "")
        )
    return "\n".join(lines)


def plain_status(rep: StatusRep, uptime: float, tinker: str | None = None, tinker_note: str = "") -> str:
    """``tinker``: the Tinker API's URL, where the cluster serves it; ``tinker_note``: why not now."""
    engines = plain_engines(rep.engines, uptime)
    tail = cluster_line(rep) + tinker_line(tinker, tinker_note)
    return plain_jobs(rep.jobs, rep.now) + "\n\n" + engines + "\n" + tail
