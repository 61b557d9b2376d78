"""A Tinker API address that does not move: ``plexctl tinker-proxy`` listens on a fixed host and
port (a login node's, say) and forwards each request, as it came, to the front end the cluster's
``tinker.json`` names now.

After a Slurm requeue the cluster's front end may listen on another node; the SDK's ``base_url``
cannot follow it, the proxy's address stays. Invariants: a request is forwarded at most once
(the SDK retries, and the front end makes its retries idempotent by their ids); while no front end
answers (the file is gone, or its URL refuses), a request gets 503 with ``x-should-retry: true``,
which the SDK retries for its own five minutes; a body over the front end's limit gets 413 here,
unread; the proxy keeps no state of its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from plexctl.common.cluster import TINKER_FILE
from plexctl.tinker.wire import MAX_BODY_BYTES

log = logging.getLogger("plexrl.tinker.proxy")

REQUEST_TIMEOUT_S = 600.0  # a retrieve long-polls for less; a sample of a long sequence may take minutes
CONNECT_TIMEOUT_S = 5.0
# not forwarded either way (RFC 9110 7.6.1), nor what the HTTP client recomputes
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers"}
    | {"transfer-encoding", "upgrade", "host", "content-length"}
)


class FrontEnd:
    """The URL in ``state_dir/tinker.json``, read again whenever the file changes."""

    def __init__(self, state_dir: Path) -> None:
        self.file = state_dir / TINKER_FILE
        self._seen: tuple[int, int] | None = None
        self._url: str | None = None

    def url(self) -> str | None:
        try:
            st = self.file.stat()
        except FileNotFoundError:
            return None
        if (st.st_mtime_ns, st.st_ino) != self._seen:
            try:
                self._url = str(json.loads(self.file.read_text())["url"]).rstrip("/")
            except (OSError, ValueError, KeyError, TypeError):
                return None
            self._seen = (st.st_mtime_ns, st.st_ino)
        return self._url


def create_app(state_dir: Path, max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """The proxy as an ASGI app (Starlette)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    front = FrontEnd(state_dir)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
    )

    def away(why: str) -> Response:
        return JSONResponse(
            {"error": f"the cluster's Tinker API is away: {why}; retry", "category": "server"},
            status_code=503,
            headers={"x-should-retry": "true", "retry-after": "2"},
        )

    async def read_body(request: Request) -> bytes | None:
        """The body, or None once it passes ``max_body_bytes`` (announced or sent)."""
        announced = request.headers.get("content-length")
        if announced is not None and announced.isdigit() and int(announced) > max_body_bytes:
            return None
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                return None
            parts.append(chunk)
        return b"".join(parts)

    async def forward(request: Request) -> Response:
        try:
            body = await read_body(request)
        except ClientDisconnect:
            return Response(status_code=400)
        if body is None:
            return JSONResponse(
                {"error": f"request body over {max_body_bytes} bytes", "category": "user"}, status_code=413
            )
        url = front.url()
        if url is None:
            return away(f"no front end is listed ({front.file} is missing): the cluster is down or starting")
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP]
        try:
            reply = await client.request(
                request.method, url + request.url.path, params=request.url.query, content=body, headers=headers
            )
        except httpx.TransportError as e:
            log.warning("%s %s: the front end at %s: %s", request.method, request.url.path, url, e)
            return away(f"the front end at {url} does not answer ({type(e).__name__})")
        # httpx has decoded the body: its encoding and length headers no longer hold
        dropped = HOP_BY_HOP | {"content-encoding"}
        out = {k: v for k, v in reply.headers.items() if k.lower() not in dropped}
        return Response(reply.content, status_code=reply.status_code, headers=out)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        yield
        await client.aclose()

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def serve(state_dir: Path, host: str, port: int) -> None:
    """Serve the proxy on ``host:port`` until SIGINT or SIGTERM, saying where once it listens."""
    from functools import partial

    from plexctl.tinker import listen

    def ready(url: str) -> None:
        print(f"Tinker API proxy: base_url={url} -> the front end in {state_dir / TINKER_FILE}", flush=True)

    listen.run(partial(create_app, state_dir), host, port, on_ready=ready)
