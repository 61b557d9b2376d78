"""The jailed driver's first code, in its own process: the jail, then the driver.

``daemon.jail.start`` runs ``python -I -S <this file>`` (by path) and writes ``cfg`` on its
standard input (nothing of it shows in ``ps``), the JSON of a dict: ``cgroups`` (the
``cgroup.procs`` files it joins first), ``mode`` (root | userns), ``uid`` / ``gid`` / ``groups``
(root mode: whom the job runs as), ``system`` and ``paths`` (bound read-only at their own paths;
``paths`` becomes ``sys.path``), ``job`` / ``in`` / ``keys`` / ``sock`` (bound at ``/mnt/job``,
``/mnt/in``, ``/mnt/keys``, ``/mnt/sock``), ``hide`` (covered by empty mounts), ``limits``,
``executable`` and ``argv`` (the driver's arguments).

Until ``jail`` sets ``sys.path`` from ``cfg["paths"]`` only the standard library can be
imported: ``-S`` leaves out site-packages and ``-I`` keeps this file's folder off ``sys.path``
(nothing of the checkout or of the owner's environment is importable before the jail holds).
Keep it so: this module imports the standard library alone at its top (not even ``typing``),
and ``daemon.driver`` only once the jail is up.

Invariant: any failure of the jail's own exits with ``SETUP_FAILED_EXIT`` and one
``plexrl-jail: setup failed at STAGE: ...`` line on stderr, before a line of the job's code is
imported. ``daemon.jail`` imports this module for that exit code: it does nothing on import.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

TYPE_CHECKING = False  # typing is not imported at run time (only the standard library, and little of it)
if TYPE_CHECKING:
    from typing import Any

SETUP_FAILED_EXIT = 121  # the jail could not be set up; the job's code never ran
CPU_GRACE_S = 5  # CPU seconds past its limit before the kernel kills a driver that ignored SIGXCPU
CPU_LIMIT_EXIT = 122  # the supervisor's exit code for a driver ended by its CPU-time limit
NEW_ROOT = "/mnt"  # where the new root is built, in the old tree; it becomes "/"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
ISOLATION = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plexctl/common/isolation.py")


def isolation() -> Any:
    """``plexctl.common.isolation``, loaded by path (no package is importable yet)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plexrl_isolation", ISOLATION)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def jail(cfg: dict[str, Any]) -> list[str]:
    """Jail this process as ``cfg`` says; the driver's argv. Exits on any failure of its own
    (``SETUP_FAILED_EXIT``); the process that returns is the driver, pid 1 of its PID namespace."""
    stage = "cgroups"
    try:
        for procs in cfg["cgroups"]:  # before any fork: every process of the job is in them
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        stage = "isolation"
        iso = isolation()
        libc = iso.Libc()
        stage = "namespaces"
        enter_namespaces(iso, libc, cfg["mode"])
        stage = "pid namespace"
        supervise_driver(libc, cfg["limits"].get("cpu", 0))
        stage = "mounts"
        build_root(iso, libc, cfg)
        stage = "pivot_root"
        pivot_root(iso, libc)
        stage = "python"
        sys.path[:] = list(cfg["paths"])
        sys.path_importer_cache.clear()
        sys.executable = cfg["executable"]
        stage = "libseccomp"
        import pyseccomp  # noqa: F401 - found and loaded now, with the rights to look libseccomp up

        stage = "drop privileges"
        if cfg["mode"] == "root":
            os.setgroups(cfg["groups"])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        stage = "limits"
        set_limits(iso, cfg["limits"])
        libc.no_new_privs()
        libc.drop_capabilities()
        stage = "seccomp"
        iso.seccomp()
        os.umask(0o077)
        os.chdir("/mnt/job")
    except BaseException as e:  # noqa: BLE001 - any setup failure exits before the job's code is imported
        os.write(2, ("plexrl-jail: setup failed at %s: %s: %s\n" % (stage, type(e).__name__, e)).encode())
        os._exit(SETUP_FAILED_EXIT)
    return cfg["argv"]


def enter_namespaces(iso: Any, libc: Any, mode: str) -> None:
    """New mount, network, IPC and PID namespaces (the next child is pid 1 of the PID one); in
    ``userns`` mode a user namespace too, the owner's uid inside and out, no capability outside."""
    uid, gid = os.getuid(), os.getgid()
    flags = iso.CLONE_NEWNS | iso.CLONE_NEWNET | iso.CLONE_NEWIPC | iso.CLONE_NEWPID
    if mode == "userns":
        flags |= iso.CLONE_NEWUSER
    libc.unshare(flags)
    if mode == "userns":
        iso.map_user(uid, uid, gid)


