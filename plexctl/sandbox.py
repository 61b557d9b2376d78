"""Run untrusted Python (model-written code, tests, tool calls) in its own contained process.

``run_python`` runs one program for one result, ``SandboxSession`` keeps one running (a request
and its reply per line), ``SandboxPool`` runs many at once (bounded, never raising), and
``isolation()`` / ``network_isolation()`` say which protection holds on this machine. Each run
gets its own session and process started by ``python -I -S plexctl/sandbox_boot.py`` (no site,
no ``PYTHON*`` variables, a minimal environment: the driver's variables stay out), a fresh
working directory removed afterwards, rlimits (``Limits``: CPU, address space, file size,
processes, open files, no cores), a wall-clock timeout that SIGKILLs its whole process group,
and stdout and stderr kept up to ``Limits.output_bytes`` each.

Isolation, strongest first (``plexctl/sandbox_boot.py`` applies it before the program runs):
``namespaces`` (the driver is root: new mount, network and IPC namespaces, the tree read-only
but the working directory, no network, then a uid of the run's own with ``no_new_privs``);
``userns`` (unprivileged user namespaces: the same plus a PID namespace whose init is the
program, capabilities dropped); ``guard`` (neither: an audit hook refuses sockets, process
spawning, ctypes and writes outside the working directory; native code could get around it).
``docs/environments.md`` describes each in full.

It deliberately does not limit what the program may read, give it third-party packages, hide
other processes, or run anything but Python. ``run_python`` never raises for what the program
does: every failure is a ``SandboxResult`` with ``ok=False``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from plexctl.sandbox_boot import SETUP_FAILED_EXIT

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

T = TypeVar("T")

SANDBOX_UID_BASE = 1_500_000  # namespaces mode: runs use uids [BASE, BASE + SANDBOX_UIDS)
SANDBOX_UIDS = 4096
USERNS_INNER_UID = 1000  # userns mode: the driver's uid appears as this (not 0: no caps on exec)
BOOT = Path(__file__).with_name("sandbox_boot.py")  # run by path: ``-S`` leaves no site-packages to import from
MODES = ("namespaces", "userns", "guard")
_READ_CHUNK = 65536
_DRAIN_AFTER_EXIT_S = 0.5


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one run may use. Sizes in bytes, times in seconds."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_bytes: int = 512 * 2**20  # RLIMIT_AS: address space, not resident memory
    file_bytes: int = 16 * 2**20  # largest file the program may write
    processes: int = 16  # RLIMIT_NPROC: processes and threads of the run
    open_files: int = 64
    output_bytes: int = 64 * 2**10  # kept of stdout and of stderr each; the rest is dropped


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one run did. ``ok``: exited 0 within its limits.

    ``limit_hit`` names the limit that ended or hurt the run, where it can be told:
    wall | cpu | memory | file_size | processes | output | setup | crash (None: none).
    ``killed_by`` is the signal that ended the program (e.g. ``SIGKILL``), or None.
    """

    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    killed_by: str | None
    seconds: float
    limit_hit: str | None
    truncated: bool = False
    error: str | None = None  # one line, when the sandbox itself failed (not the program)


@dataclasses.dataclass(frozen=True)
class Isolation:
    """Which protections hold for sandboxed runs on this machine."""

    mode: str  # namespaces | userns | guard
    network: str
    filesystem: str
    processes: str


# ---------------------------------------------------------------- isolation


_PROBE = "import collections.abc, json, socket, os\nassert os.getcwd().endswith('work')\n"


_probe_lock = threading.Lock()


def isolation() -> Isolation:
    """The strongest isolation that works here (probed once per process with a real run).

    ``PLEXRL_SANDBOX_MODE`` (namespaces | userns | guard) forces a mode, e.g. to test the
    weaker ones on a machine that allows the stronger.
    """
    with _probe_lock:
        return _probe_isolation()


@functools.cache
def _probe_isolation() -> Isolation:
    for mode in _candidate_modes():
        try:
            result = _run(mode, _PROBE, "", Limits(wall_seconds=20))
        except Exception:  # noqa: BLE001 - e.g. no uid lease directory: this mode is not available
            continue
        if result.ok:
            return _describe(mode)
    return _describe("guard")


def network_isolation() -> str:
    """How sandboxed runs are kept off the network here: ``netns``, ``userns+netns`` or ``audit-guard``."""
    return isolation().network


def _candidate_modes() -> list[str]:
    forced = os.environ.get("PLEXRL_SANDBOX_MODE")
    if forced in MODES:
        return [forced]
    modes = ["namespaces"] if os.geteuid() == 0 else []
    return modes + ["userns", "guard"]


