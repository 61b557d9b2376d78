"""No one let in: CURVE keys on the daemon's socket, users' jobs kept apart, internal operations
kept to the cluster's own processes. A real plexd on loopback with no workers (as in
test_robustness), real key files, the real CLI for what a user runs; other users are simulated
by their own PLEXRL_HOME and user name (LOGNAME/USER), as on a shared machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from plexctl import inputs
from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.client import Client, current_user
from plexctl.common.cluster import read_endpoint
from plexctl.common.errors import ExitCode, RemoteError
from plexctl.common.spec import spec_to_wire
from plexctl.spec_files import load_spec
from tests.conftest import local_account
from tests.test_robustness import TINY, BareDaemon

REPO = Path(__file__).resolve().parents[1]
OWNER = current_user()


class Cluster:
    """A bare daemon owned by this user, and a home (PLEXRL_HOME) per simulated user."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root = root
        self.state = root / "state"
        self.exit = contextlib.ExitStack()  # removes the accounts made for shared users' jobs
        self.accounts: dict[str, tuple[int, int, Path]] = {}
        self.daemon = BareDaemon(self.state, model, env=self.env(OWNER))
        self.server = read_endpoint(self.state).server_key.encode()
        self.spec = spec_to_wire(load_spec(TINY, [f"model.path={model}"], None))

    def home(self, user: str) -> Path:
        return self.root / f"home-{user}"

    def env(self, user: str) -> dict[str, str]:
        return {
            **os.environ,
            "PLEXRL_HOME": str(self.home(user)),
            "LOGNAME": user,
            "USER": user,
            "PYTHONPATH": str(REPO),
        }

    def cli(self, user: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "plexctl.cli", "--state-dir", str(self.state), *args],
            cwd=REPO,
            env=self.env(user),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def keygen(self, user: str) -> Path:
        out = self.cli(user, "keygen")
        assert out.returncode == 0, out.stderr
        return self.home(user) / "keys" / f"{user}.key"

    def client(self, user: str) -> Client:
        return Client(
            self.daemon.address, timeout=3.0, retries=0, keys=auth.user_keys(self.home(user), user, self.server)
        )

    def submit(self, user: str, name: str) -> str:
        if user != OWNER:  # a shared user's job runs with their own uid: they need an account
            if os.geteuid() != 0:
                pytest.skip("shared users' jobs run under their own accounts, which only root can make")
            if user not in self.accounts:
                self.accounts[user] = self.exit.enter_context(local_account(user))
        return inputs.submit(self.client(user), {**self.spec, "name": name}, user="mallory").job_id


@pytest.fixture
def cluster(tiny_model: Path, tmp_path: Path):
    c = Cluster(tmp_path, tiny_model)
    with c.exit:
        yield c
        c.daemon.stop()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_key_files_are_private_and_a_readable_secret_stops_the_daemon(cluster: Cluster, tiny_model: Path) -> None:
    keys = cluster.state / "keys"
    assert _mode(keys) == 0o700
    for name in ("server", "internal"):
        assert _mode(keys / f"{name}.key_secret") == 0o600
    assert _mode(cluster.home(OWNER) / "keys" / f"{OWNER}.key_secret") == 0o600
    assert _mode(cluster.keygen("bob").with_suffix(".key_secret")) == 0o600

    cluster.daemon.stop()
    os.chmod(keys / "server.key_secret", 0o644)
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.main", "--state-dir", str(cluster.state)],  # its cluster.json names the model
        cwd=REPO,
        env=cluster.env(OWNER),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"plexd: refusing to use {keys / 'server.key_secret'}: it is readable by others (mode 644); "
        f"`chmod 600 {keys / 'server.key_secret'}`"
    ]
    os.chmod(keys / "server.key_secret", 0o600)
    cluster.daemon = BareDaemon(cluster.state, tiny_model, env=cluster.env(OWNER))  # and it starts again


