"""The scheduler core with an injected clock: admission, placement policies, capacity, affinity,
backfill, ordering and fairness, hints for the state manager, accounting, and a scale run."""

import heapq
import random
import statistics
import time

import pytest

from daemon.scheduler import EMA, Admission, Engine, Scheduler, Task
from plexctl.common.scheduling import POLICIES


def task(tid: int, job: str, kind: str = "rollout", method: str = "generate", t: float = 0.0, prio: int = 0) -> Task:
    return Task(tid, job, kind, method, "m", t, prio)


def test_respects_capacity_and_kind():
    s = Scheduler()
    s.engine_up(Engine("w0/rollout", "w0", "rollout", "m", capacity=2))
    s.engine_up(Engine("w1/trainer", "w1", "trainer", "m", capacity=1))
    for i in range(3):
        s.submit(task(i, f"j{i}"))
    s.submit(task(10, "j0", "trainer", "train_step"))
    s.submit(task(11, "j1", "trainer", "train_step"))
    placed = s.tick(now=1.0)
    by_engine = {}
    for p in placed:
        by_engine.setdefault(p.engine_id, []).append(p.task.task_id)
    assert len(by_engine["w0/rollout"]) == 2
    assert len(by_engine["w1/trainer"]) == 1
    assert len(s.queue) == 2
    # finishing frees a slot for the waiting task
    s.done(by_engine["w0/rollout"][0], now=2.0, seconds=1.0)
    assert [p.task.kind for p in s.tick(now=2.0)] == ["rollout"]


def test_wrong_model_is_never_placed():
    s = Scheduler()
    s.engine_up(Engine("e", "w", "rollout", "other"))
    s.submit(task(1, "j"))
    assert s.tick(1.0) == []


def test_trainer_affinity_keeps_a_job_on_its_engine():
    s = Scheduler()
    s.engine_up(Engine("a", "w0", "trainer", "m"))
    s.engine_up(Engine("b", "w1", "trainer", "m"))
    s.submit(task(1, "j1", "trainer", "train_step"))
    s.submit(task(2, "j2", "trainer", "train_step"))
    first = {p.task.job_id: p.engine_id for p in s.tick(0.0)}
    assert first["j1"] != first["j2"]  # new jobs spread over trainer engines
    s.done(1, 1.0, 1.0)
    s.done(2, 1.0, 1.0)
    # j1's next step waits for its own engine even if the other one is free
    s.submit(task(3, "j2", "trainer", "train_step"))
    s.submit(task(4, "j1", "trainer", "train_step"))
    s.tick(1.0)
    s.submit(task(5, "j1", "trainer", "publish"))
    placed = s.tick(1.5)
    assert placed == []  # its home is busy with task 4
    s.done(4, 2.0, 1.0)
    assert [(p.task.task_id, p.engine_id) for p in s.tick(2.0)] == [(5, first["j1"])]


def test_response_ratio_lets_short_calls_pass_long_ones():
    s = Scheduler()
    s.engine_up(Engine("e", "w", "rollout", "m"))
    s.estimates[("long", "generate")] = 100.0
    s.estimates[("short", "generate")] = 0.1
    s.submit(task(1, "long", t=0.0))
    s.submit(task(2, "short", t=0.5))
    assert s.tick(1.0)[0].task.job_id == "short"  # (0.5+0.1)/0.1 > (1+100)/100


def test_priority_first_and_estimates_learned():
    s = Scheduler()
    s.engine_up(Engine("e", "w", "rollout", "m"))
    s.submit(task(1, "low", t=0.0))
    s.submit(task(2, "high", t=5.0, prio=5))
    assert s.tick(5.0)[0].task.job_id == "high"
    s.done(2, 7.0, seconds=2.0)
    assert s.estimate(task(9, "high")) == 2.0


def test_engine_loss_requeues_running_tasks():
    s = Scheduler()
    s.engine_up(Engine("e", "w", "rollout", "m"))
    s.submit(task(1, "j"))
    s.tick(0.0)
    assert s.engine_down("e")[0].task_id == 1
    assert 1 in s.queue
    s.engine_up(Engine("e2", "w2", "rollout", "m"))
    assert s.tick(1.0)[0].engine_id == "e2"


def test_busy_seconds_accumulate_on_the_injected_clock():
    s = Scheduler()
    s.engine_up(Engine("e", "w", "rollout", "m", capacity=2))
    s.submit(task(1, "a"))
    s.submit(task(2, "b"))
    s.tick(10.0)
    s.done(1, 12.0)
    s.done(2, 13.0)
    assert s.engines["e"].busy_seconds == 3.0
    assert s.engines["e"].tasks_done == 2


# -- policies, admission, backfill, fairness, hints, accounting, scale


def cluster(policy: str, rollouts: int, trainers: int, **kw) -> Scheduler:
    s = Scheduler(policy, **kw)
    for i in range(rollouts):
        s.engine_up(Engine(f"r{i}", f"w{i}", "rollout", "m"), now=0.0)
    for i in range(trainers):
        s.engine_up(Engine(f"t{i}", f"w{i}", "trainer", "m"), now=0.0)
    return s


def test_unknown_policy_is_refused():
    assert POLICIES == ("isolated", "pack", "spread", "spread+backfill", "pack+backfill")
    with pytest.raises(ValueError, match="unknown policy"):
        Scheduler("round-robin")


def test_isolated_admits_one_job_per_dedicated_pair():
    s = cluster("isolated", 1, 1)
    results = [s.admit(f"j{i}", "m", now=0.0) for i in range(4)]
    assert results[0] == Admission(True, "admitted", "r0", "t0")
    for r in results[1:]:
        assert not r.ok
        assert r.reason == "waiting for dedicated engines (isolated: 0 of 1 rollout / 0 of 1 trainer free)"
    # the first job ends: its engines go to the next one
    s.release("j0")
    assert s.admit("j1", "m", now=1.0).ok

    s = cluster("isolated", 4, 4)
    homes = [s.admit(f"j{i}", "m", now=0.0) for i in range(4)]
    assert all(a.ok for a in homes)
    assert len({a.rollout for a in homes}) == 4 and len({a.trainer for a in homes}) == 4
    assert not s.admit("j4", "m", now=0.0).ok


