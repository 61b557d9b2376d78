"""A call sent to follow another (``CallReq.after``): the next step's generate, sent with the
step's ``train_and_publish``, samples from the adapter that call publishes and starts the
moment it lands, without a trip back to the driver in between.

- Its job's rollout engine on the trainer's worker, idle: the daemon sends the generate to the
  worker with the train step (``TaskBody.after``); the worker holds it and starts it as the
  step ends (no trip through the daemon either), or fails it if the step failed.
- Otherwise the daemon holds it and places it when the step's result comes in.

The daemon's side on its core (real journal, no socket) driven with the messages a driver and
a worker send; the worker's on its real trainer loop, on a real StateStore and TrainerEngine.
"""

from __future__ import annotations

import queue
import threading

import msgspec

from plexctl.common import calls as C
from plexctl.common import protocol as P
from tests.conftest import bind_worker_outbox
from tests.test_daemon_recovery import adopted_job
from tests.test_repeated_calls import train_task
from tests.test_state_store import engine, tiny_qwen2
from worker import io as worker_io
from worker import servers as worker_servers
from worker.state.store import StateStore

GENERATE = C.GenerateReq(["1+1="], P.Sampling(max_tokens=4))
TRAIN_AND_PUBLISH = C.TrainStepReq(P.TrainBatch([], [], [], []), publish=True)


def placed_job(d, tiny_model, name: str, split: bool = False) -> str:
    """A running job whose trainer state is on worker w1; its rollout engine on w1 too, or,
    ``split``, on w0 (w0 a rollout-only worker, w1 a trainer-only one)."""
    job = adopted_job(d, tiny_model, name)
    for worker, kinds in (("w0", ("rollout",)), ("w1", ("trainer",))) if split else (("w1", ("rollout", "trainer")),):
        engines = [P.EngineDecl(f"{worker}/{k}", k, str(tiny_model), 4 if k == "rollout" else 1) for k in kinds]
        resident = {job: "w1/trainer"} if worker == "w1" else {}
        d.send(worker.encode(), P.Op.REGISTER, P.RegisterReq(worker, "node", 1, engines, True, resident=resident))
    d.chores()
    assert job not in d.jobs.adopting
    d.sent.clear()  # the registrations' replies
    return job


def sent(d) -> list[tuple[bytes, object]]:
    """What the daemon sent since the last look, as (opcode, body), prefetch hints left out."""
    out = [(op, body) for _, op, body in d.sent if op != P.Op.PREFETCH]
    d.sent.clear()
    return out


def train_then_generate(d, job: str) -> list[tuple[bytes, object]]:
    """The driver's step: train_and_publish (call 1), then the next generate to follow it
    (call 2); the daemon places what it can. What it sent."""
    drv = f"drv:{job}".encode()
    d.send(drv, P.Op.CALL, P.CallReq(job, TRAIN_AND_PUBLISH), msg_id=1)
    d.send(drv, P.Op.CALL, P.CallReq(job, GENERATE, after=1), msg_id=2)
    d.place()
    return sent(d)


def task_of(d, method: str) -> int:
    (task_id,) = [tid for tid, call in d.calls.items() if call.method == method]
    return task_id


def test_a_generate_to_follow_a_publish_goes_to_the_worker_with_it_and_starts_as_it_ends(core, tiny_model):
    d = core
    job = placed_job(d, tiny_model, "ahead")
    out = train_then_generate(d, job)
    train, gen = task_of(d, "train_step"), task_of(d, "generate")
    assert [(op, body.method, body.task_id, body.after) for op, body in out] == [
        (P.Op.TASK, "train_step", train, 0),
        (P.Op.TASK, "generate", gen, train),
    ]  # both on their way
    assert out[1][1].engine_id == "w1/rollout"
    assert out[1][1].task.request.adapter.version == 1  # from the adapter the step publishes
    assert not d.sched.engines["w1/rollout"].running  # not started yet: it waits for the step
    d.send(b"w1", P.Op.RESULT, P.ResultBody(train, True, C.TrainStepResult({"loss": 0.5}), seconds=0.1))
    assert sent(d) == [(P.Op.REPLY, C.TrainStepRep({"loss": 0.5}, version=1))]  # no second task
    assert list(d.sched.engines["w1/rollout"].running) == [gen]  # started as the step ended
    d.send(b"w1", P.Op.RESULT, P.ResultBody(gen, True, C.GenerateResult([]), seconds=0.1))
    assert sent(d) == [(P.Op.REPLY, C.GenerateRep([], policy_version=1))]
    assert not d.sched.engines["w1/rollout"].running and d.jobs.runtimes[job].held_calls == {}


