"""Tinker API keys: each user's key (``tml-`` and 48 hex digits, the form the SDK accepts) in a
0600 file of their own, and the cluster's map from each key's sha256 to its user, which the
front end reads. The map holds no key; both files are written atomically. The owner's key is
made and registered by ``plexctl up``; another user makes theirs with ``plexctl keygen``, which
prints its sha256, and the owner registers that with ``plexctl share``. A digest belongs to one
user: registering it for another is refused."""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path

from plexctl.common.atomic import write_bytes_atomic, write_json_atomic
from plexctl.common.cluster import TINKER_KEY_FILE, plexrl_home

PREFIX = "tml-"


def key_file(user_home: Path | None = None) -> Path:
    """Where this user's Tinker API key is kept (``$PLEXRL_HOME/tinker-api-key``)."""
    return (user_home or plexrl_home()) / "tinker-api-key"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def own_key(user_home: Path | None = None) -> str:
    """This user's key, made once (its file 0600)."""
    path = key_file(user_home)
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    if not key.startswith(PREFIX):
        key = PREFIX + secrets.token_hex(24)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, (key + "\n").encode(), 0o600)
    return key


def ensure_key(state_dir: Path, user: str, user_home: Path | None = None) -> Path:
    """This user's key (made once), registered with the cluster at ``state_dir``; its file."""
    register(state_dir, user, digest(own_key(user_home)))
    return key_file(user_home)


class KeyError_(ValueError):
    """A digest that is not one, or that belongs to another user (one line)."""


def check_digest(state_dir: Path, user: str, key_digest: str) -> str:
    """``key_digest`` as ``register`` takes it, or ``KeyError_`` saying why not (nothing written)."""
    key_digest = key_digest.strip().lower()
    if len(key_digest) != 64 or any(c not in "0123456789abcdef" for c in key_digest):
        raise KeyError_(f"tinker key sha256 {key_digest!r}: not 64 hex digits (`plexctl keygen` prints it)")
    holder = registered(state_dir).get(key_digest)
    if holder is not None and holder != user:
        raise KeyError_(f"tinker key sha256 {key_digest[:12]}...: already {holder}'s key")
    return key_digest


def register(state_dir: Path, user: str, key_digest: str) -> None:
    """Let the key whose sha256 is ``key_digest`` in as ``user``."""
    key_digest = check_digest(state_dir, user, key_digest)
    users = registered(state_dir)
    if users.get(key_digest) != user:
        users[key_digest] = user
        write_json_atomic(state_dir / TINKER_KEY_FILE, users, mode=0o600)


def registered(state_dir: Path) -> dict[str, str]:
    """sha256 of each registered key -> its user."""
    try:
        users = json.loads((state_dir / TINKER_KEY_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return {str(k): str(v) for k, v in users.items()} if isinstance(users, dict) else {}


def user_of(state_dir: Path, key: str) -> str | None:
    """The user a key maps to; None for a key the cluster does not know."""
    if not key.startswith(PREFIX):
        return None
    return registered(state_dir).get(digest(key))
