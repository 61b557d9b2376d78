"""`plexctl top`: what every job and engine is doing, fuller than `status`.

Jobs: state, step/steps with a bar and ETA, reward with a sparkline of the recent steps, policy
version and staleness, where the job's trainer state lives. Engines: utilization since start and
since the last refresh, which job each serves now, swap traffic, memory per tier.

The daemon's ``status`` reply gives the jobs and engines; the per-step history (sparkline, ETA,
staleness) comes from each job's metrics JSONL over the daemon's ``logs`` request, read
incrementally (a ``MetricsFeed`` keeps an offset per job), so the protocol needs nothing new.
Rendering is pure (``top_view``, ``plain_top``, ``top_json`` take a ``TopFrame``); the CLI
decides between a live view, plain text and JSON.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from plexctl.cli.views import (
    STATE_STYLE,
    cluster_line,
    engine_model,
    fmt_duration,
    fmt_reward,
    job_row,
    model_name,
    passes_text,
    swaps_text,
    tiers_text,
)
from plexctl.common.protocol import EngineInfo, JobInfo, StatusRep

SPARK = "▁▂▃▄▅▆▇█"
RECENT_STEPS = 24  # steps in a sparkline
RATE_STEPS = 10  # steps the ETA's rate is measured over
MAX_READ_PER_JOB = 4 << 20  # bytes of metrics read per job and refresh (the rest on the next one)


def sparkline(values: list[float], width: int = RECENT_STEPS) -> str:
    """``▁▃▅█``: the last ``width`` values scaled between their min and max (flat: all ``▄``)."""
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARK[3] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / (hi - lo) * len(SPARK)))] for v in values)


@dataclass
class JobHistory:
    """What a job's metrics rows say beyond its ``JobInfo``."""

    offset: int = 0
    finished: bool = False
    rewards: list[float] = field(default_factory=list)  # reward_mean of the recent steps
    step_times: list[tuple[int, float]] = field(default_factory=list)  # (step, time) of the recent steps
    staleness: float | None = None
    loss: float | None = None

    def add(self, row: dict[str, Any]) -> None:
        if "reward_mean" not in row:
            return  # an eval row
        self.rewards = (self.rewards + [float(row["reward_mean"])])[-RECENT_STEPS:]
        if "time" in row and "step" in row:
            self.step_times = (self.step_times + [(int(row["step"]), float(row["time"]))])[-RATE_STEPS - 1 :]
        if "staleness" in row:
            self.staleness = float(row["staleness"])
        if "train/loss" in row:
            self.loss = float(row["train/loss"])

    def seconds_per_step(self) -> float | None:
        if len(self.step_times) < 2:
            return None
        (s0, t0), (s1, t1) = self.step_times[0], self.step_times[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None


def eta(job: JobInfo, hist: JobHistory | None, now: float) -> float | None:
    """Seconds left for a running job at its recent pace (counted from its last step)."""
    if job.state != "running" or hist is None or job.steps <= job.step:
        return None
    per_step = hist.seconds_per_step()
    if per_step is None:
        return None
    since_last = now - hist.step_times[-1][1]
    return max(0.0, (job.steps - job.step) * per_step - since_last)


class MetricsFeed:
    """Reads each job's metrics JSONL from where it left off; a resumed job's rows past its
    checkpoint (dropped and rewritten by the driver) may show twice in its sparkline."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.jobs: dict[str, JobHistory] = {}
        self.partial: dict[str, str] = {}

    def update(self, jobs: list[JobInfo]) -> dict[str, JobHistory]:
        for j in jobs:
            if j.state == "queued":
                continue
            hist = self.jobs.setdefault(j.job_id, JobHistory())
            read = 0
            while not hist.finished and read < MAX_READ_PER_JOB:
                rep = self.client.logs(j.job_id, "metrics", hist.offset)
                read += rep.offset - hist.offset
                hist.offset, hist.finished = rep.offset, rep.finished
                text = self.partial.pop(j.job_id, "") + rep.data
                lines = text.split("\n")
                if lines[-1]:
                    self.partial[j.job_id] = lines[-1]
                for line in lines[:-1]:
                    if line.strip():
                        try:
                            hist.add(json.loads(line))
                        except ValueError:
                            pass
                if not rep.data:
                    break
        return self.jobs


@dataclass
class TopFrame:
    rep: StatusRep
    history: dict[str, JobHistory]
    uptime: float
    busy_delta: dict[str, float] = field(default_factory=dict)  # engine -> busy share since the last frame


class Top:
    """One source of frames: the daemon's status plus each job's metrics history."""

    def __init__(self, client: Any, job: str | None = None, uptime_fallback: float = 0.0) -> None:
        self.client, self.job = client, job
        self.feed = MetricsFeed(client)
        self.uptime_fallback = uptime_fallback
        self.last: tuple[float, dict[str, float]] | None = None

    def frame(self) -> TopFrame:
        rep = self.client.status(self.job)
        history = self.feed.update(rep.jobs)
        uptime = rep.now - rep.started_at if rep.started_at else self.uptime_fallback
        busy = {e.engine_id: e.busy_seconds for e in rep.engines}
        delta: dict[str, float] = {}
        if self.last is not None and rep.now > self.last[0]:
            span = rep.now - self.last[0]
            delta = {e: min(1.0, max(0.0, (b - self.last[1].get(e, 0.0)) / span)) for e, b in busy.items()}
        self.last = (rep.now, busy)
        return TopFrame(rep, history, uptime, delta)


def utilization(e: EngineInfo, uptime: float) -> float | None:
    return min(1.0, e.busy_seconds / uptime) if uptime > 0 else None


def fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def top_view(f: TopFrame) -> Group:
    now = f.rep.now
    jobs = Table(title="jobs", title_justify="left")
    for col in (
        "JOB",
        "NAME",
        "MODEL",
        "TRAINS",
        "STATE",
        "STEP",
        "",
        "ETA",
        "REWARD",
        "RECENT STEPS",
        "POLICY",
        "STALE",
        "STATE AT",
        "ELAPSED",
    ):
        jobs.add_column(col, no_wrap=True)
    for j in f.rep.jobs:
        h = f.history.get(j.job_id)
        state = Text(j.state, style=STATE_STYLE.get(j.state, ""))
        if j.error or j.reason:
            state.append(f" ({(j.error or j.reason)[:50]})", style="dim")
        jobs.add_row(
            j.job_id,
            j.name,
            model_name(j.model),
            j.trains or "-",
            state,
            f"{j.step}/{j.steps}",
            ProgressBar(total=1.0, completed=j.step / j.steps if j.steps else 0.0, width=14),
            fmt_duration(eta(j, h, now)),
            fmt_reward(j.reward),
            Text(sparkline(h.rewards) if h else "", style="cyan"),
            f"v{j.policy_version}",
            "-" if h is None or h.staleness is None else f"{h.staleness:.0f}",
            j.state_tier or j.engine or "-",
            fmt_duration(_elapsed(j, now)),
        )
    engines = Table(title="engines", title_justify="left")
    for col in (
        "ENGINE",
        "KIND",
        "MODEL",
        "UTIL",
        "",
        "NOW",
        "SERVING",
        "RESIDENT",
        "TASKS",
        "SWAPS",
        "MEMORY PER TIER",
        "SHARED PASSES",
    ):
        engines.add_column(col, no_wrap=True)
    for e in f.rep.engines:
        util = utilization(e, f.uptime)
        engines.add_row(
            e.engine_id,
            e.kind,
            engine_model(e),
            fmt_share(util),
            ProgressBar(total=1.0, completed=util or 0.0, width=10),
            fmt_share(f.busy_delta.get(e.engine_id)),
            ",".join(e.running) or "-",
            ",".join(e.resident) or "-",
            str(e.tasks_done),
            swaps_text(e),
            tiers_text(e),
            passes_text(e),
        )
    footer = Text(f"{cluster_line(f.rep)} · up {fmt_duration(f.uptime)}", style="dim")
    return Group(jobs, engines, footer)


def plain_top(f: TopFrame) -> str:
    now = f.rep.now
    lines = [
        f"{'JOB':<6} {'NAME':<16} {'MODEL':<14} {'TRAINS':<11} {'STATE':<10} {'STEP':>9} {'DONE':>5} {'ETA':>7} "
        f"{'REWARD':>7} "
        f"{'RECENT':<{RECENT_STEPS}} {'POLICY':>6} {'STALE':>5}  STATE AT"
    ]
    for j in f.rep.jobs:
        h = f.history.get(j.job_id)
        done = f"{j.step / j.steps:.0%}" if j.steps else "-"
        lines.append(
            f"{j.job_id:<6} {j.name[:16]:<16} {model_name(j.model)[:14]:<14} {j.trains or '-':<11} {j.state:<10} "
            f"{f'{j.step}/{j.steps}':>9} {done:>5} "
            f"{fmt_duration(eta(j, h, now)):>7} {fmt_reward(j.reward):>7} "
            f"{(sparkline(h.rewards) if h else ''):<{RECENT_STEPS}} {'v' + str(j.policy_version):>6} "
            f"{'-' if h is None or h.staleness is None else f'{h.staleness:.0f}':>5}  "
            f"{j.state_tier or j.engine or '-'}"
            + (f"  error: {j.error}" if j.error else "")
            + (f"  waiting: {j.reason}" if j.reason else "")
        )
    lines.append("")
    lines.append(
        f"{'ENGINE':<14} {'KIND':<8} {'MODEL':<14} {'UTIL':>5} {'NOW':>5} {'TASKS':>6}  "
        "SERVING / RESIDENT  SWAPS  TIERS"
    )
    for e in f.rep.engines:
        lines.append(
            f"{e.engine_id:<14} {e.kind:<8} {engine_model(e)[:14]:<14} {fmt_share(utilization(e, f.uptime)):>5} "
            f"{fmt_share(f.busy_delta.get(e.engine_id)):>5} {e.tasks_done:>6}  "
            f"{','.join(e.running) or '-'} / {','.join(e.resident) or '-'}  {swaps_text(e)}  {tiers_text(e)}"
            + (f"  shared passes: {passes_text(e)}" if e.shared_passes else "")
        )
    lines.append(f"{cluster_line(f.rep)} · up {fmt_duration(f.uptime)}")
    return "\n".join(lines)


def top_json(f: TopFrame) -> dict[str, Any]:
    now = f.rep.now
    jobs = []
    for j in f.rep.jobs:
        h = f.history.get(j.job_id)
        jobs.append(
            {
                **job_row(j, now),
                "progress": j.step / j.steps if j.steps else 0.0,
                "eta_s": eta(j, h, now),
                "recent_rewards": list(h.rewards) if h else [],
                "staleness": h.staleness if h else None,
                "loss": h.loss if h else None,
            }
        )
    engines = [
        {
            **msgspec.to_builtins(e),
            "utilization": utilization(e, f.uptime),
            "utilization_now": f.busy_delta.get(e.engine_id),
        }
        for e in f.rep.engines
    ]
    return {
        "jobs": jobs,
        "engines": engines,
        "policy": f.rep.policy,
        "bubble_ratio": f.rep.bubble_ratio,
        "uptime_s": f.uptime,
        "now": now,
    }


def _elapsed(job: JobInfo, now: float) -> float | None:
    return None if job.started_at is None else (job.ended_at or now) - job.started_at


def watch_plain(top: Top, interval: float | None, stop: Any = None) -> None:
    """Plain text: one frame, or one every ``interval`` seconds until ``stop()`` is true."""
    while True:
        print(plain_top(top.frame()), flush=True)
        if interval is None or (stop is not None and stop()):
            return
        print(flush=True)
        time.sleep(interval)
