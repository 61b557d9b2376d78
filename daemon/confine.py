"""What holds a jailed job as a whole: its process tree's cgroup and its output directory's file system.

It owns ``JobCgroup`` (one cgroup per job, in every hierarchy this node lets the daemon write:
cgroup v2 where the daemon's parent delegates ``memory`` and ``pids``, else the v1 ``memory``,
``pids`` and ``cpuacct`` ones under the daemon's own groups), ``JobDisk`` (the job's output
directory as its own loop-mounted ext4 file system of the job's ``job-dir`` size) and
``JobTree`` (measuring or emptying that directory where no such file system could be made), and
``Confinement``, the three for one running job.

Invariants:
- the jail's first process joins the job's cgroups before it forks (``JobCgroup.procs_files``),
  so every process of the job is in them; memory and processes are held by the kernel for the
  whole tree; CPU seconds are the tree's sum, which ``breach`` compares;
- a disk limit with a ``JobDisk`` holds at write time (ENOSPC), and the job's files go with
  ``remove`` (unmount, then the image file in the daemon's own directory is deleted);
- root never resolves a path inside the job's writable tree: ``JobTree`` runs ``du`` and ``find``
  as the job's own uid, started in that directory through a descriptor, bounded in time;
- nothing here raises to the daemon's loop: a node without cgroups or loop devices gets ``None``
  from ``make``, and the jail falls back to its per-process limits (``docs/security.md``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from daemon.jail import Account, open_job_file
from plexctl.common.atomic import write_bytes_atomic
from plexctl.common.jobdir import JobDir
from plexctl.common.limits import JobLimits
from plexctl.common.sizes import fmt_bytes

log = logging.getLogger("plexd.confine")

V1_CONTROLLERS = ("memory", "pids", "cpuacct")
V2_CONTROLLERS = ("memory", "pids")
WALK_TIMEOUT_S = 20.0  # a measure or an emptying of a job's tree that takes longer is stopped
FULL_SHARE = 1 / 32  # a job's file system with less free than this share of it (ext4 keeps some back) is full
KEPT_BYTES = 64 << 20  # what the daemon keeps of a file it serves from an ended job's directory


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per hierarchy: ``{"memory": "/a/b", ..., "": "/c"}`` ("" is v2)."""
    found: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            found[name.removeprefix("name=")] = path
    return found


def _mounts() -> dict[str, Path]:
    """Where each cgroup hierarchy is mounted: v1 by controller, v2 under ""."""
    found: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2":
            found.setdefault("", Path(fields[4]))
        elif fstype == "cgroup":
            for name in V1_CONTROLLERS:
                if name in options:
                    found.setdefault(name, Path(fields[4]))
    return found


