"""The placement policies behind one interface (``daemon.policies``): the registry matches the
names the CLI offers, each policy's decisions on a small hand-made engine table, and the rule for
which train steps may share a trainer pass (``plexctl.common.scheduling.can_share_pass``)."""

from typing import get_args, get_type_hints

import pytest

from daemon.policies import (
    POLICY_CLASSES,
    Isolated,
    Pack,
    PackBackfill,
    PlacementPolicy,
    Spread,
    SpreadBackfill,
    placement_policy,
)
from daemon.scheduler import Engine, Scheduler, Task
from plexctl.common.cluster_config import ClusterConfig
from plexctl.common.scheduling import POLICIES, can_share_pass
from plexctl.common.spec import LoraSpec


def table(policy: str, loads: dict[str, int], jobs_per_engine: int | None = None) -> Scheduler:
    """A trainer engine per entry of ``loads``, home to that many jobs, and rollout engines to spare."""
    s = Scheduler(policy, jobs_per_engine=jobs_per_engine)
    for i in range(sum(loads.values()) + 2):
        s.engine_up(Engine(f"r{i}", f"w{i}", "rollout", "m"), now=0.0)
    for eid in loads:
        s.engine_up(Engine(eid, f"w-{eid}", "trainer", "m"), now=0.0)
    for eid, n in loads.items():
        for i in range(n):
            assert s.admit(f"{eid}-{i}", "m", 0.0, trainer=eid).trainer == eid
    return s


def test_the_registry_has_one_class_per_name_the_cli_offers():
    assert tuple(POLICY_CLASSES) == POLICIES
    for name, cls in POLICY_CLASSES.items():
        assert issubclass(cls, PlacementPolicy) and cls.name == name
        assert isinstance(placement_policy(name), cls)
        assert Scheduler(name).policy.name == name
    with pytest.raises(ValueError, match="unknown policy 'round-robin': choose one of isolated, pack"):
        placement_policy("round-robin")
    # the cluster setting (and so `up --policy`'s choices) offers exactly these names
    policy_type = get_type_hints(ClusterConfig, include_extras=True)["policy"]
    assert get_args(get_args(policy_type)[0]) == POLICIES


def test_each_policy_answers_its_decisions():
    answers = {
        cls.name: (cls().dedicates_engines(), cls().home_order([1, 0, 2]), cls().backfills())
        for cls in (Isolated, Pack, Spread, SpreadBackfill, PackBackfill)
    }
    assert answers == {
        "isolated": (True, [0, 1, 2], False),
        "pack": (False, [2, 1, 0], False),
        "spread": (False, [0, 1, 2], False),
        "spread+backfill": (False, [0, 1, 2], True),
        "pack+backfill": (False, [2, 1, 0], True),
    }


def test_isolated_homes_one_job_per_engine():
    s = table("isolated", {"t0": 1, "t1": 0})
    assert s.job_room("t0") == 1
    assert s.room_problem(s.engines["t0"]) == "holds a job (isolated)"
    assert s.admit("new", "m", 0.0).trainer == "t1"
    third = s.admit("third", "m", 0.0)
    assert not third.ok and third.reason.endswith("0 of 2 trainer free)")


@pytest.mark.parametrize("policy", ["pack", "pack+backfill"])
def test_pack_homes_a_new_job_on_the_fullest_engine_with_room(policy):
    assert table(policy, {"t0": 1, "t1": 2, "t2": 0}).admit("new", "m", 0.0).trainer == "t1"
    assert table(policy, {"t0": 1, "t1": 2, "t2": 0}, jobs_per_engine=2).admit("new", "m", 0.0).trainer == "t0"


@pytest.mark.parametrize("policy", ["spread", "spread+backfill"])
def test_spread_homes_a_new_job_on_the_emptiest_engine(policy):
    assert table(policy, {"t0": 1, "t1": 2, "t2": 0}).admit("new", "m", 0.0).trainer == "t2"
    assert table(policy, {"t0": 1, "t1": 2, "t2": 3}).admit("new", "m", 0.0).trainer == "t0"


@pytest.mark.parametrize("policy", ["pack", "spread", "spread+backfill", "pack+backfill"])
def test_only_the_backfill_policies_run_a_waiting_step_on_an_idle_engine(policy):
    s = table(policy, {"t0": 2, "t1": 0})  # t0 is home to t0-0 and t0-1 (no state held yet), t1 idle
    for tid, job in enumerate(["t0-0", "t0-1"], start=1):
        s.submit(Task(tid, job, "trainer", "train_step", "m", 0.0))
    placed = [(p.task.job_id, p.engine_id) for p in s.tick(0.0)]
    if policy.endswith("+backfill"):
        assert placed == [("t0-0", "t0"), ("t0-1", "t1")]
    else:
        assert placed == [("t0-0", "t0")]  # t0-1 waits for its home


def test_only_lora_steps_without_dropout_share_a_pass():
    assert can_share_pass(LoraSpec())
    assert can_share_pass(LoraSpec(rank=64, dropout=0.0))
    assert not can_share_pass(None)  # full fine-tuning
    assert not can_share_pass(LoraSpec(dropout=0.05))
