"""The service API a job's control loop calls: generate, train_step, publish, checkpoint.

A ``JobClient`` is what an RL algorithm holds. Each call names the job and goes to the
daemon, which schedules it on a shared engine; the reply comes back on the same socket.
Calls may be issued asynchronously (``call_async`` + ``wait``) to overlap generation with
training under ``max_staleness``. Importable without torch or vLLM: the caller's side is
pure Python.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import zmq

from plexctl import protocol as P


class JobCancelled(Exception):
    """The job was cancelled: stop at this call boundary."""


class CallFailed(Exception):
    """A service call failed on the engine side."""


class JobClient:
    def __init__(self, endpoint: str, job_id: str, parent_pid: int | None = None) -> None:
        self.job_id = job_id
        self.parent_pid = parent_pid
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, f"drv:{job_id}".encode())
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.connect(endpoint)
        self._replies: dict[int, tuple[bytes, Any]] = {}

    def close(self) -> None:
        self._sock.close()

    # -- transport

    def call_async(self, method: str, args: dict[str, Any] | None = None) -> int:
        frames, msg_id = P.encode(P.Op.CALL, P.CallReq(self.job_id, method, args or {}))
        self._sock.send_multipart(frames)
        return msg_id

    def wait(self, msg_id: int) -> Any:
        while msg_id not in self._replies:
            if not self._sock.poll(1000):
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    raise CallFailed("the daemon went away")
                continue
            try:
                op, header, body = P.decode(self._sock.recv_multipart())
            except P.ProtocolError:
                continue
            self._replies[header.in_reply_to] = (op, body)
        op, body = self._replies.pop(msg_id)
        if op == P.Op.ERROR:
            if body.code == "cancelled":
                raise JobCancelled(body.message)
            raise CallFailed(f"{body.code}: {body.message}")
        return body

    def call(self, method: str, args: dict[str, Any] | None = None) -> Any:
        return self.wait(self.call_async(method, args))

    def report(self, event: str, step: int, metrics: dict[str, float], message: str = "") -> None:
        frames, _ = P.encode(P.Op.REPORT, P.ReportBody(self.job_id, event, step, metrics, message))
        self._sock.send_multipart(frames)

    # -- the service calls

    def generate_async(self, prompts: list[str], sampling: P.Sampling) -> int:
        return self.call_async("generate", {"prompts": prompts, "sampling": sampling})

    def completions(self, reply: Any) -> list[P.Completion]:
        return msgspec.convert(reply["completions"], list[P.Completion])

    def generate(self, prompts: list[str], sampling: P.Sampling) -> list[P.Completion]:
        return self.completions(self.wait(self.generate_async(prompts, sampling)))

    def train_step(self, batch: P.TrainBatch, hp: P.TrainHParams) -> dict[str, float]:
        return self.call("train_step", {"batch": batch, "hp": hp})

    def publish(self) -> int:
        return int(self.call("publish")["version"])

    def checkpoint(self, step: int, extra: dict[str, Any]) -> str:
        return self.call("checkpoint", {"step": step, "extra": extra})["path"]

    def restore(self) -> dict[str, Any] | None:
        return self.call("restore")