def test_isolated_tasks_only_run_on_their_own_engines():
    s = cluster("isolated", 2, 2)
    s.admit("a", "m", 0.0)
    s.admit("b", "m", 0.0)
    s.submit(task(1, "a"))
    s.submit(task(2, "a"))
    assert [p.engine_id for p in s.tick(0.0)] == ["r0"]  # r1 is b's, even though idle


def test_admission_reasons_no_engine_and_full():
    s = Scheduler()
    a = s.admit("j", "m", now=0.0)
    assert not a.ok and a.reason.startswith("no ready engine serves m")
    s = cluster("spread", 1, 1, jobs_per_engine=2)
    assert s.admit("a", "m", 0.0).ok and s.admit("b", "m", 0.0).ok
    full = s.admit("c", "m", 0.0)
    assert not full.ok and "jobs_per_engine" in full.reason


def test_pack_fills_one_engine_first_and_spread_alternates():
    packed = cluster("pack", 2, 2, jobs_per_engine=2)
    assert [packed.admit(f"j{i}", "m", 0.0).rollout for i in range(4)] == ["r0", "r0", "r1", "r1"]
    assert [packed.home_of(f"j{i}", "trainer") for i in range(4)] == ["t0", "t0", "t1", "t1"]
    for policy in ("spread", "spread+backfill"):
        spread = cluster(policy, 2, 2)
        assert [spread.admit(f"j{i}", "m", 0.0).trainer for i in range(4)] == ["t0", "t1", "t0", "t1"]
    # a released job's slot is the emptiest again
    spread.release("j0")
    assert spread.admit("j4", "m", 0.0).trainer == "t0"


def test_spread_keeps_tasks_home_but_backfill_uses_an_idle_rollout_engine():
    for policy, expected in (("spread", ["r0"]), ("spread+backfill", ["r0", "r1"])):
        s = cluster(policy, 2, 2)
        s.admit("a", "m", 0.0)
        s.admit("b", "m", 0.0)  # b's home r1 is idle: nothing queued for it
        s.submit(task(1, "a"))
        s.submit(task(2, "a"))
        assert sorted(p.engine_id for p in s.tick(0.0)) == expected
        assert s.home_of("a", "rollout") == "r0"  # a rollout backfill does not move the home


def test_backfill_never_moves_a_trainer_task_away_from_its_jobs_state():
    s = cluster("spread+backfill", 1, 2)
    for j in ("a", "b", "c"):  # spread: a -> t0, b -> t1, c -> t0
        s.admit(j, "m", 0.0)
    assert s.home_of("c", "trainer") == "t0"
    s.submit(task(1, "c", "trainer", "train_step"))
    assert [(p.task.job_id, p.engine_id) for p in s.tick(0.0)] == [("c", "t0")]
    s.state_location("a", "t0", "device")
    s.submit(task(2, "a", "trainer", "train_step"))
    assert s.tick(1.0) == []  # t1 is idle, but a's state is on t0's device
    for tier in ("host", "nvme"):  # swapped out, it is still t0's: no trainer gets it from there
        s.state_location("a", "t0", tier)
        assert s.tick(2.0) == []
    assert s.home_of("a", "trainer") == "t0"
    s.state_location("a", "t0", None)  # no copy left anywhere: the job may start on any trainer
    assert [(p.task.job_id, p.engine_id) for p in s.tick(3.0)] == [("a", "t1")]
    assert s.home_of("a", "trainer") == "t1" and s.home["a"] == "t1"
    assert s.upcoming("t1") == [] and "a" not in s.upcoming("t0")


def test_after_a_trainer_task_its_state_is_assumed_on_that_device():
    s = cluster("spread+backfill", 1, 2)
    for j in ("a", "b", "c"):  # a and c share t0
        s.admit(j, "m", 0.0)
    s.submit(task(1, "a", "trainer", "train_step"))
    s.submit(task(2, "c", "trainer", "train_step"))
    s.tick(0.0)  # a runs on t0; c has never trained (no state): it moves to the idle t1
    assert s.home_of("c", "trainer") == "t1"
    s.done(1, 1.0, 1.0)
    s.done(2, 1.0, 1.0)
    s.submit(task(3, "b", "trainer", "train_step", t=1.0, prio=1))  # b's home t1 is now c's too
    s.submit(task(4, "c", "trainer", "publish", t=1.0))
    s.submit(task(5, "a", "trainer", "publish", t=1.0))
    placed = s.tick(1.0)
    assert sorted((p.task.job_id, p.engine_id) for p in placed) == [("a", "t0"), ("b", "t1")]
    s.done(5, 2.0, 1.0)
    assert s.tick(2.0) == []  # t0 is idle, but c's state is on t1's device: it waits for t1
    s.done(3, 3.0, 1.0)
    assert [(p.task.job_id, p.engine_id) for p in s.tick(3.0)] == [("c", "t1")]
    # a job that never trained has no state and may move
    s2 = cluster("spread+backfill", 1, 2)
    for j in ("a", "b", "c"):
        s2.admit(j, "m", 0.0)
    s2.submit(task(1, "c", "trainer", "train_step"))
    s2.submit(task(2, "a", "trainer", "restore"))
    assert sorted(p.engine_id for p in s2.tick(0.0)) == ["t0", "t1"]


