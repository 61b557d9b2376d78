"""CURVE keys of a cluster and of its users, and who each public key belongs to.

A cluster's keys live in ``STATE_DIR/keys/`` (mode 0700): ``server.key`` / ``server.key_secret``
(the daemon's pair), ``internal.key`` / ``internal.key_secret`` (the pair its drivers, workers
and node tasks present), ``owner`` (the user who ran ``plexctl up``: may act on every job
and stop the cluster) and ``clients/USER.key`` (the public keys allowed in, each mapped to
the user its file names; ``plexctl share`` adds one) and ``jobs/JOB.key`` (the public key of
the driver of a job that runs isolated: it may act on that job alone, as ``@job:JOB``). A user's own pair lives in
``PLEXRL_HOME/keys/USER.key`` / ``.key_secret``. Key files are pyzmq certificates
(``zmq.auth.create_certificates`` / ``load_certificate``); secret files are 0600, and the
daemon refuses to start on a secret readable by group or others.

The daemon's public key travels in ``endpoint.json``; ``read_endpoint`` remembers it per
address, so a ``Client(address)`` built from an endpoint it read finds it (``client_keys``).

Deliberately not here: key rotation, revoking a share (delete its file in ``clients/``),
per-user quotas.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from plexctl.common.atomic import write_bytes_atomic
from plexctl.common.errors import PlexError, UsageError

KEYS_DIR = "keys"
SERVER = "server"
INTERNAL = "internal"
INTERNAL_USER = "@internal"  # the identity of drivers, workers and node tasks; no user name can take it
KEYS_ENV = "PLEXRL_CLUSTER_KEYS"  # the keys directory, in the environment of the daemon's children
JOB_USER_PREFIX = "@job:"  # the identity of an isolated job's driver: that job's calls and reports only
DRIVER_KEYS_ENV = "PLEXRL_DRIVER_KEYS"  # an isolated driver's own keys directory (driver pair + server key)
DRIVER = "driver"
USER_NAME = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,63}$")

_servers: dict[str, tuple[bytes, Path]] = {}  # daemon address -> (its public key, state dir), from endpoint.json


class AuthError(PlexError):
    """A key is missing, unreadable or exposed."""


@dataclass(frozen=True)
class CurveKeys:
    """What a connecting socket needs: its own pair and the daemon's public key (all z85)."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server


def keys_dir(state_dir: Path) -> Path:
    return state_dir / KEYS_DIR


def user_keys_dir(home: Path) -> Path:
    return home / KEYS_DIR


def check_user_name(user: str) -> str:
    if not USER_NAME.match(user):
        raise UsageError(f"user name {user!r}: use letters, digits, '.', '_' and '-'")
    return user


def make_key_pair(directory: Path, name: str) -> Path:
    """``directory/name.key`` and ``.key_secret`` (0600) unless they exist; the public file's path.

    Both files appear at once and the secret is never readable by others, even for a moment:
    they are written in a private temporary directory and renamed into place."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public = directory / f"{name}.key"
    if public.exists() and (directory / f"{name}.key_secret").exists():
        return public
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=directory))  # mkdtemp: mode 0700
    try:
        pub, sec = zmq.auth.create_certificates(tmp, name)
        os.chmod(sec, 0o600)
        os.chmod(pub, 0o644)
        os.replace(sec, directory / f"{name}.key_secret")
        os.replace(pub, public)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return public


def check_private(secret_file: Path) -> None:
    """Refuse a secret key file that group or others can read (or that is missing)."""
    try:
        mode = secret_file.stat().st_mode
    except FileNotFoundError:
        raise AuthError(f"no secret key at {secret_file}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(
            f"refusing to use {secret_file}: it is readable by others (mode {stat.S_IMODE(mode):o}); "
            f"`chmod 600 {secret_file}`"
        )


def load_pair(directory: Path, name: str) -> tuple[bytes, bytes]:
    secret_file = directory / f"{name}.key_secret"
    check_private(secret_file)
    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise AuthError(f"{secret_file} holds no secret key")
    return public, secret


def load_public(path: Path) -> bytes:
    """The public key in a certificate file (a ``.key`` or ``.key_secret`` file)."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a key file ({exc})") from None
    if not public or len(public) != 40:
        raise UsageError(f"{path}: no CURVE public key in it")
    return public


def ensure_cluster_keys(state_dir: Path, owner: str) -> None:
    """The server and internal pairs, the clients directory and the owner's name, where missing."""
    kd = keys_dir(state_dir)
    kd.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(kd, 0o700)
    make_key_pair(kd, SERVER)
    make_key_pair(kd, INTERNAL)
    (kd / "clients").mkdir(exist_ok=True, mode=0o700)
    if not (kd / "owner").exists():
        write_bytes_atomic(kd / "owner", f"{check_user_name(owner)}\n".encode(), mode=0o600)


def owner_of(state_dir: Path) -> str:
    return (keys_dir(state_dir) / "owner").read_text().strip()


def grant(state_dir: Path, user: str, public_key_file: Path) -> None:
    """Let ``user`` in with the public key in ``public_key_file`` (replacing their previous key)."""
    check_user_name(user)
    public = load_public(public_key_file)
    target = keys_dir(state_dir) / "clients" / f"{user}.key"
    try:
        if load_public(target) == public:
            return
    except UsageError:
        pass
    write_bytes_atomic(
        target,
        (f'# the key of {user}, granted by plexctl share\ncurve\n    public-key = "{public.decode()}"\n').encode(),
        mode=0o644,
    )


