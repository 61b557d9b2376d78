"""What the state store asks of the engine whose device holds the resident jobs' state.

``StateEngine`` is the store's whole view of the trainer (``worker.trainer.TrainerEngine``
satisfies it): create a job's state, copy it off the device into a pool buffer and back, release
it, and size it. The store depends on this protocol, never on the trainer's module, so that
``worker.state`` stays below the trainer (``tests/test_imports.py`` checks the layers).
"""

from __future__ import annotations

from typing import Protocol

from plexctl.common.spec import LoraSpec
from worker.state.job_copy import BufferPool, JobStateCopy


class StateEngine(Protocol):
    """A trainer engine as the state store drives it (the device tier's side of each move)."""

    def ensure_job(self, job_id: str, lora: LoraSpec | None, seed: int) -> None:
        """Create the job's state on the device (a function of ``seed`` only); idempotent."""
        ...

    def export_state(self, job_id: str, pool: BufferPool | None = None) -> JobStateCopy:
        """A host copy of the job's state in a buffer of ``pool``; the job stays resident."""
        ...

    def import_state(self, job_id: str, copy: JobStateCopy) -> None:
        """Recreate the (not resident) job's state exactly from ``copy``."""
        ...

    def release(self, job_id: str) -> None:
        """Drop the job's state from the device."""
        ...

    def jobs(self) -> list[str]:
        """The resident jobs."""
        ...

    def state_bytes(self, job_id: str) -> int:
        """Bytes of the resident job's state on the device."""
        ...
