"""A shared user's job against the daemon's hold on its tree and its limits, as a second Unix user.

The owner (root here, as on CI) runs a local cluster and shares it with ``trudy``, a real account of
this file's own (made and removed here);
her jobs run loops of their own that call no engine. Each test runs one attack
of a hostile review as eve would: her own shell reaching into her running job through ``/proc``,
a job that plants links where the daemon once wrote and watches a restart, a tree too deep to
walk, and a process tree that shares its limits out among children. Each must fail as an
attack, and the daemon, the owner's files and the job's neighbours go on as before.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Cluster, local_account
from test_hostile_user import CUSTOM_LOOP, _cmdline, eve_client, full_log, submit_loop, wait_ended

from plexctl.common import auth
from plexctl.common.client import Client
from plexctl.common.cluster import read_endpoint
from plexctl.common.errors import RemoteError
from plexctl.common.jobdir import JobDir

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="makes a second Unix user (needs root)"),
]

# A job that tries to make itself traceable, then waits, its directory marked, for eve's shell.
EVE = "trudy"  # the hostile user of this file (test_hostile_user has its own)

DUMPABLE_LOOP = r"""
import ctypes, json, os, time

def run(job):
    libc = ctypes.CDLL(None, use_errno=True)
    found = {}
    found["set dumpable"] = (libc.prctl(4, 1, 0, 0, 0), ctypes.get_errno())  # PR_SET_DUMPABLE
    found["ptrace traceme"] = (libc.ptrace(0, 0, 0, 0), ctypes.get_errno())  # PTRACE_TRACEME
    found["uid"] = os.getuid()
    open("/mnt/job/" + json.load(open(os.path.join(os.path.dirname(__file__), "marker.json")))["name"], "w").close()
    print("READY " + json.dumps(found), flush=True)
    time.sleep(120)  # eve's shell looks for it meanwhile; the test cancels it
"""

# A job that, on its first run, plants links to root's files under every name the daemon ever wrote
# in a job's directory, records what its directory holds and exits to be started again; on its
# second run it says whether anything there changed, and tries to write what it was given.
PLANTED_LOOP = r"""
import json, os, sys

def listing():
    out = {}
    for name in sorted(os.listdir("/mnt/job")):
        st = os.lstat("/mnt/job/" + name)
        link = os.readlink("/mnt/job/" + name) if os.path.islink("/mnt/job/" + name) else ""
        out[name] = [st.st_ino, st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, link]
    return out

def run(job):
    target = json.load(open(os.path.join(os.path.dirname(__file__), "target.json")))
    if not os.path.exists("/mnt/job/listing.json"):
        for name in ("spec.json", ".spec.json.tmp", "inputs", "driver-keys", "driver-in", "metrics.jsonl.tmp"):
            os.symlink(target["file"] if "." in name else target["dir"], "/mnt/job/" + name)
        json.dump(listing(), open("/mnt/job/listing.json", "w"))
        sys.exit(1)
    before = json.load(open("/mnt/job/listing.json"))
    now = listing()
    now.pop("listing.json")
    try:
        open("/mnt/in/spec.json", "a").write("x")
        given = "written"
    except OSError as e:
        given = type(e).__name__ + " " + str(e.errno)
    print("SECOND " + json.dumps({"same": now == before, "given": given, "spec": os.path.isfile("/mnt/in/spec.json")}),
          flush=True)
"""

# A job that makes its directory deeper than any recursive walk goes, then waits past a few checks.
DEEP_LOOP = r"""
import os, time

def run(job):
    os.chdir("/mnt/job")
    for _ in range(1500):
        os.mkdir("d")
        os.chdir("d")
    open("leaf", "w").write("x" * 4096)
    print("DEEP", flush=True)
    time.sleep(8)
"""

# A job that shares its work out among children: each alone within its limit, together past it.
SPREAD_LOOP = r"""
import os, time

WHAT = open(os.path.join(os.path.dirname(__file__), "what.txt")).read().strip()

def child(what):
    if what == "cpu":
        end = time.time() + 60
        while time.time() < end:
            pass
    elif what == "memory":
        held = b"x" * (300 << 20)  # written, so resident
        time.sleep(60)
    os._exit(0)

