"""Where a cluster lives on disk, and how a client finds its daemon.

A cluster is a state directory (``$PLEXRL_HOME/clusters/NAME``, ``PLEXRL_HOME`` defaulting
to ``~/.plexrl``) holding the daemon's journal, logs, job directories and ``endpoint.json``
(address, pid, start time), which the daemon writes atomically once its socket is bound and
removes on a clean exit. The state directory is its owner's alone: other users may pass through
it (mode 0711) to read ``endpoint.json``, which holds nothing secret, and nothing else
(``make_private``). Apart from that, this module only reads and names things; it starts nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

from plexctl.common.errors import DaemonUnreachable, NotFound

DEFAULT_CLUSTER = "default"
ORPHAN_GRACE_ENV = "PLEXRL_ORPHAN_GRACE_S"
ORPHAN_GRACE_S = 120.0  # how long drivers and local workers wait for a restarted daemon to adopt them


class Endpoint(msgspec.Struct):
    address: str
    pid: int
    started_at: float
    mode: str  # local | slurm
    host: str = ""
    server_key: str = ""  # the daemon's CURVE public key (z85); clients need it to connect


def make_private(state_dir: Path) -> None:
    """Make ``state_dir`` (created if missing) the owner's alone: the directory 0711 (others may
    open ``PUBLIC_FILES`` by name, never list it), every other entry in it 0700 / 0600."""
    state_dir.mkdir(parents=True, exist_ok=True)
    state_dir.chmod(0o711)
    for entry in state_dir.iterdir():
        if entry.name in PUBLIC_FILES or entry.is_symlink():
            continue
        entry.chmod(0o700 if entry.is_dir() else 0o600)


def plexrl_home() -> Path:
    return Path(os.environ.get("PLEXRL_HOME", Path.home() / ".plexrl")).expanduser()


def cluster_dir(name: str | None = None) -> Path:
    name = name or os.environ.get("PLEXRL_CLUSTER") or DEFAULT_CLUSTER
    return plexrl_home() / "clusters" / name


def endpoint_path(state_dir: Path) -> Path:
    return state_dir / "endpoint.json"


TINKER_FILE = "tinker.json"  # in the state directory: {"url", "pid"} while the Tinker front end listens
# what other users of a shared cluster read in its state directory: the daemon's address and public
# key, and where its API front end listens (URLs, its pid and host: nothing secret)
PUBLIC_FILES = ("endpoint.json", TINKER_FILE)
TINKER_KEY_FILE = "tinker-keys.json"  # in the state directory: sha256 of each Tinker API key -> its user


def read_endpoint(state_dir: Path) -> Endpoint:
    """The cluster's endpoint, read by name: the state directory need not be listable (another
    user's is 0711), only ``endpoint.json`` and the directories above it passable."""
    path = endpoint_path(state_dir)
    try:
        text = path.read_text()
    except PermissionError:
        raise DaemonUnreachable(unreadable_endpoint(path)) from None
    except (FileNotFoundError, NotADirectoryError):
        if not state_dir.exists():
            raise NotFound(f"no cluster at {state_dir} (start one with `plexctl up --local`)") from None
        if not state_dir.is_dir():
            raise NotFound(f"{state_dir} is not a cluster directory (it is a file)") from None
        raise DaemonUnreachable(f"cluster at {state_dir} is not running (start it with `plexctl up --local`)") from None
    except OSError as exc:
        raise DaemonUnreachable(f"cannot read {path}: {exc.strerror}") from None
    try:
        ep = msgspec.convert(json.loads(text), Endpoint)
    except (ValueError, msgspec.ValidationError) as exc:
        raise DaemonUnreachable(f"unreadable {path}: {exc}") from None
    from plexctl.common.auth import remember_server  # zmq.auth: only where a key is kept

    remember_server(ep.address, ep.server_key, state_dir)
    return ep


def unreadable_endpoint(path: Path) -> str:
    """Why this user cannot read a cluster's ``endpoint.json``, and what its owner can change: the
    first directory on the way that others may not pass through, else the file's own mode."""
    blocked = next((d for d in reversed(path.absolute().parents) if not os.access(d, os.X_OK)), None)
    if blocked is not None:
        fix = f"ask the cluster's owner to let others pass through {blocked}: chmod o+x {blocked}"
    else:
        fix = f"ask the cluster's owner to make it readable: chmod o+r {path}"
    return f"cannot read {path}: permission denied ({fix})"


def closed_to_others(state_dir: Path) -> Path | None:
    """The first directory on the way to ``state_dir`` (itself included) that other users may not
    pass through, as its owner sees the modes; None when they can reach ``endpoint.json``."""
    import stat

    for d in [*reversed(state_dir.absolute().parents), state_dir.absolute()]:
        if not d.stat().st_mode & stat.S_IXOTH:
            return d
    return None


def orphan_grace() -> float:
    try:
        return float(os.environ.get(ORPHAN_GRACE_ENV, ORPHAN_GRACE_S))
    except ValueError:
        return ORPHAN_GRACE_S


def endpoint_address(path: Path) -> str | None:
    """The address in an endpoint file, None while there is none (a daemon starting or gone)."""
    try:
        return str(json.loads(path.read_text())["address"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether the process runs (an exited child not yet reaped by its parent does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def tinker_url(state_dir: Path) -> str | None:
    """Where the cluster's Tinker API front end listens; None while it does not (``tinker_state``)."""
    return tinker_state(state_dir)[0]


def openai_url(state_dir: Path) -> str | None:
    """Where the cluster's OpenAI API is served (its ``base_url``, ending ``/v1``); None while it is not."""
    return front_end_state(state_dir, "openai")[0]


def tinker_state(state_dir: Path) -> tuple[str | None, str]:
    """The cluster's Tinker API (``front_end_state``)."""
    return front_end_state(state_dir, "tinker")


FRONT_END_URLS = {"tinker": "url", "openai": "openai_url"}  # an API -> its URL's key in ``tinker.json``


def front_end_state(state_dir: Path, api: str) -> tuple[str | None, str]:
    """The cluster's API front end as serving ``api`` ("tinker" or "openai"), from its
    ``tinker.json``: ``(url, "")`` while it listens; ``(None, why)`` while its daemon starts it,
    or starts it again (the file says so, or the process it names on this host is gone, not yet
    noticed); ``(None, "")`` where it does not serve ``api`` (the daemon removes the file when it
    stops)."""
    import socket
    import time

    try:
        info = json.loads((state_dir / TINKER_FILE).read_text())
    except (OSError, ValueError):
        return None, ""
    if not isinstance(info, dict) or api not in info.get("serves", [api]):
        return None, ""
    if info.get("starting"):
        took = max(0.0, time.time() - float(info.get("since", 0.0)))
        return (
            None,
            f"{'restarting' if info.get('again') else 'starting'} (its front end is starting, {took:.0f} s so far)",
        )
    if info.get("restarting"):
        wait = max(0.0, float(info.get("retry_at", 0.0)) - time.time())
        return None, f"restarting (its front end exited with code {info.get('exit_code')}; next start in {wait:.0f} s)"
    url, pid = info.get(FRONT_END_URLS[api]), info.get("pid")
    if not isinstance(url, str):  # a front end that does not serve it
        return None, ""
    if info.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
        return None, f"restarting (its front end, pid {pid}, is gone; the daemon starts it again)"
    return url, ""
