"""`plexctl report`: PNG plots of a job's curves and of the cluster's engine timeline.

- ``job_plots``: reward (per step, a moving average over it, evaluation points) and loss curves
  of one job, or of two overlaid (``--vs``), from their metrics JSONL;
- ``cluster_timeline``: which job occupied which engine when (one colour per job), swaps of job
  state marked, idle gaps left white, from the daemon's busy spans (``status`` with
  ``timeline``), so a user sees the engines fill one job's gaps with another's work.

matplotlib is optional (``pip install 'plexrl[plots]'``) and imported only here, on use; the
Agg backend writes files without a display. Nothing here talks to the daemon: the CLI fetches
the rows and the status and passes them in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plexctl.common.errors import UsageError
from plexctl.common.protocol import StatusRep
from plexctl.common.scheduling import union_length

DPI = 100
SMOOTH = 8  # steps in the reward's moving average
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plots need matplotlib: pip install 'plexrl[plots]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def parse_metrics(text: str) -> list[dict[str, Any]]:
    rows = []
    for line in text.splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def moving_average(values: list[float], k: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= k:
            total -= values[i - k]
        out.append(total / min(i + 1, k))
    return out


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``, the last row of each step winning (a resumed job rewrites some)."""
    by_step = {int(r["step"]): float(r[key]) for r in rows if key in r and "step" in r}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def job_plots(runs: dict[str, list[dict[str, Any]]], out_dir: Path, stem: str) -> list[Path]:
    """``STEM-reward.png`` and ``STEM-loss.png`` in ``out_dir``; ``runs`` maps a label to its rows."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4), dpi=DPI)
    for color, (label, rows) in zip(COLORS, runs.items()):
        steps, rewards = _series(rows, "reward_mean")
        if steps:
            ax.plot(steps, rewards, color=color, alpha=0.25, linewidth=1)
            ax.plot(
                steps,
                moving_average(rewards, SMOOTH),
                color=color,
                linewidth=2,
                label=f"{label}: train reward ({SMOOTH}-step mean)",
            )
        e_steps, evals = _series(rows, "eval_reward")
        if e_steps:
            ax.plot(
                e_steps,
                evals,
                color=color,
                marker="o",
                linestyle="--",
                linewidth=1,
                markersize=6,
                label=f"{label}: eval reward",
            )
    _finish(ax, "reward", "reward per step (thin: each step)")
    paths.append(_save(fig, out_dir / f"{stem}-reward.png"))

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 5), dpi=DPI, sharex=True)
    for color, (label, rows) in zip(COLORS, runs.items()):
        steps, loss = _series(rows, "train/loss")
        if steps:
            ax.plot(steps, loss, color=color, linewidth=1.5, label=label)
        g_steps, grad = _series(rows, "train/grad_norm")
        if g_steps:
            ax2.plot(g_steps, grad, color=color, linewidth=1.5, label=label)
    _finish(ax, "loss", "training loss per step")
    ax.set_xlabel("")
    _finish(ax2, "grad norm", "gradient norm per step")
    paths.append(_save(fig, out_dir / f"{stem}-loss.png"))
    return paths


def _finish(ax: Any, ylabel: str, title: str) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best", framealpha=0.8)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def cluster_timeline(rep: StatusRep, out: Path, last_s: float | None = None, zoom_s: float = 3.0) -> Path:
    """One row per engine, a bar per call coloured by job, swaps marked, and under a trainer's
    row a thin strip per state move it made in the background (a prefetch from NVMe, a
    demotion for one, a write to NVMe left behind by an eviction), in the moved job's colour;
    below, ``zoom_s`` seconds from the middle of the busy period, where single calls and the
    gaps between them show."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    out.parent.mkdir(parents=True, exist_ok=True)
    spans = rep.timeline
    lo = min([s.start for s in spans], default=rep.now)  # from the first call ...
    hi = max([s.end for s in spans], default=rep.now)  # ... to the last one
    if last_s is not None:
        lo = max(lo, hi - last_s)
    engines = sorted({e.engine_id for e in rep.engines} | {s.engine_id for s in spans})
    jobs = sorted({s.job_id for s in spans if s.end > lo} | {m.job_id for m in rep.moves if m.end > lo})
    color = {j: COLORS[i % len(COLORS)] for i, j in enumerate(jobs)}
    names = {j.job_id: j.name for j in rep.jobs}
    mid = (lo + hi) / 2
    zlo, zhi = max(lo, mid - zoom_s / 2), min(hi, mid + zoom_s / 2)

    fig, (ax, zax) = plt.subplots(2, 1, figsize=(10, 1.8 + 1.5 * max(1, len(engines))), dpi=DPI)
    marks, moves = _timeline_axis(ax, rep, engines, color, lo, hi, lo)
    ax.axvspan(zlo - lo, zhi - lo, color="grey", alpha=0.15, zorder=0)
    ax.set_title(
        f"engine timeline: one bar per call, coloured by job; white = idle "
        f"({_idle_share(spans, engines, lo, hi):.0%} of engine time in this window)",
        fontsize=11,
    )
    ax.set_xlabel("seconds since the first call")
    _timeline_axis(zax, rep, engines, color, zlo, zhi, lo)
    zax.set_title(f"zoom: {zhi - zlo:.1f} s (grey band above), one job's gaps filled by the other's calls", fontsize=10)
    zax.set_xlabel("seconds since the first call")
    legend: list[Any] = [Patch(color=color[j], label=f"{j} {names.get(j, '')}".strip()) for j in jobs]
    if marks:
        legend.append(
            Line2D([], [], marker="v", color="black", linestyle="none", label=f"job state swapped in ({marks})")
        )
    if moves:
        legend.append(
            Patch(facecolor="white", edgecolor="black", hatch="////", label=f"state moved in the background ({moves})")
        )
    if legend:
        ax.legend(handles=legend, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), framealpha=0.8)
    return _save(fig, out)


