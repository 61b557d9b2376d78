"""What holds a jailed job as a whole (daemon/confine.py), on this machine's own kernel: its
cgroups count and bound its whole process tree, its file system refuses a write past its size,
and its tree, however deep or full of links, is measured and emptied by the job's own uid."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from daemon.confine import JobCgroup, JobDisk, JobTree
from plexctl.common.limits import JobLimits

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups, loop mounts and uids are root's")

JOB_UID = 1_499_999  # no account's
AS_JOB = shutil.which("python3", path="/usr/bin:/bin")  # an interpreter a uid with no home can run


def cgroup_or_skip(limits: JobLimits) -> JobCgroup:
    group = JobCgroup.make(f"test{uuid.uuid4().hex[:6]}", "j0001", limits)
    if group is None:
        pytest.skip("this node lets the daemon make no cgroup")
    return group


def in_group(group: JobCgroup, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a process that joins ``group`` first, as the jail's first process does."""
    join = f"import os\nfor p in {group.procs_files!r}: open(p, 'w').write(str(os.getpid()))\n"
    return subprocess.run([sys.executable, "-c", join + code], capture_output=True, text=True, timeout=120)


def test_the_cgroup_sums_the_cpu_of_every_process_of_the_tree_the_ended_ones_too() -> None:
    limits = JobLimits(cpu_seconds=1, memory_bytes=0, tmp_bytes=0)
    group = cgroup_or_skip(limits)
    try:
        spin = "import os, time\n" + "for _ in range(3):\n    if os.fork() == 0:\n"
        spin += (
            "        t = time.process_time()\n        while time.process_time() - t < 0.5: pass\n        os._exit(0)\n"
        )
        spin += "for _ in range(3): os.wait()\n"
        assert in_group(group, spin).returncode == 0, "the tree ran"
        assert group.cpu_seconds() >= 1.4  # three children of 0.5 CPU-s each, all ended
        assert "over its CPU-time limit of 1" in group.breach(limits)
    finally:
        group.remove()
    assert not any(d.exists() for d in group.dirs.values())


def test_the_cgroup_holds_the_trees_processes_together() -> None:
    limits = JobLimits(memory_bytes=0, tmp_bytes=0, processes=8)
    group = cgroup_or_skip(limits)
    try:
        forks = "import os\nmade = 0\ntry:\n    for _ in range(20):\n        pid = os.fork()\n"
        forks += "        if pid == 0:\n            import time; time.sleep(2); os._exit(0)\n        made += 1\n"
        forks += "except OSError:\n    pass\nprint(made)\n"
        made = in_group(group, forks)
        assert int(made.stdout) < 8, made  # the tree, not each process, is held to 8
    finally:
        group.remove()


def test_the_cgroup_holds_the_trees_memory_together() -> None:
    limits = JobLimits(memory_bytes=256 << 20, tmp_bytes=0)
    group = cgroup_or_skip(limits)
    try:
        assert group.breach(limits) == ""
        # four children of 100 MiB each: each alone well within 256 MiB, together past it
        hog = "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        x = b'x' * (100 << 20)\n"
        hog += "        time.sleep(3)\n        os._exit(0)\nfor _ in range(4): os.wait()\n"
        in_group(group, hog)
        assert group.oom_kills() >= 1
        assert "together went past its memory limit of 256.0 MiB" in group.breach(limits)
    finally:
        group.remove()


@pytest.mark.skipif(AS_JOB is None, reason="no system python3")
def test_the_jobs_file_system_refuses_writes_past_its_size_and_goes_whole(tmp_path: Path) -> None:
    disk = JobDisk.make(tmp_path / "driver.img", tmp_path / "driver", 16 << 20, JOB_UID, JOB_UID)
    if disk is None:
        pytest.skip("no loop mounts here")
    try:
        assert (tmp_path / "driver").stat().st_uid == JOB_UID and disk.breach(16 << 20) == ""
        write = "import os\nn = 0\ntry:\n    with open('big', 'wb') as f:\n        while n < (64 << 20):\n"
        write += "            f.write(b'x' * (1 << 20)); f.flush(); n += 1 << 20\n"
        write += "except OSError as e:\n    print(e.errno, n)\n"
        done = subprocess.run(
            [AS_JOB, "-c", write], cwd=tmp_path / "driver", user=JOB_UID, group=JOB_UID,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        errno, written = map(int, done.stdout.split())
        assert errno == 28 and written <= 16 << 20, done
        assert "its output directory is full: at its limit of 16.0 MiB" == disk.breach(16 << 20)
        again = JobDisk.make(tmp_path / "driver.img", tmp_path / "driver", 16 << 20, JOB_UID, JOB_UID)
        assert again == disk  # a restart keeps what is there
    finally:
        disk.remove()
    assert not (tmp_path / "driver.img").exists() and not os.path.ismount(tmp_path / "driver")


@pytest.mark.skipif(AS_JOB is None, reason="no system python3")
def test_a_tree_too_deep_for_any_recursion_is_measured_and_emptied_by_the_jobs_uid(tmp_path: Path) -> None:
    out = tmp_path / "driver"
    out.mkdir(mode=0o700)
    os.chown(out, JOB_UID, JOB_UID)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("root's")
    build = "import os\nos.symlink(%r, 'link')\nfor _ in range(3000):\n    os.mkdir('d'); os.chdir('d')\n" % str(
        precious
    )
    build += "open('leaf', 'wb').write(b'x' * (1 << 20))\n"
    subprocess.run([AS_JOB, "-c", build], cwd=out, user=JOB_UID, group=JOB_UID, check=True, timeout=120)
    tree = JobTree(out, JOB_UID, JOB_UID)
    used = tree.used_bytes()
    assert used is not None and used >= 1 << 20
    assert "over its limit of 512.0 KiB" in tree.breach(512 << 10)
    tree.empty()
    assert list(out.iterdir()) == [] and (precious / "keep").read_text() == "root's"  # the link went, not its target


def test_a_restarted_daemon_adopts_the_groups_of_a_running_job_and_makes_none_for_another() -> None:
    limits = JobLimits(cpu_seconds=1, memory_bytes=0, tmp_bytes=0)
    group = cgroup_or_skip(limits)
    cluster = group.dirs[next(iter(group.dirs))].name.split("-")[1]
    try:
        sleeper = "import time\ntime.sleep(0.2)\n"
        assert in_group(group, sleeper).returncode == 0
        adopted = JobCgroup.make(cluster, "j0001", limits, adopt=True)
        assert adopted == group and adopted.cpu_seconds() == group.cpu_seconds()  # its count goes on
        assert JobCgroup.make(cluster, "j0002", limits, adopt=True) is None
    finally:
        group.remove()
