"""How jobs and engines look in the terminal: rich tables, plain text and JSON rows.

A job's row and an engine's row are defined once, here: ``JOB_COLUMNS`` and ``ENGINE_COLUMNS``
give each column's header, its cell as text (from a ``JobRow`` / ``EngineRow``), its plain-text
layout and what rich shows instead of the text (a bar, a colour). A view picks columns by name:
``status`` and ``ls`` here, ``top`` in ``top.py``, so a value both show reads the same in both.
Plain text puts a row's optional columns (an error, an engine's tiers) after it as ``label: value``.

Pure rendering: every function takes the daemon's ``StatusRep`` (or parts of it) and returns
something printable. The CLI decides where it goes (live view on a TTY, plain otherwise). rich
is imported by the functions that build its tables, so plain text and JSON start without it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from plexctl.common.sizes import fmt_bytes

if TYPE_CHECKING:
    from rich.console import Group, RenderableType
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
SPARK = "▁▂▃▄▅▆▇█"
RECENT_STEPS = 24  # steps in a sparkline
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def fmt_reward(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def sparkline(values: Sequence[float], width: int = RECENT_STEPS) -> str:
    """``▁▃▅█``: the last ``width`` values scaled between their min and max (flat: all ``▄``)."""
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARK[3] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / (hi - lo) * len(SPARK)))] for v in values)


def elapsed(job: JobInfo, now: float) -> float | None:
    if job.started_at is None:
        return None
    return (job.ended_at or now) - job.started_at


def progress(job: JobInfo) -> float:
    """The share of its steps a job has done."""
    return job.step / job.steps if job.steps else 0.0


def eval_text(job: JobInfo) -> str:
    """``0.370 → 0.410``: the job's first and latest eval reward."""
    return f"{fmt_reward(job.eval_first)} → {fmt_reward(job.eval_last)}"


def job_row(job: JobInfo, now: float) -> dict[str, Any]:
    """The JSON form of a job (what ``--json`` prints)."""
    return {**msgspec.to_builtins(job), "elapsed_s": elapsed(job, now)}


def model_name(path: str) -> str:
    """A model as tables show it: its directory's name."""
    return os.path.basename(path.rstrip("/")) or "-"


def engine_model(e: EngineInfo) -> str:
    """An engine's model, and whether it is awake or asleep where its worker's engines take turns."""
    name = model_name(e.model)
    return f"{name} ({e.weights})" if e.weights in ("awake", "asleep") else name


def utilization(e: EngineInfo, uptime: float) -> float | None:
    """The share of ``uptime`` the engine was busy (at most 1)."""
    return min(1.0, e.busy_seconds / uptime) if uptime > 0 else None


def ready_text(e: EngineInfo) -> str:
    """``yes``, ``starting``, or ``suspect (12 s silent)`` while its worker misses heartbeats."""
    if e.suspect:
        return f"suspect ({e.silent_s:.0f} s silent)"
    return "yes" if e.ready else "starting"


def placement_text(e: EngineInfo) -> str:
    """``gpu 0,1 bf16`` (its worker's GPU ids), ``cpu fp32``, ``cpu x2 fp32`` (a trainer of two
    ranks); ``-`` when the worker did not say."""
    if not e.device:
        return "-"
    where = f"gpu {','.join(e.devices)}" if e.device == "cuda" and e.devices else e.device
    if e.ranks > 1:
        where += f" x{e.ranks}"
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


# ---- the rows -----------------------------------------------------------------------------------

R = TypeVar("R")


@dataclass(frozen=True)
class Column(Generic[R]):
    """One column of a row: its header and its cell as text; how plain text lays it out; what rich
    shows instead of the text, where that differs."""

    header: str
    text: Callable[[R], str]
    width: int = 0  # plain text: the cell padded to this width (0: as it is, after two spaces)
    right: bool = False  # plain text: right-aligned
    cut: bool = False  # plain text: cut to ``width``
    plain_header: str | None = None  # plain text's header, where it differs (a bar's column: DONE)
    label: str = ""  # plain text's label where the column follows the row (default: the header, lower case)
    rich: Callable[[R], RenderableType] | None = None


@dataclass(frozen=True)
class JobRow:
    """A job as a row reads it: its ``JobInfo``, the time, and what ``top`` reads from its metrics."""

    job: JobInfo
    now: float
    eta_s: float | None = None
    recent_rewards: Sequence[float] = ()
    staleness: float | None = None


@dataclass(frozen=True)
class EngineRow:
    """An engine as a row reads it: its ``EngineInfo``, the daemon's uptime, and (``top``) the share
    of the time since the last refresh it was busy."""

    engine: EngineInfo
    uptime: float
    busy_now: float | None = None


