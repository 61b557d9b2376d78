"""A job's input files, sent by the client that submits it (which runs with its user's rights).

What it owns: ``collect`` (the files behind a spec's paths: ``data.path``, ``data.eval_path``,
``reward.path``, ``env.path``, ``algo.path``; ``model.path`` is the cluster's), ``upload``
(each file's content, content-addressed by sha256, in chunks, skipping what the daemon already
holds for this user) and ``submit`` (both, then the submit naming them).

Invariants: a file is read once here, by the submitting user; the daemon stores it under that
user's name and checks its sha256 before it counts as there, so a job never starts on a half
or altered file; the same content uploaded again for another job of the user costs one request.
Limits (``MAX_JOB_BYTES``, ``MAX_FILES``) are checked before anything is sent.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

from plexctl.common import protocol as P
from plexctl.common.errors import UsageError
from plexctl.common.uploads import MAX_FILES, MAX_JOB_BYTES, field_paths

CHUNK = 8 << 20
SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache"}


def collect(spec: dict[str, Any]) -> tuple[list[P.InputFile], dict[str, Path]]:
    """The files behind the spec's paths, with their sha256, and where each content is read from."""
    files: list[P.InputFile] = []
    local: dict[str, Path] = {}
    total = 0
    for field, path in field_paths(spec).items():
        root = Path(path)
        if root.is_file():
            entries = [(root, root.name)]
            kind = "file"
        elif root.is_dir():
            entries = sorted(_walk(root))
            kind = "dir"
        else:
            raise UsageError(f"{field}: {path} is neither a file nor a directory")
        for source, rel in entries:
            size = source.stat().st_size
            total += size
            if total > MAX_JOB_BYTES:
                raise UsageError(
                    f"{field}: the job's input files exceed {MAX_JOB_BYTES >> 30} GiB; point it at "
                    "what the job needs, or ask the cluster's owner to trust you (shared paths)"
                )
            if len(files) >= MAX_FILES:
                raise UsageError(f"{field}: more than {MAX_FILES} input files; point it at what the job needs")
            try:
                digest = _sha256(source)
            except OSError as exc:
                raise UsageError(f"{field}: cannot read {source}: {exc.strerror or exc}") from None
            files.append(P.InputFile(field, kind, rel, digest, size))
            local[digest] = source
    return files, local


def upload(client: Any, files: list[P.InputFile], local: dict[str, Path]) -> int:
    """Send each file the daemon does not hold yet (resuming a partial one); the bytes sent."""
    sent = 0
    for f in {f.sha256: f for f in files}.values():
        have = client.blob(P.BlobReq(f.sha256, f.size)).have
        if have >= f.size:
            continue
        with open(local[f.sha256], "rb") as src:
            while have < f.size:
                src.seek(have)
                data = src.read(CHUNK)
                if not data:
                    raise UsageError(f"{f.field}: {local[f.sha256]} shrank while it was being sent")
                have = client.blob(P.BlobReq(f.sha256, f.size, have, data)).have
                sent += len(data)
    return sent


def submit(client: Any, spec: dict[str, Any], submit_id: str | None = None, **options: Any) -> P.SubmitRep:
    """Submit ``spec`` (its wire form), its input files uploaded first where the daemon wants
    them (a user whose jobs run jailed); a path the user cannot read fails here, in their name.
    ``options``: the rest of ``Client.submit``'s (``replace``, ``user``)."""
    inputs: list[P.InputFile] = []
    if client.ping(timeout=10.0).upload_inputs:
        inputs, local = collect(spec)
        upload(client, inputs, local)
    return client.submit(spec, submit_id or uuid.uuid4().hex, inputs=inputs, **options)


def _walk(root: Path):
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in names:
            path = Path(directory) / name
            if path.is_file() and not path.is_symlink():
                yield path, str(path.relative_to(root))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
