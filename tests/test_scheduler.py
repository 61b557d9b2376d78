"""The scheduler core with an injected clock: placement, capacity, affinity, fairness."""

from daemon.scheduler import Engine, Scheduler, Task


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
