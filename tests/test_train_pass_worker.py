"""The worker's trainer loop runs a pass of several jobs' train steps (``TaskPassBody``).

On a real StateStore whose device tier holds 2 jobs and a real TrainerEngine: a pass of three
jobs that may share and one with LoRA dropout trains the first two together, the third (past the
device tier) and the dropout job alone; every step gets its own result, and after two passes
each job's adapter and AdamW state are those it has trained alone (within float rounding); the
same pass sent again (a daemon that adopted the drivers) is answered unapplied.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from plexctl.common import calls as C
from plexctl.common import protocol as P
from tests.conftest import bind_worker_outbox
from tests.test_state_store import engine, job_state, make_batch, tiny_qwen2
from worker import servers as worker_servers
from worker.state.store import StateStore

JOBS = {  # job -> (LoRA, seed, hparams)
    "g1": (C.LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]), 1, P.TrainHParams(lr=3e-3)),
    "g2": (C.LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]), 2, P.TrainHParams(lr=2e-3)),
    "g3": (C.LoraSpec(rank=8, alpha=16), 3, P.TrainHParams(lr=1e-3, kl_coef=0.05)),
    "d1": (C.LoraSpec(rank=4, alpha=8, dropout=0.05), 4, P.TrainHParams(lr=2e-3)),
}


def step_batch(job: str, step: int) -> P.TrainBatch:
    return make_batch(100 * (list(JOBS).index(job) + 1) + step, rows=4)


def pass_of(step: int, first_id: int) -> P.TaskPassBody:
    tasks = []
    for i, (job, (lora, seed, hp)) in enumerate(JOBS.items()):
        trainer = C.TrainerContext(lora, seed, call_key=f"{job}:{step}")
        task = C.TrainStepTask(trainer, step_batch(job, step), hp)
        tasks.append(P.TaskBody(first_id + i, job, "w/trainer", task))
    return P.TaskPassBody("w/trainer", tasks)


def test_a_pass_trains_its_jobs_as_alone_within_rounding_and_a_repeat_is_not_applied(tmp_path) -> None:
    model_dir = tiny_qwen2(tmp_path / "model")
    reference = engine(model_dir)
    for job, (lora, seed, _) in JOBS.items():
        reference.ensure_job(job, lora, seed)
    for step in range(2):
        for job, (_, _, hp) in JOBS.items():
            reference.train_step(job, step_batch(job, step), hp)
    outbox = bind_worker_outbox()
    try:
        store = StateStore(engine(model_dir), device_slots=2, host_bytes=1 << 30)
        tasks: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=worker_servers.trainer_loop, args=(store, tasks), daemon=True).start()

        def run(body: P.TaskPassBody) -> dict[str, dict[str, float]]:
            tasks.put(body)
            out = {}
            for _ in body.tasks:
                assert outbox.poll(120_000), "no result from the trainer loop"
                _op, _header, result = P.decode(outbox.recv_multipart())
                assert result.ok, result.error
                out[next(t.job_id for t in body.tasks if t.task_id == result.task_id)] = result.value.metrics
            return out

        first = run(pass_of(0, 1))
        assert {job: m.get("group", 1.0) for job, m in first.items()} == {"g1": 2.0, "g2": 2.0, "g3": 1.0, "d1": 1.0}
        second = run(pass_of(1, 11))
        assert run(pass_of(1, 21)) == second  # the same calls again: their results, not applied twice
        for job, (lora, seed, _) in JOBS.items():
            store.ensure_resident(job, lora, seed)  # the loop is idle: its state, back on the device
            want, got = job_state(reference, job), job_state(store.trainer, job)
            for key, value in want["adapter"].items():
                torch.testing.assert_close(got["adapter"][key], value, atol=1e-5, rtol=1e-4, msg=f"{job} {key}")
            for i, moments in want["optimizer"]["state"].items():
                assert float(got["optimizer"]["state"][i]["step"]) == float(moments["step"]) == 2.0
    finally:
        outbox.close(linger=0)
