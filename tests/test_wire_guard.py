"""What a peer's bytes can do to the process that reads them: bounded decoding
(``plexctl.common.protocol``), the throttle of senders of bad messages (``daemon.throttle``) and
the guard around each message in the daemon's server (``Daemon.dispatch``, on a real socket and
journal, no workers). The same against a running daemon, fuzzed: ``test_daemon_fuzz.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.core import DaemonCore
from daemon.throttle import SenderThrottle
from plexctl import inputs
from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.spec import spec_to_wire
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]
HEADER = msgspec.msgpack.encode(P.Header(msg_id=7))


def nested(levels: int, leaf: bytes = b"\xc0") -> bytes:
    """msgpack of ``levels`` one-item arrays around ``leaf`` (msgspec cannot encode it: too deep)."""
    return b"\x91" * levels + leaf


def spliced(body: object, deep: bytes) -> bytes:
    """``body`` encoded, its string value ``"@deep"`` replaced by the msgpack ``deep``."""
    return msgspec.msgpack.encode(body).replace(msgspec.msgpack.encode("@deep"), deep)


def frames(op: bytes, body: bytes, header: bytes = HEADER) -> list[bytes]:
    return [P.MAGIC, op, header, body]


def rejected(message: list[bytes]) -> str:
    with pytest.raises(P.ProtocolError) as info:
        P.decode(message)
    text = str(info.value)
    assert "\n" not in text and len(text) < 400
    return text


# ---------------------------------------------------------------- bounded decoding


@pytest.mark.parametrize("levels", [P.MAX_OPEN_DEPTH, 1_000, 100_000])
def test_a_spec_nested_too_deep_is_a_protocol_error_not_a_recursion_error(levels: int) -> None:
    body = spliced(P.SubmitReq("s", {"algo": {"x": "@deep"}}, "mallory"), nested(levels))
    assert "deep" in rejected(frames(P.Op.SUBMIT, body))
    assert P.decode_header(frames(P.Op.SUBMIT, body)) == P.Header(msg_id=7)  # it can still be answered


def test_open_values_nested_too_deep_anywhere_are_refused() -> None:
    deep = nested(P.MAX_OPEN_DEPTH + 1)
    ctx = C.TrainerContext(None, 0)
    for op, body in [
        (P.Op.CALL, P.CallReq("j1", C.CheckpointReq(3, {"cursor": "@deep"}))),
        (P.Op.RESULT, P.ResultBody(1, True, None, info={"tiers": "@deep"})),
        (P.Op.RESULT, P.ResultBody(1, True, C.RestoreResult({"rng": "@deep"}))),
        (P.Op.INVENTORY, P.InventoryBody({"moves": "@deep"})),
        (P.Op.TASK_PASS, P.TaskPassBody("t", [P.TaskBody(1, "j", "t", C.CheckpointTask(ctx, "/o", {"a": "@deep"}))])),
    ]:
        assert "nested deeper than" in rejected(frames(op, spliced(body, deep))), op
    # a map key that is an array decodes as a tuple: nested keys count too
    key = b"\x81" + nested(P.MAX_OPEN_DEPTH + 1) + b"\xc0"
    assert "nested deeper than" in rejected(frames(P.Op.SUBMIT, spliced(P.SubmitReq("s", {"a": "@deep"}, "u"), key)))
    # a typed field does not nest: msgspec refuses the first array where a string goes
    assert "Expected `str`" in rejected(frames(P.Op.CANCEL, b"\x81\xa6job_id" + nested(100_000)))
    assert "deep" in rejected(frames(P.Op.REPLY, nested(100_000)))  # a reply is decoded untyped


def test_declared_lengths_past_the_bytes_sent_and_oversized_frames_are_refused() -> None:
    for huge in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"):
        rejected(frames(P.Op.SUBMIT, spliced(P.SubmitReq("s", {"a": "@deep"}, "u"), huge)))
        rejected(frames(P.Op.REPLY, huge))
        rejected(frames(P.Op.PING, b"", header=huge))
    assert "over its limit" in rejected(frames(P.Op.PING, b"\x80" + b"\0" * P.SMALL_BODY_BYTES))
    assert "over its limit" in rejected(frames(P.Op.PING, msgspec.msgpack.encode(P.Empty()), header=b"\0" * 2000))
    assert P.decode_header(frames(P.Op.PING, b"", header=HEADER + b"\0" * 2000)) is None
    many = msgspec.msgpack.encode(P.SubmitReq("s", {"a": [0] * (P.MAX_OPEN_ITEMS + 1)}, "u"))
    assert "items" in rejected(frames(P.Op.SUBMIT, many))
    # one frame too many or too few: refused, and still answered (its header says who asks)
    assert P.decode_header([*frames(P.Op.PING, b"\x80"), b"extra"]) == P.Header(msg_id=7)
    assert P.decode_header([P.MAGIC, P.Op.PING, HEADER]) == P.Header(msg_id=7)
    rejected([P.MAGIC, P.Op.PING, HEADER])
    assert P.decode_header([b"PLX2", P.Op.PING, HEADER, b"\x80"]) is None


def test_the_largest_legitimate_messages_decode(tiny_model: Path) -> None:
    chunk = P.BlobReq("0" * 64, 3 * inputs.CHUNK, inputs.CHUNK, b"\x91" * inputs.CHUNK)  # a full upload chunk
    assert P.decode(P.encode(P.Op.BLOB, chunk)[0])[2] == chunk
    spec = spec_to_wire(load_spec(REPO / "configs" / "tiny-arith.yaml", [f"model.path={tiny_model}"], None))
    submit = P.SubmitReq("s", spec, "u")
    assert P.decode(P.encode(P.Op.SUBMIT, submit)[0])[2] == submit
    extra = {"step": 3, "rng": [3, list(range(625)), None], "cursor": {"seed": 1, "epoch": 0}, "deep": [[[[[{}]]]]]}
    result = P.ResultBody(1, True, C.RestoreResult(extra), info={"tiers": {"host": {"jobs": ["j1"] * 1000}}})
    assert P.decode(P.encode(P.Op.RESULT, result)[0])[2] == result
    batch = P.TrainBatch([[1] * 4096] * 64, [[1] * 4096] * 64, [[0.5] * 4096] * 64, [1.0] * 64)  # no open values
    assert P.decode(P.encode(P.Op.CALL, P.CallReq("j1", C.TrainStepReq(batch)))[0])[2].request.batch == batch


def test_every_body_type_has_a_plan_for_its_open_values() -> None:
    """A new kind of field in a body type fails here, not on a peer's message."""
    planned = {op for op in P.BODY_TYPES if P._open_values_of(op) is not None}
    assert planned == {P.Op.SUBMIT, P.Op.CALL, P.Op.RESULT, P.Op.INVENTORY, P.Op.TASK, P.Op.TASK_PASS}


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    st.sampled_from(sorted(P.BODY_TYPES) + [P.Op.REPLY, b"", b"\xff"]), st.binary(max_size=40), st.binary(max_size=80)
)
def test_any_bytes_decode_or_raise_a_protocol_error(op: bytes, header: bytes, body: bytes) -> None:
    for message in (frames(op, body, header), frames(op, body), frames(op, HEADER[:-1] + body)):
        try:
            P.decode(message)
        except P.ProtocolError as exc:
            assert "\n" not in str(exc)
        P.decode_header(message)