def supervise_driver(libc: Any, cpu_seconds: int) -> None:
    """Fork the driver, which returns (dying with this process); this process, the supervisor
    (the daemon's handle), forwards signals to it and exits as it did, never returning; a driver
    that used up its ``cpu_seconds`` exits ``CPU_LIMIT_EXIT``, whatever signal ended it."""
    supervisor = os.getpid()
    child = os.fork()
    if child:
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, lambda s, _f: os.kill(child, s))
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        if cpu_seconds and os.WIFSIGNALED(status) and used.ru_utime + used.ru_stime >= cpu_seconds:
            os._exit(CPU_LIMIT_EXIT)
        if os.WIFSIGNALED(status):
            ended_by = os.WTERMSIG(status)
            if ended_by not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose disposition cannot be set
                signal.signal(ended_by, signal.SIG_DFL)
            os.kill(os.getpid(), ended_by)
        os._exit(os.waitstatus_to_exitcode(status))
    libc.die_with_parent()
    os.environ["PLEXRL_DRIVER_PID"] = str(supervisor)  # the pid the daemon knows it by


def build_root(iso: Any, libc: Any, cfg: dict[str, Any]) -> None:
    """The new root at ``NEW_ROOT``: a tmpfs with its own ``/tmp`` and ``/proc``, the system and
    import paths, the devices, the job's directory, keys and socket bound in, ``hide`` emptied."""
    os.umask(0o022)
    libc.mount(None, "/", None, iso.REC | iso.PRIVATE)
    libc.mount("tmpfs", NEW_ROOT, "tmpfs", iso.NOSUID | iso.NODEV, "mode=0755,size=16m")
    os.mkdir(NEW_ROOT + "/tmp")  # first: a bind below /tmp (a checkout there) lands in it, not under it
    tmp_bytes = cfg["limits"]["tmp"] or (1 << 40)
    libc.mount("tmpfs", NEW_ROOT + "/tmp", "tmpfs", iso.NOSUID | iso.NODEV, "mode=1777,size=%d" % tmp_bytes)
    for path in cfg["system"]:
        bind(iso, libc, path, path)
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"):
        bind(iso, libc, dev, dev)
    for path in cfg["paths"]:
        bind(iso, libc, path, path)
    bind(iso, libc, cfg["job"], "/mnt/job")
    bind(iso, libc, cfg["in"], "/mnt/in")
    bind(iso, libc, cfg["keys"], "/mnt/keys")
    bind(iso, libc, cfg["sock"], "/mnt/sock")
    for path in cfg["hide"]:  # the cluster's state, the owner's keys: empty, wherever a bind showed them
        if os.path.isdir(NEW_ROOT + path):
            libc.mount("tmpfs", NEW_ROOT + path, "tmpfs", iso.NOSUID | iso.NODEV, "mode=0755,size=1m")
    os.mkdir(NEW_ROOT + "/proc")
    libc.mount("proc", NEW_ROOT + "/proc", "proc", iso.NOSUID | iso.NODEV | iso.NOEXEC)


def bind(iso: Any, libc: Any, src: str, dst: str) -> None:
    """``src`` at ``dst`` of the new root (a link is copied as a link, not followed)."""
    target = NEW_ROOT + dst
    if os.path.islink(src):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(src), target)
        return
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    libc.mount(src, target, None, iso.BIND | iso.REC)


def pivot_root(iso: Any, libc: Any) -> None:
    """Make the new root "/", detach the old tree, and make all of it read-only and nosuid but
    ``/tmp`` and the job's directory."""
    os.mkdir(NEW_ROOT + "/.old")
    libc.pivot_root(NEW_ROOT, NEW_ROOT + "/.old")
    os.chdir("/")
    libc.detach("/.old")  # nothing of the old tree stays
    os.rmdir("/.old")
    libc.mount_setattr("/", True, iso.RDONLY | iso.NOSUID, 0)
    for path in ("/tmp", "/mnt/job"):
        libc.mount_setattr(path, False, 0, iso.RDONLY)


def set_limits(iso: Any, limits: dict[str, int]) -> None:
    """Each process's address space, its uid's processes, a file's size and a process's CPU
    seconds (0: no limit); the job's cgroups hold its tree as a whole. Past its CPU seconds a
    process gets SIGXCPU, which ends it (SIGKILL a few seconds later if it waits)."""
    rlimits = [
        (name, value, value)
        for name, value in (("RLIMIT_AS", limits["memory"]), ("RLIMIT_NPROC", limits["processes"]),
                            ("RLIMIT_FSIZE", limits["file"]))
        if value
    ]  # fmt: skip
    if limits.get("cpu"):
        rlimits.append(("RLIMIT_CPU", limits["cpu"], limits["cpu"] + CPU_GRACE_S))
    iso.set_rlimits(rlimits)


def run_driver(argv: list[str]) -> int:
    """The job's driver, imported only now that ``sys.path`` is the jail's."""
    from daemon.driver import main

    return main(argv)


def read_cfg() -> dict[str, Any]:
    """The configuration on standard input, which then reads from ``/dev/null``."""
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        return json.loads(b"".join(chunks))
    except ValueError as e:
        os.write(2, ("plexrl-jail: setup failed at configuration: %s\n" % e).encode())
        os._exit(SETUP_FAILED_EXIT)


if __name__ == "__main__":
    sys.exit(run_driver(jail(read_cfg())))
