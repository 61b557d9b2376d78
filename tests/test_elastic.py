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
