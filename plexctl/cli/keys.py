"""`plexctl keygen` and `plexctl share`: a user's key pair, and another user's key let into a cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from plexctl.cli.context import Ctx
from plexctl.common.errors import UsageError


def keygen() -> None:
    """Make your own key pair (if missing) and print the public file to give a cluster's owner."""
    from plexctl.common import auth
    from plexctl.common.client import current_user
    from plexctl.common.cluster import plexrl_home
    from plexctl.tinker import keys as tinker_keys

    user = current_user()
    public = auth.ensure_user_keys(plexrl_home(), user)
    tinker = tinker_keys.digest(tinker_keys.own_key())  # the Tinker API key's, for the owner to register
    print(public)  # not wrapped: scripts take the path from the first line
    print(f"tinker API key in {tinker_keys.key_file()} (sha256 {tinker})")
    print(f"ask the cluster's owner to run: plexctl share {user} --key {public} --tinker-key-sha256 {tinker}")


def share(
    ctx: typer.Context,
    user: Annotated[str, typer.Argument(help="the user to let in")],
    key: Annotated[Path, typer.Option("--key", help="their public key file (`plexctl keygen` makes it)")],
    tinker_key_sha256: Annotated[
        Optional[str], typer.Option(help="their Tinker API key's sha256 (`plexctl keygen` prints it)")
    ] = None,
    limit: Annotated[
        Optional[list[str]],
        typer.Option(
            "--limit",
            metavar="NAME=VALUE",
            help="what each of their jailed jobs may take, over the cluster's `up --job-limit`: memory, "
            "processes, job-dir, tmp, cpu (CPU seconds); and all their Tinker saves: tinker-disk, tinker-saves "
            "(e.g. memory=16G; 0: no limit)",
        ),
    ] = None,
) -> None:
    """Let another user's key into this cluster (owner only): they see and cancel their own jobs."""
    from plexctl.common import auth
    from plexctl.common.client import current_user
    from plexctl.common.cluster import closed_to_others
    from plexctl.common.limits import parse_limits, set_limits
    from plexctl.common.sizes import fmt_bytes

    limits = parse_limits(limit or [])

    c: Ctx = ctx.obj
    if not (auth.keys_dir(c.state_dir) / "owner").exists():
        raise UsageError(f"no cluster keys at {auth.keys_dir(c.state_dir)} (start the cluster with `plexctl up`)")
    owner = auth.owner_of(c.state_dir)
    if current_user() != owner:
        raise UsageError(f"only the cluster's owner ({owner}) may share it")
    if user == owner:
        raise UsageError(f"{user} owns this cluster: `plexctl up` lets their key in")
    if tinker_key_sha256 is not None:
        from plexctl.tinker import keys as tinker_keys

        try:  # checked before anything is granted
            tinker_key_sha256 = tinker_keys.check_digest(c.state_dir, user, tinker_key_sha256)
        except tinker_keys.KeyError_ as e:
            raise UsageError(str(e)) from None
    auth.grant(c.state_dir, user, key)
    if tinker_key_sha256 is not None:
        tinker_keys.register(c.state_dir, user, tinker_key_sha256)
    also = " (and its Tinker API key)" if tinker_key_sha256 is not None else ""
    state_dir = c.state_dir.absolute()
    print(f"{user} may now use the cluster at {state_dir}{also}")  # not wrapped: they copy the next line
    print(f"they reach it with: plexctl --state-dir {state_dir} status")
    if limits:
        now = set_limits(c.state_dir, limits, user)
        print(
            f"their jailed jobs' limits: memory {fmt_bytes(now.memory_bytes)}, processes {now.processes}, "
            f"job-dir {fmt_bytes(now.job_dir_bytes)}, tmp {fmt_bytes(now.tmp_bytes)}, cpu {now.cpu_seconds} s; "
            f"their Tinker saves: tinker-disk {fmt_bytes(now.tinker_disk_bytes)}, tinker-saves {now.tinker_saves} "
            "(0: no limit)"
        )
    closed = closed_to_others(state_dir)
    if closed is not None:
        print(f"note: others may not pass through {closed} (chmod o+x {closed}): {user} cannot reach it yet")
