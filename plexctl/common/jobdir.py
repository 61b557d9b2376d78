"""The layout of a job's directory (``<state>/jobs/<job id>/``): every name in it, spelled once.

``JobDir`` owns the paths the daemon, its server and ``daemon.inproc``'s in-process client write
and read there: the published policies (``adapters/v000012``), the checkpoints
(``ckpt/step-000040``) and ``ckpt/latest.json`` naming the newest, and the files kept beside
them (the spec, the uploaded inputs, the driver's log, pid and exit code, the metrics, a jailed
driver's own directory and its key pair). A driver's root may be its jailed directory: the
names are the same.

Invariants: a version or a step is an int >= 0 and its directory's name is canonical, six digits
at least (``v000012``, ``step-000040``); a name parses only in that form, so ``v12``, ``latest``
or a temporary ``.step-000040.tmp`` is no version or step. ``latest.json`` is written atomically.
It creates no directory: the engines write adapters and checkpoints (atomically, by rename).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import msgspec

from plexctl.common.atomic import write_json_atomic

_VERSION_NAME = re.compile(r"v([0-9]+)")
_STEP_NAME = re.compile(r"step-([0-9]+)")


class LatestCheckpoint(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``ckpt/latest.json``: the job's newest checkpoint."""

    dir: str  # the checkpoint's directory
    step: int
    policy_version: int = 0  # the policy version published when it was taken
    manifest: dict[str, Any] | None = None  # its files, as the trainer wrote them (the daemon records it)


@dataclass(frozen=True)
class JobDir:
    """One job's directory, ``root``; see the module docstring."""

    ADAPTERS: ClassVar[str] = "adapters"  # published policies, one directory per version
    CHECKPOINTS: ClassVar[str] = "ckpt"  # checkpoints, one directory per step, and LATEST
    LATEST: ClassVar[str] = "latest.json"  # in CHECKPOINTS: the newest checkpoint
    SPEC: ClassVar[str] = "spec.json"  # the job's spec, as the driver reads it
    INPUTS: ClassVar[str] = "inputs.json"  # the uploaded inputs the spec names
    DRIVER_LOG: ClassVar[str] = "driver.log"
    DRIVER_PID: ClassVar[str] = "driver.pid"
    DRIVER_EXIT: ClassVar[str] = "driver.exit"  # the exit code the driver leaves
    METRICS: ClassVar[str] = "metrics.jsonl"  # a step's metrics a line
    DRIVER_OUT: ClassVar[str] = "driver"  # a jailed driver's own directory, the one place it writes
    DRIVER_KEYS: ClassVar[str] = "driver-keys"  # a jailed driver's key pair, the daemon's
    DRIVER_IN: ClassVar[str] = "driver-in"  # what a jailed driver is given (spec, inputs), the daemon's
    DRIVER_IMAGE: ClassVar[str] = "driver.img"  # a jailed driver's own directory as a file system, the daemon's

    root: Path

    # ------------------------------------------------------------ names

    @staticmethod
    def adapter_name(version: int) -> str:
        """``v000012``: the directory of policy ``version``."""
        return f"v{_non_negative(version, 'version'):06d}"

    @staticmethod
    def checkpoint_name(step: int) -> str:
        """``step-000040``: the directory of the checkpoint taken at ``step``."""
        return f"step-{_non_negative(step, 'step'):06d}"

    @staticmethod
    def parse_version(name: str) -> int:
        """The version an adapter directory's ``name`` holds; ValueError if it is not one."""
        return _parse(_VERSION_NAME, name, JobDir.adapter_name, "an adapter version")

    @staticmethod
    def parse_step(name: str) -> int:
        """The step a checkpoint directory's ``name`` holds; ValueError if it is not one."""
        return _parse(_STEP_NAME, name, JobDir.checkpoint_name, "a checkpoint step")

    # ------------------------------------------------------------ paths

    @property
    def adapters(self) -> Path:
        return self.root / self.ADAPTERS

    @property
    def checkpoints(self) -> Path:
        return self.root / self.CHECKPOINTS

    @property
    def latest_file(self) -> Path:
        return self.checkpoints / self.LATEST

    @property
    def spec(self) -> Path:
        return self.root / self.SPEC

    @property
    def inputs(self) -> Path:
        return self.root / self.INPUTS

    @property
    def driver_log(self) -> Path:
        return self.root / self.DRIVER_LOG

    @property
    def driver_pid(self) -> Path:
        return self.root / self.DRIVER_PID

    @property
    def driver_exit(self) -> Path:
        return self.root / self.DRIVER_EXIT

    @property
    def metrics(self) -> Path:
        return self.root / self.METRICS

    @property
    def driver_out(self) -> Path:
        return self.root / self.DRIVER_OUT

    @property
    def driver_keys(self) -> Path:
        return self.root / self.DRIVER_KEYS

    @property
    def driver_in(self) -> Path:
        return self.root / self.DRIVER_IN

    @property
    def driver_image(self) -> Path:
        return self.root / self.DRIVER_IMAGE

    def adapter(self, version: int) -> Path:
        """Where policy ``version`` is published."""
        return self.adapters / self.adapter_name(version)

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is written."""
        return self.checkpoints / self.checkpoint_name(step)

    # ------------------------------------------------------------ what is there

    def published_adapters(self) -> list[Path]:
        """The published policies' directories that hold files, oldest version first."""
        try:
            entries = list(self.adapters.iterdir())
        except FileNotFoundError:
            return []
        found = [(_version_or_none(d.name), d) for d in entries]
        return [d for v, d in sorted((v, d) for v, d in found if v is not None) if d.is_dir() and any(d.iterdir())]

    def is_checkpoint(self, path: Path) -> bool:
        """``path`` is a checkpoint directory of this job (``ckpt/step-NNNNNN``, there); compared
        as spelled: resolve both sides first where links matter."""
        return path.parent == self.checkpoints and _step_or_none(path.name) is not None and path.is_dir()

    def latest_checkpoint(self) -> LatestCheckpoint | None:
        """What ``latest.json`` says, None when there is none yet (ValueError if it is malformed)."""
        try:
            data = self.latest_file.read_bytes()
        except FileNotFoundError:
            return None
        return msgspec.json.decode(data, type=LatestCheckpoint)

    def write_latest(self, latest: LatestCheckpoint) -> None:
        """Name ``latest`` the newest checkpoint (atomically)."""
        write_json_atomic(self.latest_file, msgspec.to_builtins(latest))


def _non_negative(n: int, what: str) -> int:
    if n < 0:
        raise ValueError(f"{what} {n}: a job's {what}s are >= 0")
    return n


def _parse(pattern: re.Pattern[str], name: str, canonical: Callable[[int], str], what: str) -> int:
    """The number in ``name`` if ``name`` is its canonical spelling (``canonical(n) == name``)."""
    match = pattern.fullmatch(name)
    if match is None or canonical(int(match.group(1))) != name:
        raise ValueError(f"{name!r} is not {what} (such as {canonical(12)!r})")
    return int(match.group(1))


def _version_or_none(name: str) -> int | None:
    try:
        return JobDir.parse_version(name)
    except ValueError:
        return None


def _step_or_none(name: str) -> int | None:
    try:
        return JobDir.parse_step(name)
    except ValueError:
        return None