def test_trainer_backfill_only_moves_to_a_trainer_with_room_for_the_state():
    s = Scheduler()
    s.engine_up(Engine("r", "w", "rollout", "m"))
    s.engine_up(Engine("big", "w0", "trainer", "m", state_capacity_bytes=200_000_000))
    s.engine_up(Engine("small", "w1", "trainer", "m", state_capacity_bytes=100_000_000))
    s.engine_up(Engine("big2", "w2", "trainer", "m", state_capacity_bytes=200_000_000))
    assert s.admit("x", "m", 0.0, state_bytes=150_000_000).trainer == "big"
    assert s.admit("u", "m", 0.0, state_bytes=1_000_000).trainer == "small"
    assert s.admit("v", "m", 0.0, state_bytes=1_000_000).trainer == "big2"
    assert s.admit("q", "m", 0.0, state_bytes=1_000_000).trainer == "big"
    s.release("u")  # small is now the emptiest trainer, but too small for x
    s.submit(task(1, "q", "trainer", "train_step"))
    s.submit(task(2, "v", "trainer", "train_step"))
    s.tick(0.0)  # q holds big, v holds big2
    s.submit(task(3, "x", "trainer", "train_step"))  # x has no state yet: it may start elsewhere
    assert s.tick(1.0) == []  # only small is idle
    s.done(2, 2.0, 2.0)
    assert [(p.task.job_id, p.engine_id) for p in s.tick(2.0)] == [("x", "big2")]
    assert s.home_of("x", "trainer") == "big2"


def test_admission_by_tier_capacity():
    s = Scheduler()
    s.engine_up(Engine("r", "w", "rollout", "m"))
    s.engine_up(Engine("t1", "w", "trainer", "m", state_capacity_bytes=100_000_000))
    s.engine_up(Engine("t2", "w", "trainer", "m", state_capacity_bytes=200_000_000))
    refused = s.admit("huge", "m", 0.0, state_bytes=300_000_000)
    assert refused == Admission(False, "state 300 MB does not fit any tier (largest: 200 MB)", None, None)
    assert s.admit("mid", "m", 0.0, state_bytes=150_000_000).trainer == "t2"  # t1 is emptier but too small
    assert s.admit("tiny", "m", 0.0, state_bytes=1_000_000).trainer == "t1"
    # unknown capacity (0) means no limit
    s.engine_up(Engine("t3", "w", "trainer", "m"))
    assert s.admit("huge", "m", 0.0, state_bytes=300_000_000).trainer == "t3"


def run_contention(s: Scheduler, jobs: dict[str, str], n_tasks: int, seconds: float = 1.0) -> dict[str, float]:
    """One rollout engine, every job keeps one task queued; returns engine-seconds per user."""
    served: dict[str, float] = {}
    tid = 0
    now = 0.0
    for job in jobs:
        tid += 1
        s.submit(task(tid, job, t=now))
    for _ in range(n_tasks):
        (p,) = s.tick(now)
        now += seconds
        s.done(p.task.task_id, now, seconds)
        served[jobs[p.task.job_id]] = served.get(jobs[p.task.job_id], 0.0) + seconds
        tid += 1
        s.submit(task(tid, p.task.job_id, t=now))
    return served


def test_fair_share_follows_user_weights():
    s = Scheduler("spread")
    s.engine_up(Engine("r", "w", "rollout", "m"))
    s.engine_up(Engine("t", "w", "trainer", "m"))
    s.admit("a1", "m", 0.0, user="alice")
    s.admit("a2", "m", 0.0, user="alice")  # alice has two jobs, bob one
    s.admit("b1", "m", 0.0, user="bob")
    even = run_contention(s, {"a1": "alice", "a2": "alice", "b1": "bob"}, 40)
    assert abs(even["alice"] - even["bob"]) <= 2.0  # per user, not per job

    s = Scheduler("spread")
    s.engine_up(Engine("r", "w", "rollout", "m"))
    s.engine_up(Engine("t", "w", "trainer", "m"))
    s.admit("a", "m", 0.0, user="alice")
    s.admit("b", "m", 0.0, user="bob")
    s.set_share("alice", 3.0)
    weighted = run_contention(s, {"a": "alice", "b": "bob"}, 40)
    assert abs(weighted["alice"] - 30.0) <= 2.0 and abs(weighted["bob"] - 10.0) <= 2.0


def test_fair_share_comes_after_priority_and_before_response_ratio():
    s = Scheduler()
    s.engine_up(Engine("r", "w", "rollout", "m"))
    s.engine_up(Engine("t", "w", "trainer", "m"))
    s.admit("a", "m", 0.0, user="alice")
    s.admit("b", "m", 0.0, user="bob")
    s.served["alice"] = 10.0
    s.submit(task(1, "a", t=0.0))  # waited longer: higher response ratio
    s.submit(task(2, "b", t=5.0))
    assert s.tick(5.0)[0].task.job_id == "b"
    s.done(2, 6.0, 1.0)
    s.submit(task(3, "a", t=6.0, prio=1))
    s.submit(task(4, "b", t=6.0))
    assert s.tick(6.0)[0].task.task_id == 3
    with pytest.raises(ValueError):
        s.set_share("bob", 0)


def test_a_jobs_trainer_calls_run_one_at_a_time_in_order():
    s = Scheduler()
    s.engine_up(Engine("r", "w", "rollout", "m"))
    s.engine_up(Engine("t", "w", "trainer", "m", capacity=2))
    s.estimates[("a", "train_step")] = 10.0
    s.estimates[("a", "publish")] = 0.1
    s.submit(task(1, "a", "trainer", "train_step"))
    s.submit(task(2, "a", "trainer", "publish"))
    assert [p.task.task_id for p in s.tick(1.0)] == [1]  # publish neither passes nor joins it
    s.done(1, 2.0, 10.0)
    assert [p.task.task_id for p in s.tick(2.0)] == [2]


