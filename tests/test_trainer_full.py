"""Full fine-tuning on the shared trainer engine (worker/trainer.py), real torch on a tiny Qwen2.

What a user of a full fine-tuning job relies on: every weight is trained; its steps (losses,
gradient norms, weights, AdamW moments) are bit-for-bit the same alone and beside a LoRA job
on the same base, with both jobs' state moved off the engine and back before every step; a LoRA
job never trains or scores on another job's weights; checkpoints restore exactly; what it
publishes is its weights, loadable by the model's own names.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import random_tiny_qwen2
from safetensors.torch import load_file
from test_trainer import VOCAB, assert_exactly_equal, make_batch, make_rows, on_policy, without_seconds
from transformers import AutoModelForCausalLM

from plexctl.common.protocol import LoraSpec, TrainHParams
from worker.errors import CheckpointError
from worker.trainer import FULL_WEIGHTS_FILE, TrainerEngine

LORA = LoraSpec(rank=4, alpha=8, dropout=0.05)
HP_FULL = TrainHParams(lr=1e-3, kl_coef=0.05, weight_decay=0.01, max_grad_norm=1.0)
HP_LORA = TrainHParams(lr=5e-3, loss_agg="seq-mean-token-mean")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen2-full")
    random_tiny_qwen2(path, vocab_size=VOCAB)
    return str(path)


def swap_out_and_in(engine: TrainerEngine, job_id: str) -> None:
    """The job's state off the engine (a host copy, the device copy freed) and back."""
    copy = engine.export_state(job_id)
    engine.release(job_id)
    engine.import_state(job_id, copy)


