"""Prompt datasets: reading JSONL / Parquet records and walking them in a resumable order.

This module owns three things:

* ``load_records`` reads a whole dataset (JSONL, or Parquet when ``pyarrow`` is installed)
  into a list of dicts and checks that every record carries the prompt and answer fields;
* ``first_record`` peeks at the first record only, cheaply, for job-spec validation;
* ``PromptCursor`` hands out prompts in deterministic shuffled epochs. Its position is a
  small dict (``state()``), so a job that checkpoints it resumes on exactly the prompt it
  would have drawn next.

Every problem with a file is a ``DataError`` whose message is one line naming the file, the
record and what is wrong. It deliberately does not tokenize, template or filter prompts (the
driver does), does not stream datasets larger than memory, and never imports torch.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
from plexctl.user_code import one_line

PARQUET_SUFFIXES = (".parquet", ".pq")


class DataError(Exception):
    """A dataset file that cannot be used. ``str()`` is one line: file, record, problem."""

    def __init__(self, path: str, message: str, record: int | None = None, line: int | None = None) -> None:
        self.path = path
        self.record = record
        self.line = line
        self.reason = message
        super().__init__(_format_data_error(path, message, record, line))


def _format_data_error(path: str, message: str, record: int | None, line: int | None) -> str:
    where = ""
    if record is not None:
        where = f" record {record}" + (f" (line {line})" if line is not None else "") + ":"
    return f"{path}:{where} {message}"


# ---------------------------------------------------------------- reading files


def is_parquet(path: str | Path) -> bool:
    return str(path).lower().endswith(PARQUET_SUFFIXES)


def load_records(path: str | Path, prompt_field: str, answer_field: str) -> list[dict[str, Any]]:
    """Every record of a JSONL or Parquet file; each must be an object with both fields."""
    path = str(path)
    _require_file(path)
    records = _read_parquet(path) if is_parquet(path) else _read_jsonl(path)
    if not records:
        raise DataError(path, "empty dataset (no records)")
    for number, (record, line) in enumerate(records, start=1):
        for field in (prompt_field, answer_field):
            if field not in record:
                raise DataError(path, _missing_field_message(field, record), record=number, line=line)
    return [record for record, _ in records]


def first_record(path: str | Path) -> dict[str, Any]:
    """The first record of a JSONL or Parquet file, reading as little of it as possible."""
    path = str(path)
    _require_file(path)
    if is_parquet(path):
        return _first_parquet_record(path)
    for line_number, line in _lines(path):
        if line.strip():
            return _parse_json_record(path, line, record=1, line=line_number)
    raise DataError(path, "empty dataset (no records)")


def _missing_field_message(field: str, record: dict[str, Any]) -> str:
    present = ", ".join(f"`{k}`" for k in list(record)[:10]) or "none"
    return f"missing field `{field}` (fields present: {present})"


def _require_file(path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise DataError(path, "file not found")
    if not p.is_file():
        raise DataError(path, "not a file")


def _parse_json_record(path: str, text: str, record: int, line: int) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(path, f"not valid JSON: {e.msg} (column {e.colno})", record=record, line=line) from None
    if not isinstance(value, dict):
        raise DataError(path, f"not a JSON object (got a {type(value).__name__})", record=record, line=line)
    return value


def _read_jsonl(path: str) -> list[tuple[dict[str, Any], int | None]]:
    """(record, line number) pairs; blank lines are skipped."""
    records: list[tuple[dict[str, Any], int | None]] = []
    for line_number, line in _lines(path):
        if line.strip():
            record = _parse_json_record(path, line, record=len(records) + 1, line=line_number)
            records.append((record, line_number))
    return records


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file; a line that is not UTF-8 is a ``DataError``."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                yield line_number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(path, f"line {line_number} is not UTF-8 text: {e.reason} "
                                      f"(byte 0x{raw[e.start]:02x})") from None


def _import_parquet(path: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        message = "reading Parquet needs pyarrow; install it (`pip install pyarrow`) or convert the file to JSONL"
        raise DataError(path, message) from None
    return pq


def _read_parquet(path: str) -> list[tuple[dict[str, Any], int | None]]:
    pq = _import_parquet(path)
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise DataError(path, f"cannot read Parquet: {one_line(e)}") from None
    return [(row, None) for row in rows]


def _first_parquet_record(path: str) -> dict[str, Any]:
    pq = _import_parquet(path)
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1):
            rows = batch.to_pylist()
            if rows:
                return rows[0]
    except Exception as e:
        raise DataError(path, f"cannot read Parquet: {one_line(e)}") from None
    raise DataError(path, "empty dataset (no records)")



# ---------------------------------------------------------------- the prompt cursor


class CursorState(msgspec.Struct, forbid_unknown_fields=True):
    """Where a ``PromptCursor`` stands: epoch ``epoch``, next index ``position`` in its order."""

    seed: int
    epoch: int
    position: int
    num_records: int


def epoch_order(num_records: int, seed: int, epoch: int) -> list[int]:
    """The record order of one epoch: a permutation fixed by (seed, epoch) alone."""
    order = list(range(num_records))
    random.Random(f"plexrl-data/{seed}/{epoch}").shuffle(order)
    return order


class PromptCursor:
    """Deterministic shuffled epochs over ``records``; ``state()`` / ``from_state`` resume it."""

    def __init__(self, records: list[dict[str, Any]], seed: int) -> None:
        if not records:
            raise DataError("<records>", "empty dataset (no records)")
        self.records = records
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = epoch_order(len(records), seed, 0)

    def next_batch(self, k: int) -> list[dict[str, Any]]:
        """The next ``k`` records, moving into a freshly shuffled epoch when one runs out."""
        if k < 1:
            raise ValueError(f"batch size must be >= 1, got {k}")
        batch: list[dict[str, Any]] = []
        while len(batch) < k:
            if self.position == len(self._order):
                self._start_epoch(self.epoch + 1)
            batch.append(self.records[self._order[self.position]])
            self.position += 1
        return batch

    def state(self) -> dict[str, int]:
        return msgspec.to_builtins(
            CursorState(seed=self.seed, epoch=self.epoch, position=self.position, num_records=len(self.records))
        )

    @classmethod
    def from_state(cls, records: list[dict[str, Any]], state: dict[str, Any]) -> PromptCursor:
        """A cursor over ``records`` standing exactly where ``state`` was taken."""
        try:
            saved = msgspec.convert(state, CursorState)
        except msgspec.ValidationError as e:
            raise DataError("<cursor state>", f"invalid cursor state: {e}") from None
        if saved.num_records != len(records):
            raise DataError(
                "<cursor state>",
                f"cannot resume: the dataset has {len(records)} records, "
                f"the checkpoint was taken with {saved.num_records}",
            )
        if not 0 <= saved.position <= saved.num_records or saved.epoch < 0:
            raise DataError("<cursor state>", f"invalid cursor state: epoch {saved.epoch}, position {saved.position}")
        cursor = cls(records, saved.seed)
        cursor._start_epoch(saved.epoch)
        cursor.position = saved.position
        return cursor

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self._order = epoch_order(len(self.records), self.seed, epoch)