@dataclass
class JobCgroup:
    """One job's cgroups (``dirs``, one per hierarchy); ``version`` 1 or 2."""

    version: int
    dirs: dict[str, Path]  # v1: by controller; v2: {"": the group}

    @classmethod
    def make(cls, cluster: str, job_id: str, limits: JobLimits, adopt: bool = False) -> JobCgroup | None:
        """The job's cgroups, made anew with ``limits`` (``adopt``: the ones an earlier daemon made
        for its running driver); None where this node lets the daemon make none (no write access,
        no controller). ``cluster`` keeps clusters on one node apart."""
        own, mounts = _own_cgroups(), _mounts()
        name = f"plexrl-{cluster}-{job_id}"
        group = cls._v2(own, mounts, name, adopt) or cls._v1(own, mounts, name, adopt)
        if group is None or adopt:
            return group
        try:
            group._set_limits(limits)
        except OSError as exc:
            log.warning("job %s: its cgroup takes no limits (%s); per-process limits only", job_id, exc)
            group.remove()
            return None
        return group

    @classmethod
    def _v2(cls, own: dict[str, str], mounts: dict[str, Path], name: str, adopt: bool) -> JobCgroup | None:
        if "" not in mounts or "" not in own:
            return None
        parent = mounts[""] / own[""].lstrip("/")
        parent = parent.parent if parent != mounts[""] else parent  # beside the daemon's own leaf
        try:
            enabled = (parent / "cgroup.subtree_control").read_text().split()
        except OSError:
            return None
        if not set(V2_CONTROLLERS) <= set(enabled):
            return None
        made = _group_dir(parent / name, adopt)
        return None if made is None else cls(2, {"": made})

    @classmethod
    def _v1(cls, own: dict[str, str], mounts: dict[str, Path], name: str, adopt: bool) -> JobCgroup | None:
        dirs: dict[str, Path] = {}
        for controller in V1_CONTROLLERS:
            if controller not in mounts or controller not in own:
                break
            made = _group_dir(mounts[controller] / own[controller].lstrip("/") / name, adopt)
            if made is None:
                break
            dirs[controller] = made
        else:
            return cls(1, dirs)
        for made in dirs.values() if not adopt else ():
            _remove_dir(made)
        return None

    def _set_limits(self, limits: JobLimits) -> None:
        memory = limits.memory_bytes + limits.tmp_bytes  # its /tmp is a tmpfs: its pages are the job's memory
        if self.version == 2:
            group = self.dirs[""]
            if limits.memory_bytes:
                _write(group / "memory.max", memory)
                _write(group / "memory.swap.max", 0, missing_ok=True)
            if limits.processes:
                _write(group / "pids.max", limits.processes)
            return
        if limits.memory_bytes:
            _write(self.dirs["memory"] / "memory.limit_in_bytes", memory)
        if limits.processes:
            _write(self.dirs["pids"] / "pids.max", limits.processes)

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the job's first process writes its pid to."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def cpu_seconds(self) -> float:
        """CPU seconds the job's processes used, all of them, the ended ones too."""
        if self.version == 2:
            for line in _read(self.dirs[""] / "cpu.stat").splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            return 0.0
        return int(_read(self.dirs["cpuacct"] / "cpuacct.usage") or 0) / 1e9

    def oom_kills(self) -> int:
        """Processes of the job the kernel ended for going past its memory limit."""
        path = self.dirs[""] / "memory.events" if self.version == 2 else self.dirs["memory"] / "memory.oom_control"
        for line in _read(path).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def breach(self, limits: JobLimits) -> str:
        """Why the job's tree is past its limits, in one line ("" if it is not)."""
        try:
            if limits.memory_bytes and self.oom_kills():
                return (
                    f"its processes together went past its memory limit of {fmt_bytes(limits.memory_bytes)} "
                    f"(the kernel ended one)"
                )
            used = self.cpu_seconds()
        except (OSError, ValueError):
            return ""
        if limits.cpu_seconds and used > limits.cpu_seconds:
            return f"its processes used {used:.0f} CPU-seconds, over its CPU-time limit of {limits.cpu_seconds}"
        return ""

    def remove(self) -> None:
        """Gone, once its processes are (they are killed first)."""
        for group in self.dirs.values():
            for pid in _read(group / "cgroup.procs").split():
                try:
                    os.kill(int(pid), 9)
                except (OSError, ValueError):
                    pass
            _remove_dir(group)


def _group_dir(path: Path, adopt: bool) -> Path | None:
    """``path`` made anew (a stale one of an earlier start removed), or as it is (``adopt``)."""
    if adopt:
        return path if path.is_dir() else None
    try:
        if path.is_dir():
            _remove_dir(path)
        path.mkdir()
    except OSError:
        return None
    return path


def _remove_dir(path: Path) -> None:
    try:
        path.rmdir()  # a cgroup goes with rmdir alone, once empty
    except OSError:
        pass


