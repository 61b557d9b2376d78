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

ISOLATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "common", "isolation.py")

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


def _isolation() -> Any:
    """``plexctl.common.isolation``, loaded by path (no package is importable yet); only the
    namespace modes load it: in guard mode the program's own ``import ctypes`` is refused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plexrl_isolation", ISOLATION)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def boot(cfg: dict[str, Any]) -> bytes:
    """Apply the isolation ``cfg`` asks for; the program's source. Exits on any failure."""
    mode, base = cfg["mode"], cfg["base"]
    work = base + "/work"
    stage = "start"
    try:
        with open(base + "/main.py", "rb") as f:
            source = f.read()
        sys.path[:0] = cfg.get("paths", [])  # read-only import paths (bind-mounted below)
        libc = iso = None
        if mode != "guard":
            stage = "namespaces"
            iso = _isolation()
            libc = iso.Libc()
            flags = iso.CLONE_NEWNS | iso.CLONE_NEWNET | iso.CLONE_NEWIPC
            if mode == "userns":
                flags |= iso.CLONE_NEWUSER | iso.CLONE_NEWPID
            uid, gid = os.getuid(), os.getgid()
            libc.unshare(flags)
            if mode == "userns":
                stage = "user namespace"
                iso.map_user(cfg["inner_uid"], uid, gid)
            stage = "mounts"
            libc.mount(None, "/", None, iso.REC | iso.PRIVATE)
            if mode == "namespaces":
                _bind_import_paths(iso, libc, base)
            libc.mount_setattr("/", True, iso.RDONLY | iso.NOSUID, 0)
            libc.mount(work, work, None, iso.BIND)
            libc.mount_setattr(work, False, 0, iso.RDONLY)  # the working directory alone is writable
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


def _bind_import_paths(iso: Any, libc: Any, base: str) -> None:
    """Namespaces mode: bind every import path under the run directory, where the sandbox uid
    can reach it (an interpreter in a private home, e.g. /root/.pyenv, still imports)."""
    moved: dict[str, str] = {}
    for i, p in enumerate(sys.path):
        if os.path.isdir(p):
            moved[p] = f"{base}/py/{i}"
            os.mkdir(moved[p])
            libc.mount(p, moved[p], None, iso.BIND | iso.REC)

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
