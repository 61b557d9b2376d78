"""`plexctl top`: what every job and engine is doing, fuller than `status`.

Jobs: what ``status`` shows (state, step/steps with a bar, reward, eval, policy version, where
the job's trainer state lives), plus the ETA, a sparkline of the recent steps' rewards and the
staleness. Engines: what ``status`` shows (readiness, utilization since start, which job each
serves now, swap traffic, state tiers, shared passes), plus utilization since the last refresh.

The daemon's ``status`` reply gives the jobs and engines; the per-step history (sparkline, ETA,
staleness) comes from each job's metrics JSONL over the daemon's ``logs`` request, read
incrementally (a ``MetricsFeed`` keeps an offset per job), so the protocol needs nothing new.
Rendering is pure (``top_view``, ``plain_top``, ``top_json`` take a ``TopFrame``) and uses the
job and engine rows ``views.py`` defines for ``status`` too: top picks more of their columns. The
CLI decides between a live view, plain text and JSON.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from rich.console import Group
from rich.text import Text

from plexctl.cli.views import (
    ENGINE_COLUMNS,
    ENGINE_NOTES,
    JOB_COLUMNS,
    JOB_NOTES,
    RECENT_STEPS,
    EngineRow,
    JobRow,
    cluster_line,
    fmt_duration,
    job_row,
    pick,
    plain_table,
    progress,
    rich_table,
    utilization,
)
from plexctl.common.protocol import JobInfo, StatusRep

RATE_STEPS = 10  # steps the ETA's rate is measured over
MAX_READ_PER_JOB = 4 << 20  # bytes of metrics read per job and refresh (the rest on the next one)
# status's columns and what the metrics add: ETA, the recent steps' rewards, staleness; busy since the last frame
TOP_JOBS = pick(
    JOB_COLUMNS, "job name model trains user state step progress eta reward eval recent policy stale engine elapsed"
)
PLAIN_TOP_JOBS = pick(
    JOB_COLUMNS, "job name model trains state step progress eta reward eval recent policy stale engine"
)
TOP_ENGINES = pick(
    ENGINE_COLUMNS, "engine kind model on ready serving resident busy busy_bar now tasks tiers swaps switches passes"
)
PLAIN_TOP_ENGINES = pick(ENGINE_COLUMNS, "engine kind model on ready busy now tasks serving_resident")


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


def job_rows(f: TopFrame) -> list[JobRow]:
    """Each job's row: its ``JobInfo`` and what its metrics add."""
    rows = []
    for j in f.rep.jobs:
        h = f.history.get(j.job_id)
        rows.append(
            JobRow(
                j,
                f.rep.now,
                eta_s=eta(j, h, f.rep.now),
                recent_rewards=h.rewards if h else (),
                staleness=h.staleness if h else None,
            )
        )
    return rows


def engine_rows(f: TopFrame) -> list[EngineRow]:
    return [EngineRow(e, f.uptime, f.busy_delta.get(e.engine_id)) for e in f.rep.engines]


def top_view(f: TopFrame) -> Group:
    jobs = rich_table("jobs", TOP_JOBS, job_rows(f))
    engines = rich_table("engines", TOP_ENGINES, engine_rows(f))
    footer = Text(f"{cluster_line(f.rep)} · up {fmt_duration(f.uptime)}", style="dim")
    return Group(jobs, engines, footer)


def plain_top(f: TopFrame) -> str:
    lines = plain_table(PLAIN_TOP_JOBS, job_rows(f), JOB_NOTES)
    lines.append("")
    lines += plain_table(PLAIN_TOP_ENGINES, engine_rows(f), ENGINE_NOTES)
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
                "progress": progress(j),
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
        "interactive_share": f.rep.interactive_share,
        "interactive_queued": f.rep.interactive_queued,
        "uptime_s": f.uptime,
        "now": now,
    }


def watch_plain(top: Top, interval: float | None, stop: Any = None) -> None:
    """Plain text: one frame, or one every ``interval`` seconds until ``stop()`` is true."""
    while True:
        print(plain_top(top.frame()), flush=True)
        if interval is None or (stop is not None and stop()):
            return
        print(flush=True)
        time.sleep(interval)
