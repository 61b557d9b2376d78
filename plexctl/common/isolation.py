"""The one isolation stack: the kernel calls that the jail (``daemon/jail_boot.py``) and the sandbox
(``plexctl/sandbox_boot.py``) make to hold code they run, written once.

It owns ``Libc`` (namespaces, mounts, ``pivot_root``, capabilities, ``no_new_privs``, the parent
death signal), ``map_user`` (a new user namespace's one uid), ``set_rlimits`` and ``seccomp``
(the filter every jailed process carries: no ``ptrace``, no reading or writing another
process's memory, no taking another process's descriptors, no ``PR_SET_DUMPABLE``).

Both boots run by path with ``python -I -S`` and load this file by path too, before any
site-packages is importable: it imports the standard library alone at its top (not even
``typing`` at run time), and does nothing on import. ``seccomp`` imports ``pyseccomp`` (a
binding to libseccomp) when it is called, once the caller's import path is set.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x40000000, 0x08000000, 0x20000000
CLONE_NEWUSER = 0x10000000
# mount(2) flags; RDONLY, NOSUID, NODEV and NOEXEC have the same values as mount_setattr(2)'s MOUNT_ATTR_*
BIND, REC, PRIVATE, RDONLY, NOSUID, NODEV, NOEXEC = 0x1000, 0x4000, 0x40000, 0x1, 0x2, 0x4, 0x8
SYS_PIVOT_ROOT, SYS_MOUNT_SETATTR = 155, 442
AT_FDCWD, AT_RECURSIVE, MNT_DETACH = -100, 0x8000, 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_PTRACER = 1, 4, 38, 0x59616D61
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# what no jailed process may do to another: trace it, read or write its memory, take its descriptors,
# compare its kernel objects, or make itself traceable (``prctl`` below, by its first argument)
DENIED_SYSCALLS = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp")
DENIED_PRCTL = (PR_SET_DUMPABLE, PR_SET_PTRACER)


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
    """The system calls isolation makes that ``os`` does not offer; each raises ``OSError``."""

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


def map_user(inner_uid: int, uid: int, gid: int) -> None:
    """In a new user namespace: ``uid`` and ``gid`` outside appear as ``inner_uid``; no setgroups."""
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", "%d %d 1" % (inner_uid, uid)),
        ("gid_map", "%d %d 1" % (inner_uid, gid)),
    ):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)


def set_rlimits(limits: list[tuple[str, int, int]]) -> None:
    """``[("RLIMIT_AS", soft, hard), ...]``, in that order."""
    for name, soft, hard in limits:
        resource.setrlimit(getattr(resource, name), (soft, hard))


def seccomp() -> None:
    """Load the filter of ``DENIED_SYSCALLS`` and ``DENIED_PRCTL`` (each fails with EPERM) on this
    process and all it starts; ``no_new_privs`` must hold. Raises if libseccomp cannot be loaded."""
    import pyseccomp

    flt = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            flt.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        except OSError:  # a call this kernel's architecture does not have: nothing to deny
            continue
    for option in DENIED_PRCTL:
        flt.add_rule(pyseccomp.ERRNO(errno.EPERM), "prctl", pyseccomp.Arg(0, pyseccomp.EQ, option))
    flt.load()