def _describe(mode: str) -> Isolation:
    if mode == "namespaces":
        return Isolation(
            mode,
            "netns",
            "read-only root, writable working directory, own uid",
            "RLIMIT_NPROC per run uid; leftovers killed by uid",
        )
    if mode == "userns":
        return Isolation(
            mode,
            "userns+netns",
            "read-only root, writable working directory",
            "RLIMIT_NPROC per user namespace; PID namespace killed as a whole",
        )
    return Isolation(
        mode,
        "audit-guard",
        "audit guard refuses writes outside the working directory",
        "RLIMIT_NPROC over the driver user's processes (not enforced for root)",
    )


# ---------------------------------------------------------------- running one program


def run_python(code: str, stdin: str = "", limits: Limits = Limits(), paths: tuple[str, ...] = ()) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox; never raises for what the program does.

    ``paths`` are directories put first on the program's ``sys.path`` (e.g. the user's reward
    module and the driver's site-packages); they stay read-only. In ``namespaces`` mode a
    world-readable one is bind-mounted, any other (a job's private staged copy) is copied into
    the run's own directory, readable by the run's uid alone.
    """
    try:
        return _run(isolation().mode, code, stdin, limits, paths)
    except Exception as e:  # noqa: BLE001 - the sandbox machinery itself failed: that run's failure only
        return _failed(f"sandbox error: {type(e).__name__}: {e}", limit_hit="crash")


def _failed(error: str, limit_hit: str | None = None, seconds: float = 0.0) -> SandboxResult:
    return SandboxResult(
        ok=False,
        stdout="",
        stderr="",
        exit_code=None,
        timed_out=False,
        killed_by=None,
        seconds=seconds,
        limit_hit=limit_hit,
        error=error,
    )


def _run(mode: str, code: str, stdin: str, limits: Limits, paths: tuple[str, ...] = ()) -> SandboxResult:
    t0 = time.perf_counter()
    with _uid_lease() if mode == "namespaces" else contextlib.nullcontext() as uid:
        base = Path(tempfile.mkdtemp(prefix="plexrl-sbx-"))
        try:
            paths = _fill_run_dir(base, uid, code, stdin, paths)
            return _spawn_and_collect(mode, uid, base, limits, t0, paths)
        finally:
            if uid is not None:
                _kill_uid(uid)
            shutil.rmtree(base, ignore_errors=True)


def _fill_run_dir(base: Path, uid: int | None, code: str, stdin: str, paths: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``base/`` (0711) gets ``main.py``, ``stdin``, ``py/`` (stdlib mount points) and ``work/``;
    returns ``paths`` with each one the run's uid could not read replaced by its own copy."""
    (base / "main.py").write_text(code, encoding="utf-8")
    (base / "stdin").write_text(stdin, encoding="utf-8")
    (base / "py").mkdir()
    work = base / "work"
    work.mkdir(mode=0o700)
    if uid is None:
        return paths
    os.chown(work, uid, uid)
    base.chmod(0o711)
    readable = []
    for i, path in enumerate(paths):
        if os.stat(path).st_mode & 0o005 == 0o005:
            readable.append(path)
            continue
        copy = base / "own" / str(i)
        shutil.copytree(path, copy, symlinks=False)
        for root, dirs, files in os.walk(base / "own"):
            for name in (*dirs, *files):
                os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)
        readable.append(str(copy))
    if (base / "own").exists():
        os.chown(base / "own", uid, uid)
        (base / "own").chmod(0o500)
    return tuple(readable)


def _rlimits(mode: str, limits: Limits) -> list[tuple[str, tuple[int, int]]]:
    processes = limits.processes
    if mode == "guard":  # RLIMIT_NPROC counts every process of the user here
        processes += len(_processes_of_uid(os.getuid()))
    cpu = max(1, int(limits.cpu_seconds))
    return [
        ("RLIMIT_CPU", (cpu, cpu + 1)),  # SIGXCPU at the soft limit, SIGKILL a second later
        ("RLIMIT_AS", (limits.memory_bytes, limits.memory_bytes)),
        ("RLIMIT_FSIZE", (limits.file_bytes, limits.file_bytes)),
        ("RLIMIT_NPROC", (processes, processes)),
        ("RLIMIT_NOFILE", (limits.open_files, limits.open_files)),
        ("RLIMIT_CORE", (0, 0)),
    ]


_LIVE: dict[int, int | None] = {}  # the sandboxed processes this process started and has not reaped: pid -> uid
_LIVE_LOCK = threading.Lock()


