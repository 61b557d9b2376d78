"""The daemon's telemetry: call latencies, swap marks, and a Prometheus text endpoint.

``Telemetry`` is fed by the daemon's loop (one call per finished task, one snapshot of the
cluster's gauges every ``SNAPSHOT_S``) and read by two consumers: ``status`` (the swap marks
for ``plexctl report --cluster``) and, when ``plexd --metrics-port N`` is given, a small HTTP
thread that serves ``/metrics`` in Prometheus' text format (version 0.0.4).

The HTTP thread never touches the daemon's state: it renders the last snapshot and the
counters under one lock, so a scrape costs the loop nothing but that lock. Deliberately not
here: prometheus_client (one more dependency for ~100 lines), push gateways, per-job labels
on latencies (a cluster of thousands of jobs would make thousands of series).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from daemon.scheduler import union_length
from plexctl.common.protocol import JOB_STATES, MoveSpan, SwapMark

log = logging.getLogger("plexd.metrics")

METRICS_FILE = "metrics.json"  # in the state directory: {"url": ...} while the endpoint is up
SNAPSHOT_S = 2.0  # how often the loop refreshes the gauges a scrape sees
SWAP_MARKS_KEPT = 20_000
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class Histogram:
    """Cumulative Prometheus histogram of one label set."""

    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: int = 0
    sum: float = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += 1
        self.sum += value


@dataclass
class Gauges:
    """What the loop measures every ``SNAPSHOT_S``: cheap sums, no scan of the task history."""

    jobs_by_state: dict[str, int] = field(default_factory=dict)
    engines: list[dict[str, Any]] = field(default_factory=list)  # engine_id, kind, busy_seconds, up_seconds,
    #                                                               running, swaps {direction: {count, bytes, seconds}}
    bubble_ratio: float | None = None
    uptime_s: float = 0.0
    interactive_share: float = 0.0  # the scheduler's interactive class: its share of recent engine time
    interactive_queued: int = 0  # and its calls queued


class Telemetry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[tuple[str, str], Histogram] = {}  # (method, outcome) -> worker seconds
        self.waits: dict[str, Histogram] = {}  # method -> seconds from submit to result (queue + run)
        self.swap_marks: deque[SwapMark] = deque(maxlen=SWAP_MARKS_KEPT)
        self.moves: deque[MoveSpan] = deque(maxlen=SWAP_MARKS_KEPT)  # trainers' background moves
        self.gauges = Gauges()
        self.server: ThreadingHTTPServer | None = None

    # -- fed by the daemon's loop

    def task_done(self, method: str, ok: bool, seconds: float, latency: float | None) -> None:
        with self.lock:
            self.calls.setdefault((method, "ok" if ok else "error"), Histogram()).observe(seconds)
            if latency is not None:
                self.waits.setdefault(method, Histogram()).observe(latency)

    def swapped(self, engine_id: str, job_id: str, at: float, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.swap_marks.append(SwapMark(engine_id, job_id, at, nbytes, seconds))

    def marks_since(self, since: float) -> list[SwapMark]:
        with self.lock:
            return [m for m in self.swap_marks if m.at >= since]

    def moved(self, engine_id: str, moves: list[list[Any]]) -> None:
        """A trainer's background moves, as its results report them: [direction, job, start, end]."""
        with self.lock:
            self.moves.extend(
                MoveSpan(engine_id, str(job), str(direction), float(start), float(end))
                for direction, job, start, end in moves
            )

    def moves_since(self, since: float) -> list[MoveSpan]:
        with self.lock:
            return [m for m in self.moves if m.start >= since]

    def set_gauges(self, gauges: Gauges) -> None:
        with self.lock:
            self.gauges = gauges

    # -- read by a scrape

    def render(self) -> str:
        """The Prometheus text exposition of everything above."""
        with self.lock:
            g = self.gauges
            calls = {k: Histogram(list(h.counts), h.total, h.sum) for k, h in self.calls.items()}
            waits = {k: Histogram(list(h.counts), h.total, h.sum) for k, h in self.waits.items()}
        out: list[str] = []

        def family(name: str, kind: str, doc: str) -> None:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")

        family("plexrl_jobs", "gauge", "Jobs by state.")
        for state in sorted(set(JOB_STATES) | set(g.jobs_by_state)):
            out.append(f'plexrl_jobs{{state="{_esc(state)}"}} {g.jobs_by_state.get(state, 0)}')
        family("plexrl_engine_utilization", "gauge", "Busy share of each engine's time since it came up.")
        for e in g.engines:
            util = e["busy_seconds"] / e["up_seconds"] if e["up_seconds"] > 0 else 0.0
            out.append(f"plexrl_engine_utilization{_engine_labels(e)} {util:.6f}")
        family("plexrl_engine_busy_seconds_total", "counter", "Seconds each engine was busy.")
        for e in g.engines:
            out.append(f"plexrl_engine_busy_seconds_total{_engine_labels(e)} {e['busy_seconds']:.6f}")
        family("plexrl_engine_running_tasks", "gauge", "Tasks each engine runs now.")
        for e in g.engines:
            out.append(f"plexrl_engine_running_tasks{_engine_labels(e)} {e['running']}")
        family("plexrl_bubble_ratio", "gauge", "Idle share of engine time since the daemon started.")
        out.append(f"plexrl_bubble_ratio {g.bubble_ratio if g.bubble_ratio is not None else 'NaN'}")
        for unit, key, doc in (
            ("bytes", "bytes", "Bytes of job state moved between tiers."),
            ("seconds", "seconds", "Seconds spent moving job state between tiers."),
            ("count", "count", "Moves of job state between tiers."),
        ):
            name = f"plexrl_swap_{unit}_total"
            family(name, "counter", doc)
            for e in g.engines:
                for direction, s in sorted(e.get("swaps", {}).items()):
                    labels = _engine_labels(e, direction=direction)
                    out.append(f"{name}{labels} {float(s.get(key, 0)):.6f}")
        family("plexrl_task_seconds", "histogram", "Seconds a worker spent on a call, by method and outcome.")
        for (method, outcome), h in sorted(calls.items()):
            _histogram(out, "plexrl_task_seconds", f'method="{_esc(method)}",outcome="{outcome}"', h)
        family(
            "plexrl_call_latency_seconds",
            "histogram",
            "Seconds from a job's call to its result (queueing included), by method.",
        )
        for method, h in sorted(waits.items()):
            _histogram(out, "plexrl_call_latency_seconds", f'method="{_esc(method)}"', h)
        family(
            "plexrl_interactive_share",
            "gauge",
            "Share of recent engine time that went to the interactive class (API requests a client waits on).",
        )
        out.append(f"plexrl_interactive_share {g.interactive_share:.6f}")
        family("plexrl_interactive_queued", "gauge", "Calls of the interactive class waiting for an engine.")
        out.append(f"plexrl_interactive_queued {g.interactive_queued}")
        family("plexrl_uptime_seconds", "gauge", "Seconds since the daemon started.")
        out.append(f"plexrl_uptime_seconds {g.uptime_s:.3f}")
        return "\n".join(out) + "\n"

    # -- the HTTP thread

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on a daemon thread; return the port (``port`` 0: a free one)."""
        telemetry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = telemetry.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # scrapes every few seconds: keep the log quiet
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="metrics-http", daemon=True).start()
        return self.server.server_address[1]

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _engine_labels(e: dict[str, Any], **extra: str) -> str:
    labels = {"engine": e["engine_id"], "kind": e["kind"], **extra}
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items()) + "}"


def _histogram(out: list[str], name: str, labels: str, h: Histogram) -> None:
    for bound, count in zip(LATENCY_BUCKETS, h.counts):
        out.append(f'{name}_bucket{{{labels},le="{bound}"}} {count}')
    out.append(f'{name}_bucket{{{labels},le="+Inf"}} {h.total}')
    out.append(f"{name}_sum{{{labels}}} {h.sum:.6f}")
    out.append(f"{name}_count{{{labels}}} {h.total}")


def engine_gauges(sched: Any, engine_swaps: dict[str, dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """Per engine: busy seconds so far (O(engines): the scheduler's running sums, no history scan)."""
    rows = []
    for engine_id, eng in sched.engines.items():
        busy = eng.busy_seconds + (now - eng.busy_since if eng.busy_since else 0.0)
        up = now - eng.up_at if eng.up_at is not None else 0.0
        rows.append(
            {
                "engine_id": engine_id,
                "kind": eng.kind,
                "busy_seconds": busy,
                "up_seconds": up,
                "running": len(eng.running),
                "swaps": engine_swaps.get(engine_id, {}),
            }
        )
    return rows


def bubble_of(engines: list[dict[str, Any]]) -> float | None:
    span = sum(e["up_seconds"] for e in engines)
    return 1.0 - sum(e["busy_seconds"] for e in engines) / span if span > 0 else None


def hidden_by_other_jobs(moves: list[Any], spans: list[Any]) -> float:
    """Seconds of ``moves`` (``MoveSpan``) during which some other job's task ran on some
    engine (``spans``: ``BusySpan``): the swap time other jobs' compute hid. A move's own job
    does not hide it (its rollout may run meanwhile, but its next trainer call needs the move),
    and two engines busy at once hide a moment once."""
    spans = sorted(spans, key=lambda s: s.start)
    starts = [s.start for s in spans]
    longest = max((s.end - s.start for s in spans), default=0.0)
    hidden = 0.0
    for move in moves:  # the spans that may overlap it: started at most ``longest`` before it
        near = spans[bisect.bisect_left(starts, move.start - longest) : bisect.bisect_right(starts, move.end)]
        hidden += union_length([(s.start, s.end) for s in near if s.job_id != move.job_id], move.start, move.end)
    return hidden


def busy_spans(sched: Any, now: float, limit: int = 50_000) -> list[Any]:
    """The scheduler's kept task intervals (the newest ``limit``), running tasks up to ``now``."""
    from plexctl.common.protocol import BusySpan

    spans = [BusySpan(i.engine_id, i.job_id, i.method, i.start, i.end) for i in list(sched.intervals)[-limit:]]
    for engine_id, eng in sched.engines.items():
        for task_id, task in eng.running.items():
            spans.append(BusySpan(engine_id, task.job_id, task.method, eng.started_at.get(task_id, now), now))
    return spans
