"""The daemon under bad input and load: fuzzed frames on its socket, hundreds of concurrent
submits with retries and duplicates. A real plexd on loopback with no workers (nothing here
needs an engine), so each test starts its own in a second or two.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.client import Client
from plexctl.common.cluster import read_endpoint
from plexctl.common.cluster_config import ClusterConfig, config_path, write_config
from plexctl.common.frames import NOBLOCK, recv_frames, send_frames
from plexctl.common.spec import spec_to_wire
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-arith.yaml"


class BareDaemon:
    """A daemon and its own PLEXRL_HOME; ``keys`` is the cluster's internal key (every operation)."""

    def __init__(
        self, state_dir: Path, model: Path, env: dict[str, str] | None = None, trusted_users: tuple[str, ...] = ()
    ) -> None:
        self.state_dir = state_dir
        self.log_path = state_dir / "daemon.log"
        state_dir.mkdir(parents=True, exist_ok=True)
        config = ClusterConfig(models=[str(model)], trusted_users=list(trusted_users))
        write_config(config_path(state_dir), config)  # what `up` writes
        env = env or {**os.environ, "PLEXRL_HOME": str(state_dir.parent / "home")}
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.main", "--state-dir", str(state_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
            )
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, "daemon did not start"
            try:
                self.address = read_endpoint(state_dir).address
                self.keys = auth.internal_keys(auth.keys_dir(state_dir))
                Client(self.address, keys=self.keys).ping(timeout=1.0, retries=0)
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def daemon(tiny_model: Path, tmp_path: Path):
    # the simulated users (user0..user3) have no Unix accounts: trusted, their jobs need none
    d = BareDaemon(tmp_path / "state", tiny_model, trusted_users=tuple(f"user{u}" for u in range(4)))
    yield d
    d.stop()


# ---------------------------------------------------------------- fuzzing

OPS = [v for k, v in vars(P.Op).items() if not k.startswith("_") and isinstance(v, bytes)]
HEADER = msgspec.msgpack.encode(P.Header(msg_id=1))
# Valid bodies of requests a stranger might forge; DOWN is left out (it stops the daemon by design).
FORGED = [
    (P.Op.RESULT, P.ResultBody(task_id=10**9, ok=True, value=C.PublishResult())),
    (P.Op.CALL, P.CallReq("j9999", C.TrainStepReq(P.TrainBatch([[1]], [[1]], [[0.0]], [1.0])))),
    (P.Op.CALL, P.CallReq("j0001", C.PublishReq())),
    (P.Op.REPORT, P.ReportBody("j9999", "step", 3, {"reward_mean": 1.0}, "")),
    (P.Op.HEARTBEAT, P.HeartbeatBody("nobody")),
    (P.Op.LEAVE, P.HeartbeatBody("nobody")),
    (P.Op.STATUS, P.StatusReq("j9999")),
    (P.Op.CANCEL, P.JobRef("j9999")),
    (P.Op.LOGS, P.LogsReq("j9999", "log", 0)),
    (P.Op.SUBMIT, P.SubmitReq("fuzz", {"name": 3}, "mallory")),
]

frame = st.binary(max_size=64)
messages = st.one_of(
    st.lists(frame, min_size=0, max_size=6),  # random frames
    st.tuples(st.sampled_from(OPS + [b"", b"\xff", b"ZZ"]), frame, frame).map(
        lambda t: [P.MAGIC, t[0], t[1], t[2]]
    ),  # right magic, any opcode, garbage header/body
    st.tuples(st.sampled_from(OPS), st.integers(0, 3)).map(  # valid header, body of the wrong type
        lambda t: [P.MAGIC, t[0], HEADER, msgspec.msgpack.encode([t[1], "x", {"a": None}])]
    ),
    st.tuples(st.sampled_from(FORGED), st.integers(1, 30)).map(  # truncated valid frames
        lambda t: [P.MAGIC, t[0][0], HEADER, msgspec.msgpack.encode(t[0][1])[: -t[1]] or b"\xc1"]
    ),
    st.sampled_from(FORGED).map(lambda f: [P.MAGIC, f[0], HEADER, msgspec.msgpack.encode(f[1])]),
)

MESSAGES = 10_000
BATCH = 50


