"""A running daemon fed every opcode mangled every way a peer can mangle it: random bytes,
msgpack of the wrong shape, arrays nested 1,000 to 100,000 deep (whole, or in a spec, a
checkpoint's ``extra``, a result's ``info``, a typed field), lengths declared past the bytes
sent, truncated and flipped bodies, wrong magic, a frame too many or too few, unknown opcodes,
and SUBMITs whose spec trees are mutated; sent with the cluster's internal key (every handler
reachable, never throttled) and with a shared user's key (throttled once past the limit).

After the corpus the daemon still runs and answers PING and STATUS, and every message whose
header it could read got its reply (for the messages of workers and drivers, whose valid forms
get none, only when the body is not of its opcode's type). A real plexd with no workers
(``test_robustness.BareDaemon``); the corpus runs in well under a minute.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_robustness import TINY, BareDaemon

from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.client import Client
from plexctl.common.cluster import read_endpoint
from plexctl.common.spec import spec_to_wire
from plexctl.spec_files import load_spec

HOLE = "@hole"  # a string in each sample that a mutation replaces with other msgpack
OPS = sorted(v for k, v in vars(P.Op).items() if not k.startswith("_") and isinstance(v, bytes))
# the messages of workers and drivers: a valid one may get no reply
QUIET = {P.Op.REGISTER, P.Op.HEARTBEAT, P.Op.LEAVE, P.Op.WORKER_EXITED, P.Op.RESULT, P.Op.PARTIAL, P.Op.INVENTORY}
QUIET |= {P.Op.CALL, P.Op.REPORT}
REPLY_WAIT_S = 5.0
DEEP = (1_000, 10_000, 100_000)
HUGE = (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff")
HUGE += (b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff" + b"\xc0" * 8)


def samples(spec: dict[str, Any]) -> dict[bytes, Any]:
    """A body of each opcode, with ``HOLE`` where mutations go: in the values the schema leaves
    open where there are some, in a typed string elsewhere."""
    ctx = C.TrainerContext(None, 0)
    task = P.TaskBody(1, "j0001", "fuzz-w/trainer", C.CheckpointTask(ctx, "/nowhere", {"a": HOLE}))
    return {
        P.Op.SUBMIT: P.SubmitReq("fuzz", {**spec, "algo": {**spec["algo"], "x": HOLE}}, "fuzz"),
        P.Op.STATUS: P.StatusReq(HOLE, True),
        P.Op.CANCEL: P.JobRef(HOLE),
        P.Op.PUBLISH: P.PublishReq(HOLE, 1),
        P.Op.LOGS: P.LogsReq(HOLE),
        P.Op.EXPORT: P.ExportReq("j0001", HOLE),
        P.Op.BLOB: P.BlobReq(HOLE, 10, 0, b"abc"),
        P.Op.DOWN: {"why": HOLE},
        P.Op.PING: {"x": HOLE},
        P.Op.CALL: P.CallReq("j0001", C.CheckpointReq(1, {"cursor": HOLE})),
        P.Op.REPORT: P.ReportBody("j0001", "step", 1, {"r": 1.0}, HOLE),
        P.Op.REGISTER: P.RegisterReq("fuzz-w", HOLE, 1, [P.EngineDecl("fuzz-w/rollout", "rollout", "/nowhere")], True),
        P.Op.HEARTBEAT: P.HeartbeatBody(HOLE),
        P.Op.LEAVE: P.HeartbeatBody(HOLE),
        P.Op.WORKER_EXITED: P.WorkerExited(HOLE, 1, 1),
        P.Op.RESULT: P.ResultBody(10**9, True, C.RestoreResult({"a": 1}), info={"tiers": HOLE}),
        P.Op.PARTIAL: {"task_id": 10**9, "samples": [[0, [1, 2]]], "x": HOLE},
        P.Op.INVENTORY: P.InventoryBody({"moves": HOLE}),
        P.Op.TASK: task,
        P.Op.TASK_PASS: P.TaskPassBody("fuzz-w/trainer", [task]),
        P.Op.RELEASE: P.ReleaseBody(HOLE, "e"),
        P.Op.PREFETCH: P.PrefetchBody("j", "e", [HOLE]),
        P.Op.SHUTDOWN: {"x": HOLE},
        P.Op.REPLY: {"job_id": HOLE},
        P.Op.ERROR: P.ErrorBody("x", HOLE),
    }


def filled(sample: Any, part: bytes) -> bytes:
    return msgspec.msgpack.encode(sample).replace(msgspec.msgpack.encode(HOLE), part)


def mutations(sample: Any) -> list[bytes]:
    """The bodies each opcode is sent with, besides the random ones."""
    whole = msgspec.msgpack.encode(sample)
    out = [b"", b"\xc1", b"\x00" * 64, b"\x93\x01\xa1x\x80", msgspec.msgpack.encode({"spec": [1, {"a": None}]})]
    out += [b"\x91" * n + b"\xc0" for n in DEEP]
    out += [filled(sample, b"\x91" * n + b"\xc0") for n in DEEP]
    out += [filled(sample, b"\x81" + b"\x91" * 1_000 + b"\xc0\xc0")]  # a map key nested deep
    out += list(HUGE) + [filled(sample, huge) for huge in HUGE]
    out += [whole[:cut] for cut in (1, len(whole) // 2, len(whole) - 1)]
    rnd = random.Random(len(whole))
    for _ in range(3):
        flipped = bytearray(whole)
        flipped[rnd.randrange(len(whole))] ^= 1 << rnd.randrange(8)
        out.append(bytes(flipped))
    return out


class Peer:
    """A DEALER holding a key; ``fire`` sends one message and, when a reply is due, waits for it
    (failing at once without it, with the daemon's log when it died)."""

    def __init__(self, daemon: BareDaemon, keys: auth.CurveKeys, name: str) -> None:
        self.daemon = daemon
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        keys.apply(self.sock)
        self.sock.connect(daemon.address)
        self.codes: Counter[str] = Counter()  # the codes of the errors it got

    def fire(self, msg_id: int, frames: list[bytes], due: bool) -> None:
        self.sock.send_multipart(frames)
        deadline = time.monotonic() + (REPLY_WAIT_S if due else 0.0)
        while True:
            if not self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                died = self.daemon.proc.poll() is not None
                assert not due, f"no reply to {frames[1][:8]!r} ({sum(map(len, frames))} bytes)" + (
                    ": the daemon died\n" + self.daemon.log_path.read_text()[-3000:] if died else ""
                )
                return
            op, header, body = P.decode(self.sock.recv_multipart())
            if op == P.Op.ERROR:
                self.codes[body.code] += 1
            if header.in_reply_to == msg_id:
                return

    def close(self) -> None:
        self.sock.close()


def message(op: bytes, header: bytes, body: bytes, layout: str) -> list[bytes]:
    return {
        "ok": [P.MAGIC, op, header, body],
        "extra frame": [P.MAGIC, op, header, body, b"extra"],
        "no body": [P.MAGIC, op, header],
        "wrong magic": [b"PLX0", op, header, body],
    }[layout]


def reply_due(op: bytes, body: bytes, layout: str) -> bool | None:
    """Whether the daemon owes this message (its header valid) a reply; None: it may owe none."""
    if layout == "wrong magic":
        return None  # not a PlexRL message: nobody to answer
    if layout != "ok" or op not in P.BODY_TYPES or op not in QUIET:
        return True  # refused, or a client's request (answered even when refused), or not a request
    try:
        msgspec.msgpack.decode(body, type=P.BODY_TYPES[op])
    except (msgspec.MsgspecError, RecursionError):
        return True
    return None  # a worker's or driver's valid message: handled, perhaps answered


@pytest.fixture
def daemon(tiny_model: Path, tmp_path: Path):
    d = BareDaemon(tmp_path / "state", tiny_model)
    yield d
    d.stop()


def shared_user_keys(d: BareDaemon, home: Path, user: str) -> auth.CurveKeys:
    """``user``'s own key pair, granted by the owner (``plexctl share``); let in once the daemon reads it."""
    auth.grant(d.state_dir, user, auth.ensure_user_keys(home, user))
    keys = auth.user_keys(home, user, read_endpoint(d.state_dir).server_key.encode())
    deadline = time.monotonic() + 30
    while True:
        try:
            Client(d.address, keys=keys).ping(timeout=1.0, retries=0)
            return keys
        except Exception:  # noqa: BLE001 - not let in yet
            assert time.monotonic() < deadline, "the shared user's key was not let in"


def test_no_message_ends_the_daemon_and_each_readable_one_is_answered(
    daemon: BareDaemon, tiny_model: Path, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    spec = spec_to_wire(load_spec(TINY, [f"model.path={tiny_model}"], None))
    bodies = samples(spec)
    assert set(bodies) == set(OPS) == set(P.BODY_TYPES) | {P.Op.REPLY}  # every opcode is fuzzed
    inside = Peer(daemon, daemon.keys, "inside")
    mallory = Peer(daemon, shared_user_keys(daemon, tmp_path / "mallory", "mallory"), "mallory")
    ids = itertools.count(1)
    sent = Counter[str]()

    def fire(peer: Peer, op: bytes, body: bytes, layout: str = "ok", header: bytes | None = None) -> None:
        msg_id = next(ids)
        valid = msgspec.msgpack.encode(P.Header(msg_id=msg_id))
        frames = message(op, valid if header is None else header, body, layout)
        peer.fire(msg_id, frames, due=header is None and reply_due(op, body, layout) is True)
        sent[layout] += 1

    # the corpus: every opcode (and some that are none), every mutation, every layout
    for op in [*OPS, b"", b"\xff", b"ZZ"]:
        for body in mutations(bodies.get(op, {"x": HOLE})):
            fire(inside, op, body)
        for layout in ("extra frame", "no body", "wrong magic"):
            fire(inside, op, msgspec.msgpack.encode(bodies.get(op, {})), layout)
        for header in (b"", b"\xc1", b"\x91" * 100_000 + b"\xc0", HUGE[1], b"\0" * 5000):  # no header to answer
            fire(inside, op, b"\x80", header=header)

    # spec trees mutated at random, and random frames, from both keys
    trees = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**63 - 1)
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=20,
    )
    paths = [(section, key) for section, value in spec.items() if isinstance(value, dict) for key in value]
    paths += [(section, None) for section in spec]

    @settings(
        max_examples=60,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],  # no shrinking: each try of a failing case waits out its replies
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.lists(
            st.tuples(st.sampled_from(paths), trees, st.booleans(), st.sampled_from(OPS), st.binary(max_size=64)),
            min_size=8,
            max_size=8,
        )
    )
    def blast(shots: list[tuple[tuple[str, str | None], Any, bool, bytes, bytes]]) -> None:
        for (section, key), tree, as_mallory, op, junk in shots:
            peer = mallory if as_mallory else inside
            mutated = dict(spec)
            if key is None:
                mutated[section] = tree
            else:
                mutated[section] = {**spec[section], key: tree}
            fire(peer, P.Op.SUBMIT, msgspec.msgpack.encode(P.SubmitReq(f"fuzz-{next(ids)}", mutated, "fuzz")))
            fire(peer, op, junk)

    blast()
    elapsed = time.monotonic() - t0

    assert daemon.proc.poll() is None, "the daemon died:\n" + daemon.log_path.read_text()[-3000:]
    client = Client(daemon.address, keys=daemon.keys, timeout=5.0)
    client.ping()
    client.status()
    assert inside.codes["bad_request"] > 500 and "throttled" not in inside.codes  # the cluster's own: never
    assert mallory.codes["throttled"] > 0  # a shared user's flood of bad messages is cut short
    assert "throttling b'mallory' (mallory)" in daemon.log_path.read_text()
    assert sum(sent.values()) > 1500 and elapsed < 60, (sent, elapsed)
    inside.close()
    mallory.close()
