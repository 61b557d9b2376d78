"""The sandbox's boot: the first code of every sandboxed run, in the child process.

``plexctl.sandbox`` starts ``python -I -S <this file> <config>`` (by path: with ``-S`` there is
no site-packages to import ``plexctl`` from, and ``-I`` keeps this file's folder off
``sys.path``). The config is the ``repr`` of a dict: ``mode`` (namespaces | userns | guard),
``base`` (the run directory, holding ``main.py`` and ``work/``), ``uid`` (namespaces mode: the
uid to drop to), ``inner_uid`` (userns mode), ``rlimits`` and ``paths`` (read-only import paths).

The boot applies the isolation of its mode (see ``plexctl.sandbox``), then runs ``main.py`` in a
fresh ``__main__`` module. Invariant: any failure of its own exits with ``SETUP_FAILED_EXIT``
and one ``plexrl-sandbox:`` line on stderr, before a line of the program runs, so a run never
silently gets a weaker isolation than it was asked for. Standard library only.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing is not imported at run time: it would add ~15 ms to every run
if TYPE_CHECKING:
    from typing import Any

SETUP_FAILED_EXIT = 121  # the boot could not apply the isolation it was asked for

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC = 0x00020000, 0x40000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
AT_RECURSIVE, AT_FDCWD = 0x8000, -100
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
SYS_MOUNT_SETATTR = 442
PR_SET_NO_NEW_PRIVS = 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# audit events the guard refuses outright, and those whose path arguments must stay in the work dir
GUARD_REFUSED = (
    "socket.",
    "subprocess.",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "os.fork",
    "ctypes.",
    "pty.",
    "os.forkpty",
    "winreg.",
    "_posixsubprocess.",
)
GUARD_ALLOWED = ("socket.gethostname",)
GUARD_PATH_EVENTS = frozenset(
    {
        "os.remove",
        "os.rename",
        "os.rmdir",
        "os.mkdir",
        "os.symlink",
        "os.link",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
        "os.chflags",
        "os.mkfifo",
        "os.mknod",
        "shutil.rmtree",
    }
)


class _Libc:
    """The few system calls of the namespace modes that ``os`` does not offer (ctypes is imported
    here only: in guard mode the program's own ``import ctypes`` is refused)."""

    def __init__(self) -> None:
        import ctypes

        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
        self.lib.syscall.restype = ctypes.c_long

    @staticmethod
    def check(ret: int, what: str) -> None:
        if ret != 0:
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, what + ": " + os.strerror(err))

    def unshare(self, flags: int) -> None:
        self.check(self.lib.unshare(flags), "unshare")

    def mount(self, src: str | None, dst: str, flags: int) -> None:
        self.check(self.lib.mount(src and src.encode(), dst.encode(), None, flags, None), "mount " + dst)

    def mount_setattr(self, path: str, flags: int, set_: int, clr: int) -> None:
        import ctypes

        class MountAttr(ctypes.Structure):
            _fields_ = [
                ("set", ctypes.c_uint64),
                ("clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64),
            ]

        attr = MountAttr(set_, clr, 0, 0)
        ret = self.lib.syscall(
            ctypes.c_long(SYS_MOUNT_SETATTR),
            ctypes.c_long(AT_FDCWD),
            ctypes.c_char_p(path.encode()),
            ctypes.c_long(flags),
            ctypes.byref(attr),
            ctypes.c_long(ctypes.sizeof(attr)),
        )
        self.check(ret, "mount_setattr " + path)

    def no_new_privs(self) -> None:
        self.check(self.lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")

    def drop_capabilities(self) -> None:
        import ctypes

        class CapHeader(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        data = (ctypes.c_uint32 * 6)()
        self.check(self.lib.capset(ctypes.byref(CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), data), "drop capabilities")


def boot(cfg: dict[str, Any]) -> bytes:
    """Apply the isolation ``cfg`` asks for; the program's source. Exits on any failure."""
    mode, base = cfg["mode"], cfg["base"]
    work = base + "/work"
    stage = "start"
    try:
        with open(base + "/main.py", "rb") as f:
            source = f.read()
        sys.path[:0] = cfg.get("paths", [])  # read-only import paths (bind-mounted below)
        libc = None
        if mode != "guard":
            stage = "namespaces"
            libc = _Libc()
            flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC
            if mode == "userns":
                flags |= CLONE_NEWUSER | CLONE_NEWPID
            uid, gid = os.getuid(), os.getgid()
            libc.unshare(flags)
            if mode == "userns":
                stage = "user namespace"
                _map_user(cfg["inner_uid"], uid, gid)
            stage = "mounts"
            libc.mount(None, "/", MS_REC | MS_PRIVATE)
            if mode == "namespaces":
                _bind_import_paths(libc, base)
            libc.mount_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
            libc.mount(work, work, MS_BIND)
            libc.mount_setattr(work, 0, 0, MOUNT_ATTR_RDONLY)  # the working directory alone is writable
            if mode == "userns":
                stage = "pid namespace"
                _supervise_pid_namespace()
        stage = "limits"
        import resource

        for name, (soft, hard) in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.chdir(work)
        if mode == "namespaces":
            stage = "drop privileges"
            os.setgroups([])
            os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        if libc is not None:
            libc.no_new_privs()
        if mode == "userns" and libc is not None:
            libc.drop_capabilities()
        if mode == "guard":
            stage = "guard"
            _install_guard(os.path.realpath(work))
    except BaseException as e:  # noqa: BLE001 - any setup failure exits before the user's code runs
        os.write(2, f"plexrl-sandbox: setup failed at {stage}: {type(e).__name__}: {e}\n".encode())
        os._exit(SETUP_FAILED_EXIT)
    return source


def _map_user(inner_uid: int, uid: int, gid: int) -> None:
    """In a new user namespace: the driver's uid and gid appear as ``inner_uid``; no setgroups."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{inner_uid} {uid} 1"), ("gid_map", f"{inner_uid} {gid} 1")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)


def _bind_import_paths(libc: _Libc, base: str) -> None:
    """Namespaces mode: bind every import path under the run directory, where the sandbox uid
    can reach it (an interpreter in a private home, e.g. /root/.pyenv, still imports)."""
    moved: dict[str, str] = {}
    for i, p in enumerate(sys.path):
        if os.path.isdir(p):
            moved[p] = f"{base}/py/{i}"
            os.mkdir(moved[p])
            libc.mount(p, moved[p], MS_BIND | MS_REC)

    def rebase(path: str) -> str:
        old = max((o for o in moved if path == o or path.startswith(o + "/")), key=len, default=None)
        return path if old is None else moved[old] + path[len(old) :]

    sys.path[:] = list(moved.values())
    for module in list(sys.modules.values()):  # packages imported so far find their submodules
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [rebase(p) for p in search]
    sys.path_importer_cache.clear()


def _supervise_pid_namespace() -> None:
    """The program runs as pid 1 of a new PID namespace: when it dies, or when this supervisor
    (the process group leader the driver kills) takes it down, every process it left dies."""
    pid = os.fork()
    if pid == 0:
        return
    import signal

    for limit in (signal.SIGXCPU, signal.SIGXFSZ):
        signal.signal(limit, signal.SIG_IGN)  # the supervisor idles; only the program has limits
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _install_guard(work: str) -> None:
    """Guard mode: an audit hook (which Python code cannot remove) refuses sockets, process
    spawning, ctypes and writes outside ``work``."""

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return True
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        real = os.path.realpath(os.fspath(path))
        return real == work or real.startswith(work + os.sep) or real == "/dev/null"

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith(GUARD_REFUSED) and event not in GUARD_ALLOWED:
            raise PermissionError(f"plexrl-sandbox: {event} refused")
        if event == "open" and len(args) >= 3 and args[0] is not None:
            mode, flags = args[1], args[2] or 0
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
                flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if writing and not inside(args[0]):
                raise PermissionError(f"plexrl-sandbox: write outside the working directory refused: {args[0]!r}")
        elif event in GUARD_PATH_EVENTS:
            for arg in args[:2]:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                    raise PermissionError(f"plexrl-sandbox: {event} outside the working directory refused")

    sys.addaudithook(hook)


def run_program(source: bytes) -> None:
    """Run ``source`` as ``main.py`` in a fresh ``__main__`` module, argv ``["main.py"]``."""
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    sys.argv[:] = ["main.py"]
    code = compile(source, "main.py", "exec")
    del source
    exec(code, main.__dict__)


if __name__ == "__main__":
    run_program(boot(eval(sys.argv[1], {"__builtins__": {}})))