def switch_run(max_switches: int) -> list[str]:
    """One trainer engine; b waits from t=0, a submits its next call half-way through each one."""
    s = Scheduler("spread", max_switches=max_switches)
    s.engine_up(Engine("r", "w", "rollout", "m"))
    s.engine_up(Engine("t", "w", "trainer", "m"))
    s.admit("a", "m", 0.0)
    s.admit("b", "m", 0.0)
    s.submit(task(1, "a", "trainer", "train_step", t=0.0))
    order = [p.task.job_id for p in s.tick(0.0)]
    s.submit(task(100, "b", "trainer", "train_step", t=0.0))
    now, next_a = 0.0, 2
    while s.engines["t"].running:
        if next_a <= 6:  # a's next call arrives while its previous one runs
            s.submit(task(next_a, "a", "trainer", "publish" if next_a % 2 else "train_step", t=now + 0.5))
            next_a += 1
        (running,) = s.engines["t"].running
        now += 1.0
        s.done(running, now, 1.0)
        order += [p.task.job_id for p in s.tick(now)]
    return order


def test_switch_bound_continues_a_job_for_at_most_max_switches_tasks():
    # by response ratio alone b (waiting since t=0) cuts in as soon as a's first call ends
    assert switch_run(0) == ["a", "b", "a", "a", "a", "a", "a"]
    assert switch_run(2) == ["a", "a", "b", "a", "a", "a", "a"]
    assert switch_run(4) == ["a", "a", "a", "a", "b", "a", "a"]


def test_switch_bound_never_overrides_priority():
    s = Scheduler("spread", max_switches=4)
    s.engine_up(Engine("r", "w", "rollout", "m"))
    s.engine_up(Engine("t", "w", "trainer", "m"))
    s.admit("a", "m", 0.0)
    s.admit("b", "m", 0.0)
    s.submit(task(1, "a", "trainer", "train_step"))
    s.submit(task(2, "a", "trainer", "publish"))
    s.tick(0.0)
    s.submit(task(3, "b", "trainer", "train_step", prio=1))
    s.done(1, 1.0, 1.0)
    assert s.tick(1.0)[0].task.job_id == "b"


def test_upcoming_lists_a_trainers_jobs_in_run_order():
    s = Scheduler("spread", max_switches=1)
    s.engine_up(Engine("r", "w", "rollout", "m"))
    s.engine_up(Engine("t", "w", "trainer", "m"))
    for j in ("a", "b", "c", "d"):
        s.admit(j, "m", 0.0)
    assert s.upcoming("t") == [] and s.expected("t") == ["a", "b", "c", "d"]  # none has run: admission order
    s.submit(task(1, "d", "trainer", "train_step", t=0.0))
    s.tick(0.0)  # d runs; the others queue behind it
    s.submit(task(2, "a", "trainer", "train_step", t=3.0))
    s.submit(task(3, "b", "trainer", "train_step", t=1.0))
    s.submit(task(4, "c", "trainer", "train_step", t=2.0, prio=1))
    s.submit(task(5, "b", "trainer", "publish", t=1.0))
    assert s.upcoming("t", now=4.0) == ["c", "b", "a"]  # priority, then longest wait
    assert s.expected("t", now=4.0) == ["c", "b", "a", "d"]  # d runs here: needed last
    s.done(1, 4.0, 1.0)
    assert [p.task.job_id for p in s.tick(4.0)] == ["c"]
    s.done(4, 5.0, 1.0)
    assert [p.task.job_id for p in s.tick(5.0)] == ["b"]
    # b's publish (queued since t=1, behind its running train_step) waited longer than a's call
    assert s.upcoming("t") == ["b", "a"]
    assert s.upcoming("r") == []


def test_expected_orders_every_trainer_job_by_when_it_should_call_next():
    s = Scheduler("spread")
    s.engine_up(Engine("r", "w", "rollout", "m", capacity=4))
    s.engine_up(Engine("t", "w", "trainer", "m"))
    for j in ("a", "b", "c", "d", "e"):
        s.admit(j, "m", 0.0)
    # learned estimates: a's rollouts take 10 s, b's 2 s
    for tid, job, took in ((1, "a", 10.0), (2, "b", 2.0)):
        s.submit(task(tid, job, t=0.0))
        s.tick(0.0)
        s.done(tid, took, took)
    s.submit(task(3, "c", "trainer", "train_step", t=0.0))
    s.tick(0.0)
    s.done(3, 1.0, 1.0)  # c trained last: a new rollout is ahead of it
    s.submit(task(4, "d", t=0.0))
    s.tick(0.0)
    s.done(4, 3.0, 3.0)  # d's rollout ended, it scores now: its trainer call comes first
    s.submit(task(5, "a", t=20.0))  # expected to end at 30
    s.submit(task(6, "b", t=21.0))  # expected to end at 23
    s.tick(21.0)
    s.submit(task(7, "c", "trainer", "train_step", t=22.0))
    s.submit(task(8, "e", "trainer", "train_step", t=22.0))  # queued: upcoming comes before all
    assert [p.task.job_id for p in s.tick(22.0)] == ["c"]  # c runs (its state is on the device), e queues
    assert s.upcoming("t") == ["e"]
    assert s.expected("t") == ["e", "d", "b", "a", "c"]  # c, running here, is needed last
    assert s.expected("r") == s.upcoming("r")
    s.done(6, 23.0, 2.0)  # b's rollout ended: it scores, like d (whose ended first)
    assert s.expected("t") == ["e", "d", "b", "a", "c"]
    s.done(5, 24.0, 4.0)
    assert s.expected("t") == ["e", "d", "b", "a", "c"]


