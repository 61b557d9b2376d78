"""The trainer engine's and the state store's errors: each message is one line for the user
(the worker sends it to the job's driver as it is)."""

from __future__ import annotations


class TrainerError(Exception):
    """Base of the trainer engine's errors; the message is one line for the user."""


class UnknownJobError(TrainerError, LookupError):
    """The call names a job that is not resident on this engine."""


class JobConfigError(TrainerError, ValueError):
    """``ensure_job`` for a resident job with a different LoRA configuration."""


class BatchError(TrainerError, ValueError):
    """A malformed ``TrainBatch`` or hyper-parameter (ragged rows, no trainable token ...)."""


class CheckpointError(TrainerError):
    """A checkpoint that is missing, corrupt, or written for another adapter shape."""


class NoSpaceError(CheckpointError):
    """A checkpoint or adapter not written for lack of disk space or quota; the previous one is kept."""


class StateCopyError(TrainerError, ValueError):
    """``import_state`` of a copy that does not fit the job's adapter (keys, shapes, layout)."""


class UntrustedCodeError(TrainerError, PermissionError):
    """A custom loss for a job whose submitter the cluster does not trust with code in the trainer."""


class LossLoadError(TrainerError):
    """A custom loss ``module:function`` that cannot be imported, or returns the wrong shape."""


class StateStoreError(Exception):
    """Base of the state store's errors; the message is one line for the user."""


class TierFullError(StateStoreError):
    """No tier has room for a state that must leave the device."""


class CorruptCopyError(StateStoreError):
    """An nvme copy whose file is missing, of the wrong size, fails its checksums, or cannot be read back."""