def test_an_unknown_key_is_refused_at_the_connection_and_others_are_still_served(cluster: Cluster) -> None:
    cluster.keygen("bob")
    out = cluster.cli("bob", "status")
    assert out.returncode == ExitCode.KEY_REFUSED, out
    (line,) = out.stderr.strip().splitlines()
    assert f"the daemon at {cluster.daemon.address} refused this client's key" in line
    assert "plexctl share bob --key" in line

    ctx = zmq.Context.instance()
    strangers = []
    for keys in (auth.user_keys(cluster.home("bob"), "bob", cluster.server), None):  # unknown key; no CURVE
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.apply(s)
        s.connect(cluster.daemon.address)
        s.send_multipart(P.encode(P.Op.STATUS, P.StatusReq(None))[0])
        strangers.append(s)
    assert cluster.client(OWNER).ping().pid == cluster.daemon.proc.pid  # served meanwhile
    time.sleep(1.0)
    assert not any(s.poll(0) for s in strangers), "a stranger got a reply"
    for s in strangers:
        s.close()
    assert cluster.client(OWNER).status().jobs == []
    assert cluster.daemon.proc.poll() is None

    share = cluster.cli(OWNER, "share", "bob", "--key", str(cluster.home("bob") / "keys" / "bob.key"))
    assert share.returncode == 0, share.stderr
    assert cluster.cli("bob", "status").returncode == 0  # no restart needed
    assert _mode(cluster.state / "keys" / "clients" / "bob.key") == 0o644
    refused = cluster.cli("bob", "share", "carol", "--key", str(cluster.home("bob") / "keys" / "bob.key"))
    assert refused.returncode == ExitCode.USAGE and f"only the cluster's owner ({OWNER})" in refused.stderr


def test_users_see_and_cancel_only_their_own_jobs_and_the_owner_all(cluster: Cluster) -> None:
    for user in ("alice", "bob"):
        assert cluster.cli(OWNER, "share", user, "--key", str(cluster.keygen(user))).returncode == 0
    a = cluster.submit("alice", "alice-job")
    b = cluster.submit("bob", "bob-job")
    mine = cluster.submit(OWNER, "owner-job")

    def ls(user: str) -> dict[str, str]:
        out = cluster.cli(user, "ls", "--json")
        assert out.returncode == 0, out.stderr
        return {j["job_id"]: j["user"] for j in json.loads(out.stdout)}

    assert ls("alice") == {a: "alice"}  # the key's user, whatever the request said ("mallory")
    assert ls("bob") == {b: "bob"}
    assert ls(OWNER) == {a: "alice", b: "bob", mine: OWNER}
    for verb in (("status", a), ("logs", a), ("cancel", a), ("status", "alice-job"), ("cancel", "alice-job")):
        out = cluster.cli("bob", *verb)
        assert out.returncode == ExitCode.NOT_FOUND, (verb, out)
    assert cluster.client("alice").status(a).jobs[0].state == "queued"
    with pytest.raises(RemoteError) as err:
        cluster.client("alice").cancel(mine)
    assert err.value.code == "not_found"

    assert cluster.client("bob").cancel(b).state == "cancelled"
    out = cluster.cli(OWNER, "cancel", a)
    assert out.returncode == 0 and "cancelled" in out.stdout
    assert cluster.client("alice").status(a).jobs[0].state == "cancelled"


def test_internal_operations_and_down_are_refused_to_user_keys(cluster: Cluster) -> None:
    assert cluster.cli(OWNER, "share", "bob", "--key", str(cluster.keygen("bob"))).returncode == 0
    forged = [
        (P.Op.REGISTER, P.RegisterReq("w9", "node", 1, [], True)),
        (P.Op.HEARTBEAT, P.HeartbeatBody("w9")),
        (P.Op.LEAVE, P.HeartbeatBody("w9")),
        (P.Op.RESULT, P.ResultBody(task_id=1, ok=True, value=C.PublishResult())),
        (P.Op.CALL, P.CallReq("j0001", C.PublishReq())),
        (P.Op.REPORT, P.ReportBody("j0001", "step", 1, {}, "")),
    ]
    for user in (OWNER, "bob"):
        client = cluster.client(user)
        for op, body in forged:
            with pytest.raises(RemoteError) as err:
                client.request(op, body, retries=0)
            assert err.value.code == "forbidden", (user, op)
    out = cluster.cli("bob", "down")
    assert out.returncode == ExitCode.REFUSED and f"only the cluster's owner ({OWNER})" in out.stderr
    assert cluster.daemon.proc.poll() is None
    # the internal key may (a forged heartbeat of an unknown worker is ignored: no reply)
    internal = Client(cluster.daemon.address, timeout=0.5, retries=0, keys=cluster.daemon.keys)
    with pytest.raises(Exception, match="no reply"):
        internal.request(P.Op.HEARTBEAT, P.HeartbeatBody("w9"))
    assert internal.ping().pid == cluster.daemon.proc.pid