def _timeline_axis(
    ax: Any, rep: StatusRep, engines: list[str], color: dict[str, str], lo: float, hi: float, origin: float
) -> tuple[int, int]:
    """Draw the calls, swap marks and background moves in [lo, hi] on ``ax``; return how many
    swaps and moves it drew."""
    row = {e: i for i, e in enumerate(engines)}
    spans = [s for s in rep.timeline if s.end > lo and s.start < hi]
    for e in engines:
        for j in color:
            bars = [
                (max(s.start, lo) - origin, min(s.end, hi) - max(s.start, lo))
                for s in spans
                if s.engine_id == e and s.job_id == j
            ]
            if bars:
                ax.broken_barh(bars, (row[e] - 0.35, 0.7), facecolors=color[j], edgecolors="none")
        busy = union_length([(s.start, s.end) for s in spans if s.engine_id == e], lo, hi)
        ax.text(hi - origin, row[e], f" {busy / (hi - lo):.0%} busy" if hi > lo else "", va="center", fontsize=9)
    marks = [m for m in rep.swap_marks if lo <= m.at <= hi and m.engine_id in row]
    if marks:
        ax.scatter(
            [m.at - origin for m in marks],
            [row[m.engine_id] - 0.45 for m in marks],
            marker="v",
            color="black",
            s=14,
            zorder=3,
        )
    moves = [m for m in rep.moves if m.end > lo and m.start < hi and m.engine_id in row]
    for m in moves:  # a thin strip under the engine's row, in the moved job's colour
        ax.broken_barh(
            [(max(m.start, lo) - origin, min(m.end, hi) - max(m.start, lo))],
            (row[m.engine_id] + 0.38, 0.14),
            facecolors=color.get(m.job_id, "grey"),
            edgecolors="black",
            linewidth=0.3,
            hatch="////",
        )
    ax.set_yticks(range(len(engines)))
    ax.set_yticklabels(engines)
    ax.set_ylim(len(engines) - 0.4 + (0.15 if moves else 0.0), -0.65)
    ax.set_xlim(lo - origin, hi - origin + (hi - lo) * 0.12)
    ax.grid(axis="x", alpha=0.3)
    return len(marks), len(moves)


def _idle_share(spans: list[Any], engines: list[str], lo: float, hi: float) -> float:
    if hi <= lo or not engines:
        return 0.0
    busy = sum(union_length([(s.start, s.end) for s in spans if s.engine_id == e], lo, hi) for e in engines)
    return 1.0 - busy / ((hi - lo) * len(engines))