def _state_cell(r: JobRow) -> RenderableType:
    from rich.text import Text

    j = r.job
    state = Text(j.state, style=STATE_STYLE.get(j.state, ""))
    if j.error or j.reason:
        state.append(f" ({(j.error or j.reason)[:60]})", style="dim")
    return state


def _bar(completed: float, width: int) -> RenderableType:
    from rich.progress_bar import ProgressBar

    return ProgressBar(total=1.0, completed=completed, width=width)


def _cyan(text: str) -> RenderableType:
    from rich.text import Text

    return Text(text, style="cyan")


JOB_COLUMNS: dict[str, Column[JobRow]] = {
    "job": Column("JOB", lambda r: r.job.job_id, width=6),
    "name": Column("NAME", lambda r: r.job.name, width=20, cut=True),
    "model": Column("MODEL", lambda r: model_name(r.job.model), width=14, cut=True),
    "trains": Column("TRAINS", lambda r: r.job.trains or "-", width=11),
    "user": Column("USER", lambda r: r.job.user, width=10),
    "state": Column("STATE", lambda r: r.job.state, width=11, rich=_state_cell),
    "step": Column(
        "STEP", lambda r: f"{r.job.step}/{r.job.steps}" if r.job.steps else f"{r.job.step}", width=9, right=True
    ),
    "progress": Column(
        "",
        lambda r: f"{progress(r.job):.0%}" if r.job.steps else "-",
        width=5,
        right=True,
        plain_header="DONE",
        rich=lambda r: _bar(progress(r.job), 16),
    ),
    "eta": Column("ETA", lambda r: fmt_duration(r.eta_s), width=7, right=True),
    "reward": Column("REWARD", lambda r: fmt_reward(r.job.reward), width=7, right=True),
    "eval": Column("EVAL first→last", lambda r: eval_text(r.job), width=13, right=True, plain_header="EVAL"),
    "recent": Column(
        "RECENT STEPS",
        lambda r: sparkline(r.recent_rewards),
        width=RECENT_STEPS,
        plain_header="RECENT",
        rich=lambda r: _cyan(sparkline(r.recent_rewards)),
    ),
    "policy": Column("POLICY", lambda r: f"v{r.job.policy_version}", width=6, right=True),
    "stale": Column("STALE", lambda r: "-" if r.staleness is None else f"{r.staleness:.0f}", width=5, right=True),
    # where its trainer state lives (engine:tier) where the daemon knows it, else the engines it runs on
    "engine": Column("ENGINE", lambda r: r.job.state_tier or r.job.engine or "-"),
    "elapsed": Column("ELAPSED", lambda r: fmt_duration(elapsed(r.job, r.now)), width=7, right=True),
    "error": Column("ERROR", lambda r: r.job.error),
    "waiting": Column("WAITING", lambda r: r.job.reason),
}

ENGINE_COLUMNS: dict[str, Column[EngineRow]] = {
    "engine": Column("ENGINE", lambda r: r.engine.engine_id, width=14),
    "kind": Column("KIND", lambda r: r.engine.kind, width=8),
    "model": Column("MODEL", lambda r: engine_model(r.engine), width=14, cut=True),
    "on": Column("ON", lambda r: placement_text(r.engine), width=12),
    "ready": Column("READY", lambda r: ready_text(r.engine), width=8),
    "busy": Column("BUSY", lambda r: fmt_share(utilization(r.engine, r.uptime)), width=5, right=True),
    "busy_bar": Column("", lambda r: "", rich=lambda r: _bar(utilization(r.engine, r.uptime) or 0.0, 10)),
    "now": Column("NOW", lambda r: fmt_share(r.busy_now), width=5, right=True),
    "serving": Column("SERVING", lambda r: ",".join(r.engine.running) or "-"),
    "resident": Column("RESIDENT", lambda r: ",".join(r.engine.resident) or "-"),
    "serving_resident": Column(
        "SERVING / RESIDENT", lambda r: f"{','.join(r.engine.running) or '-'} / {','.join(r.engine.resident) or '-'}"
    ),
    "tasks": Column("TASKS", lambda r: str(r.engine.tasks_done), width=6, right=True),
    "tiers": Column("STATE TIERS", lambda r: tiers_text(r.engine), label="tiers"),
    "swaps": Column("SWAPS", lambda r: swaps_text(r.engine)),
    "switches": Column("SWITCHES", lambda r: str(r.engine.switches) if r.engine.switches else "-"),
    "passes": Column("SHARED PASSES", lambda r: passes_text(r.engine)),
}


def pick(columns: dict[str, Column[R]], names: str) -> list[Column[R]]:
    """The columns a view shows, by name, in its order (``"job name state"``)."""
    return [columns[name] for name in names.split()]