def test_a_message_sent_frame_by_frame_arrives_whole_and_one_at_a_time() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://frames")
    b.connect("inproc://frames")
    try:
        with pytest.raises(zmq.Again):  # nothing queued: NOBLOCK says so at once
            recv_frames(b, NOBLOCK)
        message = [P.MAGIC, P.Op.PING, b"", bytes(range(256)) * 40]
        send_frames(a, message)
        send_frames(a, [b"one"])
        assert [f.bytes for f in recv_frames(b)] == message  # its frames in order, the empty one kept
        assert [f.bytes for f in recv_frames(b, NOBLOCK)] == [b"one"]  # and not the next message's
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_fuzzed_frames_never_stop_the_daemon_serving_correct_clients(daemon: BareDaemon) -> None:
    ctx = zmq.Context.instance()
    peers = []
    for i in range(8):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, f"fuzz-{i}".encode())
        s.setsockopt(zmq.LINGER, 0)
        daemon.keys.apply(s)  # a peer that got in: the internal key reaches every handler
        s.connect(daemon.address)
        peers.append(s)
    stop, served, failures = threading.Event(), [0], []

    def correct_client() -> None:  # pings and status calls throughout, each must be answered
        client = Client(daemon.address, timeout=5.0, retries=1, keys=daemon.keys)
        while not stop.is_set():
            try:
                client.ping(timeout=5.0, retries=1)
                assert client.status().jobs == []
                served[0] += 1
            except Exception as exc:  # noqa: BLE001 - recorded and asserted below
                failures.append(repr(exc))
            time.sleep(0.01)

    watcher = threading.Thread(target=correct_client, daemon=True)
    watcher.start()
    sent = [0]

    @settings(max_examples=MESSAGES // BATCH, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(messages, min_size=BATCH, max_size=BATCH), st.randoms(use_true_random=False))
    def blast(batch: list[list[bytes]], rnd: random.Random) -> None:
        for frames in batch:
            peer = rnd.choice(peers)
            if frames:
                peer.send_multipart(frames)
            else:
                peer.send(b"")
            sent[0] += 1
        while any(p.poll(0) for p in peers):  # drain error replies so no queue fills up
            for p in peers:
                while p.poll(0):
                    p.recv_multipart()

    blast()
    # an oversized frame (over the socket's 256 MiB limit) only drops that peer's connection
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    daemon.keys.apply(big)
    big.connect(daemon.address)
    big.send_multipart([P.MAGIC, P.Op.PING, HEADER, b"\0" * (257 * 2**20)])
    big.close()
    time.sleep(1.0)
    stop.set()
    watcher.join(30)

    assert sent[0] >= MESSAGES
    assert daemon.proc.poll() is None, "the daemon died"
    assert failures == [] and served[0] > 10
    Client(daemon.address, keys=daemon.keys).ping()
    rejections = Counter(re.findall(r"rejected message from (b'[^']*')", daemon.log_path.read_text()))
    assert rejections and max(rejections.values()) == 1  # logged once per peer, not per message
    assert set(rejections) <= {repr(f"fuzz-{i}".encode()) for i in range(8)}


# ---------------------------------------------------------------- load


def test_500_submits_from_20_clients_with_retries_and_duplicates_make_exactly_500_jobs(
    daemon: BareDaemon, tiny_model: Path
) -> None:
    spec = spec_to_wire(load_spec(TINY, [f"model.path={tiny_model}"], None))
    per_client, clients = 25, 20
    ids: dict[str, set[str]] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def submitter(n: int) -> None:
        rnd = random.Random(n)
        client = Client(daemon.address, timeout=10.0, retries=3, keys=daemon.keys)  # internal: may name the user
        ctx = zmq.Context.instance()
        for k in range(per_client):
            submit_id = uuid.UUID(int=rnd.getrandbits(128)).hex
            try:
                if rnd.random() < 0.3:  # a request whose reply is lost: the socket closes first
                    lost = ctx.socket(zmq.DEALER)
                    lost.setsockopt(zmq.LINGER, 1000)
                    daemon.keys.apply(lost)
                    lost.connect(daemon.address)
                    lost.send_multipart(
                        P.encode(P.Op.SUBMIT, P.SubmitReq(submit_id, {**spec, "name": f"c{n}-{k}"}, f"user{n % 4}"))[0]
                    )
                    lost.close()
                replies = {
                    client.submit({**spec, "name": f"c{n}-{k}"}, submit_id, f"user{n % 4}").job_id
                    for _ in range(rnd.randint(1, 3))
                }  # the same submit, retried
                with lock:
                    ids[submit_id] = replies
            except Exception as exc:  # noqa: BLE001 - recorded and asserted below
                errors.append(f"client {n}: {exc!r}")

    threads = [threading.Thread(target=submitter, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == []
    assert len(ids) == 500 and all(len(v) == 1 for v in ids.values())  # one job per submit, whatever retried
    jobs = Client(daemon.address, keys=daemon.keys).status().jobs
    assert len(jobs) == 500
    assert sorted(j.job_id for j in jobs) == sorted(next(iter(v)) for v in ids.values())
    assert Counter(j.user for j in jobs) == {f"user{u}": 125 for u in range(4)}
    assert json.loads(json.dumps([j.name for j in jobs])) and len({j.name for j in jobs}) == 500
    assert os.path.exists(daemon.state_dir / "journal.db")
