"""The daemon's journal: jobs and their events in SQLite (WAL mode) in the state directory.

Everything the daemon must not forget across a restart lives here: each submitted job
(with the idempotency key of its submit and its ``JobSpec``, stored as its JSON wire form and
handed back decoded), its state and progress summary, and
an append-only event log (submitted, started, step checkpoints, cancelled, ended ...).
A submit is committed before it is acknowledged. Per-step metrics live in the job's own
JSONL file, not here. Single-threaded use by the daemon's loop.

Reads of the jobs table are served from memory (a copy loaded at open and kept in step by
``submit`` and ``update``, which write SQLite first): ``status`` is asked for a thousand
times a second while the table only changes at a job's steps. A spec never changes once
submitted: each is decoded once, when first asked for.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from plexctl.common.protocol import JobInfo
from plexctl.common.spec import JobSpec

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT UNIQUE NOT NULL,
    submit_id TEXT UNIQUE NOT NULL,
    name TEXT NOT NULL,
    user TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    step INTEGER NOT NULL DEFAULT 0,
    steps INTEGER NOT NULL DEFAULT 0,
    reward REAL,
    eval_first REAL,
    eval_last REAL,
    policy_version INTEGER NOT NULL DEFAULT 0,
    engine TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    priority INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    t REAL NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id);
CREATE TABLE IF NOT EXISTS published (
    job_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (job_id, version)
);
CREATE TABLE IF NOT EXISTS published_checkpoints (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (job_id, step)
);
"""

TERMINAL = ("succeeded", "failed", "cancelled")
UPDATABLE = {
    "state",
    "started_at",
    "ended_at",
    "step",
    "reward",
    "eval_first",
    "eval_last",
    "policy_version",
    "engine",
    "error",
    "restarts",
}