def run(job):
    if WHAT == "disk":
        fd = os.open("/mnt/job/big", os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.posix_fallocate(fd, 0, 900 << 20)
            print("DISK fallocate 900 MiB granted", flush=True)
        except OSError as e:
            print("DISK fallocate refused " + str(e.errno), flush=True)
        written = 0
        try:
            while written < 900 << 20:
                os.write(fd, b"x" * (1 << 20))
                written += 1 << 20
        except OSError as e:
            print("DISK write refused %d after %d" % (e.errno, written), flush=True)
        time.sleep(60)
    for _ in range(4):
        if os.fork() == 0:
            child(WHAT)
    print("SPREAD " + WHAT, flush=True)
    time.sleep(60)  # the daemon ends it first
"""


@pytest.fixture(scope="module")
def eve() -> Iterator[tuple[int, int, Path]]:
    with local_account(EVE) as account:
        yield account


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, eve):
    c = Cluster(tmp_path_factory.mktemp("tree-owner")).up(tiny_model, "--workers", "1")
    yield c
    c.run("down", timeout=120)


def submit(
    cluster: Cluster, eve, tiny_model: Path, loop: str, files: dict[str, str], *overrides: str, client=None
) -> str:
    """Trudy's job running ``loop``, submitted with her own key (or ``client``'s)."""
    client = client or eve_client(cluster, eve[2], EVE)
    return submit_loop(cluster, eve, tiny_model, loop, files, *overrides, client=client)


def wait_line(client: Client, job: str, prefix: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = client.status(job).jobs[0].state in ("succeeded", "failed", "cancelled")
        line = next((ln for ln in full_log(client, job).splitlines() if ln.startswith(prefix)), None)
        if line is not None:
            return line.removeprefix(prefix).strip()
        if ended:
            break
        time.sleep(0.5)
    raise AssertionError(f"job {job} never printed {prefix!r}: {full_log(client, job)[-3000:]}")


def limited(cluster: Cluster, eve, *limits: str) -> None:
    public = auth.ensure_user_keys(eve[2] / ".plexrl", EVE)
    cluster.run("share", EVE, "--key", str(public), *[a for x in limits for a in ("--limit", x)], check=True)


EVES_SHELL = r"""
import json, os, sys
marker, found = sys.argv[1], []
for pid in filter(str.isdigit, os.listdir("/proc")):
    for way in ("cwd", "root/mnt/job"):
        try:
            if marker in os.listdir("/proc/%s/%s" % (pid, way)):
                found.append("/proc/%s/%s" % (pid, way))
        except OSError:
            pass
