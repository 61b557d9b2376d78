"""The elastic allocation's rule (``daemon.elastic.decide``), which the daemon and the simulator
share: when the cluster grows, by how much, and which joined units it gives back."""

from __future__ import annotations

from daemon.elastic import Decision, ElasticRule, Unit, decide

RULE = ElasticRule(min_units=1, max_units=4, grow_after_s=300.0, shrink_after_s=600.0)
BASE = Unit(unit_id="base", ready=True, base=True, idle_since=0.0)


def test_work_that_waited_grow_after_grows_the_cluster_by_what_it_wants_up_to_max():
    assert decide(RULE, 299.0, 0.0, 2, [BASE]) == Decision(0, (), 300.0)  # not yet: look again at 300
    assert decide(RULE, 300.0, 0.0, 2, [BASE]) == Decision(2, (), None)
    assert decide(RULE, 300.0, 0.0, 9, [BASE]).grow == 3  # at most max_units
    full = [BASE, *(Unit(unit_id=f"j{i}", ready=True) for i in range(3))]
    assert decide(RULE, 900.0, 0.0, 1, full).grow == 0
    assert decide(RULE, 900.0, 0.0, 0, [BASE]).grow == 0  # waiting, but what is up has room


def test_no_growth_while_units_asked_for_are_still_starting():
    starting = Unit(unit_id="j0", ready=False)
    assert decide(RULE, 900.0, 0.0, 2, [BASE, starting]).grow == 0


def test_an_idle_joined_unit_leaves_after_shrink_after_longest_idle_first_never_below_min():
    a = Unit(unit_id="a", ready=True, idle_since=100.0)
    b = Unit(unit_id="b", ready=True, idle_since=50.0)
    busy = Unit(unit_id="busy", ready=True)
    assert decide(RULE, 640.0, None, 0, [BASE, a, b, busy]) == Decision(0, (), 650.0)
    assert decide(RULE, 650.0, None, 0, [BASE, a, b, busy]).release == ("b",)
    assert decide(RULE, 700.0, None, 0, [BASE, a, b, busy]).release == ("b", "a")
    # never below min_units: with min 3, only one of the four goes
    rule = ElasticRule(min_units=3, max_units=4, grow_after_s=300.0, shrink_after_s=600.0)
    assert decide(rule, 700.0, None, 0, [BASE, a, b, busy]).release == ("b",)


def test_the_base_allocation_and_units_while_work_waits_are_kept():
    idle_base = Unit(unit_id="base", ready=True, base=True, idle_since=0.0)
    assert decide(RULE, 10_000.0, None, 0, [idle_base]).release == ()
    a = Unit(unit_id="a", ready=True, idle_since=0.0)
    assert decide(RULE, 10_000.0, 9_000.0, 0, [idle_base, a]).release == ()


def test_the_daemons_elastic_allocations_ask_adopt_follow_and_give_back(tmp_path, monkeypatch):
    """``daemon.allocations.ElasticAllocations`` over a real ``slurm.json``; Slurm's answers are
    the test's (the real Slurm cluster's run is tests/test_slurm.py's elastic test)."""
    import time

    from daemon import allocations as A
    from plexctl.common import slurm as S
    from plexctl.common.cluster_config import ClusterConfig

    cancelled, asked = [], []
    monkeypatch.setattr(S, "cancel", cancelled.append)
    monkeypatch.setattr(S, "job_state", lambda job_id: ("RUNNING", ""))

    def submit(state_dir, config, note):
        asked.append((config.nodes, config.max_nodes, note))
        alloc = S.Allocation(f"{100 + len(asked)}", 1, True, time.time(), "sbatch", 0.0, elastic=True, state="starting")
        S.record_allocation(state_dir, alloc)
        return alloc

    S.record_allocation(tmp_path, S.Allocation("100", 1, False, 0.0, "sbatch", 60.0))
    config = ClusterConfig(nodes=1, max_nodes=3, grow_after=5.0, shrink_after=10.0)
    e = A.ElasticAllocations(tmp_path, config, submit=submit)
    e.step(0.0, 0.0, {"n1": True})  # a job waits since 0: not yet
    assert asked == []
    e.step(5.0, 0.0, {"n1": True})
    assert asked == [(1, 3, "jobs waited 5 s for engines")]
    e.step(7.0, 0.0, {"n1": True})  # still starting: no second ask
    assert len(asked) == 1
    e.step(9.0, None, {"n1": True, "n2-101": True, "n2-101-g1": False})  # its workers registered, busy
    [row] = [r for r in S.allocation_rows(S.read_allocations(tmp_path), 9.0) if r["role"] == "joined"]
    assert row["state"] == "up" and row["idle_s"] is None and row["job_id"] == "101"
    e.step(11.0, None, {"n1": True})  # its worker restarts: kept, up, while Slurm runs it
    assert list(e.units) == ["101"] and e.units["101"].state == "up" and cancelled == []
    e.step(13.0, None, {"n1": True, "n2-101": False})  # back, idle from 13
    e.step(21.0, None, {"n1": True, "n2-101": False})
    assert cancelled == []
    e.step(23.0, None, {"n1": True, "n2-101": False})  # 10 s idle: given back
    assert cancelled == ["101"]
    # a daemon started again adopts what Slurm still runs
    again = A.ElasticAllocations(tmp_path, config, submit=submit)
    assert list(again.units) == ["101"] and again.units["101"].state == "releasing"
    e.step(25.0, None, {"n1": True})  # its workers left
    rows = S.allocation_rows(S.read_allocations(tmp_path), 25.0)
    assert [(r["job_id"], r["role"], r["state"]) for r in rows] == [
        ("100", "base", "up"),
        ("101", "joined", "released"),
    ]
    assert rows[1]["note"] == "given back: its engines held no job for 10 s"
    assert S.allocation_line(rows[1]) == (
        "Slurm job 101: joined, 1 node, released (given back: its engines held no job for 10 s)"
    )
    assert S.allocation_rows(S.read_allocations(tmp_path), 25.0 + S.RELEASED_SHOWN_S + 1)[1:] == []


def test_a_failed_submission_is_tried_again_and_never_ends_the_daemon(tmp_path, monkeypatch):
    from daemon import allocations as A
    from plexctl.common import slurm as S
    from plexctl.common.cluster_config import ClusterConfig

    tries = []

    def refuse(state_dir, config, note):
        tries.append(note)
        raise S.SlurmUnavailable("sbatch refused the allocation: Invalid account")

    e = A.ElasticAllocations(tmp_path, ClusterConfig(nodes=1, max_nodes=2, grow_after=0.0), submit=refuse)
    e.step(10.0, 0.0, {})
    e.step(12.0, 0.0, {})
    assert len(tries) == 2 and e.units == {}
