"""A one-job script's service calls through ``daemon.inproc.InprocClient``: the daemon's core and a
worker's servers on engines in the test's process (vLLM on CPU, torch + peft), no socket.

What a user relies on: a few GRPO steps train the adapter the trainer trains from the same
batches alone, bit for bit; publishes, checkpoints and ``latest.json`` land in the job's
directory as the daemon lays it out, and a restore there (by this client or a new one) takes the
state and the policy version back; a generate samples from the policy current when it was sent;
a trainer's error reaches the loop as ``CallFailed``; a full fine-tuning job samples from its own
published weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from daemon.inproc import InprocClient
from plexctl.algos import run_algorithm
from plexctl.common import calls as C
from plexctl.common.jobdir import JobDir
from plexctl.common.protocol import AdapterRef, GenRequest, Sampling, TrainBatch, TrainHParams
from plexctl.common.spec import JobSpec
from plexctl.rl import CallFailed, Job
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]
BATCH = TrainBatch([[1, 5, 6, 7, 8], [1, 8, 7, 6, 5]], [[0, 0, 1, 1, 1]] * 2, [[0.0] * 5] * 2, [1.0, -1.0])
HP = TrainHParams(lr=5e-2)
SAMPLING = Sampling(temperature=1.0, max_tokens=4, n=2, seed=3)
PROMPTS = ["1+2=", "3+4="]


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[tuple[Any, Any]]:
    """One rollout engine and one trainer for the module's jobs (each client releases its job)."""
    from worker.rollout import RolloutEngine
    from worker.trainer import TrainerEngine

    rollout = RolloutEngine(str(tiny_model), max_loras=2, max_cpu_loras=4, max_model_len=64)
    yield rollout, TrainerEngine(str(tiny_model), threads=2)
    rollout.close()