# ---------------------------------------------------------------- the throttle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_sender_past_the_limit_within_the_window_is_unheard_for_the_penalty() -> None:
    clock = Clock()
    throttle = SenderThrottle(limit=3, window_s=10.0, penalty_s=30.0, clock=clock)
    assert not throttle.count_bad(b"a", "mallory")
    assert not throttle.count_bad(b"a", "mallory")
    assert throttle.wait_s(b"a", "mallory") == 0.0
    clock.now += 5
    assert throttle.count_bad(b"a", "mallory")  # the third within 10 s
    assert throttle.wait_s(b"a", "mallory") == 30.0
    assert throttle.wait_s(b"other-socket", "mallory") == 30.0  # the user, whatever connection
    assert throttle.wait_s(b"b", "bob") == 0.0
    clock.now += 29
    assert throttle.wait_s(b"a", "mallory") == pytest.approx(1.0)
    clock.now += 1
    assert throttle.wait_s(b"a", "mallory") == 0.0  # heard again, its count afresh
    assert not throttle.count_bad(b"a", "mallory") and not throttle.count_bad(b"a", "mallory")


def test_bad_messages_spread_wider_than_the_window_never_throttle() -> None:
    clock = Clock()
    throttle = SenderThrottle(limit=3, window_s=10.0, penalty_s=30.0, clock=clock)
    for _ in range(20):
        assert not throttle.count_bad(b"a", "mallory")
        clock.now += 5.1
    assert throttle.wait_s(b"a", "mallory") == 0.0


def test_each_user_and_each_identity_count_on_their_own_and_the_cluster_s_processes_never() -> None:
    clock = Clock()
    throttle = SenderThrottle(limit=3, window_s=10.0, penalty_s=30.0, clock=clock)
    assert [throttle.count_bad(f"s{i}".encode(), "mallory") for i in range(3)] == [False, False, True]
    assert throttle.wait_s(b"s9", "mallory") == 30.0 and throttle.wait_s(b"s9", "bob") == 0.0
    assert not any(throttle.count_bad(b"x0", "") for _ in range(2))  # no user: the identity alone
    assert throttle.count_bad(b"x0", "") and throttle.wait_s(b"x0", "") == 30.0
    assert not any(throttle.count_bad(b"w0", auth.INTERNAL_USER) for _ in range(100))
    assert throttle.wait_s(b"w0", auth.INTERNAL_USER) == 0.0


