"""Session fixtures: the tiny models (built once, cached in .plexrl) and one local cluster.

The cluster is real: ``plexctl up --local`` starts the daemon and two worker processes
(vLLM on CPU, torch + peft) on loopback ZeroMQ sockets, in a temporary PLEXRL_HOME. It is
started once per session, since engine start-up dominates.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_ROOT = REPO / ".plexrl"
PLEXCTL = [sys.executable, "-m", "plexctl.cli"]
_in_process = threading.Lock()  # one in-process CLI run at a time: each sets os.environ
# Verbs that only talk to the daemon or read the cluster's files: run in the test's process.
IN_PROCESS_VERBS = {"submit", "status", "logs", "wait", "cancel", "share", "ls"}


class Cluster:
    def __init__(self, home: Path, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.env = {**os.environ, "PLEXRL_HOME": str(home), "PYTHONPATH": str(REPO), **(env or {})}
        self.state_dir = home / "clusters" / "default"

    def run(self, *args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
        """``plexctl ARGS``: a verb of IN_PROCESS_VERBS runs the console script's own ``main`` in this
        process, without an interpreter's start-up (~0.2 s of CPU a run), any other as a subprocess."""
        proc = self._in_process(args) or subprocess.run(
            [*PLEXCTL, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"plexctl {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def _in_process(self, args: tuple[str, ...]) -> subprocess.CompletedProcess | None:
        """The run of ``plexctl.cli.main`` on ``args`` with this cluster's environment, its output
        and exit code as a subprocess's; None where the verb is not one to run here (it starts or
        stops processes, or follows), another run holds the process, or the cwd is not the repo's."""
        from plexctl.cli.app import verb_of

        if verb_of(list(args)) not in IN_PROCESS_VERBS or {"-f", "--follow"} & set(args) or Path.cwd() != REPO:
            return None
        if not _in_process.acquire(blocking=False):
            return None
        from plexctl.cli import main

        out, err = io.StringIO(), io.StringIO()
        saved_env, saved_argv = dict(os.environ), sys.argv
        try:
            os.environ.clear()
            os.environ.update(self.env)
            sys.argv = ["plexctl", *args]
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    main()
                    code = 0
                except SystemExit as exc:
                    if exc.code is not None and not isinstance(exc.code, int):
                        print(exc.code, file=sys.stderr)
                    code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
                except Exception:  # noqa: BLE001  # what the interpreter would print, and its exit code
                    traceback.print_exc()
                    code = 1
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
            sys.argv = saved_argv
            _in_process.release()
        return subprocess.CompletedProcess([*PLEXCTL, *args], code, out.getvalue(), err.getvalue())

    def up(self, model: Path, *args: str) -> "Cluster":
        """`plexctl up --local` on ``model``; on failure, the error carries the daemon and worker logs."""
        t0 = time.monotonic()
        up = self.run("up", "--local", "--model", str(model), *args, timeout=900)
        if up.returncode != 0:
            logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(self.state_dir.rglob("*.log")))
            raise AssertionError(f"plexctl up failed ({up.returncode}): {up.stderr}\n{logs}")
        self.cold_start_s = time.monotonic() - t0
        return self

    def status(self, job: str | None = None) -> dict:
        """`plexctl status [JOB] --json` (in this process: tests poll it every second, and an
        interpreter's start-up is ten times the verb's own work)."""
        return json.loads(self.run("status", *([job] if job else []), "--json", check=True).stdout)

    def job(self, job: str) -> dict:
        return self.status(job)["jobs"][0]

    def wait_for(self, job: str, pred, timeout: float = 600, what: str = "") -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job)
            if pred(info):
                return info
            time.sleep(1.0)
        raise AssertionError(f"timed out waiting for {job}: {what} (last: {info})")