def tiny_spec(model: Path, *overrides: str) -> JobSpec:
    return load_spec(
        REPO / "configs" / "tiny-arith.yaml",
        [
            f"model.path={model}",
            "algo.prompts_per_step=4",
            "algo.group_size=4",
            "algo.eval_every=0",
            "checkpoint.every=0",
            "data.eval_path=null",
            *overrides,
        ],
        "inproc",
    )


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Recording(InprocClient):
    """The client, keeping the requests the loop made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.requests: list[C.Request] = []
        super().__init__(*args, **kwargs)

    def call_async(self, request: C.Request, after: int | None = None) -> int:
        self.requests.append(request)
        return super().call_async(request, after)


def test_grpo_steps_in_process_train_the_adapter_the_trainer_trains_alone(
    engines: tuple[Any, Any], tiny_model: Path, tmp_path: Path
) -> None:
    rollout, trainer = engines
    spec = tiny_spec(tiny_model, "algo.steps=3")
    client = Recording(rollout, trainer, spec, tmp_path / "job")
    job = Job(client, spec, tmp_path / "job", log=lambda _m: None)
    try:
        run_algorithm(job)
    finally:
        job.close()
        client.close()
    layout = JobDir(tmp_path / "job")
    assert [p.name for p in layout.published_adapters()] == ["v000002", "v000003"]  # the daemon's pruning
    latest = layout.latest_checkpoint()
    assert latest is not None and (latest.step, latest.policy_version) == (3, 3)
    assert Path(latest.dir) == layout.checkpoint(3) and layout.is_checkpoint(Path(latest.dir))
    steps = [r for r in client.requests if isinstance(r, C.TrainStepReq)]
    assert len(steps) == 3 and all(r.publish for r in steps)
    trainer.ensure_job("alone", spec.lora, spec.seed)  # the same steps, on the engine itself
    try:
        for r in steps:
            trainer.train_step("alone", r.batch, r.hp)
        trainer.save_adapter("alone", str(tmp_path / "alone"))
    finally:
        trainer.release("alone")
    assert same_tensors(adapter(layout.adapter(3)), adapter(tmp_path / "alone"))


def test_publish_checkpoint_restore_round_trip_in_the_job_dir(
    engines: tuple[Any, Any], tiny_model: Path, tmp_path: Path
) -> None:
    rollout, trainer = engines
    layout = JobDir(tmp_path / "job")
    client = InprocClient(rollout, trainer, tiny_spec(tiny_model), layout.root)
    try:
        client.train_step(BATCH, HP)
        assert client.publish() == 1 and (layout.adapter(1) / "adapter_config.json").exists()
        checkpointed = adapter(layout.adapter(1))  # read now: the daemon keeps the newest two versions
        assert client.checkpoint(1, {"step": 1}) == str(layout.checkpoint(1))
        latest = layout.latest_checkpoint()
        assert latest is not None and (latest.dir, latest.step, latest.policy_version) == (
            str(layout.checkpoint(1)),
            1,
            1,
        )
        assert client.train_and_publish(BATCH, HP)[1] == 2
        assert not same_tensors(checkpointed, adapter(layout.adapter(2)))
        assert client.restore() == {"step": 1}
        assert client.publish() == 3
        assert same_tensors(adapter(layout.adapter(3)), checkpointed)  # the checkpoint's state
        assert [p.name for p in layout.published_adapters()] == ["v000002", "v000003"]
    finally:
        client.close()


def test_a_new_client_on_the_job_dir_resumes_its_policy_version(
    engines: tuple[Any, Any], tiny_model: Path, tmp_path: Path
) -> None:
    rollout, trainer = engines
    layout = JobDir(tmp_path / "job")
    first = InprocClient(rollout, trainer, tiny_spec(tiny_model), layout.root)
    try:
        first.train_and_publish(BATCH, HP)
        first.train_and_publish(BATCH, HP)
        first.checkpoint(2, {"step": 2})
    finally:
        first.close()
    second = InprocClient(rollout, trainer, tiny_spec(tiny_model), layout.root)
    try:
        assert second.restore() == {"step": 2}
        assert second.publish() == 3  # after the checkpoint's version 2
        assert same_tensors(adapter(layout.adapter(3)), adapter(layout.adapter(2)))
        reply = second.wait(second.generate_async(PROMPTS, SAMPLING))
        assert reply.policy_version == 3
    finally:
        second.close()


def test_a_generate_samples_from_the_policy_current_when_it_was_sent(
    engines: tuple[Any, Any], tiny_model: Path, tmp_path: Path
) -> None:
    rollout, trainer = engines
    layout = JobDir(tmp_path / "job")
    served: list[str] = []
    client = InprocClient(
        rollout, trainer, tiny_spec(tiny_model), layout.root, before_generate=lambda: served.append("generate")
    )
    try:
        client.train_and_publish(BATCH, HP)
        sent = client.generate_async(PROMPTS, SAMPLING)
        assert served == []  # served when waited on
        assert client.train_and_publish(BATCH, HP)[1] == 2
        reply = client.wait(sent)
        assert served == ["generate"] and reply.policy_version == 1
        ref = AdapterRef(client.job_id, 1, str(layout.adapter(1)))
        [alone] = rollout.generate([GenRequest("alone", PROMPTS, SAMPLING, ref)])
        assert [(c.token_ids, c.logprobs) for c in reply.completions] == [(c.token_ids, c.logprobs) for c in alone]
    finally:
        client.close()


def test_a_trainer_error_surfaces_as_call_failed(engines: tuple[Any, Any], tiny_model: Path, tmp_path: Path) -> None:
    rollout, trainer = engines
    client = InprocClient(rollout, trainer, tiny_spec(tiny_model), tmp_path / "job")
    try:
        bad = TrainBatch([[1, 5, 6]], [[0, 1]], [[0.0, 0.0, 0.0]], [1.0, 2.0])  # lengths that disagree
        training = client.train_and_publish_async(bad, HP)
        following = client.generate_async(PROMPTS, SAMPLING, after=training)
        with pytest.raises(CallFailed, match="^call_failed: train_step failed: "):
            client.wait(training)
        with pytest.raises(CallFailed, match="generate was to follow train_step, which failed"):
            client.wait(following)
        assert client.train_and_publish(BATCH, HP)[1] == 1  # the job goes on
    finally:
        client.close()


def test_a_full_fine_tuning_job_samples_from_its_published_weights(
    engines: tuple[Any, Any], tiny_model: Path, tmp_path: Path
) -> None:
    rollout, trainer = engines
    layout = JobDir(tmp_path / "job")
    spec = msgspec.structs.replace(tiny_spec(tiny_model), lora=None)  # every weight trained
    client = InprocClient(rollout, trainer, spec, layout.root)
    try:
        assert client.train_and_publish(BATCH, HP)[1] == 1
        reply = client.wait(client.generate_async(PROMPTS, SAMPLING))
        assert reply.policy_version == 1 and rollout.loaded_weights == f"{client.job_id}@v1"
    finally:
        client.close()
