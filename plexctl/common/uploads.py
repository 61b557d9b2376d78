"""What a shared user's client uploads for a job: the spec paths that take files, and how much.

The client (``plexctl.inputs``) and the daemon (``daemon.blobs``, the submit check) read these
one definition: which fields a job may upload, at most how many files and bytes, and which of a
spec's paths are set.
"""

from __future__ import annotations

from typing import Any

INPUT_FIELDS = (("data", "path"), ("data", "eval_path"), ("reward", "path"), ("env", "path"), ("algo", "path"))
MAX_JOB_BYTES = 4 << 30  # all of a job's inputs together
MAX_FILES = 10_000  # in all of a job's directory fields


def field_paths(spec: dict[str, Any]) -> dict[str, str]:
    """``{"data.path": "/abs/train.jsonl", ...}``: the spec's input paths that are set."""
    found = {}
    for section, key in INPUT_FIELDS:
        value = (spec.get(section) or {}).get(key)
        if value:
            found[f"{section}.{key}"] = str(value)
    return found