class Journal:
    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)  # explicit transactions
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self._jobs: dict[str, JobInfo] = {  # job_id -> its row, in submit order; never mutated in place
            r["job_id"]: self._info(r) for r in self.db.execute("SELECT * FROM jobs ORDER BY seq")
        }
        self._specs: dict[str, JobSpec] = {}  # job_id -> its spec, decoded once asked for
        self._published = {(r["job_id"], r["version"]) for r in self.db.execute("SELECT * FROM published")}
        self._published_checkpoints = {
            (r["job_id"], r["step"]) for r in self.db.execute("SELECT * FROM published_checkpoints")
        }

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def _durable(self) -> Iterator[None]:
        """Commits inside reach the disk before they return, so that a submit acknowledged or a
        job's state change survives the node's crash too (progress updates, between them, are
        durable against the daemon's own crash only: WAL with synchronous=NORMAL)."""
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            yield
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")

    def submit(self, submit_id: str, user: str, spec: JobSpec) -> tuple[str, bool]:
        """Insert ``user``'s job of ``spec`` unless this submit_id was seen; (job_id, created)."""
        known = self.submitted(submit_id)
        if known is not None:
            return known, False
        now = time.time()
        with self._durable(), self.db:
            self.db.execute("BEGIN IMMEDIATE")
            seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            job_id = f"j{seq:04d}"
            self.db.execute(
                "INSERT INTO jobs (seq, job_id, submit_id, name, user, spec, state, submitted_at, steps, priority)"
                " VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    seq,
                    job_id,
                    submit_id,
                    spec.name,
                    user,
                    msgspec.json.encode(spec).decode(),
                    "queued",
                    now,
                    spec.steps_total,
                    spec.priority,
                ),
            )
            self.db.execute("INSERT INTO events (job_id, t, kind) VALUES (?,?,?)", (job_id, now, "submitted"))
        row = self.db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        self._jobs[job_id] = self._info(row)
        self._specs[job_id] = spec
        return job_id, True

    def submitted(self, submit_id: str) -> str | None:
        """The job this submit_id made, if it was seen (a retried submit gets it again)."""
        row = self.db.execute("SELECT job_id FROM jobs WHERE submit_id=?", (submit_id,)).fetchone()
        return row["job_id"] if row else None

    def holding(self, name: str, user: str) -> list[JobInfo]:
        """``user``'s queued or running jobs named ``name``, oldest first (a name is one job's)."""
        return [
            info
            for info in self._jobs.values()
            if info.name == name and info.user == user and info.state in ("queued", "running")
        ]

    def update(self, job_id: str, **fields: Any) -> None:
        bad = set(fields) - UPDATABLE
        if bad:
            raise ValueError(f"not updatable: {bad}")
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._durable() if "state" in fields else contextlib.nullcontext():
            self.db.execute(f"UPDATE jobs SET {cols} WHERE job_id=?", (*fields.values(), job_id))
        if job_id in self._jobs:
            self._jobs[job_id] = msgspec.structs.replace(self._jobs[job_id], **fields)

    def event(self, job_id: str, kind: str, detail: str = "") -> None:
        self.db.execute(
            "INSERT INTO events (job_id, t, kind, detail) VALUES (?,?,?,?)", (job_id, time.time(), kind, detail)
        )

    def events(self, job_id: str) -> list[tuple[float, str, str]]:
        rows = self.db.execute("SELECT t, kind, detail FROM events WHERE job_id=? ORDER BY id", (job_id,))
        return [(r["t"], r["kind"], r["detail"]) for r in rows]

    def publish(self, job_id: str, version: int, public: bool, checkpoint: bool = False) -> bool:
        """Make policy ``version`` of the job (``checkpoint``: its checkpoint of that step, a
        training state) readable by every user of the cluster (``public``) or its owner's alone
        again; whether that changed anything."""
        key = (job_id, version)
        held = self._published_checkpoints if checkpoint else self._published
        if (key in held) == public:
            return False
        table, column = ("published_checkpoints", "step") if checkpoint else ("published", "version")
        with self._durable():
            if public:
                self.db.execute(f"INSERT INTO {table} VALUES (?,?,?)", (job_id, version, time.time()))
            else:
                self.db.execute(f"DELETE FROM {table} WHERE job_id=? AND {column}=?", key)
        (held.add if public else held.discard)(key)
        return True

    def is_published(self, job_id: str, version: int, checkpoint: bool = False) -> bool:
        """Whether policy ``version`` of the job (``checkpoint``: its checkpoint of that step) is public."""
        return (job_id, version) in (self._published_checkpoints if checkpoint else self._published)

    def spec(self, job_id: str) -> JobSpec:
        """The job's spec; ``msgspec.ValidationError`` (a ``ValueError``) for one this version
        cannot read (written by another)."""
        spec = self._specs.get(job_id)
        if spec is None:
            row = self.db.execute("SELECT spec FROM jobs WHERE job_id=?", (job_id,)).fetchone()
            spec = self._specs[job_id] = msgspec.json.decode(row["spec"], type=JobSpec)
        return spec

    def jobs(self, states: tuple[str, ...] | None = None) -> list[JobInfo]:
        if not states:
            return list(self._jobs.values())
        return [info for info in self._jobs.values() if info.state in states]

    def job(self, job_id: str) -> JobInfo | None:
        return self._jobs.get(job_id)

    @staticmethod
    def _info(r: sqlite3.Row) -> JobInfo:
        return JobInfo(
            job_id=r["job_id"],
            name=r["name"],
            user=r["user"],
            state=r["state"],
            step=r["step"],
            steps=r["steps"],
            reward=r["reward"],
            eval_first=r["eval_first"],
            eval_last=r["eval_last"],
            policy_version=r["policy_version"],
            engine=r["engine"],
            submitted_at=r["submitted_at"],
            started_at=r["started_at"],
            ended_at=r["ended_at"],
            error=r["error"],
            priority=r["priority"],
            restarts=r["restarts"],
        )