def random_tiny_qwen2(path: Path, **overrides) -> str:
    """A randomly initialised tiny Qwen2 (hidden 128, 2 layers, 2 heads, float32) in HF format."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=128,
        torch_dtype="float32",
    )
    fields.update(overrides)
    torch.manual_seed(1234)
    Qwen2ForCausalLM(Qwen2Config(**fields)).save_pretrained(path)
    return str(path)


def build_tiny(recipe: str) -> Path:
    """The recipe's model dir, built first if it is not cached (under the recipe's build lock:
    a build already running elsewhere is waited for)."""
    subprocess.run(
        [sys.executable, "-m", "plexctl.tiny_models", "--root", str(TINY_ROOT), "--only", recipe], cwd=REPO, check=True
    )
    return TINY_ROOT / "models" / recipe


_beside: list[subprocess.Popen] = []  # the tiny-tool build running beside the tests


@pytest.fixture(scope="session")
def tiny_model(request: pytest.FixtureRequest) -> Path:
    """tiny-arith. When the session has tests on tiny-tool (the tool-learning ones, late in the
    run), that model's build (~85 s on one core) starts beside this one in its own process, and
    goes on while the first tests run; ``tool_model`` waits for it."""
    if any("tool_model" in item.fixturenames for item in request.session.items):
        TINY_ROOT.mkdir(parents=True, exist_ok=True)
        log = open(TINY_ROOT / "tiny-tool-build.log", "w")
        _beside.append(
            subprocess.Popen(
                [sys.executable, "-m", "plexctl.tiny_models", "--root", str(TINY_ROOT), "--only", "tiny-tool"],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        log.close()
    return build_tiny("tiny-arith")


@pytest.fixture(scope="session")
def tool_model(tiny_model: Path) -> Path:
    """tiny-tool: the build started beside the session, waited for (rebuilt here if it failed,
    so that its error shows)."""
    for build in _beside:
        build.wait()
    return build_tiny("tiny-tool")


@pytest.fixture(scope="session")
def llama_model(tiny_model: Path) -> Path:
    """tiny-llama: tiny-arith's task on a Llama-style base of another size (a second base)."""
    return build_tiny("tiny-llama")


# What each test file needs, as a pytest marker (``make test-fast`` runs ``-m unit``): journey (what
# README and docs tell a user to type, run as they type it: the CLI in a subprocess, a fresh HOME),
# slurm (a real Slurm cluster), bench (a benchmark's quick mode), learning (runs until the tiny task is
# learned), e2e (real engines, clusters or daemons in processes of their own); the rest: unit.
MARKS = {
    "unit": {"test_daemon_core.py"},
    "slurm": {"test_slurm.py"},
    "journey": {"test_journey_demo.py", "test_journey_readme.py", "test_journey_security.py", "test_journey_tinker.py"},
    "bench": {"test_bench_multiplex.py", "test_bench_quick.py", "test_bench_cli_startup.py"},
    "learning": {"test_algos_learning.py", "test_tool_learning.py", "test_multiplex.py", "test_e2e.py"},
    "e2e": {
        "test_auth.py",
        "test_daemon_fuzz.py",
        "test_dtype_and_rank.py",
        "test_faults.py",
        "test_hostile_user.py",
        "test_logs_follow.py",
        "test_robustness.py",
        "test_user_errors.py",
        "test_worker_stall.py",
        "test_tiny_and_rollout.py",
        "test_rollout_full.py",
        "test_multi_base_e2e.py",
        "test_tinker_e2e.py",
        "test_tinker_server.py",
        "test_train_passes_e2e.py",
        "test_wheel.py",
        "test_inproc.py",
    },
}


