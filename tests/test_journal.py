"""The SQLite journal: idempotent submits, updates, and survival across reopen."""

from daemon.journal import Journal


def test_submit_is_idempotent_and_durable(tmp_path):
    j = Journal(tmp_path / "journal.db")
    a, created = j.submit("s1", "job", "alice", {"name": "job"}, steps=10, priority=0)
    b, again = j.submit("s1", "job", "alice", {"name": "job"}, steps=10, priority=0)
    c, _ = j.submit("s2", "job", "alice", {"name": "job"}, steps=10, priority=0)
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
    ids = [j.submit(f"s{i}", f"n{i % 3}", "alice", {"i": i}, steps=5, priority=i)[0] for i in range(7)]
    j.update(ids[2], state="running", step=2, reward=0.25)
    j.update(ids[5], state="failed", error="boom", ended_at=1.0)
    fresh = Journal(tmp_path / "journal.db")  # reads SQLite only
    assert j.jobs() == fresh.jobs() and len(j.jobs()) == 7
    assert j.jobs(("running", "failed")) == fresh.jobs(("running", "failed")) == [j.job(ids[2]), j.job(ids[5])]
    assert j.job(ids[3]) == fresh.job(ids[3]) and j.job("nope") is None
    before = j.job(ids[0])
    j.update(ids[0], state="running")
    assert before.state == "queued"  # a row handed out earlier does not change under its reader
