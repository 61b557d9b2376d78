"""Benchmark: the daemon's own overhead, a no-op call's round trip and messages per second.

Starts a real daemon with no workers in a temporary state directory (as ``plexctl up`` does) and
measures on loopback, CURVE on: the round trip of one PING at a time (p50 / p90 / p99 / max;
target p50 < 1 ms) and the replies per second of ``--clients`` DEALER sockets over ``--procs``
client processes, ``--depth`` PINGs in flight each (target >= 20,000/s), with the daemon's CPU
seconds per message. PING is the no-op: its handler only reads in-memory counters. When a target
is missed (or with ``--profile``), the same load runs against a daemon in this process under
cProfile and the functions that take its time are printed. Method: ``docs/benchmarks.md``.

It deliberately runs no workers, jobs or service calls (the other benchmarks do) and no remote
hosts; the clients share this machine's cores with the daemon, so the throughput is this
machine's, clients included.

Usage: ``python bench/daemon_rtt.py [--quick] [--clients N] [--procs N] [--depth N] [--profile]
[--out FILE]``; writes ``bench/results/daemon.json`` (``daemon-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import multiprocessing
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from plexctl.common import auth  # noqa: E402
from plexctl.common import protocol as P  # noqa: E402
from plexctl.common.atomic import write_json_atomic  # noqa: E402
from plexctl.common.client import Client, current_user  # noqa: E402
from plexctl.common.cluster import endpoint_path, plexrl_home, read_endpoint  # noqa: E402
from plexctl.common.frames import NOBLOCK, recv_frames, send_frames  # noqa: E402

TARGET_P50_MS = 1.0
TARGET_MSGS_PER_S = 20_000
START_TIMEOUT_S = 30.0

console = Console() if sys.stdout.isatty() else Console(width=120)  # a log keeps the table whole


@dataclass(frozen=True)
class Load:
    """The throughput run's shape."""

    clients: int
    procs: int
    depth: int
    warmup_s: float
    window_s: float
    rounds: int  # windows measured, each with fresh client processes; the best is reported


# ---------------------------------------------------------------- the daemon under test