def kill_live_runs() -> None:
    """SIGKILL every sandboxed program of this process still running (its process group, and in
    namespaces mode its uid's processes): they run in sessions of their own, so nothing else
    stops them when this process is told to stop."""
    with _LIVE_LOCK:
        live = list(_LIVE.items())
    for pid, uid in live:
        _kill_run(pid, uid)


def _reaped(proc: subprocess.Popen) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(proc.pid, None)


def _popen(
    mode: str, uid: int | None, base: Path, limits: Limits, paths: tuple[str, ...], stdin: Any
) -> subprocess.Popen:
    """Start the boot on ``base/main.py`` in its own session, stdout and stderr piped (the
    process is in ``_LIVE`` until ``_reaped``)."""
    config = {
        "mode": mode,
        "base": str(base),
        "uid": uid,
        "inner_uid": USERNS_INNER_UID,
        "rlimits": _rlimits(mode, limits),
        "paths": [str(p) for p in paths],
    }
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(base / "work"),
        "TMPDIR": str(base / "work"),
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
    }
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", str(BOOT), repr(config)],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=base,
        env=env,
        start_new_session=True,
        close_fds=True,
    )
    with _LIVE_LOCK:
        _LIVE[proc.pid] = uid
    return proc


def _spawn_and_collect(
    mode: str, uid: int | None, base: Path, limits: Limits, t0: float, paths: tuple[str, ...] = ()
) -> SandboxResult:
    with open(base / "stdin", "rb") as stdin:
        proc = _popen(mode, uid, base, limits, paths, stdin)
    try:
        out, err, timed_out = _collect(proc, t0 + limits.wall_seconds, limits.output_bytes, uid)
    except BaseException:
        _kill_run(proc.pid, uid)
        proc.wait()
        _reaped(proc)
        raise
    returncode = proc.wait()
    _reaped(proc)
    return _result(out, err, returncode, timed_out, time.perf_counter() - t0)


