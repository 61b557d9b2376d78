"""The SQLite journal: idempotent submits, updates, specs stored and read back as ``JobSpec``,
and survival across reopen."""

import json
from pathlib import Path

from daemon.journal import Journal
from plexctl.common.spec import JobSpec, spec_to_wire
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]


def spec(name: str, priority: int = 0) -> JobSpec:
    overrides = ["model.path=/models/tiny", f"priority={priority}"]
    return load_spec(REPO / "configs" / "tiny-arith.yaml", overrides, name, check_files=False)


def test_submit_is_idempotent_and_durable(tmp_path):
    j = Journal(tmp_path / "journal.db")
    a, created = j.submit("s1", "alice", spec("job"))
    b, again = j.submit("s1", "alice", spec("job"))
    c, _ = j.submit("s2", "alice", spec("job"))
    assert created and not again and a == b and c != a
    j.update(a, state="running", step=3, reward=0.5)
    j.event(a, "checkpoint", "step 3")
    j.close()
    j2 = Journal(tmp_path / "journal.db")
    info = j2.job(a)
    assert (info.state, info.step, info.reward) == ("running", 3, 0.5)
    assert [k for _, k, _ in j2.events(a)] == ["submitted", "checkpoint"]
    assert [x.job_id for x in j2.jobs() if x.name == "job"] == [a, c]  # in submit order
    assert [x.job_id for x in j2.jobs(("queued",))] == [c]
    mode = j2.db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_reads_served_from_memory_match_the_database(tmp_path):
    j = Journal(tmp_path / "journal.db")
    ids = [j.submit(f"s{i}", "alice", spec(f"n{i % 3}", priority=i))[0] for i in range(7)]
    j.update(ids[2], state="running", step=2, reward=0.25)
    j.update(ids[5], state="failed", error="boom", ended_at=1.0)
    fresh = Journal(tmp_path / "journal.db")  # reads SQLite only
    assert j.jobs() == fresh.jobs() and len(j.jobs()) == 7
    assert j.jobs(("running", "failed")) == fresh.jobs(("running", "failed")) == [j.job(ids[2]), j.job(ids[5])]
    assert j.job(ids[3]) == fresh.job(ids[3]) and j.job("nope") is None
    assert [fresh.job(i).priority for i in ids] == list(range(7)) and fresh.job(ids[4]).name == "n1"
    before = j.job(ids[0])
    j.update(ids[0], state="running")
    assert before.state == "queued"  # a row handed out earlier does not change under its reader


def test_a_spec_is_stored_and_read_back_as_the_jobspec_it_was(tmp_path):
    j = Journal(tmp_path / "journal.db")
    submitted = spec("kept", priority=3)
    job, _ = j.submit("s", "alice", submitted)
    fresh = Journal(tmp_path / "journal.db")
    assert fresh.spec(job) == submitted and isinstance(fresh.spec(job), JobSpec)
    assert (fresh.job(job).name, fresh.job(job).steps) == ("kept", submitted.algo.steps)


def test_a_journal_that_stored_the_clients_wire_dict_still_reads(tmp_path):
    """Journals written before specs were stored as ``JobSpec``: the wire dict, ``json.dumps``'d."""
    j = Journal(tmp_path / "journal.db")
    old = spec("old")
    j.db.execute(
        "INSERT INTO jobs (seq, job_id, submit_id, name, user, spec, state, submitted_at, steps, priority)"
        " VALUES (1, 'j0001', 's', 'old', 'alice', ?, 'queued', 0, 1, 0)",
        (json.dumps(spec_to_wire(old)),),
    )
    j.close()
    assert Journal(tmp_path / "journal.db").spec("j0001") == old
