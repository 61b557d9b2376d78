"""Multipart ZeroMQ messages, one frame at a time with int flags.

pyzmq's ``send_multipart`` computes ``SNDMORE | flags`` per frame, an ``IntFlag`` operation
that builds a new enum member each time, and ``recv_multipart`` asks ``getsockopt(RCVMORE)``
after each frame, which looks the option up as a ``SocketOption`` enum. A message of the
protocol is five frames at the daemon (the peer's identity, then ``MAGIC``, op, header, body),
so those enum calls were a good part of what a small request cost the daemon (see
``bench/daemon_rtt.py``). These do the same with plain ints, and with ``Frame.more``, which the
receive sets from C.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags)``."""
    more = SNDMORE | flags
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, more if i < last else flags)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``sock.recv_multipart(flags, copy=False)``: the parts as frames (``.bytes`` for their
    data, ``.get("User-Id")`` for the sender a ZAP handler named). ``zmq.Again`` from the first
    part with NOBLOCK, as there."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:  # the rest of a message is there once its first part is
        frame = sock.recv(0, copy=False)
        frames.append(frame)
    return frames


def recv_message(sock: zmq.Socket, flags: int = 0) -> list[bytes]:
    """``sock.recv_multipart(flags)``: the parts' bytes."""
    return [frame.bytes for frame in recv_frames(sock, flags)]
