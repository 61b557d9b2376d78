"""Prompt datasets: reading JSONL / Parquet records and walking them in a resumable order.

This module owns four things:

* ``record_problem``: what a record must be (an object whose prompt field is a non-empty
  string and which has the answer field), the one rule the two readers below apply;
* ``load_records`` reads a whole dataset (JSONL, or Parquet when ``pyarrow`` is installed)
  into a list of dicts, for the job's driver;
* ``scan_records`` checks every record without keeping any (one line or one Parquet batch in
  memory at a time), for job-spec validation at submit; ``first_record`` peeks at the first;
* ``PromptCursor`` hands out prompts in deterministic shuffled epochs. Its position is a
  small dict (``state()``), so a job that checkpoints it resumes on exactly the prompt it
  would have drawn next.

Every problem with a file is a ``DataError`` whose message is one line naming the file, the
record (and its line) and what is wrong. It deliberately does not tokenize, template or filter
prompts (the driver does; a scan hands the prompts to a caller that counts tokens), does not
hold datasets larger than memory for a job, and never imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from plexctl.common.user_code import one_line

PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_BATCH = 1024  # rows of a Parquet file read at a time
SCAN_PROBLEMS = 5  # bad records a scan names one by one; the others are counted
PROMPT_CHUNK = 512  # prompts a scan hands to its caller at a time


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


def record_problem(record: Any, prompt_field: str, answer_field: str) -> str | None:
    """Why ``record`` cannot be a prompt record (one line, without its location), or None."""
    if not isinstance(record, dict):
        return f"not a JSON object (got {_kind(record)})"
    for field in (prompt_field, answer_field):
        if field not in record:
            return _missing_field_message(field, record)
    prompt = record[prompt_field]
    if not isinstance(prompt, str):
        return f"`{prompt_field}` must be a string, got {_kind(prompt)}"
    if not prompt:
        return f"`{prompt_field}` is an empty string"
    return None


def load_records(path: str | Path, prompt_field: str, answer_field: str) -> list[dict[str, Any]]:
    """Every record of a JSONL or Parquet file; the first bad one raises its ``DataError``."""
    path = str(path)
    _require_file(path)
    records = [
        _checked(path, number, line, item, prompt_field, answer_field) for number, line, item in _raw_records(path)
    ]
    if not records:
        raise DataError(path, "empty dataset (no records)")
    return records


@dataclasses.dataclass
class Scan:
    """What ``scan_records`` found: the records, the first bad ones and how many were bad."""

    records: int = 0
    problems: list[DataError] = dataclasses.field(default_factory=list)  # the first SCAN_PROBLEMS
    bad: int = 0


def scan_records(
    path: str | Path,
    prompt_field: str,
    answer_field: str,
    on_prompts: Callable[[list[tuple[str, str]]], None] | None = None,
) -> Scan:
    """Check every record of a JSONL or Parquet file as ``load_records`` does, keeping none.
    ``on_prompts`` gets the good records' (location, prompt) pairs, ``PROMPT_CHUNK`` at a time
    (location: ``line N``, or ``record N`` of a Parquet file). A file that cannot be read at
    all, or holds no record, raises ``DataError``."""
    path = str(path)
    _require_file(path)
    scan, prompts = Scan(), []
    for number, line, item in _raw_records(path):
        scan.records += 1
        try:
            record = _checked(path, number, line, item, prompt_field, answer_field)
        except DataError as e:
            scan.bad += 1
            if len(scan.problems) < SCAN_PROBLEMS:
                scan.problems.append(e)
            continue
        if on_prompts is not None:
            prompts.append((f"line {line}" if line is not None else f"record {number}", record[prompt_field]))
            if len(prompts) >= PROMPT_CHUNK:
                on_prompts(prompts)
                prompts = []
    if not scan.records:
        raise DataError(path, "empty dataset (no records)")
    if prompts and on_prompts is not None:
        on_prompts(prompts)
    return scan


def first_record(path: str | Path) -> dict[str, Any]:
    """The first record of a JSONL or Parquet file, reading as little of it as possible."""
    path = str(path)
    _require_file(path)
    for number, line, item in _raw_records(path):
        return _parse_json_record(path, item, record=number, line=line) if isinstance(item, str) else item
    raise DataError(path, "empty dataset (no records)")


def _checked(
    path: str, number: int, line: int | None, item: str | dict[str, Any], prompt_field: str, answer_field: str
) -> dict[str, Any]:
    """The record of ``item`` (a JSONL line's text, or a Parquet row), or its ``DataError``."""
    record = _parse_json_record(path, item, record=number, line=line) if isinstance(item, str) else item
    problem = record_problem(record, prompt_field, answer_field)
    if problem is not None:
        raise DataError(path, problem, record=number, line=line)
    return record


def _kind(value: Any) -> str:
    """``5`` -> ``an integer (5)``: a JSON value's type as a reader names it, and the value."""
    kinds = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }
    kind = kinds.get(type(value), type(value).__name__)
    if value is None:
        return kind
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def _missing_field_message(field: str, record: dict[str, Any]) -> str:
    present = ", ".join(f"`{k}`" for k in list(record)[:10]) or "none"
    return f"missing field `{field}` (fields present: {present})"


def _require_file(path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise DataError(path, "file not found")
    if not p.is_file():
        raise DataError(path, "not a file")


def _parse_json_record(path: str, text: str, record: int, line: int | None) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(path, f"not valid JSON: {e.msg} (column {e.colno})", record=record, line=line) from None
    if not isinstance(value, dict):
        raise DataError(path, f"not a JSON object (got a {type(value).__name__})", record=record, line=line)
    return value


def _raw_records(path: str) -> Iterator[tuple[int, int | None, str | dict[str, Any]]]:
    """(record number, line number, the line's text) of a JSONL file, blank lines skipped; or
    (record number, None, the row) of a Parquet file, one batch in memory at a time."""
    if is_parquet(path):
        yield from _parquet_rows(path)
        return
    number = 0
    for line_number, line in _lines(path):
        if line.strip():
            number += 1
            yield number, line_number, line


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file; a line that is not UTF-8 is a ``DataError``."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                yield line_number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    path, f"line {line_number} is not UTF-8 text: {e.reason} (byte 0x{raw[e.start]:02x})"
                ) from None


def _import_parquet(path: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        message = "reading Parquet needs pyarrow; install it (`pip install pyarrow`) or convert the file to JSONL"
        raise DataError(path, message) from None
    return pq


def _parquet_rows(path: str) -> Iterator[tuple[int, None, dict[str, Any]]]:
    pq = _import_parquet(path)
    number = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH):
            rows = batch.to_pylist()
            for row in rows:
                number += 1
                yield number, None, row
    except Exception as e:  # noqa: BLE001 - pyarrow raises several unrelated types for a bad file
        raise DataError(path, f"cannot read Parquet: {one_line(e)}") from None


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