print(json.dumps(found))
"""


def test_her_own_shell_cannot_reach_into_her_running_job(cluster, eve, tiny_model) -> None:
    """Break 1: a job made itself dumpable and eve's shell opened /proc/PID/cwd and /proc/PID/root,
    the job's writable directory, from outside the jail. Now the job runs under a uid of its own
    (not hers) and its seccomp filter refuses PR_SET_DUMPABLE and ptrace; root, the control, finds
    the job's directory through /proc where her shell finds nothing. The jail's supervisor shows
    no state directory or hidden path in `ps`."""
    marker = f"marker-{uuid.uuid4().hex}"
    job = submit(cluster, eve, tiny_model, DUMPABLE_LOOP, {"marker.json": json.dumps({"name": marker})})
    client = eve_client(cluster, eve[2], EVE)
    try:
        found = json.loads(wait_line(client, job, "READY "))
        assert found["set dumpable"] == [-1, 1] and found["ptrace traceme"] == [-1, 1], found  # EPERM both
        assert found["uid"] != eve[0]
        as_eve = subprocess.run(
            ["python3", "-c", EVES_SHELL, marker], user=EVE, group=eve[1], capture_output=True, text=True, check=True
        )
        assert json.loads(as_eve.stdout) == []
        as_root = subprocess.run(["python3", "-c", EVES_SHELL, marker], capture_output=True, text=True, check=True)
        assert json.loads(as_root.stdout), "the control: root sees the job's directory through /proc"
        boots = [p for p in Path("/proc").glob("[0-9]*") if "jail_boot" in _cmdline(p)]
        assert boots and not [p for p in boots if str(cluster.state_dir) in _cmdline(p)]
    finally:
        client.cancel(job)


def test_the_daemon_touches_nothing_in_a_jobs_tree_across_a_restart(cluster, eve, tiny_model) -> None:
    """Breaks 2 and 3: root rewrote spec.json (a chmod through a swapped temp file) and linked
    staged inputs in the job's own directory at each restart. Now what the daemon gives a job lies
    in a directory of root's, read-only in the jail; a restart changes nothing in the job's
    directory (every name the daemon once wrote there is a link to root's files, left alone), no
    root system call names a path inside it, and root's files keep their owner, mode and bytes."""
    roots = Path("/var/tmp") / f"plexrl-roots-{uuid.uuid4().hex[:8]}"
    roots.mkdir(mode=0o700)
    (roots / "precious").write_text("root's own")
    (roots / "precious").chmod(0o600)
    before = {p.name: (p.stat().st_uid, stat.S_IMODE(p.stat().st_mode), p.read_bytes()) for p in roots.iterdir()}
    target = {"target.json": json.dumps({"file": str(roots / "precious"), "dir": str(roots)})}
    daemon = int(json.loads((cluster.state_dir / "endpoint.json").read_text())["pid"])
    trace = roots.parent / f"{roots.name}.strace"
    strace = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", str(trace), "-p", str(daemon), "-e", "trace=%file"],
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.0)
        job = submit(cluster, eve, tiny_model, PLANTED_LOOP, target, "checkpoint.max_restarts=1")
        client = eve_client(cluster, eve[2], EVE)
        second = json.loads(wait_line(client, job, "SECOND "))
        wait_ended(client, job)
    finally:
        strace.terminate()
        strace.wait(30)
    assert second["same"] and second["spec"], second
    assert second["given"] in ("PermissionError 13", "OSError 30"), second  # root's file, on a read-only mount
    after = {p.name: (p.stat().st_uid, stat.S_IMODE(p.stat().st_mode), p.read_bytes()) for p in roots.iterdir()}
    assert after == before and stat.S_IMODE(roots.stat().st_mode) == 0o700
    inside = f"{cluster.state_dir / 'jobs' / job / JobDir.DRIVER_OUT}/"
    writes = ("chmod", "chown", "link", "rename", "symlink", "unlink", "mkdir", "rmdir", "truncate", "O_CREAT")
    touched = [ln for ln in trace.read_text().splitlines() if inside in ln and any(w in ln for w in writes)]
    assert touched == [], touched[:5]
    reads = [ln for ln in trace.read_text().splitlines() if inside in ln]
    assert all("O_NOFOLLOW" in ln for ln in reads if "open" in ln), [ln for ln in reads if "O_NOFOLLOW" not in ln]


def test_a_tree_too_deep_to_walk_ends_neither_the_daemon_nor_the_job(cluster, eve, tiny_model) -> None:
    """Break 5: 1,200 nested directories in a job's directory raised RecursionError in the
    daemon's walk, from its main loop. Now nothing walks it there; the job ends as its loop does
    (it returns without a training step: that, not a limit, is its one line)."""
    job = submit(cluster, eve, tiny_model, DEEP_LOOP, {})
    client = eve_client(cluster, eve[2], EVE)
    wait_ended(client, job)
    assert "DEEP" in full_log(client, job)
    assert "LoopRanNoStep" in client.status(job).jobs[0].error
    assert client.ping().version and cluster.run("status", check=True).returncode == 0