def allowed_clients(state_dir: Path) -> dict[bytes, str]:
    """Public key (z85) -> user, from ``clients/`` (and ``@job:JOB`` from ``jobs/``); files that
    do not parse are skipped."""
    allowed: dict[bytes, str] = {}
    for sub, prefix in (("jobs", JOB_USER_PREFIX), ("clients", "")):
        for path in sorted((keys_dir(state_dir) / sub).glob("*.key")):
            try:
                allowed[load_public(path)] = prefix + path.stem
            except UsageError:
                continue
    return allowed


def ensure_user_keys(home: Path, user: str) -> Path:
    """The user's own pair in ``home/keys/`` (made if missing); the public file's path."""
    kd = user_keys_dir(home)
    kd.mkdir(parents=True, exist_ok=True, mode=0o700)
    return make_key_pair(kd, check_user_name(user))


def user_keys(home: Path, user: str, server: bytes) -> CurveKeys:
    kd = user_keys_dir(home)
    if not (kd / f"{user}.key_secret").exists():
        raise AuthError(
            f"no key for {user} in {kd} (make one with `plexctl keygen`, then ask the cluster's "
            f"owner: plexctl share {user} --key {kd / (user + '.key')})"
        )
    public, secret = load_pair(kd, user)
    return CurveKeys(public, secret, server)


def internal_keys(kd: Path) -> CurveKeys:
    """The internal pair and the server's public key, from a cluster's keys directory."""
    public, secret = load_pair(kd, INTERNAL)
    return CurveKeys(public, secret, load_public(kd / f"{SERVER}.key"))


def internal_keys_from_env() -> CurveKeys | None:
    """For the daemon's children (drivers, workers): the keys the daemon named, an isolated
    driver's own pair first (it never sees the cluster's keys directory)."""
    own = os.environ.get(DRIVER_KEYS_ENV)
    if own:
        public, secret = load_pair(Path(own), DRIVER)
        return CurveKeys(public, secret, load_public(Path(own) / f"{SERVER}.key"))
    kd = os.environ.get(KEYS_ENV)
    return internal_keys(Path(kd)) if kd else None


def make_job_keys(state_dir: Path, job_id: str, directory: Path) -> None:
    """A fresh pair for the isolated driver of ``job_id`` in ``directory`` (with the server's
    public key beside it), let in as ``@job:JOB``; a previous pair of that job is replaced."""
    for name in (f"{DRIVER}.key", f"{DRIVER}.key_secret"):
        (directory / name).unlink(missing_ok=True)
    public = make_key_pair(directory, DRIVER)
    server = (keys_dir(state_dir) / f"{SERVER}.key").read_bytes()
    write_bytes_atomic(directory / f"{SERVER}.key", server, mode=0o644)
    write_bytes_atomic(keys_dir(state_dir) / "jobs" / f"{job_id}.key", public.read_bytes(), mode=0o600)


def job_of(user: str) -> str | None:
    """The job an isolated driver's identity stands for, None for any other identity."""
    return user[len(JOB_USER_PREFIX) :] if user.startswith(JOB_USER_PREFIX) else None


def remember_server(address: str, server_key: str, state_dir: Path) -> None:
    if server_key:
        _servers[address] = (server_key.encode(), state_dir)


def client_keys(address: str, home: Path, user: str) -> CurveKeys | None:
    """The keys a client of this user presents to the daemon at ``address``: None for a daemon whose
    endpoint file this process has not read (a plain socket), else the user's own pair. A process
    of the cluster's owner whose pair in ``home`` is not the one granted (a test or benchmark
    driving the cluster in-process) presents the internal key, which that account can read anyway."""
    known = _servers.get(address)
    if known is None:
        return None
    server, state_dir = known
    if not _granted(state_dir, home, user):
        kd = keys_dir(state_dir)
        try:
            ours = (kd / f"{INTERNAL}.key_secret").stat().st_uid == os.geteuid() and owner_of(state_dir) == user
        except OSError:
            ours = False
        if ours:
            return internal_keys(kd)
    return user_keys(home, user, server)


def _granted(state_dir: Path, home: Path, user: str) -> bool:
    """Whether ``user``'s own public key in ``home`` is the one the cluster lets in as ``user``."""
    try:
        return load_public(keys_dir(state_dir) / "clients" / f"{user}.key") == load_public(
            user_keys_dir(home) / f"{user}.key"
        )
    except (UsageError, OSError):
        return False


def set_up_cluster(state_dir: Path, home: Path, user: str, replace_key: bool = True) -> str:
    """What `plexctl up` (and a daemon started by hand) makes: the cluster's keys where missing
    and, when ``user`` owns the cluster, their own pair let in (the daemon, which may run with
    another PLEXRL_HOME on a Slurm node, leaves a granted key alone). Returns the owner."""
    ensure_cluster_keys(state_dir, user)
    owner = owner_of(state_dir)
    if owner == user and (replace_key or not (keys_dir(state_dir) / "clients" / f"{owner}.key").exists()):
        grant(state_dir, owner, ensure_user_keys(home, owner))
    return owner
