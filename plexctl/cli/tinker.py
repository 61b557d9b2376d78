"""`plexctl tinker-proxy`: a Tinker API address that stays put while the cluster's front end moves."""

from __future__ import annotations

from typing import Annotated

import typer

from plexctl.cli.context import Ctx
from plexctl.common.errors import UsageError


def tinker_proxy(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="the port the SDK's base_url names")] = 8000,
    host: Annotated[str, typer.Option(help="the address to listen on (0.0.0.0: every interface)")] = "127.0.0.1",
) -> None:
    """Serve the cluster's Tinker API at a fixed address, forwarding to wherever its front end
    listens now (after a Slurm requeue, maybe another node); runs until Ctrl-C."""
    c: Ctx = ctx.obj
    if not c.state_dir.is_dir():
        raise UsageError(f"no cluster state at {c.state_dir} (start one with `plexctl up --tinker-port`)")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: not a TCP port (0-65535)")
    from plexctl.tinker.proxy import serve

    try:
        serve(c.state_dir, host, port)
    except OSError as e:
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