@pytest.mark.parametrize(
    ("what", "limits", "line"),
    [
        ("cpu", ["cpu=4"], "CPU-seconds, over its CPU-time limit of 4"),
        ("memory", ["memory=700M", "tmp=16M"], "went past its memory limit of 700.0 MiB"),
        ("disk", ["job-dir=32M"], "at its limit of 32.0 MiB"),
    ],
)
def test_limits_hold_for_the_jobs_whole_tree(cluster, eve, tiny_model, what: str, limits: list[str], line: str):
    """Break 6: four forked children burned 16 CPU-s under cpu=5 and held 1,090 MiB under
    memory=400M, and fallocate wrote 900 MiB under job-dir=32M. Now the job's cgroup holds its
    tree and its directory is a file system of its limit's size: each job is stopped with one line,
    the disk refused at write time, and its files are gone."""
    limited(cluster, eve, *limits)
    try:
        job = submit(cluster, eve, tiny_model, SPREAD_LOOP, {"what.txt": what})
        client = eve_client(cluster, eve[2], EVE)
        assert wait_ended(client, job, timeout=180) == "failed"
        info = client.status(job).jobs[0]
        assert line in info.error and "\n" not in info.error, info.error
        log = full_log(client, job)
        if what == "disk":
            # ENOSPC (EFBIG where the one file's size limit comes first), at write time, within the limit
            assert "DISK fallocate refused 27" in log or "DISK fallocate refused 28" in log, log[-2000:]
            written = int(log.split("DISK write refused 28 after ")[1].split()[0])
            assert written <= 32 << 20, log[-2000:]
        job_dir = cluster.state_dir / "jobs" / job
        assert not (job_dir / JobDir.DRIVER_IMAGE).exists() and not any((job_dir / JobDir.DRIVER_OUT).iterdir())
        assert client.ping().version
    finally:
        limited(cluster, eve, "cpu=0", "memory=8G", "tmp=1G", "job-dir=2G")


SLEEPY_LOOP = r"""
import time

def run(job):
    time.sleep(120)
"""


def test_a_users_jobs_at_once_and_submits_a_minute_are_held_to_their_limits(
    cluster, eve, tiny_model, tmp_path: Path
) -> None:
    """No per-user cap: one user could fill the cluster's queue and every driver slot. Now past
    `running` a user's next job waits (status says why) and past `submits` a minute a submit is
    refused with one line; the owner's jobs are not counted."""
    user = "mallory-" + uuid.uuid4().hex[:6]
    public = auth.ensure_user_keys(tmp_path / user, user)
    cluster.run("share", user, "--key", str(public), "--limit", "running=1", "--limit", "submits=3", check=True)
    endpoint = read_endpoint(cluster.state_dir)
    keys = auth.user_keys(tmp_path / user, user, endpoint.server_key.encode())
    client = Client(endpoint.address, timeout=10.0, retries=0, keys=keys)
    made = [submit(cluster, eve, tiny_model, SLEEPY_LOOP, {}, client=client) for _ in range(3)]
    with pytest.raises(RemoteError) as refused:
        submit(cluster, eve, tiny_model, SLEEPY_LOOP, {}, client=client)
    assert "submitted 3 jobs in the last minute, their limit (submits=3" in str(refused.value)
    assert refused.value.code == "refused" and "\n" not in str(refused.value)
    try:
        cluster.wait_for(made[0], lambda j: j["state"] == "running", timeout=120)
        for job in made[1:]:
            waiting = client.status(job).jobs[0]
            assert waiting.state == "queued" and "runs 1 jobs, their limit (running=1)" in waiting.reason, waiting
        owners = cluster.run("submit", str(CUSTOM_LOOP.parent.parent / "tiny-arith.yaml"), "--set", "algo.steps=1",
                             "-q", check=True).stdout.strip()  # fmt: skip
        assert cluster.job(owners)["state"] in ("queued", "running", "succeeded")  # not held by her count
        cluster.run("cancel", owners)
    finally:
        for job in made:
            client.cancel(job)


def test_a_name_only_another_user_holds_is_one_line_for_the_owner_in_every_verb(cluster, eve, tiny_model) -> None:
    """The owner naming a job only eve holds: each verb says whose jobs hold that name, in one
    line with exit code 4 (not found), and prints no traceback."""
    job = submit(cluster, eve, tiny_model, SLEEPY_LOOP, {})
    name = eve_client(cluster, eve[2], EVE).status(job).jobs[0].name
    try:
        for verb in (["status"], ["logs"], ["cancel"], ["wait", "--timeout", "5"], ["export", "--to", "/tmp"]):
            done = cluster.run(verb[0], name, *verb[1:])
            assert done.returncode == 4 and "Traceback" not in done.stdout + done.stderr, (verb, done)
            assert f"{EVE}/{name} ({job})" in done.stderr and len(done.stderr.strip().splitlines()) == 1, (verb, done)
    finally:
        cluster.run("cancel", job)
