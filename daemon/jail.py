"""The isolated driver: a job of a user the cluster does not trust runs held to that user's rights.

What it owns: ``account`` (the local account a cluster user name stands for), ``refusal`` (why
this daemon cannot isolate a user's driver, or ""), and ``start`` (the driver's process). The
daemon runs as root here; the process it starts, before any of the job's code runs:

- leaves the daemon's mount, network and IPC namespaces: the network namespace has only a
  down loopback, so the one way out is the daemon's Unix socket, bound into the jail;
- sees the whole file tree read-only and nosuid, with ``/tmp`` an empty tmpfs of its own and
  the cluster's state directory and the owner's PLEXRL_HOME covered by empty tmpfs mounts: no
  journal, no cluster keys, no other job's directory, no other job's staged files;
- gets, under ``/mnt`` (a tmpfs), its output directory (writable: metrics, TensorBoard, exit
  code), the daemon's socket, the interpreter and the import path read-only;
- then drops to the submitting user's uid, gid and groups (a user with no local account: a uid
  of the job's own, ``job_account``) with ``no_new_privs``. Its spec's files (data, rewards,
  loop, environment) are the ones its client uploaded (``daemon.blobs``), read-only in its
  directory; any other path is opened with that user's rights, never the owner's. It presents
  its job's own CURVE key, which lets it call and report for that job alone.

Invariants: a jail that cannot be set up exits with ``SETUP_FAILED_EXIT`` and one line on stderr
before any of the job's code is imported; nothing the driver writes lies outside its output
directory, which the daemon reads without following links (``read_job_file``).

What it deliberately does not do: run without root (a daemon of an ordinary user cannot switch
uid; ``refusal`` says so and the daemon refuses such jobs at submit), hide other processes.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

SETUP_FAILED_EXIT = 121
JOB_UID_BASE = 1_400_000  # jobs of users with no local account: uids [BASE, BASE + JOB_UIDS), by job number
JOB_UIDS = 100_000
JAIL_ROOT = "/mnt"  # a tmpfs in the jail's mount namespace: what the driver is given lives here
OUT_DIR = "driver"  # in the job's directory: the one place the isolated driver writes
SOCKET_NAME = "plexd.sock"
MAX_READ = 1 << 30
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Account:
    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def account(user: str) -> Account | None:
    """The local account named ``user`` (never root), None if there is none."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    if entry.pw_uid == 0:
        return None
    return Account(user, entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(user, entry.pw_gid)))


def job_account(user: str, job_id: str) -> Account:
    """For a user with no local account: a uid and gid of the job's own, unused by any account."""
    number = int(job_id.lstrip("j") or 0)
    uid = JOB_UID_BASE + number % JOB_UIDS
    return Account(user, uid, uid, ())


def refusal(user: str) -> str:
    """Why this daemon cannot run ``user``'s code held to that user's rights ("" if it can)."""
    if os.geteuid() != 0:
        return (f"user {user!r} is not trusted by this cluster and its daemon does not run as root, so it "
                f"cannot run their code with their own rights; the cluster's owner can trust them "
                f"(`plexctl up --trust-user-code {user}`)")
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
    """The job's output directory, owned by ``who`` (made if missing, re-owned if not theirs)."""
    out = job_dir / OUT_DIR
    out.mkdir(mode=0o700, exist_ok=True)
    st = out.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{out} is not a directory")
    os.chown(out, who.uid, who.gid)
    out.chmod(0o700)
    return out


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


