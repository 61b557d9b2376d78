"""Serving an ASGI app on a host and port, for the Tinker front end and its proxy: bind (waiting
for a fixed port still held by a process that just died), run uvicorn until SIGINT or SIGTERM,
and write ``{"url", "pid", "host"}`` atomically once it listens."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plexctl.common.atomic import write_json_atomic

BIND_WAIT_S = 30.0  # how long to wait for a fixed port in use to be freed
GRACE_S = 3  # at shutdown, open requests (long polls) get this long to finish


def bind(host: str, port: int, wait_s: float = BIND_WAIT_S) -> socket.socket:
    """A listening socket on ``host:port`` (0: any free port); a port in use is tried again for
    ``wait_s`` (the front end of a daemon that just died may still hold it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.create_server((host, port), family=family)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def url_of(sock: socket.socket, host: str) -> str:
    """The URL others reach ``sock`` at: this machine's name where it listens on every interface."""
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else host
    port = sock.getsockname()[1]
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def run(
    make_app: Callable[[], Any],
    host: str,
    port: int | None,
    ready_file: Path | None = None,
    on_ready: Callable[[str], None] | None = None,
    also: dict[str, tuple[int, str]] | None = None,
) -> None:
    """Bind, then serve the app ``make_app`` makes until SIGINT or SIGTERM; once it listens,
    ``ready_file`` (if given) holds ``{"url", "pid", "host"}`` (left behind at exit: a reader
    checks the pid) and ``on_ready`` gets the URL. ``also``: more ports the app is served on, each
    written to ``ready_file`` under its name as its URL and a path (``{"openai_url": (0, "/v1")}``);
    ``port`` None: only those."""
    import uvicorn

    socks = {"url": (bind(host, port), "")} if port is not None else {}
    for name, (extra, path) in (also or {}).items():
        socks[name] = (bind(host, extra), path)
    urls = {name: url_of(sock, host) + path for name, (sock, path) in socks.items()}
    config = uvicorn.Config(make_app(), log_level="warning", access_log=False, timeout_graceful_shutdown=GRACE_S)
    server = uvicorn.Server(config)

    async def serve() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock for sock, _ in socks.values()]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            if ready_file is not None:
                info = {**urls, "pid": os.getpid(), "host": socket.gethostname()}
                write_json_atomic(ready_file, info, mode=0o644)  # read by every user of the cluster
            if on_ready is not None:
                on_ready(next(iter(urls.values())))
        await serving

    try:
        asyncio.run(serve())
    finally:
        for sock, _ in socks.values():
            sock.close()