# The longest files first (``make test`` runs them on two processes, a file each at a time): the
# last file to start is a short one, so neither process idles at the end while the other runs a
# long one. The tool-learning file stays late: its model builds beside the first tests.
LONGEST_FIRST = (  # by their time in a clean-clone run
    "test_slurm.py",
    "test_wide_trainer.py",
    "test_bench_quick.py",
    "test_algos_learning.py",
    "test_e2e.py",
    "test_faults.py",
    "test_trainer_group.py",
    "test_worker_stall.py",
    "test_openai_api.py",
    "test_hostile_tree.py",
    "test_hostile_user.py",
    "test_tinker_e2e.py",
    "test_multi_base_e2e.py",
    "test_bench_multiplex.py",
    "test_journey_readme.py",
    "test_multiplex.py",
    "test_journey_tinker.py",
    "test_journey_demo.py",
    "test_tool_learning.py",
    "test_trainer_numerics.py",
    "test_journey_security.py",
    "test_train_passes_e2e.py",
    "test_trainer_levers.py",
    "test_tinker_restart.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        kinds = [kind for kind, files in MARKS.items() if name in files] or ["unit"]
        for kind in kinds:
            item.add_marker(getattr(pytest.mark, kind))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_sessionfinish(session: pytest.Session) -> None:
    for build in _beside:  # a session that ended before it needed the build
        if build.poll() is None:
            build.terminate()
            build.wait()


class DrivenCore:
    """A ``DaemonCore`` driven as its server drives it, at the times a test gives; the messages
    its effects send are recorded in ``sent`` as (identity, opcode, body), its other effects
    (drivers to start or stop, directories to prune) in ``effects``. Its state reads through."""

    def __init__(self, core) -> None:
        self.core = core
        self.sent: list[tuple[bytes, bytes, object]] = []
        self.effects: list[object] = []

    def __getattr__(self, name: str):
        return getattr(self.core, name)

    def take(self, effects: list) -> list:
        from daemon.core import Send

        for e in effects:
            if isinstance(e, Send):
                self.sent.append((e.identity, e.op, e.body))
            else:
                self.effects.append(e)
        return effects

    def send(
        self,
        identity: bytes,
        op: bytes,
        body: object,
        msg_id: int = 1,
        user: str = "",
        now: float | None = None,
        epoch: int = 0,
    ):
        """A message from ``identity`` (sent by ``user``; default: the cluster's own processes;
        ``epoch``: the sending process's, ``Header.sender_epoch``)."""
        from plexctl.common import auth
        from plexctl.common import protocol as P

        header = P.Header(msg_id=msg_id, sender_epoch=epoch)
        return self.take(self.core.handle(identity, user or auth.INTERNAL_USER, op, header, body, now or time.time()))

    def place(self, now: float | None = None):
        return self.take(self.core.place(now or time.time()))

    def chores(self, now: float | None = None):
        return self.take(self.core.chores(now or time.time()))

    def heartbeat(self, now: float):
        return self.take(self.core.heartbeat(now))

    def adopt(self, job_id: str, pid: int = 0, now: float | None = None, alive: bool = True):
        return self.take(self.core.adopt(job_id, pid, now or time.time(), alive))

    def driver_started(self, job_id: str, pid: int, now: float | None = None):
        return self.take(self.core.driver_started(job_id, pid, now or time.time()))

    def driver_not_started(self, job_id: str, why: str, now: float | None = None):
        return self.take(self.core.driver_not_started(job_id, why, now or time.time()))

    def driver_exited(self, job_id: str, rc: int, now: float | None = None):
        return self.take(self.core.driver_exited(job_id, rc, now or time.time()))

    def drain(self, reason: str, now: float | None = None, urgent: bool = True):
        return self.take(self.core.drain(reason, now or time.time(), urgent))


@pytest.fixture
def core(tiny_model: Path, tmp_path: Path):
    """The daemon's core on a real journal in a temporary state directory: no socket, no
    process; its owner is this user."""
    from daemon.core import DaemonCore
    from plexctl.common.client import current_user

    c = DaemonCore(tmp_path / "state", [str(tiny_model)], current_user(), trusted_users=SIMULATED_USERS)
    yield DrivenCore(c)
    c.close()


@pytest.fixture
def daemon(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A real daemon server on a real socket and journal, no workers."""
    from daemon.main import Daemon
    from plexctl.common import auth

    monkeypatch.setenv("PLEXRL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(auth.KEYS_ENV, raising=False)  # the daemon sets it: put back after the test
    d = Daemon(tmp_path / "state", [str(tiny_model)], [], trusted_users=SIMULATED_USERS)
    yield d
    if not d.sock.closed:
        d.authenticator.stop()
        d.sock.close()
        d.core.close()


@pytest.fixture(scope="session")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("plexrl-home")).up(tiny_model, "--device-slots", "2", "--max-loras", "2")
    yield c
    c.run("down", timeout=120)


SIMULATED_USERS = ["alice", "bob", "carol"]  # users of in-process daemons: trusted (their drivers run unjailed)


@contextlib.contextmanager
def local_account(name: str) -> Iterator[tuple[int, int, Path]]:
    """A real Unix account ``name`` (root only) and its home directory (0700, outside /tmp): a
    second user of a shared cluster, as the kernel sees them. An account made here is removed on
    leaving, its processes first; one that was there before is left as it was. Give each test
    file a name of its own: files run side by side."""
    import pwd

    try:
        entry, made = pwd.getpwnam(name), False
    except KeyError:
        subprocess.run(
            ["useradd", "--create-home", "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True
        )
        entry, made = pwd.getpwnam(name), True
    home = Path(entry.pw_dir)
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    home.chmod(0o700)
    try:
        yield entry.pw_uid, entry.pw_gid, home
    finally:
        if made:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
            for _ in range(50):  # userdel refuses while a process of the account lives
                if subprocess.run(["userdel", "--remove", name], capture_output=True).returncode in (0, 6):
                    break
                time.sleep(0.1)


def json_file(path: Path) -> dict | None:
    """A JSON file's content, or None while it is not there: read in one go, never after a
    separate ``exists()`` (its writer may replace or remove it in between)."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None


def bind_worker_outbox():
    """A PULL socket bound where a worker's engine threads push their results (``worker.io.OUTBOX``,
    on the process's shared context), as the worker's I/O thread binds it. An in-process worker
    of an earlier test in this process may still be letting it go: wait for it, up to 10 s."""
    import zmq

    from worker import io as worker_io

    outbox = zmq.Context.instance().socket(zmq.PULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            outbox.bind(worker_io.OUTBOX)
            return outbox
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                outbox.close(linger=0)
                raise
            time.sleep(0.1)
