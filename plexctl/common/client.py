"""The client library: one request/reply to the daemon over a ZeroMQ DEALER socket.

Requests carry a msg_id; the reply names it in ``in_reply_to``. Idempotent requests are
retried on a fresh socket after a timeout (the "lazy pirate" pattern); submit is made
idempotent by its client-chosen ``submit_id``. Errors from the daemon arrive as
``{code, message}`` and are raised as ``RemoteError``.

The socket is a CURVE client (``plexctl.common.auth``): given keys, or this user's own pair and the
daemon's public key from the endpoint file that named its address. A daemon that refuses the
key drops the connection; a socket monitor sees that and raises ``KeyRefused`` at once
instead of waiting out the timeout.
"""

from __future__ import annotations

import getpass
import itertools
import os
import time
from typing import Any

import msgspec
import zmq

from plexctl.common import auth
from plexctl.common import protocol as P
from plexctl.common.cluster import plexrl_home
from plexctl.common.errors import DaemonUnreachable, KeyRefused, RemoteError
from plexctl.common.frames import recv_message, send_frames


def current_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return "unknown"


_monitor_ids = itertools.count()


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket receiving ``sock``'s ``events``, on an inproc address used once.

    pyzmq's default address is derived from the socket's file descriptor, which a socket made right after
    another was closed reuses while libzmq may still hold the old monitor's endpoint: "Address already in use".
    """
    return sock.get_monitor_socket(events, addr=f"inproc://plexrl-monitor-{os.getpid()}-{next(_monitor_ids)}")


class Client:
    def __init__(
        self, address: str, timeout: float = 10.0, retries: int = 2, keys: auth.CurveKeys | None = None
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self.keys = keys
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None

    def _curve_keys(self) -> auth.CurveKeys | None:
        if self.keys is None:
            self.keys = auth.client_keys(self.address, plexrl_home(), current_user())
        return self.keys

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            keys = self._curve_keys()
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                keys.apply(s)
                self._monitor = monitor_socket(s, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            s.connect(self.address)
            self._sock = s
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._sock.close(linger=0)
            self._sock = None

    def _check_refused(self) -> None:
        while self._monitor is not None and self._monitor.poll(0):
            import zmq.utils.monitor  # pulls in asyncio: only when the monitor has something to say

            event = zmq.utils.monitor.recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._reset()
                raise KeyRefused(
                    f"the daemon at {self.address} refused this client's key (ask the cluster's "
                    f"owner: plexctl share {current_user()} --key "
                    f"{auth.user_keys_dir(plexrl_home()) / (current_user() + '.key')})"
                )

    def close(self) -> None:
        self._reset()

    def request(self, op: bytes, body: Any, timeout: float | None = None, retries: int | None = None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        retries = self.retries if retries is None else retries
        for _attempt in range(retries + 1):
            sock = self._socket()
            frames, msg_id = P.encode(op, body)
            send_frames(sock, frames)
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(min(int(left * 1000) + 1, 100)):
                    self._check_refused()
                    continue
                try:
                    rop, header, rbody = P.decode(recv_message(sock))
                except P.ProtocolError:
                    continue
                if header.in_reply_to != msg_id:
                    continue  # a late reply to an earlier, retried request
                if rop == P.Op.ERROR:
                    raise RemoteError(rbody.code, rbody.message)
                return rbody
            self._reset()
        raise DaemonUnreachable(f"no reply from the daemon at {self.address} after {retries + 1} tries")

    # -- typed helpers

    def ping(self, timeout: float = 2.0, retries: int = 0) -> P.Pong:
        return msgspec.convert(self.request(P.Op.PING, P.Empty(), timeout, retries), P.Pong)

    def submit(
        self,
        spec: dict[str, Any],
        submit_id: str,
        user: str | None = None,
        replace: bool = False,
        inputs: list[P.InputFile] | None = None,
    ) -> P.SubmitRep:
        """Submit a spec as is; ``plexctl.inputs.submit`` uploads its files first where needed."""
        req = P.SubmitReq(
            submit_id=submit_id, spec=spec, user=user or current_user(), replace=replace, inputs=list(inputs or [])
        )
        return msgspec.convert(self.request(P.Op.SUBMIT, req), P.SubmitRep)

    def blob(self, req: P.BlobReq) -> P.BlobRep:
        return msgspec.convert(self.request(P.Op.BLOB, req, timeout=max(self.timeout, 60.0)), P.BlobRep)

    def status(self, job_id: str | None = None, timeline: bool = False) -> P.StatusRep:
        return msgspec.convert(self.request(P.Op.STATUS, P.StatusReq(job_id, timeline)), P.StatusRep)

    def cancel(self, job_id: str) -> P.JobInfo:
        return msgspec.convert(self.request(P.Op.CANCEL, P.JobRef(job_id)), P.JobInfo)

    def publish(self, job_id: str, version: int, public: bool = True, checkpoint: bool = False) -> P.PublishRep:
        """Make the job's policy ``version`` (``checkpoint``: its checkpoint of that step) readable
        by the cluster's other users (or not again)."""
        req = P.PublishReq(job_id, version, public, checkpoint)
        return msgspec.convert(self.request(P.Op.PUBLISH, req), P.PublishRep)

    def logs(self, job_id: str, kind: str = "log", offset: int = 0) -> P.LogsRep:
        return msgspec.convert(self.request(P.Op.LOGS, P.LogsReq(job_id, kind, offset)), P.LogsRep)

    def export(self, job_id: str, what: str = "adapter", path: str = "", offset: int = 0) -> P.ExportRep:
        """The listing of a job's latest adapter or checkpoint (``path`` empty), or a chunk of one
        of its files from ``offset``."""
        return msgspec.convert(self.request(P.Op.EXPORT, P.ExportReq(job_id, what, path, offset)), P.ExportRep)

    def down(self) -> None:
        self.request(P.Op.DOWN, P.Empty(), retries=0)
