"""The sandbox contains hostile programs: each is that sample's failure, and the machine goes on.

Real subprocesses under the isolation this machine allows (``sandbox.isolation()``); nothing
is mocked. Every test ends by checking that the sandbox still runs a normal program.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from plexctl import sandbox
from plexctl.sandbox import Limits, SandboxPool, run_python

REPO = Path(__file__).resolve().parents[1]
FAST = Limits(cpu_seconds=2, wall_seconds=3.0)


def still_works() -> None:
    result = run_python("print(6 * 7)")
    assert result.ok and result.stdout == "42\n", result


def leftover_sandbox_processes() -> list[int]:
    """Live processes of the sandbox uid range (namespaces mode leases those uids)."""
    pids = []
    for entry in os.scandir("/proc"):
        uid = sandbox._status_uid(entry.name) if entry.name.isdigit() else None
        if uid is not None and sandbox.SANDBOX_UID_BASE <= uid < sandbox.SANDBOX_UID_BASE + sandbox.SANDBOX_UIDS:
            pids.append(int(entry.name))
    return pids


def test_isolation_is_reported() -> None:
    iso = sandbox.isolation()
    assert iso.mode in sandbox.MODES
    assert sandbox.network_isolation() == iso.network
    if os.geteuid() == 0 and "PLEXRL_SANDBOX_MODE" not in os.environ:
        assert iso.mode == "namespaces" and iso.network == "netns"


def test_a_normal_program_runs_in_an_empty_private_directory() -> None:
    result = run_python(
        "import os, sys\nprint(os.listdir('.'), sys.stdin.read())\nopen('f.txt', 'w').write('x')", stdin="hello"
    )
    assert result.ok, result
    assert result.stdout == "[] hello\n"
    assert (result.exit_code, result.timed_out, result.killed_by, result.limit_hit) == (0, False, None, None)


def test_environment_of_the_driver_is_not_passed() -> None:
    os.environ["PLEXRL_TEST_SECRET"] = "hunter2"
    try:
        result = run_python("import os; print(os.environ.get('PLEXRL_TEST_SECRET'))")
    finally:
        del os.environ["PLEXRL_TEST_SECRET"]
    assert result.stdout == "None\n"


def test_infinite_loop_is_stopped_by_the_cpu_limit() -> None:
    result = run_python("while True:\n    pass", limits=Limits(cpu_seconds=1, wall_seconds=10))
    assert not result.ok and result.limit_hit == "cpu" and result.killed_by in ("SIGXCPU", "SIGKILL")
    assert result.seconds < 5
    still_works()


def test_a_sleeping_program_is_killed_at_the_wall_clock_timeout_with_its_children() -> None:
    code = (
        "import os, time\n"
        "try:\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "except PermissionError:\n"
        "    pass  # the guard refuses fork\n"
        "time.sleep(60)"
    )
    t0 = time.monotonic()
    result = run_python(code, limits=Limits(wall_seconds=1.0))
    assert time.monotonic() - t0 < 4
    assert result.timed_out and result.limit_hit == "wall" and not result.ok
    if sandbox.isolation().mode == "namespaces":
        assert leftover_sandbox_processes() == []  # the child that left the session died too
    still_works()


def test_a_stopping_driver_kills_the_programs_it_still_runs() -> None:
    """A driver told to stop (SIGTERM: cancel, roll back) kills its sandboxed programs; they run
    in sessions of their own, and one that blocks without using CPU would outlive it."""
    with SandboxPool(max_workers=2) as pool:
        futures = [
            pool.submit("import threading\nthreading.Event().wait()", limits=Limits(wall_seconds=60)) for _ in range(2)
        ]
        deadline = time.monotonic() + 20
        while len(sandbox._LIVE) < 2:
            assert time.monotonic() < deadline, "the programs did not start"
            time.sleep(0.05)
        t0 = time.monotonic()
        sandbox.kill_live_runs()
        results = [f.result(timeout=10) for f in futures]
        assert time.monotonic() - t0 < 5 and not any(r.ok for r in results)
    assert sandbox._LIVE == {}  # reaped, and forgotten


def test_fork_bomb_is_contained() -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_python(code, limits=Limits(cpu_seconds=2, wall_seconds=2.0, processes=8))
    assert not result.ok
    assert result.limit_hit in ("wall", "cpu", "processes") or "refused" in result.stderr
    if sandbox.isolation().mode == "namespaces":
        assert leftover_sandbox_processes() == []
    still_works()


def test_ten_gib_allocation_fails_with_memory_error() -> None:
    result = run_python("data = bytearray(10 * 2**30)\nprint('allocated')", limits=FAST)
    assert not result.ok and "allocated" not in result.stdout
    assert result.limit_hit == "memory" and "MemoryError" in result.stderr
    still_works()


@pytest.mark.parametrize("where", ["tmp", "repo"])
def test_write_outside_the_working_directory_fails(where: str) -> None:
    target = (Path("/tmp") if where == "tmp" else REPO) / f"plexrl-escape-{uuid.uuid4().hex}"
    result = run_python(f"open({str(target)!r}, 'w').write('escaped')\nprint('wrote')", limits=FAST)
    try:
        assert not result.ok and "wrote" not in result.stdout
        assert "Read-only file system" in result.stderr or "refused" in result.stderr, result.stderr
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)
    still_works()


def test_file_size_limit() -> None:
    code = "open('big', 'wb').write(b'x' * (4 * 2**20))"
    result = run_python(code, limits=Limits(file_bytes=2**20, wall_seconds=5))
    assert not result.ok and result.limit_hit == "file_size"


def test_network_connection_to_a_listening_server_fails() -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        result = run_python(code, limits=FAST)
        # the server is really there: the driver itself can connect
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert not result.ok and "connected" not in result.stdout
    assert "Network is unreachable" in result.stderr or "refused" in result.stderr, result.stderr
    assert len(accepted) == 1  # only the driver's own connection
    still_works()


def test_stdout_is_bounded() -> None:
    result = run_python(
        "import sys\nsys.stdout.write('x' * 5_000_000)\nprint('done', file=sys.stderr)",
        limits=Limits(output_bytes=1000, wall_seconds=10),
    )
    assert result.ok and len(result.stdout) == 1000 and result.truncated
    assert result.limit_hit == "output" and result.stderr == "done\n"


def test_pool_runs_concurrently_and_survives_crashing_samples() -> None:
    programs = [
        "import time; time.sleep(0.5); print('slept')",
        "import ctypes; ctypes.string_at(0)",  # segfault (or refused by the guard)
        "\ud800",  # not encodable: the machinery itself fails for this sample
        "raise SystemExit(3)",
        "print(sum(range(10)))",
    ] + ["import time; time.sleep(0.5); print('slept')"] * 5
    with SandboxPool(max_workers=6) as pool:
        t0 = time.monotonic()
        results = pool.map(programs, limits=FAST)
        took = time.monotonic() - t0
        assert pool.submit("print('after')").result().stdout == "after\n"
    assert len(results) == len(programs)
    assert [r.stdout for r in results if r.stdout == "slept\n"] == ["slept\n"] * 6
    assert results[1].killed_by == "SIGSEGV" or "refused" in results[1].stderr
    assert not results[2].ok and results[2].limit_hit == "crash" and results[2].error
    assert results[3].exit_code == 3 and not results[3].ok
    assert results[4].stdout == "45\n"
    assert took < 2.5, f"6 half-second sleeps on 6 workers took {took:.2f}s"


ECHO_SERVER = """
import os, subprocess, sys, time
count = 0
while True:
    line = sys.stdin.readline()
    if not line:
        break
    count += 1
    cmd = line.strip()
    print("noise before the reply")  # not a reply line: dropped
    if cmd == "hang":
        try:
            subprocess.Popen(["sleep", "60"])  # a leftover child (the guard mode refuses it)
        except Exception:
            pass
        time.sleep(60)
    if cmd == "exit":
        print("giving up", file=sys.stderr)
        sys.exit(4)
    if cmd == "quiet":
        os.close(2)  # the program may close its stderr: it still answers
    if cmd == "long":
        sys.stdout.write("x" * 10_000)
        sys.stdout.flush()
        time.sleep(60)
    print("REPLY %d %d %s" % (os.getpid(), count, cmd), flush=True)