def base_weights(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    """The base model's own weights, by their names before any adapter was attached."""
    return {name: p.detach().clone() for name, p in engine._base_params.items()}


def test_full_job_steps_are_identical_alone_and_shared_with_swaps_every_step(model_dir: str) -> None:
    batches = [make_batch(seed) for seed in (1, 2, 3)]

    alone = TrainerEngine(model_dir, threads=2)
    alone.ensure_job("F", None, seed=5)
    first = {k: t.clone() for k, t in alone.adapter_state_dict("F").items()}
    metrics_alone = [alone.train_step("F", on_policy(alone, "F", b), HP_FULL) for b in batches]

    shared = TrainerEngine(model_dir, threads=2)
    shared.ensure_job("L", LORA, seed=7)  # a LoRA job exists first, on the same base
    shared.train_step("L", make_batch(100), HP_LORA)
    shared.ensure_job("F", None, seed=5)
    metrics_shared = []
    for i, batch in enumerate(batches):
        swap_out_and_in(shared, "F")
        metrics_shared.append(shared.train_step("F", on_policy(shared, "F", batch), HP_FULL))
        swap_out_and_in(shared, "L")
        shared.train_step("L", make_batch(101 + i), HP_LORA)

    assert [without_seconds(m) for m in metrics_alone] == [without_seconds(m) for m in metrics_shared]
    assert all(m["grad_norm"] > 0 and m["kl"] > 0 for m in metrics_alone[1:])
    assert_exactly_equal(alone.adapter_state_dict("F"), shared.adapter_state_dict("F"), "weights")
    assert_exactly_equal(alone.optimizer_state_dict("F"), shared.optimizer_state_dict("F"), "optimizer")
    trained = alone.adapter_state_dict("F")
    assert set(trained) == {name for name, _ in alone._base.named_parameters()}  # every weight, tied ones once
    changed = [k for k in trained if not torch.equal(trained[k], first[k])]
    assert "model.embed_tokens.weight" in changed and "model.norm.weight" in changed
    assert all(t.dtype == torch.float32 for t in trained.values())


def test_lora_job_never_sees_a_full_jobs_weights(model_dir: str) -> None:
    rows = make_rows(300)
    alone = TrainerEngine(model_dir, threads=2)
    alone.ensure_job("L", LORA, seed=7)
    before = base_weights(alone)
    lora_alone = [alone.train_step("L", make_batch(s), HP_LORA) for s in (10, 11)]
    logprobs_alone = alone.logprobs("L", *rows)

    shared = TrainerEngine(model_dir, threads=2)
    shared.ensure_job("L", LORA, seed=7)
    shared.ensure_job("F", None, seed=5)
    lora_shared = []
    for s in (10, 11):
        shared.train_step("F", make_batch(s + 50), TrainHParams(lr=1e-2))
        lora_shared.append(shared.train_step("L", make_batch(s), HP_LORA))
    assert [without_seconds(m) for m in lora_alone] == [without_seconds(m) for m in lora_shared]
    assert shared.logprobs("L", *rows) == logprobs_alone
    assert shared.logprobs("F", *rows) != logprobs_alone  # the full job did train
    assert_exactly_equal(before, base_weights(shared), "base")
    assert all(not p.requires_grad and p.grad is None for p in shared._base_params.values())


def test_full_checkpoint_restores_exactly_and_refuses_a_lora_job(model_dir: str, tmp_path: Path) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("F", None, seed=5)
    engine.train_step("F", make_batch(1), HP_FULL)
    engine.save_checkpoint("F", str(tmp_path / "ckpt"), {"step": 1})
    expected = engine.train_step("F", make_batch(2), HP_FULL)

    restored = TrainerEngine(model_dir, threads=2)
    assert restored.load_checkpoint("F2", str(tmp_path / "ckpt"), None, seed=5) == {"step": 1}
    assert without_seconds(restored.train_step("F2", make_batch(2), HP_FULL)) == without_seconds(expected)
    assert_exactly_equal(engine.adapter_state_dict("F"), restored.adapter_state_dict("F2"), "weights")
    with pytest.raises(CheckpointError, match="full_finetune"):
        restored.load_checkpoint("L", str(tmp_path / "ckpt"), LORA, seed=5)


def test_published_weights_load_by_the_models_names(model_dir: str, tmp_path: Path) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("F", None, seed=5)
    engine.train_step("F", make_batch(1), TrainHParams(lr=1e-2))
    engine.save_adapter("F", str(tmp_path / "v1"))
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == [FULL_WEIGHTS_FILE]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(load_file(str(tmp_path / "v1" / FULL_WEIGHTS_FILE)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    input_ids, loss_mask = make_rows(7, rows=1)
    with torch.no_grad():
        logits = model(torch.tensor(input_ids)).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, torch.tensor(input_ids[0][1:])[:, None])[:, 0]
    ours = engine.logprobs("F", input_ids, loss_mask)[0]
    want = [0.0] + [v if m else 0.0 for v, m in zip(logp.tolist(), loss_mask[0][1:])]
    assert ours == pytest.approx(want, abs=1e-5)


def test_a_bfloat16_engine_trains_float32_masters_and_publishes_bfloat16(model_dir: str, tmp_path: Path) -> None:
    alone = TrainerEngine(model_dir, dtype="bfloat16", threads=2)
    alone.ensure_job("F", None, seed=5)
    expected = [without_seconds(alone.train_step("F", make_batch(s), HP_FULL)) for s in (1, 2)]

    shared = TrainerEngine(model_dir, dtype="bfloat16", threads=2)
    base = base_weights(shared)
    shared.ensure_job("L", LORA, seed=7)
    shared.ensure_job("F", None, seed=5)
    got = []
    for s in (1, 2):
        swap_out_and_in(shared, "F")
        got.append(without_seconds(shared.train_step("F", make_batch(s), HP_FULL)))
        shared.train_step("L", make_batch(s + 10), HP_LORA)
    assert got == expected
    masters = shared.adapter_state_dict("F")
    assert all(t.dtype == torch.float32 for t in masters.values())
    assert_exactly_equal(base, base_weights(shared), "base")
    assert all(t.dtype == torch.bfloat16 for t in base.values())
    shared.save_adapter("F", str(tmp_path / "v1"))
    published = load_file(str(tmp_path / "v1" / FULL_WEIGHTS_FILE))
    assert all(t.dtype == torch.bfloat16 for t in published.values())
    assert torch.equal(published["model.norm.weight"], masters["model.norm.weight"].to(torch.bfloat16))