def test_shared_engines_name_only_the_jobs_a_user_may_see(cluster: Cluster, tiny_model: Path) -> None:
    """Alice's and Bob's jobs run on the same engines: Bob's status lists the engines, and on
    them only his own job; the owner sees both."""
    for user in ("alice", "bob"):
        assert cluster.cli(OWNER, "share", user, "--key", str(cluster.keygen(user))).returncode == 0
    worker = zmq.Context.instance().socket(zmq.DEALER)  # a worker that takes tasks and never answers
    worker.setsockopt(zmq.IDENTITY, b"wrk:shared")
    worker.setsockopt(zmq.LINGER, 0)
    cluster.daemon.keys.apply(worker)
    worker.connect(cluster.daemon.address)
    model = os.path.realpath(tiny_model)
    engines = [
        P.EngineDecl("shared/rollout", "rollout", model, 16),
        P.EngineDecl("shared/trainer", "trainer", model, 1, state_capacity_bytes=1 << 30),
    ]
    worker.send_multipart(P.encode(P.Op.REGISTER, P.RegisterReq("shared", "node", os.getpid(), engines, True))[0])
    try:
        a = cluster.submit("alice", "alice-job")
        b = cluster.submit("bob", "bob-job")
        deadline = time.monotonic() + 60
        while True:
            worker.send_multipart(P.encode(P.Op.HEARTBEAT, P.HeartbeatBody("shared"))[0])
            rep = cluster.client(OWNER).status()
            named = {j for e in rep.engines for j in (*e.running, *e.resident)}
            if {a, b} <= named:
                break
            assert time.monotonic() < deadline, f"both jobs never placed: {rep.engines}"
            time.sleep(0.5)
        for user, own in (("alice", a), ("bob", b)):
            rep = cluster.client(user).status()
            assert {e.engine_id for e in rep.engines} == {"shared/rollout", "shared/trainer"}
            assert {j for e in rep.engines for j in (*e.running, *e.resident)} == {own}
    finally:
        worker.close()
        cluster.daemon.proc.terminate()  # a drain would wait for steps that never end: the second stops at once
        time.sleep(0.5)


def test_a_socket_made_after_another_was_closed_gets_its_own_monitor() -> None:
    """Reconnecting clients make a socket (and its monitor) right after closing the last: while libzmq still
    holds the old monitor's endpoint, a name taken from the reused file descriptor was "Address already in
    use" (a `plexctl status` failed that way while the daemon restarted)."""
    from plexctl.common.client import monitor_socket

    ctx = zmq.Context.instance()
    monitors = []
    try:
        for _ in range(50):
            sock = ctx.socket(zmq.DEALER)
            monitors.append(monitor_socket(sock, zmq.EVENT_HANDSHAKE_FAILED_AUTH))
            sock.close(linger=0)
    finally:
        for m in monitors:
            m.close(linger=0)
    assert len(monitors) == 50


def test_another_users_tinker_key_is_let_in_by_the_owner_and_a_digest_belongs_to_one_user(cluster: Cluster) -> None:
    from plexctl.tinker import keys as tinker_keys

    out = cluster.cli("bob", "keygen")
    assert out.returncode == 0, out.stderr
    key = (cluster.home("bob") / "tinker-api-key").read_text().strip()
    assert _mode(cluster.home("bob") / "tinker-api-key") == 0o600 and key.startswith("tml-")
    digest = tinker_keys.digest(key)
    assert f"--tinker-key-sha256 {digest}" in out.stdout and key not in out.stdout  # the secret stays home
    assert tinker_keys.user_of(cluster.state, key) is None  # not in until the owner says so
    public = str(cluster.home("bob") / "keys" / "bob.key")

    # a malformed digest, or bob's for another user: one line, exit 2, nothing granted or registered
    carol = str(cluster.keygen("carol"))
    before = (cluster.state / "tinker-keys.json").read_bytes() if (cluster.state / "tinker-keys.json").exists() else b""
    bad = cluster.cli(OWNER, "share", "carol", "--key", carol, "--tinker-key-sha256", "xyz")
    assert bad.returncode == ExitCode.USAGE and "not 64 hex digits" in bad.stderr
    assert not (cluster.state / "keys" / "clients" / "carol.key").exists()

    share = cluster.cli(OWNER, "share", "bob", "--key", public, "--tinker-key-sha256", digest)
    assert share.returncode == 0, share.stderr
    assert tinker_keys.user_of(cluster.state, key) == "bob"
    assert before != (cluster.state / "tinker-keys.json").read_bytes()
    assert (
        _mode(cluster.state / "tinker-keys.json") == 0o600
        and key not in (cluster.state / "tinker-keys.json").read_text()
    )

    stolen = cluster.cli(OWNER, "share", "carol", "--key", carol, "--tinker-key-sha256", digest)
    assert stolen.returncode == ExitCode.USAGE and "already bob's key" in stolen.stderr
    assert tinker_keys.user_of(cluster.state, key) == "bob"
    assert not (cluster.state / "keys" / "clients" / "carol.key").exists()
