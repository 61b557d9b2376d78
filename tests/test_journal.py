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
    assert j2.find("job") == c  # a name finds its newest job
    assert [x.job_id for x in j2.jobs(("queued",))] == [c]
    mode = j2.db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