def test_bubble_ratio_and_utilization_on_a_hand_computed_timeline():
    s = Scheduler()
    s.engine_up(Engine("r", "w", "rollout", "m", capacity=2), now=0.0)
    s.engine_up(Engine("t", "w", "trainer", "m"), now=0.0)
    # r: [0, 4] and [2, 6] overlap -> busy 6; t: [4, 6] -> busy 2
    s.submit(task(1, "a", t=0.0))
    s.tick(0.0)
    s.submit(task(2, "b", t=2.0))
    s.tick(2.0)
    s.done(1, 4.0)
    s.submit(task(3, "a", "trainer", "train_step", t=4.0))
    s.tick(4.0)
    s.done(2, 6.0)
    s.done(3, 6.0)
    assert s.engines["r"].busy_seconds == 6.0
    assert s.engines["r"].busy_by_job == {"a": 4.0, "b": 4.0}
    assert list(s.intervals) == [
        ("r", "a", "generate", 0.0, 4.0),
        ("r", "b", "generate", 2.0, 6.0),
        ("t", "a", "train_step", 4.0, 6.0),
    ]
    assert s.utilization("r", now=10.0, since=0.0) == pytest.approx(0.6)
    assert s.utilization("t", now=10.0, since=0.0) == pytest.approx(0.2)
    assert s.utilizations(now=10.0, since=0.0) == pytest.approx({"r": 0.6, "t": 0.2})
    assert s.bubble_ratio(now=10.0, since=0.0) == pytest.approx(1 - 8 / 20)
    assert s.bubble_ratio(now=10.0, since=5.0) == pytest.approx(1 - 2 / 10)  # r 5-6, t 5-6
    # a running task counts up to now
    s.submit(task(4, "a", "trainer", "publish", t=8.0))
    s.tick(8.0)
    assert s.bubble_ratio(now=10.0, since=0.0) == pytest.approx(1 - 10 / 20)
    # an engine counts only from when it came up
    s.engine_up(Engine("late", "w", "rollout", "m"), now=9.0)
    assert s.bubble_ratio(now=10.0, since=0.0) == pytest.approx(1 - 10 / 21)


def test_release_frees_homes_and_drops_queued_tasks_and_estimates():
    s = cluster("spread", 1, 1)
    s.admit("a", "m", 0.0)
    s.submit(task(1, "a", "trainer", "train_step"))
    s.submit(task(2, "a", "trainer", "publish"))
    s.tick(0.0)
    s.done(1, 1.0, 1.0)
    dropped = s.release("a")
    assert [t.task_id for t in dropped] == [2]
    assert s.queue == {} and "a" not in s.home and s.home_of("a", "trainer") is None
    assert ("a", "train_step") not in s.estimates
    assert s.forget_job("a") == []


def test_engine_loss_rehomes_jobs():
    s = cluster("spread", 2, 2)
    s.admit("a", "m", 0.0)
    s.submit(task(1, "a", "trainer", "train_step"))
    s.tick(0.0)
    s.state_location("a", "t0", "device")
    assert [t.task_id for t in s.engine_down("t0")] == [1]
    assert s.home_of("a", "trainer") == "t1"  # its task needed a home again
    assert [(p.task.task_id, p.engine_id) for p in s.tick(1.0)] == [(1, "t1")]


def test_scale_1000_jobs_on_2048_engines():
    """10,000 calls of 1,000 jobs through submit/tick/done on a simulated clock.

    Each job loops: two generate calls at once (a group split in two), reward time, then
    train_step and publish; after 30 % of publishes its state is offloaded to host memory.
    1,536 one-slot rollout engines and 512 trainers (two jobs each), spread+backfill.
    """
    rng = random.Random(7)
    s = Scheduler()
    for i in range(1536):
        s.engine_up(Engine(f"r{i}", f"w{i // 6}", "rollout", "m"), now=0.0)
    for i in range(512):
        s.engine_up(Engine(f"t{i}", f"w{i // 2}", "trainer", "m"), now=0.0)
    for j in range(1000):
        assert s.admit(f"j{j}", "m", 0.0, user=f"u{j % 10}").ok
    phase = {f"j{j}": "generate" for j in range(1000)}
    outstanding = dict.fromkeys(phase, 0)
    events: list[tuple[float, int, str, object]] = []
    seq = tids = finished = backfilled = moved = 0
    trainer_home = {j: s.home_of(j, "trainer") for j in phase}
    latencies = []

    def push(at: float, kind: str, what: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, what))

    for j in phase:
        push(rng.uniform(0.0, 5.0), "submit", j)
    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "submit":
            calls = 2 if phase[what] == "generate" else 1
            for _ in range(min(calls, 10_000 - tids)):
                tids += 1
                outstanding[what] += 1
                method = phase[what]
                s.submit(Task(tids, what, "rollout" if method == "generate" else "trainer", method, "m", now))
        else:
            t, took = what
            s.done(t.task_id, now, took)
            finished += 1
            outstanding[t.job_id] -= 1
            if outstanding[t.job_id] == 0:
                nxt = {"generate": "train_step", "train_step": "publish", "publish": "generate"}
                phase[t.job_id] = nxt[t.method]
                if t.method == "publish" and rng.random() < 0.3:
                    s.state_location(t.job_id, s.home_of(t.job_id, "trainer"), "host")  # offloaded
                think = rng.expovariate(1 / 2.0) if t.method == "generate" else 0.05  # rewards, tools
                push(now + think, "submit", t.job_id)
        t0 = time.perf_counter()
        placed = s.tick(now)
        latencies.append(time.perf_counter() - t0)
        for p in placed:
            if p.task.kind == "rollout":
                backfilled += p.engine_id != s.home_of(p.task.job_id, "rollout")
            else:
                moved += p.engine_id != trainer_home[p.task.job_id]
                trainer_home[p.task.job_id] = p.engine_id
            took = {"generate": rng.uniform(2, 20), "train_step": rng.uniform(1, 4), "publish": 0.3}[p.task.method]
            push(now + took, "done", (p.task, took))
    assert tids == finished == 10_000 and not s.queue
    assert backfilled > 0 and moved > 0  # the run exercised both kinds of backfill
    q = statistics.quantiles(latencies, n=100)
    print(
        f"\ntick latency over {len(latencies)} ticks at 1,000 jobs / 2,048 engines: "
        f"p50 {q[49] * 1e6:.0f} us, p99 {q[98] * 1e6:.0f} us, max {max(latencies) * 1e6:.0f} us; "
        f"{backfilled} rollout calls backfilled, {moved} trainer homes moved; "
        f"bubble ratio {s.bubble_ratio(now, 0.0):.2f}"
    )


