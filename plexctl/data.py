"""Prompt datasets, as the job library and users' loops name them: ``plexctl.common.datasets``
(reading JSONL / Parquet records, checking them, walking them in resumable epochs), which the
daemon's checks at submit share."""

from plexctl.common.datasets import (
    DataError,
    PromptCursor,
    Scan,
    epoch_order,
    first_record,
    is_parquet,
    load_records,
    record_problem,
    scan_records,
)

__all__ = [
    "DataError",
    "PromptCursor",
    "Scan",
    "epoch_order",
    "first_record",
    "is_parquet",
    "load_records",
    "record_problem",
    "scan_records",
]