def test_the_table_keeps_only_recent_offenders() -> None:
    clock = Clock()
    throttle = SenderThrottle(limit=3, window_s=10.0, penalty_s=30.0, clock=clock)
    for i in range(1000):  # a new connection for each bad message
        throttle.count_bad(f"peer-{i}".encode(), "")
    assert throttle.tracked() == 1000
    clock.now += 41
    throttle.count_bad(b"late", "")
    assert throttle.tracked() == 1


# ---------------------------------------------------------------- the guard around each message


@pytest.fixture
def replies(daemon, monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, bytes, object, int]]:
    """What the daemon server sends, as (identity, opcode, body, in_reply_to), instead of sending it."""
    sent: list[tuple[bytes, bytes, object, int]] = []
    monkeypatch.setattr(
        daemon, "_send", lambda identity, op, body, in_reply_to=0: sent.append((identity, op, body, in_reply_to))
    )
    return sent


def errors(sent: list[tuple[bytes, bytes, object, int]]) -> list[tuple[str, int]]:
    return [(body.code, msg_id) for _, op, body, msg_id in sent if op == P.Op.ERROR]  # type: ignore[attr-defined]


def test_a_message_that_does_not_decode_costs_one_bad_request(daemon, replies) -> None:
    deep = spliced(P.SubmitReq("s", {"a": "@deep"}, "mallory"), nested(100_000))
    daemon.dispatch([b"peer", *frames(P.Op.SUBMIT, deep)], "mallory")
    daemon.dispatch([b"peer", P.MAGIC, P.Op.PING, HEADER], "mallory")  # a frame short
    daemon.dispatch([b"peer", b"junk"], "mallory")  # nobody to answer
    assert errors(replies) == [("bad_request", 7), ("bad_request", 7)]
    daemon.dispatch([b"peer", *P.encode(P.Op.PING, P.Empty())[0]], "mallory")
    assert replies[-1][1] == P.Op.REPLY  # and the daemon goes on


def test_a_failure_in_handling_costs_one_internal_error_logged_once_with_its_traceback(
    daemon, replies, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(core, identity, header, body):
        raise KeyError("a bug\nover two lines")

    monkeypatch.setitem(DaemonCore.HANDLERS, P.Op.STATUS, broken)
    with caplog.at_level(logging.ERROR, logger="plexd"):
        daemon.dispatch([b"peer", *frames(P.Op.STATUS, msgspec.msgpack.encode(P.StatusReq()))], "mallory")
    ((code, body_msg),) = [(b.code, b.message) for _, op, b, _ in replies if op == P.Op.ERROR]  # type: ignore[attr-defined]
    assert code == "internal" and "\n" not in body_msg and "Traceback" not in body_msg
    (record,) = [r for r in caplog.records if r.exc_info]
    assert record.exc_info and record.exc_info[0] is KeyError

    def failing_effects(effects):
        raise OSError("no space left")

    replies.clear()
    monkeypatch.setattr(daemon, "_carry_out", failing_effects)  # what the server does with the effects
    daemon.dispatch([b"peer", *frames(P.Op.PING, msgspec.msgpack.encode(P.Empty()))], "mallory")
    assert errors(replies) == [("internal", 7)]


def test_a_flood_of_bad_messages_throttles_its_sender_and_no_one_else(daemon, replies) -> None:
    limit = daemon.throttle.limit
    for i in range(limit):
        daemon.dispatch([f"s{i}".encode(), *frames(P.Op.SUBMIT, b"\xc1")], "mallory")
    assert errors(replies) == [("bad_request", 7)] * limit
    replies.clear()
    ping = P.encode(P.Op.PING, P.Empty())[0]
    daemon.dispatch([b"s-new", *ping], "mallory")  # her next message, even a good one, goes unheard
    daemon.dispatch([b"b0", *ping], "bob")
    for _ in range(limit * 2):  # the cluster's own processes are never throttled
        daemon.dispatch([b"w0", *frames(P.Op.SUBMIT, b"\xc1")], auth.INTERNAL_USER)
    daemon.dispatch([b"w0", *ping], auth.INTERNAL_USER)
    assert [(to, op, getattr(body, "code", "")) for to, op, body, _ in replies if to != b"w0"] == [
        (b"s-new", P.Op.ERROR, "throttled"),
        (b"b0", P.Op.REPLY, ""),
    ]
    assert replies[-1][:2] == (b"w0", P.Op.REPLY)