def check_indexes(s: Scheduler) -> None:
    """The incremental indexes agree with a from-scratch view (white-box)."""
    queued = {tid for job in s.jobs.values() for tid in job.queued}
    assert queued == set(s.queue)
    assert not set(s.queue) & set(s._running)
    for job in s.jobs.values():
        for kind, home in job.homes.items():
            assert job.job_id in s.homes.homed[home] and s.engines[home].kind == kind
        assert job.running.get("trainer", 0) <= 1
    for eid, engine in s.engines.items():
        assert all(s.jobs[j].homes.get(engine.kind) == eid for j in s.homes.homed[eid])
        assert eid in s.homes.buckets[engine.key][len(s.homes.homed[eid])]
        assert (eid in s.queues.free.get(engine.key, {})) == (engine.free > 0)
        if engine.free > 0:
            assert not s.queues.pending[eid], "a free engine left tasks queued for it"
        for tid, t in s.queues.pending[eid].items():
            job = s.jobs[t.job_id]
            assert s.queues._where[tid] == eid and job.homes[t.kind] == eid
            movable = s.policy.backfills() and (t.kind == "rollout" or job.state_tier is None)
            assert (tid in s.queues.waiting.get(engine.key, {})) == (engine.free <= 0 and movable)
    if s.policy.dedicates_engines():
        assert all(len(h) <= 1 for h in s.homes.homed.values())
    else:
        assert all(len(h) <= (s.job_room(e) or len(h)) for e, h in s.homes.homed.items())
    assert {j: e for j in s.jobs for k, e in s.jobs[j].homes.items() if k == "trainer"} == s.home
    running = sum(len(e.running) for e in s.engines.values())
    assert running == len(s._running)
    for tid, t in s.queue.items():  # every queued task is either eligible or behind its job's call
        job = s.jobs[t.job_id]
        eligible = t.kind == "rollout" or (not job.running.get(t.kind) and job.serial[t.kind][0] is t)
        assert (tid in s.queues._where) == eligible
    limit = 1 if s.policy.dedicates_engines() else s.jobs_per_engine
    if s.policy.backfills():  # nothing movable waits while a suitable engine is idle
        for key, waiting in s.queues.waiting.items():
            idle = [e for e in s.homes.by_key.get(key, ()) if s.engines[e].free > 0]
            for t in waiting.values():
                job = s.jobs[t.job_id]
                assert not [
                    e
                    for e in idle
                    if t.kind == "rollout"
                    or (len(s.homes.homed[e]) < limit and s.homes.fits(s.engines[e], job.state_bytes))
                ], (t, idle)
    for t in s.queues.homeless.values():  # a task lacks a home only while no engine has room
        assert all(len(s.homes.homed[e]) >= limit for e in s.homes.by_key.get((t.kind, t.model), ()))


@pytest.mark.parametrize("policy", POLICIES)
def test_indexes_stay_consistent_under_random_events(policy):
    rng = random.Random(policy)
    s = Scheduler(policy, jobs_per_engine=3, max_switches=2)
    engines = 0

    def add_engine(kind: str) -> None:
        nonlocal engines
        engines += 1
        s.engine_up(Engine(f"{kind}{engines}", "w", kind, "m", capacity=rng.choice([1, 1, 2])), now=0.0)

    for _ in range(3):
        add_engine("rollout")
        add_engine("trainer")
    jobs = [f"j{i}" for i in range(12)]
    now, tid = 0.0, 0
    for _ in range(3000):
        now += rng.random()
        op = rng.random()
        if op < 0.35:
            tid += 1
            kind = rng.choice(["rollout", "trainer"])
            s.submit(
                Task(
                    tid,
                    rng.choice(jobs),
                    kind,
                    "generate" if kind == "rollout" else "train_step",
                    "m",
                    now,
                    rng.choice([0, 0, 1]),
                )
            )
        elif op < 0.65:
            running = [t for e in s.engines.values() for t in e.running]
            if running:
                s.done(rng.choice(running), now, rng.random() * 3)
        elif op < 0.72:
            s.admit(rng.choice(jobs), "m", now, user=rng.choice(["x", "y"]))
        elif op < 0.77:
            s.release(rng.choice(jobs))
        elif op < 0.85:
            job = s.jobs.get(rng.choice(jobs))
            if job is not None and job.homes.get("trainer"):
                # the state manager only loads state where the core left room for it
                limit = 1 if s.policy.dedicates_engines() else s.jobs_per_engine
                room = [e for e in s.engines if len(s.homes.homed[e]) < limit]
                s.state_location(
                    job.job_id, rng.choice([job.homes["trainer"], *room]), rng.choice(["device", "host", "nvme", None])
                )
        elif op < 0.88 and len(s.engines) > 2:
            s.engine_down(rng.choice(list(s.engines)))
        elif op < 0.91:
            add_engine(rng.choice(["rollout", "trainer"]))
        s.tick(now)
        check_indexes(s)


# -- weights: grouping calls by the weights their engine must hold, devices that take turns


def wtask(tid: int, job: str, weights: str, model: str = "m", t: float = 0.0) -> Task:
    return Task(tid, job, "rollout", "generate", model, t, 0, weights)


