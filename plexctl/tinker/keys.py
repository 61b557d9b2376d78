"""Tinker API keys: each user's key (``tml-`` and 48 hex digits, the form the SDK accepts) in a
0600 file of their own, and the cluster's map from each key's sha256 to its user, which the
front end reads. The map holds no key; both files are written atomically."""

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


def ensure_key(state_dir: Path, user: str, user_home: Path | None = None) -> Path:
    """This user's key (made once), registered with the cluster at ``state_dir``; its file."""
    path = key_file(user_home)
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    if not key.startswith(PREFIX):
        key = PREFIX + secrets.token_hex(24)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, (key + "\n").encode(), 0o600)
    users = registered(state_dir)
    if users.get(digest(key)) != user:
        users[digest(key)] = user
        write_json_atomic(state_dir / TINKER_KEY_FILE, users, mode=0o600)
    return path


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
