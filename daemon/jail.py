"""The isolated driver: a job of a user the cluster does not trust runs held to a uid of its own.

It owns ``mode`` (how this daemon jails: ``root`` or ``userns``, or not at all), ``refusal`` (why
it cannot, or ""), ``runs_as`` / ``job_account`` (the uid a job runs as: in ``root`` mode one of
the job's own, never a person's), ``start`` (the driver's process, whose first code is
``daemon/jail_boot.py``), ``jailed_env`` (the environment's allow-list) and ``read_job_file``
(what a driver wrote). Before any of the job's code runs, that process joins the job's cgroups
(``daemon.confine``), leaves the daemon's mount, network (keeping only a down loopback), IPC and
PID namespaces (in ``userns`` mode its user namespace too); pivots into a new, empty root that
holds, read-only, the system, the interpreter, the import path, and under ``/mnt`` what the
daemon gave it (``in``: its spec and uploaded inputs; ``keys``), its output directory (writable)
and the daemon's socket; in ``root`` mode takes the job's uid; sets its rlimits; then drops
every capability, sets ``no_new_privs`` and loads its seccomp filter.

Invariants: a jail that cannot be set up exits with ``SETUP_FAILED_EXIT`` and one line on stderr
before any of the job's code is imported; the state directory and the owner's PLEXRL_HOME are
covered by empty mounts inside; the daemon writes only in directories of its own (``in``,
``keys``), never in the job's output directory, and reads there without following links
(``open_job_file``); its configuration reaches the jail on a pipe, not on a command line.

It deliberately does not jail without namespaces (``refusal`` says why and the daemon refuses
such jobs at submit). The whole model and the limits: ``docs/security.md``.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from daemon.jail_boot import CPU_LIMIT_EXIT as CPU_LIMIT_EXIT
from daemon.jail_boot import SETUP_FAILED_EXIT as SETUP_FAILED_EXIT
from plexctl.common.jobdir import JobDir
from plexctl.common.limits import JobLimits

JOB_UID_BASE = 1_400_000  # jobs of users with no local account: uids [BASE, BASE + JOB_UIDS), by job number
JOB_UIDS = 100_000
JAIL_ROOT = "/mnt"  # a tmpfs in the jail's mount namespace: what the driver is given lives here
OUT_DIR = JobDir.DRIVER_OUT  # in the job's directory: the one place the isolated driver writes
# A jailed driver's environment: these exact names of the daemon's, nothing else (no token or locale
# of the owner's shell, none of the cluster's keys or the owner's home, no debugging switch).
ENV_NAMES = (
    "PATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "GOMP_SPINCOUNT", "TOKENIZERS_PARALLELISM",
    "PLEXRL_ORPHAN_GRACE_S", "PLEXRL_SANDBOX_MODE",  # the cluster's, that a driver reads
)  # fmt: skip
JAIL_LOCALE = "C.UTF-8"  # the jail's own locale, whatever the owner's
SOCKET_NAME = "plexd.sock"
MAX_READ = 1 << 30
MODE_ENV = "PLEXRL_JAIL_MODE"  # root | userns: force a mode (e.g. to test userns as root)
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/localtime")
REPO_ROOT = Path(__file__).resolve().parents[1]
BOOT = Path(__file__).resolve().with_name("jail_boot.py")  # the jail's first code, run by path (its docstring says why)


@dataclass(frozen=True)
class Account:
    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def job_account(user: str, job_id: str) -> Account:
    """A uid and gid of the job's own, unused by any account: no person's process (not even the
    submitting user's own shell) can signal, trace or open the ``/proc`` of a process of the job."""
    number = int(job_id.lstrip("j") or 0)
    uid = JOB_UID_BASE + number % JOB_UIDS
    return Account(user, uid, uid, ())


def mode() -> str:
    """``root`` (the daemon may switch uid), ``userns`` (an ordinary user where the kernel lets
    it make user namespaces), or "" (neither: no jail)."""
    forced = os.environ.get(MODE_ENV)
    if forced in ("root", "userns"):
        return forced
    if os.geteuid() == 0:
        return "root"
    return "userns" if _userns_allowed() else ""


@functools.cache
def _userns_allowed() -> bool:
    """Whether this process may make a user namespace (tried in a child, which then exits)."""
    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        os._exit(0 if libc.unshare(0x10000000 | 0x00020000) == 0 else 1)  # NEWUSER | NEWNS
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def runs_as(user: str, job_id: str) -> Account:
    """Whom a jailed job of ``user`` runs as: in ``root`` mode the job's own uid, in ``userns``
    mode the daemon's own uid."""
    if mode() == "root":
        return job_account(user, job_id)
    return Account(user, os.getuid(), os.getgid(), ())


def refusal(user: str) -> str:
    """Why this daemon cannot run ``user``'s code held to that user's rights ("" if it can)."""
    if not mode():
        return (
            f"user {user!r} is not trusted by this cluster, and its daemon can neither switch uid (it "
            f"does not run as root) nor make user namespaces here, so it cannot jail their code; the "
            f"cluster's owner can trust them (`plexctl up --trust-user-code {user}`)"
        )
    if not Path(JAIL_ROOT).is_dir():
        return f"the daemon's node has no {JAIL_ROOT} to mount an isolated driver's files on"
    return ""


def socket_dir(state_dir: Path) -> Path:
    """Where the daemon's Unix socket for isolated drivers lives (a short path: sun_path is 108 bytes)."""
    path = state_dir / "run"
    if len(str(path / SOCKET_NAME)) > 100:
        import hashlib

        path = Path("/tmp") / f"plexrl-{hashlib.sha256(str(state_dir).encode()).hexdigest()[:16]}"
    return path


def prepare_socket_dir(state_dir: Path) -> str:
    """The socket directory (0711: drivers of other uids reach the socket, never list it); its
    ZeroMQ address. CURVE still decides who is let in."""
    path = socket_dir(state_dir)
    path.mkdir(mode=0o711, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise RuntimeError(f"{path} is not a directory of this daemon's own")
    path.chmod(0o711)
    return f"ipc://{path / SOCKET_NAME}"


def open_socket(state_dir: Path) -> None:
    """Let any uid connect to the bound socket (the handshake, not the file mode, lets them in)."""
    (socket_dir(state_dir) / SOCKET_NAME).chmod(0o666)


def out_dir(job_dir: Path, who: Account) -> Path:
    """The job's output directory, owned by ``who`` (made if missing, re-owned if not theirs). Its
    entry lies in the daemon's own directory: the job can fill it, never swap it."""
    out = job_dir / OUT_DIR
    out.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, who.uid, who.gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return out


def given_dir(job_dir: Path) -> Path:
    """The daemon's directory of what a jailed job is given (its spec, its uploaded inputs), made
    empty: root's, readable by the job's uid, bound read-only at ``/mnt/in``."""
    given = job_dir / JobDir.DRIVER_IN
    if given.is_symlink() or given.is_file():
        given.unlink()
    elif given.exists():
        shutil.rmtree(given)
    given.mkdir(mode=0o755)
    given.chmod(0o755)
    return given


def open_job_file(path: Path) -> BinaryIO:
    """A file a driver wrote, opened for reading without following a link and only if it is a
    regular file (a jailed driver may have put a link or a FIFO there)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def read_job_file(path: Path, offset: int = 0, limit: int = MAX_READ) -> bytes:
    """Up to ``limit`` bytes of a file a driver wrote, from ``offset`` (``open_job_file``)."""
    with open_job_file(path) as f:
        f.seek(offset)
        return f.read(limit)


def jailed_env(env: dict[str, str], who: Account) -> dict[str, str]:
    """The environment a jailed driver gets: the allowed names of ``env`` (``ENV_NAMES``), its own
    locale, home, user, temporary directory and keys."""
    kept = {name: value for name, value in env.items() if name in ENV_NAMES}
    own = {"LANG": JAIL_LOCALE, "TMPDIR": "/tmp", "HOME": f"{JAIL_ROOT}/job", "USER": who.user, "LOGNAME": who.user}
    return {**kept, **own, "PLEXRL_DRIVER_KEYS": f"{JAIL_ROOT}/keys"}


def start(
    who: Account,
    job_id: str,
    job_dir: Path,
    state_dir: Path,
    log_path: Path,
    hide: list[Path],
    keys: Path,
    limits: JobLimits,
    cgroups: list[str],
) -> subprocess.Popen:
    """Start the driver of ``job_id`` jailed (``mode()``) and running as ``who``, held to
    ``limits``, in the cgroups whose ``cgroup.procs`` files ``cgroups`` names, given what
    ``given_dir`` holds and the key pair in ``keys`` (both read-only to it); its output goes to
    ``log_path``. The process returned is the jail's supervisor: it forwards signals to the
    driver (pid 1 of its own PID namespace), which dies with it."""
    out = job_dir / OUT_DIR
    cfg = {
        "mode": mode(),
        "uid": who.uid,
        "gid": who.gid,
        "groups": list(who.groups),
        "system": [d for d in SYSTEM_PATHS if os.path.lexists(d)],
        "paths": list(
            dict.fromkeys(
                p for p in [str(REPO_ROOT), *sys.path, os.path.realpath(sys.base_prefix)] if p and os.path.isdir(p)
            )
        ),
        "cgroups": cgroups,
        "job": str(out),
        "in": str(job_dir / JobDir.DRIVER_IN),
        "keys": str(keys),
        "sock": str(socket_dir(state_dir)),
        "limits": {
            "memory": limits.memory_bytes,
            "processes": limits.processes,
            "file": limits.job_dir_bytes,
            "tmp": limits.tmp_bytes,
            "cpu": limits.cpu_seconds,
        },
        "hide": sorted({str(p) for p in hide}, key=lambda p: -p.count("/")),  # deepest first
        "executable": os.path.realpath(sys.executable),
        "argv": [
            "--endpoint",
            f"ipc://{JAIL_ROOT}/sock/{SOCKET_NAME}",
            *driver_args(job_id),
        ],
    }
    child_env = jailed_env(dict(os.environ), who)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(BOOT)],
            stdout=fd,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE,
            env=child_env,
            cwd="/",
        )
    finally:
        os.close(fd)
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(cfg).encode())  # on a pipe: the paths it names stay out of `ps`
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the jail failed at once: its line is in the log, its exit code with the daemon
    return proc


def driver_args(job_id: str) -> list[str]:
    """A jailed driver's arguments (its address aside): its job, and where it finds its files."""
    return ["--job-id", job_id, "--job-dir", f"{JAIL_ROOT}/job", "--spec", f"{JAIL_ROOT}/in/spec.json", "--isolated"]
