"""plexd: the daemon of one cluster. This module is its server; the logic is ``daemon.core``.

``Daemon`` owns what the core does not: the ROUTER socket (one for every peer: CLI clients,
job drivers, workers, Slurm node tasks; CURVE-authenticated, ``daemon.auth``), the signals, the
processes (job drivers, jailed or not, in ``--local-worker`` mode the workers, and the Tinker
API front end, started again with backoff when it dies), the port, endpoint and metrics files.
One poll loop decodes each message and hands it to ``DaemonCore.handle``; heartbeats, chores
and placement run on timers; the effects the core returns are carried out here (``Send``,
``StartDriver``, ``StopDriver``, ``Prune``), and what happens to processes goes back to the core
as events (``driver_started``, ``driver_exited``, ``worker_process_exited``).

Stopping drains: on ``plexctl down``, SIGTERM or SIGUSR1/2 (a Slurm allocation ending) the core
admits nothing more and asks each running job to checkpoint at its step's end; the loop stops
when they have exited or the drain timeout passed (``drain_timeout_s``); a second SIGTERM stops
at once. Its settings are the cluster's ``cluster.json`` (``plexctl.common.cluster_config``),
which ``plexctl up`` wrote; its command line says only where it runs and which local workers it
starts, which read the same file.

A daemon that dies does not take its jobs with it: drivers and local workers outlive it, and
the next daemon on the same state directory binds the same port and adopts them
(``daemon.procs``): a job whose driver still runs goes on where it was (``DaemonCore.adopt``),
the others are queued again and resume from their last checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import msgspec
import zmq

from daemon import jail, procs
from daemon import metrics as M
from daemon.allocations import ElasticAllocations
from daemon.auth import secure
from daemon.confine import Confinement, JobDisk, keep_job_file
from daemon.core import (
    ADOPT_TIMEOUT_S,
    CANCEL_GRACE_S,
    DRIVER_EXIT_DRAINED,
    HEARTBEAT_S,
    MAX_RUNNING,
    VERSION,
    WORKER_GRACE_S,
    DaemonCore,
    Effect,
    JobRuntime,
    PendingCall,
    Prune,
    Send,
    StartDriver,
    StopDriver,
    WorkerState,
)
from daemon.core.job_kinds import driver_for
from daemon.journal import TERMINAL
from daemon.throttle import SenderThrottle
from plexctl.common import auth
from plexctl.common import protocol as P
from plexctl.common.atomic import write_bytes_atomic, write_json_atomic
from plexctl.common.client import current_user
from plexctl.common.cluster import (
    TINKER_FILE,
    Endpoint,
    endpoint_path,
    make_private,
    openai_url,
    plexrl_home,
    tinker_url,
)
from plexctl.common.cluster_config import ClusterConfig, ConfigError, config_path, drain_timeout_s, read_config
from plexctl.common.frames import NOBLOCK, recv_frames, send_frames
from plexctl.common.jobdir import JobDir
from plexctl.common.limits import limits_for
from plexctl.common.spec import spec_to_wire

log = logging.getLogger("plexd")

__all__ = [
    "ADOPT_TIMEOUT_S",
    "CANCEL_GRACE_S",
    "DRIVER_EXIT_DRAINED",
    "LOCAL_WORKER_RESPAWNS",
    "REPO_ROOT",
    "WORKER_GRACE_S",
    "Daemon",
    "JobRuntime",
    "PendingCall",
    "WorkerState",
    "child_env",
    "main",
    "wait_or_kill",
]

CHORES_S = 0.02  # reaping drivers and admitting jobs, at most this often
WARNED_PEERS = 10_000  # peers remembered as warned about (a bad message, a reply that could not go)
LIMITS_S = 2.0  # jailed jobs' trees (CPU, memory) and output directories checked against their limits this often
LOCAL_WORKER_RESPAWNS = 3  # a local worker that dies is started again this many times
TINKER_BACKOFF_S = (1.0, 30.0)  # a dead Tinker front end is started again after 1 s, doubling up to 30 s
TINKER_STABLE_S = 60.0  # a front end that lived this long starts the backoff afresh when it dies
KEPT_TINKER_PORT_FILE = "tinker-port.json"  # the port `--tinker-port 0` took, taken again by the next `up`


def kept_tinker_port(state_dir: Path, host: str) -> int:
    """The port this cluster's Tinker front end took on an earlier start with ``--tinker-port 0``,
    if it can be bound on ``host`` now; else 0 (a free one: a new port, said by ``tinker.json``)."""
    try:
        port = int(msgspec.json.decode((state_dir / KEPT_TINKER_PORT_FILE).read_bytes())["port"])
    except (OSError, ValueError, KeyError, TypeError, msgspec.DecodeError):
        return 0
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            log.warning("the Tinker API's earlier port %d is taken: the front end takes another", port)
            return 0
    return port


REPO_ROOT = Path(__file__).resolve().parents[1]


class Daemon:
    """The server around one ``DaemonCore``: socket, signals, processes, files."""

    def __init__(
        self,
        state_dir: Path,
        models: list[str],
        local_workers: list[list[str]],
        host: str = "127.0.0.1",
        port: int = 0,
        max_running: int = MAX_RUNNING,
        mode: str = "local",
        config: ClusterConfig | None = None,
        advertise_host: str | None = None,
        trusted_users: list[str] | None = None,  # beside the config's (tests' simulated users)
        config_file: Path | None = None,  # where the local workers read the config (None: the state directory's)
    ) -> None:
        config = config or ClusterConfig()
        self.config_file = config_file or config_path(state_dir)
        self.state_dir = state_dir
        self.mode = mode
        state_dir.mkdir(parents=True, exist_ok=True)
        make_private(state_dir)
        owner = auth.set_up_cluster(state_dir, plexrl_home(), current_user(), replace_key=False)
        os.environ[auth.KEYS_ENV] = str(auth.keys_dir(state_dir))  # drivers and workers present the internal key
        self.core = DaemonCore(
            state_dir,
            models,
            owner,
            max_running=max_running,
            policy=config.policy,
            jobs_per_engine=config.jobs_per_engine,
            pass_window=config.group_window_ms / 1000 if config.train_grouping else None,
            drain_timeout=drain_timeout_s(config, slurm=mode == "slurm"),
            trusted_users=[*config.trusted_users, *(trusted_users or [])],
            worker_grace=config.worker_grace,
        )
        self.jobs_dir = self.core.jobs_dir
        self.journal = self.core.journal
        self.drivers: dict[str, procs.Handle] = {}  # running job -> its driver's process
        self.worker_procs: dict[str, procs.Handle] = {}
        self.local_layouts: dict[str, tuple[list[str], list[str]]] = {}  # local worker -> (engines, models)
        self.respawns: dict[str, int] = {}
        self.warned: collections.OrderedDict[tuple[str, bytes], None] = collections.OrderedDict()  # warn_once's
        self.throttle = SenderThrottle()  # senders of bad messages, unheard for a while past a limit
        self.metrics_port: int | None = None
        self.tinker: subprocess.Popen | None = None  # the Tinker API front end (``plexctl.tinker``)
        # its host, Tinker and OpenAI ports (None: not served; 0: the port it took, once it listens)
        self.tinker_at: tuple[str, int | None, int | None] = ("", None, None)
        self.tinker_started = 0.0
        self.tinker_deaths = 0  # in a row: each doubles the wait before the next start
        self.tinker_retry_at: float | None = None  # it died: when it starts again
        self._janitor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plexd-prune")
        self.confined: dict[str, Confinement] = {}  # a running jailed job -> what holds it as a whole
        self.cluster_key = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:8]  # its cgroups' names
        self.breached: set[str] = set()  # jailed jobs ended by a limit: their files go with their driver
        self._limits = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plexd-limits")
        self._limit_check: concurrent.futures.Future[list[tuple[str, str]]] | None = None
        # an elastic Slurm allocation: joining allocations asked for and given back (``max_nodes``)
        self.elastic = ElasticAllocations(state_dir, config) if mode == "slurm" and config.max_nodes else None

        # its own context: the ZAP handler's inproc address is per context (a daemon started after
        # another in one process finds it free)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        self.authenticator = secure(self.sock, state_dir)
        port = self._bind(host, port)
        if jail.mode():  # jailed drivers have no network: they reach the daemon through this socket
            self.sock.bind(jail.prepare_socket_dir(state_dir))
            jail.open_socket(state_dir)
        connect_host = advertise_host or (
            "127.0.0.1" if host in ("127.0.0.1", "0.0.0.0") and mode == "local" else socket.gethostname()
        )
        self.address = f"tcp://{connect_host}:{port}"
        if config.metrics_port is not None:
            self.metrics_port = self.core.telemetry.serve(host, config.metrics_port)
            url = f"http://{connect_host}:{self.metrics_port}/metrics"
            write_json_atomic(state_dir / M.METRICS_FILE, {"url": url, "pid": os.getpid()})
            log.info("Prometheus metrics on %s", url)

        self._recover_jobs()
        self.local_worker_count = max(1, len(local_workers))
        for i, engines in enumerate(local_workers):
            self._spawn_local_worker(f"w{i}", engines, models)
        self.core.workers.local_workers = len(self.worker_procs)
        self._write_endpoint(mode)
        if config.tinker_port is not None or config.openai_port is not None:
            self._start_tinker(host, config.tinker_port, config.openai_port)

    def _write_endpoint(self, mode: str) -> None:
        state_dir = self.state_dir
        write_json_atomic(
            endpoint_path(state_dir),
            msgspec.to_builtins(
                Endpoint(
                    address=self.address,
                    pid=os.getpid(),
                    started_at=self.core.settings.started_at,
                    mode=mode,
                    host=socket.gethostname(),
                    server_key=auth.load_public(auth.keys_dir(state_dir) / f"{auth.SERVER}.key").decode(),
                )
            ),
            mode=0o644,
        )  # the one file other users read
        log.info("plexd %s listening on %s (state %s)", VERSION, self.address, state_dir)

    def _start_tinker(self, host: str, port: int | None, openai_port: int | None = None) -> None:
        """Start the Tinker API front end (``python -m plexctl.tinker``): it reaches this daemon
        as its own clients do, with the cluster's internal key, and says where it listens in
        ``tinker.json`` once it does; until then the file says it is starting."""
        again = self.tinker is not None  # a front end that died is started again
        serves = [api for api, p in (("tinker", port), ("openai", openai_port)) if p is not None]
        write_json_atomic(
            self.state_dir / TINKER_FILE,
            {"starting": True, "again": again, "since": time.time(), "serves": serves},
            mode=0o644,  # read by every user of the cluster (``PUBLIC_FILES``)
        )
        if port == 0:  # a free port asked for: the one this cluster took before, while it is free
            port = kept_tinker_port(self.state_dir, host)
        cmd = [sys.executable, "-m", "plexctl.tinker", "--state-dir", str(self.state_dir), "--host", host]
        cmd += ["--parent-pid", str(os.getpid())]
        cmd += ["--port", str(port)] if port is not None else []
        cmd += ["--openai-port", str(openai_port)] if openai_port is not None else []
        with open(self.state_dir / "tinker.log", "ab") as out:
            self.tinker = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(), cwd=REPO_ROOT
            )
        self.tinker_at, self.tinker_started, self.tinker_retry_at = (host, port, openai_port), time.time(), None
        log.info("started the Tinker API front end, pid %d", self.tinker.pid)

    def _supervise_tinker(self, now: float) -> None:
        """A front end that died is started again, on the port it had, after a wait that doubles
        with each death in a row (``TINKER_BACKOFF_S``); meanwhile ``tinker.json`` says it is
        restarting (no URL), so ``status`` and the proxy do not send clients to a closed port."""
        proc = self.tinker
        if proc is None or self.core.stopping:
            return
        host, port, openai_port = self.tinker_at
        rc = proc.poll()
        if rc is None:
            if port == 0:  # a free port was asked for: the one it took, kept for its successors
                url = tinker_url(self.state_dir)
                port = int(url.rsplit(":", 1)[1]) if url else 0
                self.tinker_at = (host, port, openai_port)
                if port:  # kept for the cluster's next `up`: a client's base_url outlives down / up
                    write_json_atomic(self.state_dir / KEPT_TINKER_PORT_FILE, {"port": port})
            if openai_port == 0 and (url := openai_url(self.state_dir)):  # the one it took, for its successors
                self.tinker_at = (host, self.tinker_at[1], int(url.removesuffix("/v1").rsplit(":", 1)[1]))
            if now - self.tinker_started >= TINKER_STABLE_S:
                self.tinker_deaths = 0
            return
        if self.tinker_retry_at is None:
            first, most = TINKER_BACKOFF_S
            wait = min(most, first * 2**self.tinker_deaths)
            self.tinker_deaths += 1
            self.tinker_retry_at = now + wait
            write_json_atomic(
                self.state_dir / TINKER_FILE,
                {
                    "restarting": True,
                    "exit_code": rc,
                    "retry_at": self.tinker_retry_at,
                    "serves": [api for api, p in (("tinker", port), ("openai", openai_port)) if p is not None],
                },
                mode=0o644,
            )
            log.warning("the Tinker front end (pid %d) exited with code %s: starting it in %.0f s", proc.pid, rc, wait)
        elif now >= self.tinker_retry_at:
            self._start_tinker(host, port, openai_port)

    # ------------------------------------------------------------------ lifecycle

    def _bind(self, host: str, port: int) -> int:
        """Bind the socket; a local daemon takes its predecessor's port when it is free, so the
        drivers and workers that outlived it find it where they left it."""
        port_file = self.state_dir / "daemon.port"
        if not port and self.mode == "local":
            try:
                port = int(port_file.read_text())
                self.sock.bind(f"tcp://{host}:{port}")
            except (OSError, ValueError, zmq.ZMQError):
                port = 0
        elif port:
            self.sock.bind(f"tcp://{host}:{port}")
        if not port:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        write_bytes_atomic(port_file, f"{port}\n".encode())
        return port

    def _recover_jobs(self) -> None:
        """Jobs that were running when the last daemon stopped: a job whose driver outlived
        that daemon is adopted and goes on where it was (the driver sends its calls again);
        the others are queued again and resume from their last checkpoint."""
        now = time.time()
        for info in self.journal.jobs(TERMINAL):  # ended while no daemon held it: its file system goes
            layout = JobDir(self.jobs_dir / info.job_id)
            if layout.driver_image.exists():
                if not layout.metrics.exists():
                    keep_job_file(layout.driver_out / JobDir.METRICS, layout.metrics)
                JobDisk(layout.driver_image, layout.driver_out).remove()
        for info in self.journal.jobs(("running", "interrupted")):
            job_dir = self.jobs_dir / info.job_id
            proc = None
            if info.state == "running" and not driver_for(self.journal.spec(info.job_id)).has_process:
                self._carry_out(self.core.adopt(info.job_id, 0, now))  # no driver: its client goes on
                continue
            if info.state == "running":  # its driver runs on, or ended (and said how) while no daemon ran
                argv, exit_file = (
                    self._driver_argv(info.job_id, job_dir, info.user),
                    self._exit_file(job_dir, info.user),
                )
                pid_file = JobDir(job_dir).driver_pid
                proc = procs.find(pid_file, argv, exit_file) or procs.exited(pid_file, exit_file)
            if proc is None:
                self.core.requeue(info.job_id, info.state)
                continue
            self.drivers[info.job_id] = proc
            if self.core.is_isolated(info.user):  # what held it goes on holding it
                who, limits = jail.runs_as(info.user, info.job_id), limits_for(self.state_dir, info.user)
                layout = JobDir(job_dir)
                self.confined[info.job_id] = Confinement.make(
                    self.cluster_key, info.job_id, layout, who, limits, adopt=True
                )
            alive = proc.poll() is None
            self._carry_out(self.core.adopt(info.job_id, proc.pid, now, alive=alive))
            if alive:
                log.info("job %s: adopted its driver (pid %d)", info.job_id, proc.pid)
            else:  # judged by the next pass over the drivers, as if seen exiting
                log.info(
                    "job %s: its driver (pid %d) ended with code %d while no daemon ran",
                    info.job_id,
                    proc.pid,
                    proc.returncode,
                )
        for info in self.journal.jobs(("queued",)):  # a driver started just before the last daemon died
            job_dir = self.jobs_dir / info.job_id  # (its job not yet marked running): it starts again
            stray = procs.find(JobDir(job_dir).driver_pid, self._driver_argv(info.job_id, job_dir, info.user))
            if stray is not None:
                stray.kill()
                log.warning("job %s: stopped a driver (pid %d) the journal did not know of", info.job_id, stray.pid)

    def _spawn_local_worker(self, worker_id: str, engines: list[str], models: list[str]) -> None:
        self.local_layouts[worker_id] = (engines, models)
        logs = self.state_dir / "workers"
        logs.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "worker.main",
            "--endpoint",
            self.address,
            "--worker-id",
            worker_id,
            "--engines",
            ",".join(engines),
            *(arg for model in models for arg in ("--model", model)),
            "--scratch",
            str(self.state_dir / "nodes" / worker_id),
            "--endpoint-file",
            str(endpoint_path(self.state_dir)),
            "--cluster-config",
            str(self.config_file),
            "--threads",
            str(max(1, (os.cpu_count() or 1) // self.local_worker_count)),  # this machine's cores, shared out
        ]
        pid_file = logs / f"{worker_id}.pid"
        argv = [a for a in cmd[1:] if a != self.address]  # a survivor follows the daemon's address
        survivor = procs.find(pid_file, argv)
        if survivor is not None:  # it outlived the last daemon: its engines are loaded, keep it
            self.worker_procs[worker_id] = survivor
            log.info("adopted local worker %s (%s) pid %d", worker_id, ",".join(engines), survivor.pid)
            return
        with open(logs / f"{worker_id}.log", "ab") as out:
            proc = self.worker_procs[worker_id] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(), cwd=REPO_ROOT
            )
        procs.record(pid_file, proc, argv)
        log.info("started local worker %s (%s) pid %d", worker_id, ",".join(engines), proc.pid)

    def drain(self, reason: str, urgent: bool = True) -> None:
        self._carry_out(self.core.drain(reason, time.time(), urgent))

    def run(self) -> None:
        for sig, why, urgent in (
            (signal.SIGTERM, "SIGTERM", True),
            (signal.SIGINT, "SIGINT", True),
            (signal.SIGUSR1, "SIGUSR1 (allocation ending)", False),
            (signal.SIGUSR2, "SIGUSR2 (allocation ending)", False),
        ):
            signal.signal(sig, lambda *_, why=why, urgent=urgent: self.drain(why, urgent))
        core = self.core
        last_beat = last_gauges = last_chores = last_limits = 0.0
        while not core.stopping:
            wake = core.sched.next_wake()  # a trainer waiting for a shared pass's steps: not past its window
            if self.sock.poll(50 if wake is None else max(0, min(50, int((wake - time.time()) * 1000) + 1))):
                for _ in range(1000):
                    try:
                        parts = recv_frames(self.sock, NOBLOCK)
                    except zmq.Again:
                        break
                    user = cast(str, parts[1].get("User-Id")) if len(parts) > 1 else ""
                    self.dispatch([p.bytes for p in parts], user)
            now = time.time()
            if now - last_beat >= HEARTBEAT_S:
                last_beat = now
                self._carry_out(core.heartbeat(now))
                self._poll_local_workers(now)
                self._supervise_tinker(now)
            if now - last_limits >= LIMITS_S:
                last_limits = now
                self._check_limits(now)
            if self.elastic is not None:
                self._scale(now)
            if self.metrics_port is not None and now - last_gauges >= M.SNAPSHOT_S:
                last_gauges = now
                core.snapshot_gauges(now)
            if now - last_chores >= CHORES_S:  # not on every message: a status storm wakes the loop 1000x/s
                last_chores = now
                self.reap_drivers(now)
                self._carry_out(core.chores(now))
            self._carry_out(core.place(now))
        self.shutdown()

    def _scale(self, now: float) -> None:
        """Let the elastic allocation grow or shrink (``daemon.allocations``), never while draining."""
        assert self.elastic is not None
        jobs, sched = self.core.jobs, self.core.sched
        if jobs.drain_deadline is not None or not self.elastic.due(now):
            return
        waiting_since = min(jobs.room_waits.values(), default=None)
        workers = {
            w.worker_id: any(
                bool(sched.homes.homed.get(d.engine_id)) or bool((e := sched.engines.get(d.engine_id)) and e.running)
                for d in w.engines
            )
            for w in self.core.workers.values()
        }
        try:
            self.elastic.step(now, waiting_since, workers)
        except Exception:  # noqa: BLE001 - the allocation's bookkeeping never ends the daemon
            log.exception("elastic allocation step failed (tried again)")

    def shutdown(self) -> None:
        log.info("shutting down")
        if self.tinker is not None and self.tinker.poll() is None:
            self.tinker.terminate()
            wait_or_kill(self.tinker, 10)
        (self.state_dir / TINKER_FILE).unlink(missing_ok=True)
        for proc in self.drivers.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.drivers.values():
            wait_or_kill(proc, 10)
        self._carry_out(self.core.interrupt_running())
        for proc in self.worker_procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.worker_procs.values():
            wait_or_kill(proc, 15)
        endpoint_path(self.state_dir).unlink(missing_ok=True)
        (self.state_dir / M.METRICS_FILE).unlink(missing_ok=True)
        self._janitor.shutdown(wait=True)
        self._limits.shutdown(wait=True, cancel_futures=True)
        for job_id in list(self.confined):  # drained jobs go on at the next start, their files kept
            self._release(job_id)
        self.core.close()
        self.sock.close(linger=500)  # let the workers' shutdown messages out
        self.authenticator.stop()

    # ------------------------------------------------------------------ messages and effects

    def dispatch(self, frames: list[bytes], user: str = "") -> None:
        """One message off the socket: decoded, handled by the core, its effects carried out.

        Guarded: whatever goes wrong costs that message one ERROR reply, when its header says who
        asks (``bad_request``: it does not decode; ``internal``: the daemon failed on it, the
        traceback to the log), never the loop. Bad messages count against their sender; a sender
        past the limit is answered ``throttled``, unheard, for a while (``daemon.throttle``)."""
        identity, rest = frames[0], frames[1:]

        def refuse(code: str, message: str) -> None:
            asked = P.decode_header(rest)
            if asked is not None:  # a request that says who it is gets its error, not silence
                self._send(identity, P.Op.ERROR, P.ErrorBody(code, P.one_line(message)), asked.msg_id)

        wait = self.throttle.wait_s(identity, user)
        if wait:
            refuse("throttled", f"too many bad messages from this sender: unheard for {wait:.0f} s more")
            return
        bad, failures = False, self.core.handler_failures
        refusal = self.core.refusal(rest[1], user) if len(rest) > 1 and len(rest[1]) == 1 else ""
        try:
            if refusal:  # nothing is decoded of what its sender may not send
                refuse("forbidden", refusal)
                bad = True
            else:
                op, header, body = P.decode(rest)
                self._carry_out(self.core.handle(identity, user, op, header, body, time.time()))
        except P.ProtocolError as exc:
            self.warn_once("rejected", identity, f"rejected message from {identity!r}: {exc}")
            refuse("bad_request", str(exc))
            bad = True
        except Exception as exc:  # noqa: BLE001 - one message costs one error reply, never the daemon
            log.exception("message from %r (%s) failed", identity, user or "no user")
            refuse("internal", f"{type(exc).__name__}: {exc}")
            bad = True
        bad = bad or self.core.handler_failures != failures  # the core answered a handler's failure itself
        if bad and self.throttle.count_bad(identity, user):
            log.warning(
                "throttling %r (%s): %d bad messages within %.0f s; unheard for %.0f s",
                identity,
                user or "no user",
                self.throttle.limit,
                self.throttle.window_s,
                self.throttle.penalty_s,
            )

    def _carry_out(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Send):
                self._send(effect.identity, effect.op, effect.body, effect.in_reply_to)
            elif isinstance(effect, StartDriver):
                self._start_driver(effect.job_id)
            elif isinstance(effect, StopDriver):
                proc = self.drivers.get(effect.job_id)
                if proc is not None and proc.poll() is None:
                    proc.kill() if effect.kill else proc.terminate()
            elif isinstance(effect, Prune):
                self._janitor.submit(_prune, effect.parent, effect.keep)

    def _send(self, identity: bytes, op: bytes, body: object, in_reply_to: int = 0) -> None:
        frames, _ = P.encode(op, body, in_reply_to)
        try:  # never blocking: a peer that reads nothing fills its own queue, never stalls the loop
            send_frames(self.sock, [identity, *frames], NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY), or its queue full (EAGAIN)
            self.warn_once("unsent", identity, f"cannot send to {identity!r}: {exc}")

    def warn_once(self, kind: str, identity: bytes, message: str) -> None:
        """Log ``message`` the first time a peer gives cause of this ``kind`` (of the last
        ``WARNED_PEERS``): a flooding peer costs one line, not one a message."""
        if (kind, identity) in self.warned:
            return
        self.warned[(kind, identity)] = None
        if len(self.warned) > WARNED_PEERS:
            self.warned.popitem(last=False)
        log.warning("%s", message)

    # ------------------------------------------------------------------ processes

    def reap_drivers(self, now: float) -> None:
        """Tell the core of the drivers that exited."""
        for job_id, proc in list(self.drivers.items()):
            rc = proc.poll()
            if rc is not None:
                del self.drivers[job_id]
                revoke_driver_keys(self.state_dir, job_id, self.jobs_dir / job_id)  # before a restart makes new ones
                effects = self.core.driver_exited(job_id, rc, now)
                if job_id in self.confined:  # before the effects: one may start the driver again
                    info = self.journal.job(job_id)
                    self._release(job_id, ended=info is None or info.state in TERMINAL)
                self._carry_out(effects)

    def _check_limits(self, now: float) -> None:
        """The jailed jobs past a limit (their tree's CPU or memory, their output directory) end
        with one line; their neighbours and the daemon go on. The checks run off this loop: a
        job's tree can be large, and the last round's findings are carried out here."""
        done, self._limit_check = self._limit_check, None
        if done is not None and not done.done():
            self._limit_check = done
            return
        try:
            found = done.result() if done is not None else []
        except Exception:  # noqa: BLE001 - a check that failed costs that round, never the daemon
            log.exception("checking jailed jobs' limits failed; checking again")
            found = []
        for job_id, why in found:
            if job_id in self.drivers and job_id not in self.breached:
                self.breached.add(job_id)
                self._carry_out(self.core.limit_breached(job_id, why, now))
        running = {job_id: held for job_id, held in self.confined.items() if job_id in self.drivers}
        if running:
            self._limit_check = self._limits.submit(
                lambda: [(job_id, why) for job_id, held in running.items() if (why := held.breach())]
            )

    def _release(self, job_id: str, ended: bool = False) -> None:
        """What held a jailed job's driver goes; once the job ended, its output directory's file
        system too (what the daemon serves from it, its metrics, kept first). A job ended by its
        limits keeps nothing."""
        held = self.confined.pop(job_id, None)
        if held is None:
            return
        breached = job_id in self.breached
        self.breached.discard(job_id)
        layout = JobDir(self.jobs_dir / job_id)
        if ended and not breached:
            keep_job_file(layout.driver_out / JobDir.METRICS, layout.metrics)
        try:
            held.release(remove_files=breached, ended=ended)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("job %s: its confinement was not released: %s", job_id, exc)

    def _poll_local_workers(self, now: float) -> None:
        """A local worker whose process exited is lost at once, and started again (a few times)."""
        for wid, proc in list(self.worker_procs.items()):
            rc = proc.poll()
            if rc is None:
                continue
            self._carry_out(self.core.worker_process_exited(wid, rc, now))
            problems = self.core.workers.problems
            reported = any(wid in p for p in problems)  # it failed to start: not retried
            if not reported and not self.core.stopping and self.respawns.get(wid, 0) < LOCAL_WORKER_RESPAWNS:
                self.respawns[wid] = self.respawns.get(wid, 0) + 1
                log.warning("starting local worker %s again (%d/%d)", wid, self.respawns[wid], LOCAL_WORKER_RESPAWNS)
                self._spawn_local_worker(wid, *self.local_layouts[wid])
            elif not reported:
                problems.append(
                    f"worker {wid} exited with code {rc} (see {self.state_dir / 'workers' / (wid + '.log')})"
                )
                log.error(problems[-1])

    def _start_driver(self, job_id: str) -> None:
        """Start a job's driver; the core hears whether it started."""
        try:
            proc = self._spawn_driver(job_id)
        except Exception as exc:  # noqa: BLE001 - no disk, no processes, bad inputs: that job waits, the daemon goes on
            log.warning("job %s: its driver did not start", job_id, exc_info=not isinstance(exc, (OSError, ValueError)))
            self._carry_out(self.core.driver_not_started(job_id, str(exc), time.time()))
            return
        self.drivers[job_id] = proc
        self._carry_out(self.core.driver_started(job_id, proc.pid, time.time()))

    def _spawn_driver(self, job_id: str) -> procs.Handle:
        job_dir = self.jobs_dir / job_id
        layout = JobDir(job_dir)
        job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(layout.spec, spec_to_wire(self.journal.spec(job_id)))
        info = self.journal.job(job_id)
        assert info is not None  # the core admitted it
        if self.core.is_isolated(info.user):
            proc = self._start_isolated_driver(job_id, job_dir, info.user)
        else:
            cmd = [
                sys.executable,
                "-m",
                "daemon.driver",
                "--endpoint",
                self.address,
                *self._driver_argv(job_id, job_dir, info.user),
            ]
            with open(layout.driver_log, "ab") as out:
                proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(), cwd=REPO_ROOT
                )
        try:
            procs.record(layout.driver_pid, proc, self._driver_argv(job_id, job_dir, info.user))
        except BaseException:  # a driver no daemon could find again must not run
            proc.kill()
            proc.wait()
            raise
        return proc

    def _start_isolated_driver(self, job_id: str, job_dir: Path, user: str) -> subprocess.Popen:
        """The driver of a job of ``user``, jailed and running as ``user`` (``daemon.jail``), with a
        key of its own that acts on this job alone."""
        refusal = jail.refusal(user)
        if refusal:
            raise RuntimeError(refusal)
        who = jail.runs_as(user, job_id)
        limits = limits_for(self.state_dir, user)
        spec = spec_to_wire(self.journal.spec(job_id))
        try:
            files = msgspec.json.decode(JobDir(job_dir).inputs.read_bytes(), type=list[P.InputFile])
        except FileNotFoundError:
            files = []
        given = jail.given_dir(job_dir)  # the daemon's: it writes nowhere the job can
        staged = self.core.blobs.stage(user, files, given / "inputs")
        for name, path in staged.items():  # the job reads its uploaded copies, at their place in the jail
            section, key = name.split(".")
            spec[section][key] = f"{jail.JAIL_ROOT}/in/{Path(path).relative_to(given)}"
        write_json_atomic(given / JobDir.SPEC, spec, mode=0o644)
        self._release(job_id)  # a restart: the last driver's cgroups go, its files stay
        held = self.confined[job_id] = Confinement.make(self.cluster_key, job_id, JobDir(job_dir), who, limits)
        jail.out_dir(job_dir, who)
        keys = self._make_driver_keys(job_id, job_dir, who)
        return jail.start(
            who,
            job_id,
            job_dir,
            self.state_dir,
            JobDir(job_dir).driver_log,
            hide=[self.state_dir, plexrl_home()],
            keys=keys,
            limits=limits,
            cgroups=held.cgroup.procs_files if held.cgroup is not None else [],
        )

    def _make_driver_keys(self, job_id: str, job_dir: Path, who: jail.Account) -> Path:
        """A fresh key pair for a jailed driver in ``job_dir/driver-keys``: a directory of the
        daemon's that the job can read (bound read-only into its jail) and never write, so no path
        the job made is followed; only the secret file just made here is handed to its uid."""
        keys = JobDir(job_dir).driver_keys
        revoke_driver_keys(self.state_dir, job_id, job_dir)
        keys.mkdir(mode=0o700)
        keys.chmod(0o755)  # whatever the umask: its uid passes; only the secret, below, is its alone
        auth.make_job_keys(self.state_dir, job_id, keys)
        secret = os.open(keys / f"{auth.DRIVER}.key_secret", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchown(secret, who.uid, who.gid)
        finally:
            os.close(secret)
        return keys

    def _driver_argv(self, job_id: str, job_dir: Path, user: str) -> list[str]:
        """What identifies a job's driver process (its address aside: a driver follows the daemon's)."""
        if self.core.is_isolated(user):
            return jail.driver_args(job_id)
        return ["--job-id", job_id, "--job-dir", str(job_dir)]

    def _exit_file(self, job_dir: Path, user: str) -> Path:
        """Where the driver of a job of ``user`` leaves its exit code."""
        layout = JobDir(job_dir)
        return layout.driver_out / JobDir.DRIVER_EXIT if self.core.is_isolated(user) else layout.driver_exit


def revoke_driver_keys(state_dir: Path, job_id: str, job_dir: Path) -> None:
    """A jailed driver's key is let in no more, and its pair is gone (its driver exited)."""
    (auth.keys_dir(state_dir) / "jobs" / f"{job_id}.key").unlink(missing_ok=True)
    keys = JobDir(job_dir).driver_keys
    if keys.is_symlink():
        keys.unlink()
    elif keys.exists():
        shutil.rmtree(keys)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def wait_or_kill(proc: procs.Handle, seconds: float) -> None:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _prune(parent: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` directories of ``parent``."""
    dirs = sorted((d for d in parent.iterdir() if d.is_dir() and not d.name.startswith(".")), key=lambda d: d.name)
    for d in dirs[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="plexd",
        description="PlexRL daemon (started by `plexctl up`); the cluster's settings are in its config file.",
    )
    ap.add_argument("--state-dir", required=True, type=Path)
    ap.add_argument(
        "--cluster-config", type=Path, default=None, help="the cluster's settings (default: STATE_DIR/cluster.json)"
    )
    ap.add_argument(
        "--local-worker",
        action="append",
        default=[],
        help="start a local worker hosting these engines (comma list: rollout,trainer)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-running", type=int, default=MAX_RUNNING, help="job drivers running at once")
    ap.add_argument("--mode", default="local")
    ap.add_argument("--advertise-host", default=None, help="address peers on other nodes connect to")
    args = ap.parse_args(argv)
    os.umask(0o077)  # what the daemon and its children write is the owner's alone
    args.state_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config_file = (args.cluster_config or config_path(args.state_dir)).resolve()
    try:
        config = read_config(config_file)
        daemon = Daemon(
            args.state_dir,
            config.models,
            [w.split(",") for w in args.local_worker],
            args.host,
            args.port,
            args.max_running,
            args.mode,
            config,
            args.advertise_host,
            config_file=config_file,
        )
    except (auth.AuthError, ConfigError) as exc:
        print(f"plexd: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    daemon.run()


if __name__ == "__main__":
    main()
