"""A full fine-tuning job (no ``lora``) through the daemon's core: no socket, no process.

What its user relies on: the job is admitted when its weights and AdamW state fit a trainer's
tier and refused at submit, in one line with the numbers, when they fit none (nothing queued);
its trainer tasks say it trains every weight; its generates, once it published, sample from
its own published weights (``AdapterRef.full``).
"""

from __future__ import annotations

from pathlib import Path

from test_daemon_core import BATCH, GENERATE, answer, call, running, tasks

from daemon.core import StartDriver
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.client import current_user
from plexctl.common.errors import ExitCode
from plexctl.common.spec import spec_to_wire
from plexctl.common.state_size import full_state_bytes, model_config
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]


def register(d, worker: str, model: Path, capacity: int = 0) -> None:
    engines = [
        P.EngineDecl(f"{worker}/rollout", "rollout", str(model), 4),
        P.EngineDecl(f"{worker}/trainer", "trainer", str(model), 1, state_capacity_bytes=capacity),
    ]
    d.send(worker.encode(), P.Op.REGISTER, P.RegisterReq(worker, "node", 1, engines, True, resident={}))


def submit_full(d, model: Path, name: str) -> list:
    spec = load_spec(REPO / "configs" / "tiny-arith-full.yaml", [f"model.path={model}"], name)
    assert spec.lora is None
    d.send(b"cli", P.Op.SUBMIT, P.SubmitReq(f"sid-{name}", spec_to_wire(spec), current_user()), user=current_user())
    replies = [(op, body) for to, op, body in d.sent if to == b"cli"]
    d.sent.clear()
    return replies


def test_a_full_job_trains_every_weight_and_samples_from_its_own_weights(core, tiny_model):
    d = core
    register(d, "w0", tiny_model, capacity=1 << 30)
    [(op, reply)] = submit_full(d, tiny_model, "full")
    assert op == P.Op.REPLY
    job = reply.job_id
    assert StartDriver(job) in d.chores()
    d.driver_started(job, 4242)

    call(d, job, C.TrainStepReq(BATCH, publish=True), 1)
    d.place()
    (step,) = tasks(d)
    assert isinstance(step.task, C.TrainStepTask) and step.task.trainer.lora is None
    answer(d, "w0", step, C.TrainStepResult({"loss": 0.5}))
    call(d, job, GENERATE, 2)
    d.place()
    (gen,) = tasks(d)
    assert gen.task.request.adapter == P.AdapterRef(job, 1, step.task.publish_dir, full=True)

    lora = running(d, tiny_model, "lora", pid=4343)
    d.sent.clear()
    d.send(b"cli", P.Op.STATUS, P.StatusReq(), user=current_user())
    (status,) = [body for to, op, body in d.sent if op == P.Op.REPLY and to == b"cli"]
    assert {j.job_id: j.trains for j in status.jobs} == {job: "all weights", lora: "adapter"}


def test_a_full_job_whose_state_fits_no_tier_is_refused_at_submit_with_the_numbers(core, tiny_model):
    d = core
    need = full_state_bytes(model_config(str(tiny_model)), "float32")
    register(d, "w0", tiny_model, capacity=2 << 20)
    assert need > 2 << 20  # the tiny model's weights and moments: about 4 MiB
    [(op, error)] = submit_full(d, tiny_model, "too-big")
    assert op == P.Op.ERROR and error.code == "refused"
    assert error.message == (
        f"lora (none: full fine-tuning): the job's weights and optimizer state takes {need / (1 << 20):.1f} MiB, "
        "more than any trainer's largest tier holds (2.0 MiB)"
    )
    assert ExitCode.REFUSED == 7
    assert all(j.name != "too-big" for j in d.journal.jobs())  # nothing queued


def test_a_full_jobs_generates_wait_for_the_engine_to_drain_then_one_weight_load_serves_them(core, tiny_model):
    d = core
    register(d, "w0", tiny_model, capacity=1 << 30)
    [(_, reply)] = submit_full(d, tiny_model, "full")
    full = reply.job_id
    assert StartDriver(full) in d.chores()
    d.driver_started(full, 4242)
    lora = running(d, tiny_model, "lora", pid=4343)
    call(d, full, C.TrainStepReq(BATCH, publish=True), 1)
    d.place()
    (step,) = tasks(d)
    answer(d, "w0", step, C.TrainStepResult({"loss": 0.5}))

    call(d, full, GENERATE, 2)
    call(d, lora, GENERATE, 3)
    call(d, full, GENERATE, 4)
    call(d, lora, GENERATE, 5)
    d.place()

    def sent(batch: list[P.TaskBody]) -> list[tuple[str, bool]]:
        return [(t.job_id, t.task.request.adapter is not None and t.task.request.adapter.full) for t in batch]

    first = tasks(d)  # the engine holds the base: the LoRA job's generates need no load and go first
    assert sent(first) == [(lora, False), (lora, False)]
    answer(d, "w0", first[0], C.GenerateResult([]))
    d.place()
    assert tasks(d) == []  # no load while a generate on the base runs
    answer(d, "w0", first[1], C.GenerateResult([]))
    d.place()
    second = tasks(d)
    assert sent(second) == [(full, True), (full, True)]  # then both at once: one load serves them
    engine = d.sched.engines["w0/rollout"]
    assert engine.switches == 1 and engine.holds == f"{full}@v1"
