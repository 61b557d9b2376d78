"""The jailed driver's first code, in its own process: the jail, then the driver.

``daemon.jail.start`` runs ``python -I -S <this file> <cfg>`` (by path), ``cfg`` the JSON of a
dict: ``mode`` (root | userns), ``uid`` / ``gid`` / ``groups`` (root mode: whom the job runs as),
``system`` and ``paths`` (bound read-only at their own paths; ``paths`` becomes ``sys.path``),
``job`` / ``keys`` / ``sock`` (bound at ``/mnt/job``, ``/mnt/keys``, ``/mnt/sock``), ``hide``
(covered by empty mounts), ``limits``, ``executable`` and ``argv`` (the driver's arguments).

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

import ctypes
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

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x40000000, 0x08000000, 0x20000000
CLONE_NEWUSER = 0x10000000
# mount(2) flags; RDONLY, NOSUID, NODEV and NOEXEC have the same values as mount_setattr(2)'s MOUNT_ATTR_*
BIND, REC, PRIVATE, RDONLY, NOSUID, NODEV, NOEXEC = 0x1000, 0x4000, 0x40000, 0x1, 0x2, 0x4, 0x8
SYS_PIVOT_ROOT, SYS_MOUNT_SETATTR = 155, 442
AT_FDCWD, AT_RECURSIVE, MNT_DETACH = -100, 0x8000, 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("set", ctypes.c_uint64),
        ("clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class Libc:
    """The system calls the jail makes that ``os`` does not offer; each raises ``OSError``."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        self.lib.syscall.restype = ctypes.c_long

    @staticmethod
    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, what + ": " + os.strerror(err))

    def unshare(self, flags: int) -> None:
        self.check(self.lib.unshare(flags), "unshare")

    def mount(self, src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        ret = self.lib.mount(
            src and src.encode(), dst.encode(), fstype and fstype.encode(), flags, data and data.encode()
        )
        self.check(ret, "mount " + dst)

    def mount_setattr(self, path: str, recursive: bool, set_: int, clr: int) -> None:
        attr = MountAttr(set_, clr, 0, 0)
        ret = self.lib.syscall(
            ctypes.c_long(SYS_MOUNT_SETATTR),
            ctypes.c_long(AT_FDCWD),
            ctypes.c_char_p(path.encode()),
            ctypes.c_long(AT_RECURSIVE if recursive else 0),
            ctypes.byref(attr),
            ctypes.c_long(ctypes.sizeof(attr)),
        )
        self.check(ret, "mount_setattr " + path)

    def pivot_root(self, new: str, old: str) -> None:
        ret = self.lib.syscall(
            ctypes.c_long(SYS_PIVOT_ROOT), ctypes.c_char_p(new.encode()), ctypes.c_char_p(old.encode())
        )
        self.check(ret, "pivot_root")

    def detach(self, path: str) -> None:
        self.check(self.lib.umount2(path.encode(), MNT_DETACH), "umount " + path)

    def die_with_parent(self) -> None:
        self.check(self.lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent death signal")

    def no_new_privs(self) -> None:
        self.check(self.lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")

    def drop_capabilities(self) -> None:
        header = CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
        self.check(self.lib.capset(ctypes.byref(header), (ctypes.c_uint32 * 6)()), "drop capabilities")


def jail(cfg: dict[str, Any]) -> list[str]:
    """Jail this process as ``cfg`` says; the driver's argv. Exits on any failure of its own
    (``SETUP_FAILED_EXIT``); the process that returns is the driver, pid 1 of its PID namespace."""
    libc = Libc()
    stage = "namespaces"
    try:
        enter_namespaces(libc, cfg["mode"])
        stage = "pid namespace"
        supervise_driver(libc, cfg["limits"].get("cpu", 0))
        stage = "mounts"
        build_root(libc, cfg)
        stage = "pivot_root"
        pivot_root(libc)
        stage = "python"
        sys.path[:] = list(cfg["paths"])
        sys.path_importer_cache.clear()
        sys.executable = cfg["executable"]
        stage = "drop privileges"
        if cfg["mode"] == "root":
            os.setgroups(cfg["groups"])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        stage = "limits"
        set_limits(cfg["limits"])
        libc.no_new_privs()
        libc.drop_capabilities()
        os.umask(0o077)
        os.chdir("/mnt/job")
    except BaseException as e:  # noqa: BLE001 - any setup failure exits before the job's code is imported
        os.write(2, ("plexrl-jail: setup failed at %s: %s: %s\n" % (stage, type(e).__name__, e)).encode())
        os._exit(SETUP_FAILED_EXIT)
    return cfg["argv"]


def enter_namespaces(libc: Libc, mode: str) -> None:
    """New mount, network, IPC and PID namespaces (the next child is pid 1 of the PID one); in
    ``userns`` mode a user namespace too, the owner's uid inside and out, no capability outside."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID
    if mode == "userns":
        flags |= CLONE_NEWUSER
    libc.unshare(flags)
    if mode == "userns":
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", "%d %d 1" % (uid, uid)),
            ("gid_map", "%d %d 1" % (gid, gid)),
        ):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)


def supervise_driver(libc: Libc, cpu_seconds: int) -> None:
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


def build_root(libc: Libc, cfg: dict[str, Any]) -> None:
    """The new root at ``NEW_ROOT``: a tmpfs with its own ``/tmp`` and ``/proc``, the system and
    import paths, the devices, the job's directory, keys and socket bound in, ``hide`` emptied."""
    os.umask(0o022)
    libc.mount(None, "/", None, REC | PRIVATE)
    libc.mount("tmpfs", NEW_ROOT, "tmpfs", NOSUID | NODEV, "mode=0755,size=16m")
    os.mkdir(NEW_ROOT + "/tmp")  # first: a bind below /tmp (a checkout there) lands in it, not under it
    tmp_bytes = cfg["limits"]["tmp"] or (1 << 40)
    libc.mount("tmpfs", NEW_ROOT + "/tmp", "tmpfs", NOSUID | NODEV, "mode=1777,size=%d" % tmp_bytes)
    for path in cfg["system"]:
        bind(libc, path, path)
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"):
        bind(libc, dev, dev)
    for path in cfg["paths"]:
        bind(libc, path, path)
    bind(libc, cfg["job"], "/mnt/job")
    bind(libc, cfg["keys"], "/mnt/keys")
    bind(libc, cfg["sock"], "/mnt/sock")
    for path in cfg["hide"]:  # the cluster's state, the owner's keys: empty, wherever a bind showed them
        if os.path.isdir(NEW_ROOT + path):
            libc.mount("tmpfs", NEW_ROOT + path, "tmpfs", NOSUID | NODEV, "mode=0755,size=1m")
    os.mkdir(NEW_ROOT + "/proc")
    libc.mount("proc", NEW_ROOT + "/proc", "proc", NOSUID | NODEV | NOEXEC)


def bind(libc: Libc, src: str, dst: str) -> None:
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
    libc.mount(src, target, None, BIND | REC)


def pivot_root(libc: Libc) -> None:
    """Make the new root "/", detach the old tree, and make all of it read-only and nosuid but
    ``/tmp`` and the job's directory."""
    os.mkdir(NEW_ROOT + "/.old")
    libc.pivot_root(NEW_ROOT, NEW_ROOT + "/.old")
    os.chdir("/")
    libc.detach("/.old")  # nothing of the old tree stays
    os.rmdir("/.old")
    libc.mount_setattr("/", True, RDONLY | NOSUID, 0)
    for path in ("/tmp", "/mnt/job"):
        libc.mount_setattr(path, False, 0, RDONLY)


def set_limits(limits: dict[str, int]) -> None:
    """The job's address space, processes, file size and CPU seconds (0: no limit). Past its CPU
    seconds the driver gets SIGXCPU, which ends it (SIGKILL a few seconds later if it waits)."""
    for which, value in (
        (resource.RLIMIT_AS, limits["memory"]),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_FSIZE, limits["file"]),
    ):
        if value:
            resource.setrlimit(which, (value, value))
    if limits.get("cpu"):
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + CPU_GRACE_S))


def run_driver(argv: list[str]) -> int:
    """The job's driver, imported only now that ``sys.path`` is the jail's."""
    from daemon.driver import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(run_driver(jail(json.loads(sys.argv[1]))))