"""


def test_a_session_answers_many_requests_from_one_contained_process() -> None:
    with sandbox.SandboxSession(ECHO_SERVER, Limits(cpu_seconds=30), marker="REPLY ") as session:
        replies = [session.request(f"req{i}", timeout=10).split() for i in range(3)]
        pid = replies[0][0]
        assert [r[1:] for r in replies] == [["1", "req0"], ["2", "req1"], ["3", "req2"]]  # state kept
        assert {r[0] for r in replies} == {pid} and int(pid) != os.getpid()
        assert session.request("quiet", timeout=10).split() == [pid, "4", "quiet"]
        assert session.request("after", timeout=10).split() == [pid, "5", "after"]
        assert session.alive and session.requests == 5
    assert not session.alive and session.base is None  # closed: process gone, directory removed
    still_works()


def test_a_session_that_stops_answering_is_killed_with_what_it_left() -> None:
    session = sandbox.SandboxSession(ECHO_SERVER, Limits(cpu_seconds=30, processes=32), marker="REPLY ")
    assert session.request("first", timeout=10).endswith(" 1 first")
    t0 = time.monotonic()
    with pytest.raises(sandbox.SessionFailed, match="no reply within 1 s"):
        session.request("hang", timeout=1)
    assert time.monotonic() - t0 < 5
    assert not session.alive and session.proc is None
    assert not leftover_sandbox_processes()  # the child it started died with it
    with pytest.raises(sandbox.SessionFailed, match="closed"):
        session.request("again", timeout=1)
    still_works()


@pytest.mark.parametrize(
    "request_line, phrase",
    [("exit", "exited with status 4: giving up"), ("long", "a line of output longer than 1000 bytes")],
)
def test_a_session_that_exits_or_floods_fails_with_the_reason(request_line: str, phrase: str) -> None:
    session = sandbox.SandboxSession(ECHO_SERVER, Limits(cpu_seconds=30, output_bytes=1000), marker="REPLY ")
    try:
        with pytest.raises(sandbox.SessionFailed, match=phrase):
            session.request(request_line, timeout=10)
        assert session.proc is None
    finally:
        session.close()
    still_works()