def start(who: Account, job_id: str, job_dir: Path, state_dir: Path, log_path: Path,
          hide: list[Path], env: dict[str, str]) -> subprocess.Popen:
    """Start the driver of ``job_id`` jailed and running as ``who``; its output goes to ``log_path``."""
    out = out_dir(job_dir, who)
    cfg = {
        "uid": who.uid, "gid": who.gid, "groups": list(who.groups),
        "binds": [[str(out), "job", True], [str(socket_dir(state_dir)), "sock", False],
                  [sys.base_prefix, "python", False]],
        "paths": list(dict.fromkeys(p for p in [str(REPO_ROOT), *sys.path] if p and os.path.isdir(p))),
        "hide": sorted((str(p) for p in hide if p.is_dir()), key=lambda p: -p.count("/")),  # deepest first
        "executable": os.path.relpath(os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)),
        "argv": ["--endpoint", f"ipc://{JAIL_ROOT}/sock/{SOCKET_NAME}", "--job-id", job_id,
                 "--job-dir", f"{JAIL_ROOT}/job", "--isolated"],
    }
    child_env = {**env, "TMPDIR": "/tmp", "HOME": f"{JAIL_ROOT}/job", "USER": who.user, "LOGNAME": who.user}
    for name in ("PLEXRL_CLUSTER_KEYS", "PLEXRL_HOME", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"):
        child_env.pop(name, None)
    child_env["PLEXRL_DRIVER_KEYS"] = f"{JAIL_ROOT}/job/.keys"
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(cfg)], stdout=fd,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env, cwd="/")
    finally:
        os.close(fd)


# Runs as root in the new process (``python -I -S -c``): the jail, then the driver. Any failure of
# its own exits with SETUP_FAILED_EXIT before a line of the job's code is imported.
_BOOT = r"""
import os, sys
def _jail():
    import ctypes, json
    cfg = json.loads(sys.argv[1])
    root = "/mnt"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.syscall.restype = ctypes.c_long
    class MountAttr(ctypes.Structure):
        _fields_ = [("set", ctypes.c_uint64), ("clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]
    def check(ret, what):
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, what + ": " + os.strerror(err))
    def mount(src, dst, fstype, flags, data=None):
        check(libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                         data and data.encode()), "mount " + dst)
    def setattr_(path, recursive, set_, clr):
        attr = MountAttr(set_, clr, 0, 0)
        check(libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), ctypes.c_char_p(path.encode()),
                           ctypes.c_long(0x8000 if recursive else 0), ctypes.byref(attr),
                           ctypes.c_long(ctypes.sizeof(attr))), "mount_setattr " + path)
    BIND, REC, PRIVATE, RDONLY, NOSUID = 0x1000, 0x4000, 0x40000, 0x1, 0x2
    stage = "namespaces"
    try:
        check(libc.unshare(0x00020000 | 0x40000000 | 0x08000000), "unshare")  # NEWNS | NEWNET | NEWIPC
        stage = "mounts"
        os.umask(0o022)  # the jail's own mount points: reachable by the driver's uid
        mount(None, "/", None, REC | PRIVATE)
        mount("tmpfs", root, "tmpfs", NOSUID, "mode=0755,size=16m")
        for src, name, _ in cfg["binds"]:
            os.mkdir(root + "/" + name)
            mount(src, root + "/" + name, None, BIND | REC)
        moved = {}
        os.mkdir(root + "/py")
        for i, p in enumerate(cfg["paths"]):
            moved[p] = "%s/py/%d" % (root, i)
            os.mkdir(moved[p])
            mount(p, moved[p], None, BIND | REC)
        for path in cfg["hide"] + ["/tmp"]:
            mount("tmpfs", path, "tmpfs", NOSUID, "mode=1777,size=1g" if path == "/tmp" else "mode=0755,size=1m")
        setattr_("/", True, RDONLY | NOSUID, 0)
        for path in ("/tmp", root + "/job"):
            setattr_(path, False, 0, RDONLY)
        stage = "python"
        def rebase(path):
            old = max((o for o in moved if path == o or path.startswith(o + "/")), key=len, default=None)
            return path if old is None else moved[old] + path[len(old):]
        sys.path[:] = list(moved.values())
        for module in list(sys.modules.values()):  # packages imported so far find their submodules
            search = getattr(module, "__path__", None)
            if isinstance(search, list):
                search[:] = [rebase(p) for p in search]
        sys.executable = root + "/python/" + cfg["executable"]
        sys.path_importer_cache.clear()
        stage = "drop privileges"
        os.setgroups(cfg["groups"])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
        os.umask(0o077)
        os.chdir(root + "/job")
    except BaseException as e:
        os.write(2, ("plexrl-jail: setup failed at %s: %s: %s\n" % (stage, type(e).__name__, e)).encode())
        os._exit(121)
    return cfg["argv"]
_argv = _jail()
del _jail
from daemon.driver import main
sys.exit(main(_argv))
"""