class _Stream:
    """One pipe's bytes, kept up to a bound; the rest is read and dropped."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.bound - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.dropped += max(len(chunk) - max(room, 0), 0)


def _collect(proc: subprocess.Popen, deadline: float, bound: int, uid: int | None) -> tuple[_Stream, _Stream, bool]:
    """Read both pipes until the program exits (then kill what it left) or the deadline passes."""
    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None  # started with both piped (_popen)
    pipes: dict[FileDescriptorLike, _Stream] = {stdout: _Stream(bound), stderr: _Stream(bound)}
    exit_fd = _pidfd(proc.pid)
    timed_out, exited, drain_until = False, False, 0.0
    with selectors.DefaultSelector() as sel:
        for pipe in pipes:
            sel.register(pipe, selectors.EVENT_READ)
        if exit_fd is not None:
            sel.register(exit_fd, selectors.EVENT_READ)
        while True:
            now = time.perf_counter()
            if not exited and now >= deadline:
                timed_out = True
                exited, drain_until = True, _end_run(proc.pid, uid)
            open_pipes = [k.fileobj for k in sel.get_map().values() if k.fileobj in pipes]
            if exited and (not open_pipes or now >= drain_until):
                break
            wait = (drain_until if exited else deadline) - now
            if exit_fd is None and not exited:
                wait = min(wait, 0.05)  # no pidfd: poll for the exit
            for key, _ in sel.select(timeout=max(wait, 0.0)):
                if key.fileobj is exit_fd:
                    sel.unregister(exit_fd)
                    exited, drain_until = True, _end_run(proc.pid, uid)
                    continue
                chunk = os.read(key.fd, _READ_CHUNK)
                if chunk:
                    pipes[key.fileobj].add(chunk)
                else:
                    sel.unregister(key.fileobj)
            if not exited and exit_fd is None and _has_exited(proc.pid):
                exited, drain_until = True, _end_run(proc.pid, uid)
    if exit_fd is not None:
        os.close(exit_fd)
    stdout.close()
    stderr.close()
    return pipes[stdout], pipes[stderr], timed_out


def _end_run(pid: int, uid: int | None) -> float:
    """Kill what is left of the run (leftovers would hold the pipes open); the drain deadline."""
    _kill_run(pid, uid)
    return time.perf_counter() + _DRAIN_AFTER_EXIT_S


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _has_exited(pid: int) -> bool:
    """Whether the program has exited, without reaping it (so its pid cannot be reused yet)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_run(pid: int, uid: int | None) -> None:
    """SIGKILL the run's process group, and in namespaces mode every process of its uid."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        _kill_uid(uid)


def _result(out: _Stream, err: _Stream, returncode: int, timed_out: bool, seconds: float) -> SandboxResult:
    stdout = bytes(out.data).decode("utf-8", errors="replace")
    stderr = bytes(err.data).decode("utf-8", errors="replace")
    killed_by = signal.Signals(-returncode).name if returncode < 0 else None
    truncated = bool(out.dropped or err.dropped)
    error = None
    if returncode == SETUP_FAILED_EXIT and stderr.startswith("plexrl-sandbox: setup failed"):
        error = stderr.strip().splitlines()[0]
    limit_hit = _limit_hit(stderr, killed_by, timed_out, truncated, error)
    return SandboxResult(
        ok=returncode == 0 and not timed_out,
        stdout=stdout,
        stderr=stderr,
        exit_code=returncode,
        timed_out=timed_out,
        killed_by=killed_by,
        seconds=seconds,
        limit_hit=limit_hit,
        truncated=truncated,
        error=error,
    )


def _limit_hit(stderr: str, killed_by: str | None, timed_out: bool, truncated: bool, error: str | None) -> str | None:
    """Which limit ended the run, told from how it ended (stderr is only a hint: the program writes it)."""
    if error is not None:
        return "setup"
    if timed_out:
        return "wall"
    if killed_by in ("SIGXCPU", "SIGKILL"):
        return "cpu"
    if killed_by == "SIGXFSZ" or "File too large" in stderr:
        return "file_size"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    if "Resource temporarily unavailable" in stderr:
        return "processes"
    if truncated:
        return "output"
    return None


# ---------------------------------------------------------------- sessions


class SessionFailed(Exception):
    """A session's program exited, broke the protocol or missed a deadline; ``str()`` says which.
    The session is closed by then."""


class SandboxSession:
    """One contained program kept running for many requests (e.g. a job's reward function,
    imported once instead of on every step).

    A request is one line written to the program's stdin; its reply is the next line the
    program writes to stdout that starts with ``marker`` (other output is dropped). The
    program runs under the same isolation, uid lease and rlimits as a ``run_python`` run, for
    its whole life: ``Limits.cpu_seconds`` counts over the session (size it so), and each
    ``request`` has its own deadline instead of ``wall_seconds``. A program that exits, writes
    a line longer than ``Limits.output_bytes`` or misses a deadline is killed with what it
    left (``SessionFailed``); the session then stays closed, make a new one. ``close`` kills
    the program and every process it left and removes its directory. One request at a time.
    """

    def __init__(
        self, code: str, limits: Limits = Limits(), paths: tuple[str, ...] = (), marker: str = "PLEXRL-REPLY "
    ) -> None:
        self.marker = marker.encode()
        self.bound = limits.output_bytes
        self.requests = 0
        self.mode = isolation().mode
        self._lease = _uid_lease() if self.mode == "namespaces" else None
        self.uid = self._lease.__enter__() if self._lease is not None else None
        self.base: Path | None = Path(tempfile.mkdtemp(prefix="plexrl-sbx-"))
        self.proc: subprocess.Popen | None = None
        self._out = bytearray()
        self._err_tail = b""
        try:
            paths = _fill_run_dir(self.base, self.uid, code, "", paths)
            self.proc = _popen(self.mode, self.uid, self.base, limits, paths, subprocess.PIPE)
            for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                assert pipe is not None  # all three piped
                os.set_blocking(pipe.fileno(), False)
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def request(self, line: str, timeout: float) -> str:
        """Send ``line``; the reply line (``marker`` stripped) within ``timeout`` seconds."""
        if self.proc is None:
            raise SessionFailed("the session is closed")
        self.requests += 1
        try:
            return self._exchange((line.rstrip("\n") + "\n").encode(), time.perf_counter() + timeout, timeout)
        except SessionFailed:
            self.close()
            raise
        except BaseException as e:  # noqa: BLE001 - any failure, interrupts too, closes the session first
            self.close()
            raise SessionFailed(f"sandbox error: {type(e).__name__}: {e}") from None

    def _exchange(self, data: bytes, deadline: float, timeout: float) -> str:
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        pending = memoryview(data)
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            sel.register(proc.stderr, selectors.EVENT_READ)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
            while True:
                reply = self._reply_line()
                if reply is not None:
                    return reply
                wait = deadline - time.perf_counter()
                if wait <= 0:
                    raise SessionFailed(f"no reply within {timeout:g} s")
                for key, _ in sel.select(timeout=wait):
                    if key.fileobj is proc.stdin:
                        try:
                            pending = pending[os.write(key.fd, pending) :]
                        except BrokenPipeError:
                            raise SessionFailed(self._exited()) from None
                        if not pending:
                            sel.unregister(proc.stdin)
                        continue
                    chunk = os.read(key.fd, _READ_CHUNK)
                    if not chunk and key.fileobj is proc.stderr:  # a program may close its stderr
                        sel.unregister(proc.stderr)
                        continue
                    if not chunk:
                        raise SessionFailed(self._exited())
                    if key.fileobj is proc.stderr:
                        self._err_tail = (self._err_tail + chunk)[-2048:]
                    else:
                        self._out += chunk

    def _reply_line(self) -> str | None:
        """The reply, once a whole marked line is in; other lines are dropped."""
        while True:
            end = self._out.find(b"\n")
            if end < 0:
                if len(self._out) > self.bound:
                    raise SessionFailed(f"a line of output longer than {self.bound} bytes")
                return None
            line = bytes(self._out[:end])
            del self._out[: end + 1]
            if line.startswith(self.marker):
                return line[len(self.marker) :].decode("utf-8", errors="replace")

    def _exited(self) -> str:
        """Why the program stopped talking: its exit and the last line it wrote to stderr."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "closed its output"
        tail = self._err_tail.decode("utf-8", errors="replace").strip().splitlines()
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return how + (f": {tail[-1]}" if tail else "")

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            _kill_run(proc.pid, self.uid)
            proc.wait()
            _reaped(proc)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        elif self.uid is not None:
            _kill_uid(self.uid)
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None
        if self._lease is not None:
            self._lease.__exit__(None, None, None)
            self._lease = None

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- run uids (namespaces mode)