def test_calls_are_grouped_by_weights_and_a_switch_waits_for_the_engine_to_drain():
    s = Scheduler(max_group=3)
    s.engine_up(Engine("r", "w0", "rollout", "m", capacity=2, holds="base"))
    s.set_switch_estimate("full@v1", 5.0)
    # a full fine-tuning job's generate comes first, yet the engine holds the base: the LoRA
    # jobs' calls (base weights) go first while the group may grow
    s.submit(wtask(1, "full", "full@v1", t=0.0))
    s.submit(wtask(2, "a", "base", t=0.1))
    s.submit(wtask(3, "b", "base", t=0.2))
    assert sorted(p.task.task_id for p in s.tick(1.0)) == [2, 3]
    s.done(2, 2.0, 1.0)
    assert s.tick(2.0) == []  # a free slot, but the switch waits for task 3: no two weights at once
    s.submit(wtask(4, "a", "base", t=2.0))
    assert [p.task.task_id for p in s.tick(2.0)] == [4]  # group of 3 reached: no more base calls after this one
    s.submit(wtask(5, "b", "base", t=2.5))
    assert s.tick(2.5) == []  # the engine drains for the switch
    s.done(3, 3.0, 1.0)
    s.done(4, 3.0, 1.0)
    assert [p.task.task_id for p in s.tick(3.0)] == [1]  # the switch, alone
    engine = s.engines["r"]
    assert (engine.holds, engine.switches) == ("full@v1", 1)
    assert s.charged[""] == pytest.approx(s.estimate(wtask(1, "full", "")) / 2 + 5.0)  # the switch is charged
    s.done(1, 9.0, seconds=1.0, switch_seconds=6.0)
    assert s.switch_estimate("full@v1") == pytest.approx((1 - EMA) * 5.0 + EMA * 6.0)  # learned from what it took
    assert [p.task.task_id for p in s.tick(9.0)] == [5]  # and back: a second switch
    assert engine.switches == 2


def test_engines_that_take_turns_on_a_device_never_run_at_once_and_switch_once_per_group():
    s = Scheduler(max_group=4)
    s.engine_up(Engine("w0/a", "w0", "rollout", "ma", capacity=2, device="w0", holds="ma"))
    s.engine_up(Engine("w0/b", "w0", "rollout", "mb", capacity=2, device="w0", holds="mb"))  # up last: awake
    s.submit(wtask(1, "ja", "ma", model="ma", t=0.0))
    s.submit(wtask(2, "jb", "mb", model="mb", t=0.1))
    s.submit(wtask(3, "ja2", "ma", model="ma", t=0.2))
    assert [p.engine_id for p in s.tick(1.0)] == ["w0/b"]  # the awake engine serves; a's wait for it
    s.submit(wtask(4, "jb", "mb", model="mb", t=1.0))
    assert [p.task.task_id for p in s.tick(1.0)] == [4]
    s.done(2, 2.0, 1.0)
    assert s.tick(2.0) == []  # b still runs task 4
    s.done(4, 3.0, 1.0)
    woke = s.tick(3.0)
    assert sorted(p.task.task_id for p in woke) == [1, 3] and {p.engine_id for p in woke} == {"w0/a"}
    assert s.engines["w0/a"].switches == 1 and s.engines["w0/b"].switches == 0  # one wake for the group


@pytest.mark.parametrize("seed", range(5))
def test_weights_and_turns_hold_under_random_arrivals_and_every_call_runs(seed: int):
    rng = random.Random(seed)
    s = Scheduler(max_group=4)
    s.engine_up(Engine("w0/a", "w0", "rollout", "ma", capacity=3, device="w0", holds="ma"))
    s.engine_up(Engine("w0/b", "w0", "rollout", "mb", capacity=3, device="w0", holds="mb"))
    jobs = [("la", "ma", "ma"), ("lb", "mb", "mb"), ("fa", "ma", "fa@v1"), ("fb", "mb", "fb@v1")]
    running: dict[int, tuple[str, str, float]] = {}  # task -> engine, weights, end
    now, tid, ran, switches_fifo, last = 0.0, 0, 0, 0, None
    for _ in range(400):
        now += rng.expovariate(12.0)  # calls queue up: more than the device serves
        if rng.random() < 0.6:
            tid += 1
            job, model, weights = rng.choice(jobs)
            s.submit(wtask(tid, job, weights, model=model, t=now))
            switches_fifo += (model, weights) != last  # served in arrival order, one switch per change
            last = (model, weights)
        for task_id, (_, _, end) in sorted(running.items()):
            if end <= now:
                del running[task_id]
                s.done(task_id, now, 0.3)
        for p in s.tick(now):
            running[p.task.task_id] = (p.engine_id, p.task.weights, now + rng.uniform(0.1, 0.5))
            ran += 1
        busy = {e for e, _, _ in running.values()}
        assert len(busy) <= 1, busy  # one engine of the device at a time
        for e in busy:
            assert len({w for en, w, _ in running.values() if en == e}) == 1  # one set of weights on it
    while running or s.queue:
        now += 0.5
        for task_id in list(running):
            del running[task_id]
            s.done(task_id, now, 0.3)
        for p in s.tick(now):
            running[p.task.task_id] = (p.engine_id, p.task.weights, now)
            ran += 1
    assert ran == tid  # nothing starves
    switches = sum(e.switches for e in s.engines.values())
    assert switches < switches_fifo / 2  # grouped: far fewer switches than serving in arrival order


def pass_cluster(window: float | None, budget: int = 100) -> Scheduler:
    s = Scheduler("spread", pass_window=window)
    s.engine_up(Engine("r0", "w0", "rollout", "m", capacity=4, job_slots=16), now=0.0)
    s.engine_up(Engine("t0", "w0", "trainer", "m", pass_tokens=budget), now=0.0)
    for job in "abcd":
        assert s.admit(job, "m", 0.0).ok
    return s


def step(task_id: int, job: str, at: float, tokens: int = 30, priority: int = 0) -> Task:
    return Task(task_id, job, "trainer", "train_step", "m", at, priority, tokens=tokens)


