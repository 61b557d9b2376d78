"""`plexctl keygen` and `plexctl share`: a user's key pair, and another user's key let into a cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from plexctl.cli.context import Ctx, console
from plexctl.common.errors import UsageError


def keygen() -> None:
    """Make your own key pair (if missing) and print the public file to give a cluster's owner."""
    from plexctl.common import auth
    from plexctl.common.client import current_user
    from plexctl.common.cluster import plexrl_home

    user = current_user()
    public = auth.ensure_user_keys(plexrl_home(), user)
    print(public)  # not wrapped: scripts take the path from the first line
    print(f"ask the cluster's owner to run: plexctl share {user} --key {public}")


def share(
    ctx: typer.Context,
    user: Annotated[str, typer.Argument(help="the user to let in")],
    key: Annotated[Path, typer.Option("--key", help="their public key file (`plexctl keygen` makes it)")],
) -> None:
    """Let another user's key into this cluster (owner only): they see and cancel their own jobs."""
    from plexctl.common import auth
    from plexctl.common.client import current_user

    c: Ctx = ctx.obj
    if not (auth.keys_dir(c.state_dir) / "owner").exists():
        raise UsageError(f"no cluster keys at {auth.keys_dir(c.state_dir)} (start the cluster with `plexctl up`)")
    owner = auth.owner_of(c.state_dir)
    if current_user() != owner:
        raise UsageError(f"only the cluster's owner ({owner}) may share it")
    if user == owner:
        raise UsageError(f"{user} owns this cluster: `plexctl up` lets their key in")
    auth.grant(c.state_dir, user, key)
    console().print(f"{user} may now use the cluster at {c.state_dir}", markup=False, highlight=False)