def test_a_generate_to_follow_a_publish_on_another_worker_waits_in_the_daemon(core, tiny_model):
    d = core
    job = placed_job(d, tiny_model, "held", split=True)
    assert [(op, body.method) for op, body in train_then_generate(d, job)] == [(P.Op.TASK, "train_step")]
    d.send(b"w1", P.Op.RESULT, P.ResultBody(task_of(d, "train_step"), True, C.TrainStepResult({"loss": 0.5})))
    (task, reply) = sent(d)  # the generate on its way before the driver hears
    assert task[0] == P.Op.TASK and (task[1].method, task[1].engine_id, task[1].after) == ("generate", "w0/rollout", 0)
    assert task[1].task.request.adapter.version == 1
    assert reply == (P.Op.REPLY, C.TrainStepRep({"loss": 0.5}, version=1))
    # a call to follow one that is over already starts at once
    d.send(f"drv:{job}".encode(), P.Op.CALL, P.CallReq(job, GENERATE, after=1), msg_id=3)
    d.place()
    assert [(op, body.method) for op, body in sent(d)] == [(P.Op.TASK, "generate")]


def test_a_call_held_to_follow_a_failed_one_fails_too(core, tiny_model):
    d = core
    job = placed_job(d, tiny_model, "failed", split=True)
    train_then_generate(d, job)
    d.send(b"w1", P.Op.RESULT, P.ResultBody(task_of(d, "train_step"), False, error="loss is nan"))
    d.place()
    errors = [(body.code, body.message) for op, body in sent(d)]  # and no task
    assert errors == [
        ("call_failed", "train_step failed: loss is nan"),
        ("call_failed", "generate was to follow train_step, which failed"),
    ]
    assert d.jobs.runtimes[job].held_calls == {}


def test_the_worker_starts_a_task_sent_ahead_as_the_one_it_follows_ends_or_fails_it(tmp_path):
    store = StateStore(engine(tiny_qwen2(tmp_path / "model")), device_slots=1, host_bytes=1 << 30)
    tasks: queue.Queue[P.TaskBody] = queue.Queue()
    followers = worker_io.Followers()
    followers.route = tasks.put  # what the I/O thread's router does with a released task
    outbox = bind_worker_outbox()
    try:
        threading.Thread(target=worker_servers.trainer_loop, args=(store, tasks, followers), daemon=True).start()

        def results(n: int) -> list[P.ResultBody]:
            out = []
            for _ in range(n):
                assert outbox.poll(120_000), "no result from the trainer loop"
                out.append(P.decode(outbox.recv_multipart())[2])
            return out

        step = P.TaskBody(1, "j0", "w/trainer", train_task(0, publish_dir=str(tmp_path / "v1")))
        then = P.TaskBody(2, "j0", "w/trainer", train_task(1), after=1)
        assert followers.admit(then) is None  # held: task 1 has not run
        tasks.put(step)
        got = results(2)
        assert [(r.task_id, r.ok) for r in got] == [(1, True), (2, True)], [r.error for r in got]
        assert followers.admit(P.TaskBody(5, "j0", "w/trainer", train_task(2), after=2)) is True  # 2 is over
        assert followers.admit(P.TaskBody(4, "j0", "w/trainer", train_task(2), after=3)) is None
        bad = msgspec.structs.replace(train_task(2), batch=P.TrainBatch([["?"]], [[1]], [[0.0]], [1.0]))  # type: ignore[list-item]
        tasks.put(P.TaskBody(3, "j0", "w/trainer", bad))
        got = results(2)
        assert [(r.task_id, r.ok) for r in got] == [(3, False), (4, False)]
        assert got[1].error == "train_step was to follow task 3, which failed"
        assert tasks.empty()  # task 4 never ran
    finally:
        outbox.close(linger=0)