def _write(path: Path, value: int, missing_ok: bool = False) -> None:
    try:
        path.write_text(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@dataclass
class JobDisk:
    """The job's output directory ``mount`` as an ext4 file system in ``image`` (the daemon's file)."""

    image: Path
    mount: Path

    @classmethod
    def make(cls, image: Path, mount: Path, size: int, uid: int, gid: int) -> JobDisk | None:
        """``mount`` as a file system of ``size`` bytes whose root is ``uid``'s; kept from an earlier
        start if it is there (mounted or not). None where loop mounts cannot be made here."""
        disk = cls(image, mount)
        if os.path.ismount(mount):
            return disk
        if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
            return None
        fresh = not image.exists()
        try:
            if fresh:
                with open(image, "xb") as f:
                    f.truncate(size)
                subprocess.run(
                    ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", "-E", f"root_owner={uid}:{gid}", image],
                    check=True,
                    capture_output=True,
                    timeout=60,
                )
            mount.mkdir(mode=0o700, exist_ok=True)
            subprocess.run(
                ["mount", "-o", "loop,nosuid,nodev", image, mount], check=True, capture_output=True, timeout=60
            )
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("no file system of its own for %s (%s %s)", mount, exc, detail.decode(errors="replace")[:200])
            image.unlink(missing_ok=True) if fresh else None
            return None
        return disk  # its root is the job's (mkfs's root_owner); lost+found stays ext4's, root's

    def free_bytes(self) -> int:
        st = os.statvfs(self.mount)
        return st.f_bavail * st.f_frsize

    def breach(self, limit: int) -> str:
        try:
            full = self.free_bytes() < max(1 << 20, limit * FULL_SHARE)
        except OSError:
            return ""
        return f"its output directory is full: at its limit of {fmt_bytes(limit)}" if full else ""

    def unmount(self) -> None:
        """Off its mount point; the image is kept (the job goes on at its next start)."""
        if os.path.ismount(self.mount):
            subprocess.run(["umount", "-l", self.mount], capture_output=True, timeout=60)

    def remove(self) -> None:
        """The job's files gone: unmounted, the image deleted."""
        self.unmount()
        self.image.unlink(missing_ok=True)


@dataclass(frozen=True)
class JobTree:
    """The job's output directory where it is no file system of its own: measured and emptied by
    the job's own uid (``uid``, ``gid``), never walked by the daemon."""

    path: Path
    uid: int
    gid: int

    def _run(self, argv: list[str]) -> subprocess.CompletedProcess[bytes] | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        as_job = os.geteuid() == 0 and self.uid != 0
        try:
            return subprocess.run(
                argv,
                capture_output=True,
                timeout=WALK_TIMEOUT_S,
                cwd=f"/proc/self/fd/{fd}",  # entered before the uid changes, through the descriptor: no path walked
                pass_fds=(fd,),
                user=self.uid if as_job else None,
                group=self.gid if as_job else None,
                extra_groups=[] if as_job else None,
                env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
            )
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            os.close(fd)

    def used_bytes(self) -> int | None:
        """Bytes on disk under the directory, None if it could not be measured in time."""
        done = self._run(["du", "-s", "-x", "-B1", "."])
        if done is None or not done.stdout:
            return None
        try:
            return int(done.stdout.split()[0])
        except ValueError:
            return None

    def empty(self) -> None:
        """Everything under the directory removed (by the job's uid: only what it could remove)."""
        self._run(["find", ".", "-xdev", "-mindepth", "1", "-delete"])

    def breach(self, limit: int) -> str:
        used = self.used_bytes()
        if used is not None and used > limit:
            return f"its output directory holds {fmt_bytes(used)}, over its limit of {fmt_bytes(limit)}"
        return ""


@dataclass
class Confinement:
    """What holds one running jailed job as a whole (see the module docstring)."""

    limits: JobLimits
    cgroup: JobCgroup | None
    disk: JobDisk | None
    tree: JobTree

    @classmethod
    def make(
        cls, cluster: str, job_id: str, layout: JobDir, who: Account, limits: JobLimits, adopt: bool = False
    ) -> Confinement:
        """What holds the job's next driver (``adopt``: its running one, which an earlier daemon started)."""
        size = limits.job_dir_bytes
        disk = JobDisk.make(layout.driver_image, layout.driver_out, size, who.uid, who.gid) if size else None
        group = JobCgroup.make(cluster, job_id, limits, adopt)
        if group is None:
            log.warning("job %s: no cgroup of its own here: its limits hold per process", job_id)
        if size and disk is None:
            log.warning("job %s: no file system of its own here: its directory is measured", job_id)
        return cls(limits, group, disk, JobTree(layout.driver_out, who.uid, who.gid))

    def breach(self) -> str:
        """Why the job is past one of its limits, in one line ("" if it is not)."""
        why = self.cgroup.breach(self.limits) if self.cgroup is not None else ""
        size = self.limits.job_dir_bytes
        if why or not size:
            return why
        return self.disk.breach(size) if self.disk is not None else self.tree.breach(size)

    def release(self, remove_files: bool, ended: bool) -> None:
        """Its cgroups go (any process left in them killed); once the job ended, or went past a
        limit, its output directory's file system too; files on a shared disk go only past a limit."""
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.disk is not None:
            self.disk.remove() if remove_files or ended else self.disk.unmount()
        elif remove_files:
            self.tree.empty()


def keep_job_file(source: Path, kept: Path) -> None:
    """A copy of a regular file a jailed job wrote (``open_job_file``: no link, no FIFO), its
    first ``KEPT_BYTES``, written atomically where the daemon keeps it; nothing if there is none."""
    try:
        with open_job_file(source) as f:
            data = f.read(KEPT_BYTES)
    except OSError:
        return
    write_bytes_atomic(kept, data)
