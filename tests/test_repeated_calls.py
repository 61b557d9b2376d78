"""A trainer call that arrives twice is applied once.

A driver whose daemon died sends its calls in flight again to the daemon that adopts it; the
first copy may already have run on the worker (its result went to the dead daemon). The
worker's trainer loop (real, on a real StateStore and TrainerEngine) answers the repeat with
the first result and leaves the job's state as one step left it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import zmq

from plexctl.common import calls as C
from plexctl.common import protocol as P
from tests.conftest import bind_worker_outbox
from tests.test_state_store import JOBS, assert_like_alone, batch_for, engine, job_state, tiny_qwen2
from worker import servers as worker_servers
from worker.state.store import StateStore


def train_task(step: int, call_key: str = "", publish_dir: str = "") -> C.TrainStepTask:
    """A train_step task for job j0's ``step``, as the daemon sends it."""
    lora, seed, hp = JOBS["j0"]
    trainer = C.TrainerContext(lora, seed, call_key=call_key)
    return C.TrainStepTask(trainer, batch_for("j0", step), hp, publish_dir=publish_dir)


def trainer_loop(model_dir: str, outbox: zmq.Socket) -> tuple[StateStore, Callable[[int, C.TrainStepTask], Any]]:
    """The worker's trainer loop on its own thread, and a function that gives it one j0
    train_step task and returns the result's value (the result comes back on ``outbox``)."""
    store = StateStore(engine(model_dir), device_slots=1, host_bytes=1 << 30)
    tasks: queue.Queue[P.TaskBody] = queue.Queue()
    threading.Thread(target=worker_servers.trainer_loop, args=(store, tasks), daemon=True).start()

    def serve(task_id: int, task: C.TrainStepTask) -> Any:
        tasks.put(P.TaskBody(task_id, "j0", "w/trainer", task))
        assert outbox.poll(120_000), "no result from the trainer loop"
        _op, _header, result = P.decode(outbox.recv_multipart())
        assert result.task_id == task_id and result.ok, result.error
        return result.value.metrics

    return store, serve


def test_a_repeated_train_step_is_applied_once(tmp_path) -> None:
    model_dir = tiny_qwen2(tmp_path / "model")
    lora, seed, hp = JOBS["j0"]
    reference = engine(model_dir)  # the job alone, each step once
    reference.ensure_job("j0", lora, seed)
    once = []
    for step in range(2):
        reference.train_step("j0", batch_for("j0", step), hp)
        once.append(job_state(reference, "j0"))
    outbox = bind_worker_outbox()
    try:
        store, serve = trainer_loop(model_dir, outbox)

        def train(task_id: int, step: int, key: str) -> dict[str, Any]:
            return serve(task_id, train_task(step, call_key=key))

        first = train(1, 0, "4242:7")
        again = train(2, 0, "4242:7")  # the same call, sent again after a reconnect
        assert again == first
        assert_like_alone(store.trainer, "j0", once[0])  # one step applied, not two
        train(3, 1, "4242:9")  # the next call is applied as usual
        assert_like_alone(store.trainer, "j0", once[1])
    finally:
        outbox.close(linger=0)


def test_a_train_step_that_publishes_saves_the_adapter_after_the_step(tmp_path) -> None:
    """``train_and_publish``: the worker runs the step, then saves the adapter the rollout engine
    loads next, in the one task; the saved adapter is the stepped one, and a repeat of the call
    neither steps nor saves again."""
    from safetensors.torch import load_file

    model_dir = tiny_qwen2(tmp_path / "model")
    lora, seed, hp = JOBS["j0"]
    reference = engine(model_dir)
    reference.ensure_job("j0", lora, seed)
    reference.train_step("j0", batch_for("j0", 0), hp)
    reference.save_adapter("j0", str(tmp_path / "reference"))
    outbox = bind_worker_outbox()
    try:
        _store, serve = trainer_loop(model_dir, outbox)
        out = tmp_path / "adapters" / "v000001"
        task = train_task(0, call_key="4242:7", publish_dir=str(out))
        values = [serve(1, task)]
        saved_at = (out / "adapter_model.safetensors").stat().st_mtime_ns
        values.append(serve(2, task))  # the same call again
        assert values[0] == values[1] and "loss" in values[0]
        assert (out / "adapter_model.safetensors").stat().st_mtime_ns == saved_at  # not saved again
        want = load_file(str(tmp_path / "reference" / "adapter_model.safetensors"))
        got = load_file(str(out / "adapter_model.safetensors"))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    finally:
        outbox.close(linger=0)


def test_a_repeat_that_names_another_directory_gets_the_adapter_there(tmp_path) -> None:
    """A daemon restarted between the call's run and its reply may give the repeat the next
    version's directory: the repeat is not applied, but the adapter the call published is saved
    where the repeat names it, so the generate that follows finds it."""
    from safetensors.torch import load_file

    model_dir = tiny_qwen2(tmp_path / "model")
    outbox = bind_worker_outbox()
    try:
        store, serve = trainer_loop(model_dir, outbox)
        first_dir, repeat_dir = tmp_path / "adapters" / "v000008", tmp_path / "adapters" / "v000009"
        first = serve(1, train_task(0, call_key="4242:7", publish_dir=str(first_dir)))
        stepped = job_state(store.trainer, "j0")
        again = serve(2, train_task(0, call_key="4242:7", publish_dir=str(repeat_dir)))
        assert again == first
        assert_like_alone(store.trainer, "j0", stepped)  # still one step
        want = load_file(str(first_dir / "adapter_model.safetensors"))
        got = load_file(str(repeat_dir / "adapter_model.safetensors"))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        assert (repeat_dir / "adapter_config.json").exists()
    finally:
        outbox.close(linger=0)


def test_a_trainer_context_from_an_older_sender_still_decodes() -> None:
    """The context no longer carries ``weight_decay`` (the optimizer's comes with each step); a
    task from a sender that still sends it decodes, the field ignored."""
    old = msgspec.msgpack.encode({"lora": None, "seed": 3, "weight_decay": 0.0, "call_key": "k:1"})
    context = msgspec.msgpack.decode(old, type=C.TrainerContext)
    assert (context.lora, context.seed, context.call_key) == (None, 3, "k:1")
    assert "weight_decay" not in msgspec.structs.asdict(context)