class DaemonProcess:
    """``python -m daemon.main --state-dir DIR`` with no workers, stopped with SIGTERM."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.log = open(state_dir / "daemon.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.main", "--state-dir", str(state_dir)],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.address = self._wait_for_endpoint()

    def _wait_for_endpoint(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise SystemExit(f"the daemon exited with code {self.proc.returncode}: {self._log_tail()}")
            if endpoint_path(self.state_dir).exists():
                return read_endpoint(self.state_dir).address
            time.sleep(0.05)
        self.stop()
        raise SystemExit(f"the daemon wrote no endpoint.json within {START_TIMEOUT_S:.0f} s: {self._log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _log_tail(self) -> str:
        try:
            return " | ".join((self.state_dir / "daemon.log").read_text(errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"


def machine_cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]  # to steal
    except (OSError, ValueError, IndexError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process, from /proc (None where there is no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- round trip


def round_trips(address: str, count: int, warmup: int) -> dict[str, Any]:
    """Milliseconds per PING -> Pong through the client library, one request at a time."""
    client = Client(address, timeout=5.0, retries=0)
    try:
        for _ in range(warmup):
            client.request(P.Op.PING, P.Empty())
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            client.request(P.Op.PING, P.Empty())
            samples.append((time.perf_counter() - started) * 1000.0)
    finally:
        client.close()
    samples.sort()
    return {
        "requests": count,
        "p50_ms": percentile(samples, 50),
        "p90_ms": percentile(samples, 90),
        "p99_ms": percentile(samples, 99),
        "max_ms": samples[-1],
        "mean_ms": statistics.fmean(samples),
    }


def percentile(sorted_samples: list[float], q: float) -> float:
    index = min(len(sorted_samples) - 1, max(0, round(q / 100.0 * (len(sorted_samples) - 1))))
    return sorted_samples[index]


# ---------------------------------------------------------------- throughput


def client_process(
    address: str,
    sockets: int,
    depth: int,
    start_at: float,
    end_at: float,
    results: multiprocessing.Queue,
    keys: auth.CurveKeys | None = None,
) -> None:
    """``sockets`` DEALERs, each keeping ``depth`` PINGs in flight; counts replies in [start, end).

    Kept cheap, since the clients share the machine's cores with the daemon: the request is
    encoded once (the daemon's work does not depend on its msg_id) and frames are sent and
    received as the product's peers do (``plexctl.common.frames``: one by one, int flags).
    """
    ctx = zmq.Context()
    poller = zmq.Poller()
    socks = []
    for _ in range(sockets):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:  # the daemon lets in only known CURVE keys
            keys.apply(sock)
        sock.connect(address)
        poller.register(sock, zmq.POLLIN)
        socks.append(sock)
    request = P.encode(P.Op.PING, P.Empty())[0]

    def send(sock: zmq.Socket) -> None:
        send_frames(sock, request)

    for sock in socks:
        for _ in range(depth):
            send(sock)
    replies = errors = 0
    cpu_start = None
    while (now := time.time()) < end_at:
        counting = now >= start_at
        if counting and cpu_start is None:
            cpu_start = time.process_time()
        for sock, _ in poller.poll(100):
            while True:
                try:
                    frames = recv_frames(sock, NOBLOCK)
                except zmq.Again:
                    break
                if counting:
                    if len(frames) == 4 and frames[1].bytes == P.Op.REPLY:
                        replies += 1
                    else:
                        errors += 1
                send(sock)
    cpu_s = time.process_time() - cpu_start if cpu_start is not None else 0.0
    for sock in socks:
        sock.close(linger=0)
    ctx.term()
    results.put({"replies": replies, "errors": errors, "cpu_s": cpu_s})


def run_load(address: str, load: Load, daemon_pid: int | None) -> dict[str, Any]:
    """Replies per second with ``load``; the daemon's CPU over the window if its pid is given."""
    spawn = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[dict[str, int]] = spawn.Queue()
    start_at = time.time() + 2.0 + load.warmup_s  # spawned interpreters take a moment to start
    end_at = start_at + load.window_s
    per_proc = [load.clients // load.procs + (i < load.clients % load.procs) for i in range(load.procs)]
    keys = auth.client_keys(address, plexrl_home(), current_user())
    procs = [
        spawn.Process(target=client_process, args=(address, n, load.depth, start_at, end_at, results, keys))
        for n in per_proc
        if n
    ]
    for proc in procs:
        proc.start()
    time.sleep(max(0.0, start_at - time.time()))
    cpu0, machine0 = (process_cpu_seconds(daemon_pid) if daemon_pid else None), machine_cpu_seconds()
    time.sleep(max(0.0, end_at - time.time()))
    cpu1, machine1 = (process_cpu_seconds(daemon_pid) if daemon_pid else None), machine_cpu_seconds()
    counts = [results.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(10)
    replies = sum(c["replies"] for c in counts)
    out: dict[str, Any] = {
        "clients": load.clients,
        "procs": len(procs),
        "depth": load.depth,
        "window_s": load.window_s,
        "replies": replies,
        "errors": sum(c["errors"] for c in counts),
        "msgs_per_s": replies / load.window_s,
        "clients_cpu_s": sum(c["cpu_s"] for c in counts),
    }
    if machine0 is not None and machine1 is not None:
        busy, total = machine1[0] - machine0[0], machine1[1] - machine0[1]
        out["machine_busy_cores"] = busy / total * (os.cpu_count() or 1) if total else None
    if cpu0 is not None and cpu1 is not None:
        cpu = cpu1 - cpu0
        out.update(
            daemon_cpu_s=cpu,
            daemon_core_share=cpu / load.window_s,
            daemon_cpu_us_per_msg=cpu / replies * 1e6 if replies else None,
        )
    return out


# ---------------------------------------------------------------- profile of an in-process daemon


def profile_daemon(load: Load, top: int = 15) -> dict[str, Any]:
    """The same load against a ``Daemon`` run in this process under cProfile; where its time goes."""
    from daemon.main import Daemon  # the daemon's imports stay out of the measured runs

    state_dir = Path(tempfile.mkdtemp(prefix="plexrl-bench-daemon-prof-"))
    for name in QUIET_WHILE_PROFILING:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        daemon = Daemon(state_dir, [], [])
        read_endpoint(state_dir)  # the clients learn the daemon's public key from it
        outcome: dict[str, Any] = {}
        loader = threading.Thread(target=lambda: outcome.update(run_load(daemon.address, load, None)), daemon=True)
        loader.start()
        stopper = threading.Timer(
            2.0 + load.warmup_s + load.window_s + 0.5, lambda: setattr(daemon.core, "stopping", True)
        )
        stopper.start()
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        daemon.run()  # returns once stopping is set, after its own shutdown()
        profiler.disable()
        wall = time.perf_counter() - started
        loader.join(60)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    stats = pstats.Stats(profiler)
    rows = []
    entries = stats.stats.items()  # type: ignore[attr-defined]
    for (path, line, name), (_cc, calls, tottime, cumtime, _callers) in entries:
        rows.append(
            {"function": function_label(path, line, name), "calls": calls, "tottime_s": tottime, "cumtime_s": cumtime}
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    by_name = {r["function"]: r for r in rows}
    loop_parts = {label: by_name[label]["cumtime_s"] for label in HOT_PATH if label in by_name}
    return {
        "wall_s": wall,
        "msgs_per_s_under_profiler": outcome.get("msgs_per_s"),
        "replies_under_profiler": outcome.get("replies"),
        "top_by_self_time": rows[:top],
        "loop_parts_cumtime_s": loop_parts,
    }


# The run loop's pieces, by the labels function_label gives them.
HOT_PATH = (
    "daemon/main.py:run",
    "daemon/main.py:dispatch",
    "daemon/core/__init__.py:handle",
    "daemon/core/clients.py:on_ping",
    "daemon/main.py:_send",
    "plexctl/common/protocol.py:decode",
    "plexctl/common/protocol.py:encode",
    "daemon/core/__init__.py:chores",
    "daemon/core/__init__.py:place",
    "daemon/main.py:reap_drivers",
    "daemon/core/__init__.py:heartbeat",
    "plexctl/common/frames.py:recv_frames",
    "plexctl/common/frames.py:send_frames",
    "zmq.Socket.poll",
)
QUIET_WHILE_PROFILING = ("plexd",)  # clients that leave mid-reply make the daemon warn per message


def function_label(path: str, line: int, name: str) -> str:
    """'daemon/core/__init__.py:chores' for repo code, 'zmq.Socket.poll' for pyzmq's, else 'file:name'."""
    if path == "~":
        return name.strip("<>").replace("built-in method ", "").replace("method ", "")
    if "/zmq/" in path:
        return f"zmq.{'Poller' if path.endswith('poll.py') else 'Socket'}.{name}"
    if "site-packages" not in path:
        try:
            return f"{Path(path).resolve().relative_to(REPO)}:{name}"
        except ValueError:
            pass
    return f"{Path(path).name}:{name}"


# ---------------------------------------------------------------- report


def print_report(rtt: dict[str, Any], load: dict[str, Any], profile: dict[str, Any] | None) -> None:
    table = Table(title="daemon: no-op (PING) on loopback, daemon with no workers")
    for col in ("measure", "value", "target", "met"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    table.add_row(
        "round trip p50", f"{rtt['p50_ms']:.3f} ms", f"< {TARGET_P50_MS:g} ms", yes_no(rtt["p50_ms"] < TARGET_P50_MS)
    )
    for key in ("p90", "p99", "max"):
        table.add_row(f"round trip {key}", f"{rtt[f'{key}_ms']:.3f} ms", "", "")
    table.add_row(
        f"messages/s ({load['clients']} clients x depth {load['depth']}, {load['procs']} procs, "
        f"best of {len(load['rounds_msgs_per_s'])} x {load['window_s']:g} s)",
        f"{load['msgs_per_s']:,.0f}",
        f">= {TARGET_MSGS_PER_S:,}",
        yes_no(load["msgs_per_s"] >= TARGET_MSGS_PER_S),
    )
    if load.get("daemon_cpu_us_per_msg") is not None:
        table.add_row("daemon CPU per message", f"{load['daemon_cpu_us_per_msg']:.1f} us", "", "")
        table.add_row("daemon CPU share of one core", f"{load['daemon_core_share']:.0%}", "", "")
        table.add_row("=> replies/s per daemon core", f"{1e6 / load['daemon_cpu_us_per_msg']:,.0f}", "", "")
    table.add_row("client processes' CPU share (cores)", f"{load['clients_cpu_s'] / load['window_s']:.2f}", "", "")
    if load.get("machine_busy_cores") is not None:
        table.add_row(f"whole machine busy (cores, of {os.cpu_count()})", f"{load['machine_busy_cores']:.2f}", "", "")
    if load["errors"]:
        table.add_row("error replies", str(load["errors"]), "0", yes_no(False))
    console.print(table)
    if profile is None:
        return
    replies = profile["replies_under_profiler"] or 0
    hot = Table(
        title=f"where the daemon's time goes (cProfile, in-process daemon, same load: "
        f"{profile['msgs_per_s_under_profiler'] or 0:,.0f} msg/s under the profiler)"
    )
    for col in ("function (top by self time)", "calls", "self s", "% of run", "self us / reply", "cum s"):
        hot.add_column(col, justify="left" if col.startswith("function") else "right")
    for row in profile["top_by_self_time"]:
        per = f"{row['tottime_s'] / replies * 1e6:.1f}" if replies else ""
        hot.add_row(
            row["function"],
            f"{row['calls']:,}",
            f"{row['tottime_s']:.3f}",
            f"{row['tottime_s'] / profile['wall_s']:.0%}",
            per,
            f"{row['cumtime_s']:.3f}",
        )
    console.print(hot)
    parts = ", ".join(f"{k} {v:.2f}s" for k, v in profile["loop_parts_cumtime_s"].items())
    console.print(f"run loop, cumulative seconds over {profile['wall_s']:.1f} s: {parts}")


def yes_no(ok: bool) -> str:
    return "yes" if ok else "no"


def machine() -> dict[str, Any]:
    return {
        "cpu": describe(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "python": sys.version.split()[0],
        "libzmq": zmq.zmq_version(),
        "pyzmq": zmq.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short windows: keeps the benchmark working")
    ap.add_argument("--clients", type=int, default=100, help="concurrent client sockets (default 100)")
    ap.add_argument(
        "--procs",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) - 1)),
        help="client processes the sockets are spread over (default: one core left to the daemon)",
    )
    ap.add_argument("--depth", type=int, default=8, help="requests each client keeps in flight (default 8)")
    ap.add_argument("--pings", type=int, default=None, help="round trips timed (default 5000, quick 300)")
    ap.add_argument("--profile", action="store_true", help="profile the daemon even when the targets are met")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/daemon[-quick].json)")
    args = ap.parse_args()
    if args.clients < 1 or args.procs < 1 or args.depth < 1:
        ap.error("--clients, --procs and --depth must be >= 1")
    pings = args.pings or (300 if args.quick else 5000)
    load = Load(
        args.clients,
        min(args.procs, args.clients),
        args.depth,
        warmup_s=0.5 if args.quick else 1.0,
        window_s=1.0 if args.quick else 3.0,
        rounds=1 if args.quick else 3,
    )
    out = args.out or REPO / "bench" / "results" / ("daemon-quick.json" if args.quick else "daemon.json")

    state_dir = Path(tempfile.mkdtemp(prefix="plexrl-bench-daemon-"))
    try:
        daemon = DaemonProcess(state_dir)
        try:
            with console.status(f"round trips: {pings} PINGs"):
                rtt = round_trips(daemon.address, pings, warmup=max(20, pings // 20))
            rounds = []
            for i in range(load.rounds):
                what = f"{load.clients} clients for {load.window_s:g} s ({i + 1}/{load.rounds})"
                with console.status(f"throughput: {what}"):
                    rounds.append(run_load(daemon.address, load, daemon.proc.pid))
            throughput = {
                **max(rounds, key=lambda r: r["msgs_per_s"]),
                "rounds_msgs_per_s": [r["msgs_per_s"] for r in rounds],
            }
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    met = {"p50": rtt["p50_ms"] < TARGET_P50_MS, "msgs_per_s": throughput["msgs_per_s"] >= TARGET_MSGS_PER_S}
    profile = None
    if args.profile or not all(met.values()):
        with console.status("profiling an in-process daemon under the same load"):
            profile = profile_daemon(load)
    print_report(rtt, throughput, profile)
    write_json_atomic(
        out,
        {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "quick": args.quick,
            "machine": machine(),
            "noop_request": "PING (the protocol has no dedicated no-op request)",
            "targets": {"p50_ms": TARGET_P50_MS, "msgs_per_s": TARGET_MSGS_PER_S},
            "met": met,
            "round_trip": rtt,
            "throughput": throughput,
            "profile": profile,
        },
    )
    try:
        shown = out.resolve().relative_to(REPO)
    except ValueError:
        shown = out
    console.print(f"wrote {shown}")


if __name__ == "__main__":
    main()
