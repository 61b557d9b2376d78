"""The daemon's side of CURVE: its server socket's keys and the ZAP handler that lets peers in.

A ``ThreadAuthenticator`` answers each handshake from the keys on disk (``plexctl.common.auth``): the
internal key becomes the identity ``@internal``, a key in ``keys/clients/USER.key`` becomes
``USER``, an isolated driver's key in ``keys/jobs/JOB.key`` becomes ``@job:JOB``, any other key
is refused at the connection, before the daemon sees a message. The user is attached to every
message of that connection as its ``User-Id`` property. Keys are re-read when either directory
changes, so ``plexctl share`` and a new job's driver need no restart.

Deliberately not here: what each user may do (the daemon's handlers decide, by user).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from plexctl.common import auth

log = logging.getLogger("plexd.auth")


class KeyBook:
    """Public key (z85) -> user: the internal key, then the granted clients (re-read on change)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.internal = auth.load_public(auth.keys_dir(state_dir) / f"{auth.INTERNAL}.key")
        self._lock = threading.Lock()
        self._stamp: tuple[tuple[int, int], ...] | None = None
        self._clients: dict[bytes, str] = {}
        self._refused: set[bytes] = set()  # logged once each (a refused client keeps reconnecting)

    def user(self, z85_key: bytes) -> str | None:
        if z85_key == self.internal:
            return auth.INTERNAL_USER
        kd = auth.keys_dir(self.state_dir)
        (kd / "jobs").mkdir(mode=0o700, exist_ok=True)
        with self._lock:
            stamp = tuple((st.st_mtime_ns, st.st_ino) for st in ((kd / "clients").stat(), (kd / "jobs").stat()))
            if stamp != self._stamp:
                self._clients, self._stamp = auth.allowed_clients(self.state_dir), stamp
            return self._clients.get(z85_key)

    def callback(self, domain: str, z85_key: bytes) -> bool:  # pyzmq's credentials provider
        user = self.user(z85_key)
        if user is None and z85_key not in self._refused:
            self._refused.add(z85_key)
            log.warning("refused a connection with an unknown key %s", z85_key.decode())
        return user is not None


class Authenticator(ThreadAuthenticator):
    def __init__(self, ctx: zmq.Context, book: KeyBook) -> None:
        super().__init__(ctx)
        self.book = book

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.book.user(z85.encode(client_public_key)) or ""


def secure(sock: zmq.Socket, state_dir: Path) -> Authenticator:
    """Make ``sock`` a CURVE server that lets in only known keys (call before it binds)."""
    kd = auth.keys_dir(state_dir)
    public, secret = auth.load_pair(kd, auth.SERVER)  # refuses a secret others can read
    authenticator = Authenticator(sock.context, KeyBook(state_dir))
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=authenticator.book)
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    return authenticator