class _uid_lease:
    """One uid of [SANDBOX_UID_BASE, +SANDBOX_UIDS) held for a run, across processes (flock)."""

    _dir = Path(tempfile.gettempdir()) / "plexrl-sandbox-uids"

    def __enter__(self) -> int:
        self._dir.mkdir(mode=0o700, exist_ok=True)
        for uid in range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UIDS):  # lowest free first
            fd = os.open(self._dir / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.fd, self.uid = fd, uid
            _kill_uid(uid)  # a crashed earlier holder may have left processes
            return uid
        raise RuntimeError(f"all {SANDBOX_UIDS} sandbox uids are in use")

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _processes_of_uid(uid: int) -> list[int]:
    """Live (not zombie) pids whose real uid is ``uid``, read from /proc/<pid>/status."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _status_uid(entry.name) == uid:
            pids.append(int(entry.name))
    return pids


def _status_uid(pid: str) -> int | None:
    """The real uid of a live process; None for a zombie or a process that is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                    return None
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, IndexError):
        return None
    return None


def _kill_uid(uid: int, rounds: int = 100) -> None:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb refills for a few rounds)."""
    for _ in range(rounds):
        pids = _processes_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)


# ---------------------------------------------------------------- the pool


class SandboxPool:
    """A bounded pool of threads, each waiting on one sandboxed run (or one piece of driver work).

    ``submit``/``map`` run programs with ``run_python``; their futures never raise: a crash
    becomes that sample's failed ``SandboxResult``. ``call`` runs any function (an environment
    step, a reward) on the same threads; its future raises what the function raised. A task
    must not wait on another task of the same pool (it could wait for a thread that never frees).
    """

    def __init__(self, max_workers: int | None = None, limits: Limits = Limits()) -> None:
        self.max_workers = max_workers or max(4, 2 * (os.cpu_count() or 1))
        self.limits = limits
        self._executor = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="sandbox")

    def submit(
        self, code: str, stdin: str = "", limits: Limits | None = None, paths: tuple[str, ...] = ()
    ) -> concurrent.futures.Future[SandboxResult]:
        return self._executor.submit(_never_raises, code, stdin, limits or self.limits, paths)

    def map(
        self, codes: Iterable[str], stdins: Iterable[str] | None = None, limits: Limits | None = None
    ) -> list[SandboxResult]:
        codes = list(codes)
        stdins = list(stdins) if stdins is not None else [""] * len(codes)
        if len(stdins) != len(codes):
            raise ValueError(f"{len(codes)} programs but {len(stdins)} stdins")
        futures = [self.submit(c, s, limits) for c, s in zip(codes, stdins)]
        return [f.result() for f in futures]

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        return self._executor.submit(fn, *args, **kwargs)

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _never_raises(code: str, stdin: str, limits: Limits, paths: tuple[str, ...] = ()) -> SandboxResult:
    try:
        return run_python(code, stdin, limits, paths)
    except BaseException as e:  # noqa: BLE001 - a sample's crash must stay that sample's
        return _failed(f"sandbox crashed: {type(e).__name__}: {e}", limit_hit="crash")