def test_train_steps_share_a_pass_in_their_order_up_to_the_budget_waiting_at_most_the_window():
    s = pass_cluster(0.005)
    s.submit(step(1, "a", 0.0))
    assert s.tick(0.001) == [] and s.next_wake() == 0.005  # 1 of the 4 jobs homed there has a step queued
    s.submit(step(2, "b", 0.002))
    s.submit(step(3, "c", 0.002, priority=1))
    assert s.tick(0.003) == []
    s.submit(step(4, "d", 0.003))
    placed = s.tick(0.004)  # all 4 queued: no more waiting; 3 x 30 tokens fit the budget of 100, not 4
    assert [(p.task.job_id, p.lead) for p in placed] == [("c", 0), ("a", 3), ("b", 3)]  # priority leads
    t0 = s.engines["t0"]
    assert t0.free == 0 and (t0.last_pass, t0.shared_passes, t0.shared_tasks) == (3, 1, 3)
    for task_id in (3, 1, 2):
        s.done(task_id, 1.004, seconds=1.0)
    assert s.served[""] == pytest.approx(1.0)  # each served a third of the pass's second
    assert [(p.task.job_id, p.lead) for p in s.tick(1.004)] == [("d", 0)]  # past its window: alone
    assert t0.last_pass == 1 and t0.shared_passes == 1


def test_a_lone_step_waits_for_company_no_longer_than_the_window_and_never_without_grouping():
    s = pass_cluster(0.005)
    s.submit(step(1, "a", 0.0))
    assert s.tick(0.004) == []
    assert [p.task.task_id for p in s.tick(0.005)] == [1]
    alone = pass_cluster(None)
    for i, job in enumerate("abcd", 1):
        alone.submit(step(i, job, 0.0))
    assert [(p.task.task_id, p.lead) for p in alone.tick(0.0)] == [(1, 0)]  # one at a time
    assert alone.next_wake() is None


def test_steps_that_cannot_share_run_alone_and_a_step_over_the_budget_ends_the_pass():
    s = pass_cluster(0.0, budget=100)
    s.submit(step(1, "a", 0.0))
    s.submit(step(2, "b", 0.0, tokens=0))  # full fine-tuning or LoRA dropout: not shareable
    s.submit(step(3, "c", 0.0, tokens=90))  # does not fit beside a's 30: the pass ends there
    s.submit(step(4, "d", 0.0, tokens=10))
    assert [(p.task.task_id, p.lead) for p in s.tick(0.0)] == [(1, 0)]
    s.done(1, 1.0)
    assert [(p.task.task_id, p.lead) for p in s.tick(1.0)] == [(2, 0)]
    s.done(2, 2.0)
    assert [(p.task.task_id, p.lead) for p in s.tick(2.0)] == [(3, 0), (4, 3)]


def test_a_sleeping_engine_may_take_a_backfill_when_no_engine_of_its_device_waits() -> None:
    """An engine that shares a device and is not awake asks for its turn with nothing of its own
    waiting (a backfill): with no engine of the device waiting either, it gets the device, rather
    than the scheduler failing on an empty choice."""
    from daemon.sched_records import Engine
    from daemon.switches import Switches

    a = Engine("w/rollout", "w", "rollout", "m0", device="gpu0")
    b = Engine("w/m1/rollout", "w", "rollout", "m1", device="gpu0")
    engines = {a.engine_id: a, b.engine_id: b}
    switches = Switches(engines, max_group=4)
    switches.add_engine(a)
    switches.add_engine(b)  # b came up last: awake
    assert switches.device_turn(a, {}, lambda t: (0,)) is True
    waiting = {b.engine_id: {1: object()}}
    assert switches.device_turn(a, waiting, lambda t: (0,)) is False  # the awake engine keeps its turn


def test_interactive_calls_go_first_while_their_class_is_under_its_share_and_batch_work_is_never_starved():
    """An API request a client waits on (``Task.interactive``) passes batch work of its priority
    while the interactive class has less than half of recent engine time; past it, the batch
    work's turn comes; the share forgets (half-life 60 s), so the class goes first again later."""
    from daemon.task_order import INTERACTIVE_SHARE, SHARE_HALF_LIFE_S

    s = Scheduler()
    s.engine_up(Engine("e", "w", "rollout", "m"))
    for job, user in (("batch", "alice"), ("api", "bob")):
        s.admit(job, "m", 0.0, user=user)
    s.submit(task(1, "batch", t=0.0))  # waited longest: the response ratio alone would run it first
    s.submit(Task(2, "api", "rollout", "generate", "m", 5.0, interactive=True))
    assert s.tick(5.0)[0].task.task_id == 2
    s.done(2, 9.0, 4.0)  # the class has had all of recent engine time
    assert s.interactive(9.0) == (1.0, 0) and 1.0 >= INTERACTIVE_SHARE
    s.submit(Task(3, "api", "rollout", "generate", "m", 9.0, interactive=True))
    assert s.tick(9.0)[0].task.task_id == 1  # past its share: the batch work goes
    assert s.interactive(9.0) == (1.0, 1)
    s.done(1, 12.0, 3.0)
    share, queued = s.interactive(12.0)
    assert share == pytest.approx(
        4.0 * 0.5 ** (3.0 / SHARE_HALF_LIFE_S) / (4.0 * 0.5 ** (3.0 / SHARE_HALF_LIFE_S) + 3.0)
    )
    assert s.tick(12.0)[0].task.task_id == 3 and queued == 1
    # a priority above it still comes first
    s.done(3, 13.0, 1.0)
    s.submit(task(4, "batch", t=13.0, prio=1))
    s.submit(Task(5, "api", "rollout", "generate", "m", 13.0, interactive=True))
    assert s.tick(13.0)[0].task.task_id == 4