def rich_table(title: str, columns: Sequence[Column[R]], rows: Iterable[R]) -> Table:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col.header, no_wrap=True)
    for row in rows:
        t.add_row(*(col.rich(row) if col.rich else col.text(row) for col in columns))
    return t


def _plain_line(columns: Sequence[Column[R]], cells: Sequence[str]) -> str:
    parts = []
    for i, (col, cell) in enumerate(zip(columns, cells)):
        if col.cut:
            cell = cell[: col.width]
        if i:
            parts.append(" " if col.width else "  ")
        parts.append(cell.rjust(col.width) if col.right else cell.ljust(col.width))
    return "".join(parts)


def plain_table(columns: Sequence[Column[R]], rows: Iterable[R], after: Sequence[Column[R]] = ()) -> list[str]:
    """A header line and a line per row; the ``after`` columns follow a row as ``label: value``
    where they have a value."""
    lines = [_plain_line(columns, [col.header if col.plain_header is None else col.plain_header for col in columns])]
    for row in rows:
        notes = ((col.label or col.header.lower(), col.text(row)) for col in after)
        lines.append(
            _plain_line(columns, [col.text(row) for col in columns])
            + "".join(f"  {label}: {value}" for label, value in notes if value not in ("", "-"))
        )
    return lines


# ---- status and ls ------------------------------------------------------------------------------

STATUS_JOBS = pick(JOB_COLUMNS, "job name model trains user state step progress reward eval policy engine elapsed")
PLAIN_JOBS = pick(JOB_COLUMNS, "job name model trains state step reward eval policy engine")
JOB_NOTES = pick(JOB_COLUMNS, "error waiting")  # plain text: after the row
STATUS_ENGINES = pick(
    ENGINE_COLUMNS, "engine kind model on ready serving resident busy tasks tiers swaps switches passes"
)
PLAIN_ENGINES = pick(ENGINE_COLUMNS, "engine kind model on ready busy tasks serving_resident")
ENGINE_NOTES = pick(ENGINE_COLUMNS, "tiers swaps switches passes")  # plain text: after the row


def jobs_table(jobs: list[JobInfo], now: float | None = None) -> Table:
    now = now or time.time()
    return rich_table("jobs", STATUS_JOBS, [JobRow(j, now) for j in jobs])


def engines_table(engines: list[EngineInfo], uptime: float) -> Table:
    return rich_table("engines", STATUS_ENGINES, [EngineRow(e, uptime) for e in engines])


def cluster_line(rep: StatusRep) -> str:
    bubble = "-" if rep.bubble_ratio is None else f"{rep.bubble_ratio:.0%}"
    line = f"policy {rep.policy or '-'} · engine bubble (idle share) {bubble}"
    if rep.interactive_share or rep.interactive_queued:  # API requests were served lately, or wait
        line += f" · interactive {rep.interactive_share:.0%} of engine time, {rep.interactive_queued} queued"
    return line


def tinker_line(url: str | None, note: str = "", openai: tuple[str | None, str] = (None, "")) -> str:
    """The Tinker API's line: its URL, else why it has none now (``cluster.front_end_state``); and
    the OpenAI API's, where it is served."""

    def line(name: str, url: str | None, note: str) -> str:
        return f"\n{name}: base_url={url}" if url is not None else f"\n{name}: {note}" if note else ""

    return line("Tinker API", url, note) + line("OpenAI API", *openai)


def status_view(
    rep: StatusRep,
    uptime: float,
    tinker: str | None = None,
    tinker_note: str = "",
    openai: tuple[str | None, str] = (None, ""),
) -> Group:
    from rich.console import Group
    from rich.text import Text

    table = Text(cluster_line(rep) + tinker_line(tinker, tinker_note, openai))
    return Group(jobs_table(rep.jobs, rep.now), engines_table(rep.engines, uptime), table)


def plain_jobs(jobs: list[JobInfo], now: float) -> str:
    return "\n".join(plain_table(PLAIN_JOBS, [JobRow(j, now) for j in jobs], JOB_NOTES))


def plain_engines(engines: list[EngineInfo], uptime: float) -> str:
    return "\n".join(plain_table(PLAIN_ENGINES, [EngineRow(e, uptime) for e in engines], ENGINE_NOTES))


def plain_status(
    rep: StatusRep,
    uptime: float,
    tinker: str | None = None,
    tinker_note: str = "",
    openai: tuple[str | None, str] = (None, ""),
) -> str:
    """``tinker``: the Tinker API's URL, where the cluster serves it; ``tinker_note``: why not now;
    ``openai``: the OpenAI API's URL, or why it has none now."""
    engines = plain_engines(rep.engines, uptime)
    tail = cluster_line(rep) + tinker_line(tinker, tinker_note, openai)
    return plain_jobs(rep.jobs, rep.now) + "\n\n" + engines + "\n" + tail
