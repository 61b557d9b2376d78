"""Input files uploaded by clients, kept per user and content-addressed, and a job's copy of them.

What it owns: ``BlobStore`` under ``STATE_DIR/blobs/USER/`` (0700, the owner's alone on disk):
``put`` appends a chunk at the offset the store holds (a resent or out-of-order chunk changes
nothing), and a file counts as there only once its whole content matched its sha256; ``stage``
copies a job's files out of the store into the job's own directory. A user's blobs are found
only under that user's name: knowing a sha256 gives no one another user's content.

What it deliberately does not do: quotas per user beyond each job's limit, garbage collection
of blobs no job names any more (they stay until the state directory goes).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from plexctl.common import protocol as P
from plexctl.common.auth import USER_NAME
from plexctl.common.uploads import INPUT_FIELDS, MAX_FILES, MAX_JOB_BYTES

if TYPE_CHECKING:
    from _hashlib import HASH

SHA256 = re.compile(r"^[0-9a-f]{64}$")
FIELDS = frozenset(f"{section}.{key}" for section, key in INPUT_FIELDS)  # the spec paths a job may upload


class BlobError(ValueError):
    """An upload or a job's inputs the store refuses (one line, for the client)."""


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._hashing: dict[Path, tuple[HASH, int]] = {}  # a partial upload's running sha256 and bytes hashed

    def _dir(self, user: str) -> Path:
        if not USER_NAME.match(user):
            raise BlobError(f"user {user!r} cannot upload files")
        path = self.root / user
        path.mkdir(parents=True, mode=0o700, exist_ok=True)
        return path

    def _path(self, user: str, sha256: str) -> Path:
        if not SHA256.match(sha256):
            raise BlobError(f"not a sha256: {sha256[:80]!r}")
        return self._dir(user) / sha256

    def path(self, user: str, sha256: str) -> Path:
        """Where ``user``'s complete upload of this content lies (read by the daemon only)."""
        return self._path(user, sha256)

    def have(self, user: str, sha256: str, size: int) -> int:
        """Bytes held of this content: ``size`` once complete and checked."""
        path = self._path(user, sha256)
        if path.exists():
            return size
        part = path.with_suffix(".part")
        return part.stat().st_size if part.exists() else 0

    def put(self, user: str, req: P.BlobReq) -> int:
        """Add ``req.data`` at ``req.offset``; what is held afterwards (``have``)."""
        if not 0 <= req.size <= MAX_JOB_BYTES:
            raise BlobError(f"a file of {req.size} bytes: at most {MAX_JOB_BYTES} per job")
        path = self._path(user, req.sha256)
        held = self.have(user, req.sha256, req.size)
        if held >= req.size and path.exists():
            return req.size
        if not req.data or req.offset != held:
            return held  # a question, or a chunk already held or not the next one: the client resumes from held
        if held + len(req.data) > req.size:
            raise BlobError(f"{req.sha256[:12]}: more bytes than its size {req.size}")
        part = path.with_suffix(".part")
        digest, hashed = self._hashing.get(part, (None, -1))
        if digest is None or hashed != held:  # after a daemon restart: hash what is there once
            digest, hashed = hashlib.sha256(), held
            with open(part, "ab+") as f:
                f.seek(0)
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        with open(part, "ab") as f:
            f.write(req.data)
        digest.update(req.data)
        held += len(req.data)
        self._hashing[part] = (digest, held)
        if held == req.size:
            del self._hashing[part]
            if digest.hexdigest() != req.sha256:
                part.unlink()
                raise BlobError(f"{req.sha256[:12]}: the uploaded content does not match its sha256; send it again")
            part.chmod(0o644)  # readable through a job's link to it; the user directory (0700) stays closed
            os.replace(part, path)
        return held

    def check(self, user: str, files: list[P.InputFile]) -> str:
        """Why a job's ``files`` cannot be staged ("" if they can): each complete, within limits."""
        if len(files) > MAX_FILES:
            return f"inputs: {len(files)} files, at most {MAX_FILES}"
        if sum(f.size for f in files) > MAX_JOB_BYTES:
            return f"inputs: more than {MAX_JOB_BYTES >> 30} GiB"
        for f in files:
            if f.field not in FIELDS:
                return f"inputs: {f.field[:80]!r} is not a spec path that takes files ({', '.join(sorted(FIELDS))})"
            if f.kind not in ("file", "dir") or not _safe_relpath(f.relpath):
                return f"{f.field}: {f.relpath!r} is not a file name in its directory"
            try:
                if not self._path(user, f.sha256).exists():
                    return f"{f.field}: {f.relpath} was not uploaded (submit with plexctl, which sends it)"
            except BlobError as exc:
                return f"{f.field}: {exc}"
        return ""

    def stage(self, user: str, files: list[P.InputFile], dest: Path) -> dict[str, str]:
        """Link (or copy, across file systems) ``files`` into ``dest/FIELD/...``, read-only to the
        job (root's files in root's directories); each field's path there (a file field: the file)."""
        paths: dict[str, str] = {}
        problem = self.check(user, files)  # checked at submit too: a journal of another version may hold anything
        if problem:
            raise BlobError(f"the job's inputs cannot be staged: {problem}")
        if dest.is_symlink():
            dest.unlink()
        elif dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        root = dest.resolve()
        for f in files:
            target = dest / f.field / f.relpath
            if not target.resolve().is_relative_to(root):
                raise BlobError(f"{f.field}: {f.relpath!r} leaves the job's directory")
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            blob = self._path(user, f.sha256)
            try:
                os.link(blob, target)
            except OSError:
                shutil.copyfile(blob, target)
                target.chmod(0o644)
            paths[f.field] = str(target if f.kind == "file" else dest / f.field)
        for directory, dirs, _ in os.walk(dest):
            for name in dirs:
                os.chmod(os.path.join(directory, name), 0o755)
        dest.chmod(0o755)
        return paths


def _safe_relpath(rel: str) -> bool:
    parts = Path(rel).parts
    return bool(parts) and not Path(rel).is_absolute() and ".." not in parts and "\x00" not in rel
