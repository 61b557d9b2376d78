"""Tests of the trainer engine (worker/trainer.py) with real torch and peft on a tiny random Qwen2.

They assert what a user of the shared trainer relies on: a job's training is bit-for-bit the
same whether or not other jobs' steps are interleaved; the GRPO loss is the one documented;
saved adapters load in peft unchanged; checkpoints restore exactly, reject corruption, and
never leave half-written or temporary directories behind.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import random_tiny_qwen2
from peft import PeftModel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

from plexctl.common.protocol import LoraSpec, TrainBatch, TrainHParams
from worker.errors import BatchError, CheckpointError, JobConfigError, UnknownJobError
from worker.state.arena import PAGE_BYTES, HostArena, page_round
from worker.state.job_copy import packed_layout
from worker.trainer import TrainerEngine

VOCAB = 64
LORA_A = LoraSpec(rank=8, alpha=16, dropout=0.05)
LORA_B = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
HP_A = TrainHParams(lr=2e-3, kl_coef=0.05, weight_decay=0.01, clip_low=0.2, clip_high=0.28)
HP_B = TrainHParams(lr=5e-3, loss_agg="seq-mean-token-mean", max_grad_norm=0.5)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny Qwen2 (hidden 128, 2 layers, 2 heads, vocab 64, float32) in HF format."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    random_tiny_qwen2(path, vocab_size=VOCAB)
    return str(path)


def make_rows(seed: int, rows: int = 6) -> tuple[list[list[int]], list[list[int]]]:
    """Ragged rows: a 2-4 token prompt (mask 0) then a 2-6 token completion (mask 1)."""
    rng = random.Random(seed)
    input_ids, loss_mask = [], []
    for _ in range(rows):
        prompt, completion = rng.randint(2, 4), rng.randint(2, 6)
        input_ids.append([rng.randrange(1, VOCAB) for _ in range(prompt + completion)])
        loss_mask.append([0] * prompt + [1] * completion)
    return input_ids, loss_mask


def make_batch(seed: int, rows: int = 6, old_noise: float = 0.3) -> TrainBatch:
    """A GRPO batch with behaviour log-probs near (not equal to) the policy's, random advantages."""
    rng = random.Random(seed + 10_000)
    input_ids, loss_mask = make_rows(seed, rows)
    old = [[(-4.2 + rng.uniform(-old_noise, old_noise)) * m for m in mask] for mask in loss_mask]
    advantages = [rng.gauss(0.0, 1.0) for _ in input_ids]
    return TrainBatch(input_ids, loss_mask, old, advantages)


def on_policy(engine: TrainerEngine, job_id: str, batch: TrainBatch) -> TrainBatch:
    """The same batch with old_logprobs set to the job's current log-probs (ratio 1)."""
    old = engine.logprobs(job_id, batch.input_ids, batch.loss_mask)
    return TrainBatch(batch.input_ids, batch.loss_mask, old, batch.advantages)


def snapshot(engine: TrainerEngine, job_id: str) -> dict[str, torch.Tensor]:
    return {key: t.clone() for key, t in engine.adapter_state_dict(job_id).items()}


def assert_exactly_equal(a: Any, b: Any, where: str = "") -> None:
    """Recursive bit-exact comparison of tensors / dicts / lists / scalars."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"tensors differ at {where}"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), f"keys differ at {where}"
        for key in a:
            assert_exactly_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"lengths differ at {where}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_exactly_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{a!r} != {b!r} at {where}"


def without_seconds(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k != "seconds"}


def completion_logprob(engine: TrainerEngine, job_id: str, batch: TrainBatch) -> float:
    return sum(sum(row) for row in engine.logprobs(job_id, batch.input_ids, batch.loss_mask))


# ---------------------------------------------------------------- isolation


def test_interleaved_jobs_train_exactly_like_a_lone_job(model_dir: str) -> None:
    batches = [make_batch(seed) for seed in (1, 2, 3)]

    alone = TrainerEngine(model_dir, threads=2)
    alone.ensure_job("A", LORA_A, seed=11)
    metrics_alone = [alone.train_step("A", batch, HP_A) for batch in batches]

    shared = TrainerEngine(model_dir, threads=2)
    shared.ensure_job("B", LORA_B, seed=22)  # B exists before A is created
    shared.train_step("B", make_batch(100), HP_B)
    shared.ensure_job("A", LORA_A, seed=11)
    shared.train_step("B", make_batch(101), HP_B)
    metrics_shared = [shared.train_step("A", batches[0], HP_A)]
    shared.ensure_job("C", LoraSpec(rank=2, dropout=0.1), seed=33)
    shared.train_step("C", make_batch(200), HP_A)
    shared.train_step("B", make_batch(102), HP_B)
    metrics_shared.append(shared.train_step("A", batches[1], HP_A))
    shared.release("B")
    shared.logprobs("C", *make_rows(300))
    shared.train_step("C", make_batch(201), HP_B)
    metrics_shared.append(shared.train_step("A", batches[2], HP_A))

    assert shared.jobs() == ["A", "C"]
    assert_exactly_equal(alone.adapter_state_dict("A"), shared.adapter_state_dict("A"), "adapter")
    assert_exactly_equal(alone.optimizer_state_dict("A"), shared.optimizer_state_dict("A"), "optimizer")
    assert [without_seconds(m) for m in metrics_alone] == [without_seconds(m) for m in metrics_shared]
    assert all(m["kl"] > 0 and m["tokens"] > 0 for m in metrics_alone[1:])


def test_new_adapter_depends_only_on_seed(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("x", LORA_A, seed=5)
    engine.train_step("x", make_batch(1), HP_A)
    torch.manual_seed(999)  # global RNG state must not matter either
    engine.ensure_job("y", LORA_A, seed=5)
    engine.ensure_job("z", LORA_A, seed=6)
    fresh = TrainerEngine(model_dir, threads=2)
    fresh.ensure_job("y", LORA_A, seed=5)
    assert_exactly_equal(engine.adapter_state_dict("y"), fresh.adapter_state_dict("y"))
    assert not torch.equal(
        engine.adapter_state_dict("y")["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
        engine.adapter_state_dict("z")["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
    )


# ---------------------------------------------------------------- loss correctness


def reference_gradients(model_dir: str, adapter_dir: Path, batch: TrainBatch, loss_agg: str) -> dict[str, torch.Tensor]:
    """Gradient of -mean(adv * logp) over masked tokens, written by hand on a separate peft model."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    model.eval()
    row_terms, all_terms = [], []
    for ids, mask, adv in zip(batch.input_ids, batch.loss_mask, batch.advantages):
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
        chosen = logp[torch.tensor(mask[1:], dtype=torch.bool)]
        row_terms.append((adv * chosen).mean())
        all_terms.append(adv * chosen)
    if loss_agg == "token-mean":
        loss = -torch.cat(all_terms).mean()
    else:
        loss = -torch.stack(row_terms).mean()
    loss.backward()
    return {name.replace(".default", ""): p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_on_policy_gradient_is_policy_gradient(model_dir: str, tmp_path: Path, loss_agg: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    lora = LoraSpec(rank=4, alpha=8)
    engine.ensure_job("A", lora, seed=3)
    engine.train_step("A", make_batch(1), TrainHParams(lr=1e-2))  # make lora_B non-zero
    batch = on_policy(engine, "A", make_batch(2, rows=5))
    hp = TrainHParams(lr=1e-2, loss_agg=loss_agg, clip_low=0.2, clip_high=0.2)

    grads, metrics = engine.loss_gradients("A", batch, hp)
    engine.save_adapter("A", str(tmp_path / "adapter"))
    expected = reference_gradients(model_dir, tmp_path / "adapter", batch, loss_agg)

    assert metrics["clip_frac"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert set(grads) == set(expected)
    for key in grads:
        torch.testing.assert_close(grads[key], expected[key], rtol=1e-4, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_micro_batches_give_the_same_step(model_dir: str) -> None:
    whole = TrainerEngine(model_dir, threads=2)
    split = TrainerEngine(model_dir, threads=2, micro_batch_rows=2)
    for engine in (whole, split):  # no dropout: masks would differ with the split
        engine.ensure_job("A", LoraSpec(rank=8, alpha=16), seed=9)
        engine.train_step("A", make_batch(1), HP_A)
    batch = make_batch(2, rows=7)
    for agg in ("token-mean", "seq-mean-token-mean"):
        hp = TrainHParams(lr=1e-3, kl_coef=0.1, loss_agg=agg)
        grads_whole, metrics_whole = whole.loss_gradients("A", batch, hp)
        grads_split, metrics_split = split.loss_gradients("A", batch, hp)
        for key in grads_whole:
            torch.testing.assert_close(grads_split[key], grads_whole[key], rtol=1e-4, atol=1e-6)
        assert metrics_split == pytest.approx(metrics_whole, rel=1e-5, abs=1e-6)
    rows_split = split.logprobs("A", batch.input_ids, batch.loss_mask)
    rows_whole = whole.logprobs("A", batch.input_ids, batch.loss_mask)
    assert [len(row) for row in rows_split] == [len(row) for row in batch.input_ids]
    for got, expected in zip(rows_split, rows_whole):
        assert got == pytest.approx(expected, abs=1e-5)


def test_clipping_counts_and_stops_gradient(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=4), seed=3)
    batch = on_policy(engine, "A", make_batch(4))
    # old log-probs far below the current ones: ratio >> 1 + clip_high on every token
    shifted = [[(o - 2.0) * m for o, m in zip(old, mask)] for old, mask in zip(batch.old_logprobs, batch.loss_mask)]
    positive = TrainBatch(batch.input_ids, batch.loss_mask, shifted, [1.0] * len(batch.input_ids))
    grads, metrics = engine.loss_gradients("A", positive, TrainHParams())
    assert metrics["clip_frac"] == 1.0
    assert metrics["ratio_mean"] > 5.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_zero_advantages_leave_adapter_unchanged(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=4), seed=3)
    with torch.no_grad():  # a non-trivial adapter (lora_B starts at zero)
        for key, tensor in engine.adapter_state_dict("A").items():
            if "lora_B" in key:
                tensor.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(0))
    before = snapshot(engine, "A")
    batch = make_batch(5)
    zero = TrainBatch(batch.input_ids, batch.loss_mask, batch.old_logprobs, [0.0] * len(batch.advantages))
    metrics = engine.train_step("A", zero, TrainHParams(lr=1e-2, kl_coef=0.0, weight_decay=0.0))
    assert metrics["grad_norm"] == 0.0
    assert_exactly_equal(before, engine.adapter_state_dict("A"))


def test_masked_tokens_are_ignored(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("plain", LORA_A, seed=7)
    engine.ensure_job("noisy", LORA_A, seed=7)
    batch = make_batch(6)
    noisy_old = [
        [o if m else random.Random(i).uniform(-50.0, 50.0) for i, (o, m) in enumerate(zip(old, mask))]
        for old, mask in zip(batch.old_logprobs, batch.loss_mask)
    ]
    noisy = TrainBatch(batch.input_ids, batch.loss_mask, noisy_old, batch.advantages)
    for _ in range(2):
        m_plain = engine.train_step("plain", batch, HP_A)
        m_noisy = engine.train_step("noisy", noisy, HP_A)
        assert without_seconds(m_plain) == without_seconds(m_noisy)
    assert_exactly_equal(engine.adapter_state_dict("plain"), engine.adapter_state_dict("noisy"))
    logprobs = engine.logprobs("plain", batch.input_ids, batch.loss_mask)
    assert all(lp == 0.0 for row, mask in zip(logprobs, batch.loss_mask) for lp, m in zip(row, mask) if not m)


def test_malformed_batches_are_rejected(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=2), seed=1)
    batch = make_batch(1, rows=2)
    with pytest.raises(BatchError, match="first token"):
        engine.train_step("A", TrainBatch([[1, 2]], [[1, 1]], [[0.0, 0.0]], [1.0]), TrainHParams())
    with pytest.raises(BatchError, match="rows"):
        engine.train_step("A", TrainBatch(batch.input_ids, batch.loss_mask, batch.old_logprobs, [1.0]), TrainHParams())
    with pytest.raises(BatchError, match="no trainable token"):
        engine.train_step("A", TrainBatch([[1, 2]], [[0, 0]], [[0.0, 0.0]], [1.0]), TrainHParams())
    with pytest.raises(BatchError, match="loss_agg"):
        engine.train_step("A", batch, TrainHParams(loss_agg="sum"))
    with pytest.raises(UnknownJobError):
        engine.train_step("nobody", batch, TrainHParams())


# ---------------------------------------------------------------- learning


def test_positive_advantage_raises_completion_logprob(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=8, alpha=16), seed=4)
    completion = [5, 9, 17, 33, 2, 41]
    row = [7, 8, 3] + completion
    mask = [0, 0, 0] + [1] * len(completion)
    fixed = TrainBatch([row] * 8, [mask] * 8, [[0.0] * len(row)] * 8, [1.0] * 8)
    start = completion_logprob(engine, "A", fixed) / 8
    for _ in range(8):
        engine.train_step("A", on_policy(engine, "A", fixed), TrainHParams(lr=1e-2))
    end = completion_logprob(engine, "A", fixed) / 8
    assert end > start + 1.0, (start, end)


# ---------------------------------------------------------------- adapters and checkpoints


def test_saved_adapter_loads_in_peft_with_same_logprobs(model_dir: str, tmp_path: Path) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LORA_A, seed=2)
    engine.ensure_job("B", LORA_B, seed=3)
    for seed in (1, 2):
        engine.train_step("A", make_batch(seed), HP_A)
        engine.train_step("B", make_batch(seed + 50), HP_B)
    out = tmp_path / "published" / "A-v2"
    engine.save_adapter("A", str(out))

    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == model_dir
    assert config["r"] == 8 and config["lora_alpha"] == 16

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(out))
    loaded.eval()
    input_ids, loss_mask = make_rows(9, rows=4)
    engine_logprobs = engine.logprobs("A", input_ids, loss_mask)
    with torch.no_grad():
        for ids, mask, got in zip(input_ids, loss_mask, engine_logprobs):
            logits = loaded(input_ids=torch.tensor([ids])).logits[0].float()
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
            expected = [0.0] + [lp if m else 0.0 for lp, m in zip(logp.tolist(), mask[1:])]
            assert got == pytest.approx(expected, abs=1e-5)
    assert sorted(os.listdir(out.parent)) == ["A-v2"]


def test_checkpoint_round_trip_continues_exactly(model_dir: str, tmp_path: Path) -> None:
    batches = [make_batch(seed) for seed in (1, 2, 3, 4)]
    extra = {"step": 2, "data_cursor": 17, "rng": [1, 2, 3]}
    ckpt = tmp_path / "ckpt" / "A" / "latest"

    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LORA_A, seed=8)
    for batch in batches[:2]:
        engine.train_step("A", batch, HP_A)
    manifest = engine.save_checkpoint("A", str(ckpt), extra)
    continued = [engine.train_step("A", batch, HP_A) for batch in batches[2:]]

    files = {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt", "extra.json"}
    assert set(manifest["files"]) == files
    assert all(len(record["sha256"]) == 64 for record in manifest["files"].values())
    assert json.loads((ckpt / "manifest.json").read_text()) == manifest

    restored = TrainerEngine(model_dir, threads=2)
    restored.ensure_job("other", LORA_B, seed=1)
    restored.train_step("other", make_batch(77), HP_B)
    assert restored.load_checkpoint("A", str(ckpt), LORA_A, seed=8) == extra
    resumed = [restored.train_step("A", batch, HP_A) for batch in batches[2:]]

    assert_exactly_equal(engine.adapter_state_dict("A"), restored.adapter_state_dict("A"), "adapter")
    assert_exactly_equal(engine.optimizer_state_dict("A"), restored.optimizer_state_dict("A"), "optimizer")
    assert [without_seconds(m) for m in continued] == [without_seconds(m) for m in resumed]

    # overwrite the same directory with a later checkpoint: still complete, nothing left over
    engine.save_checkpoint("A", str(ckpt), {"step": 4})
    engine.release("A")
    assert engine.jobs() == []
    assert engine.load_checkpoint("A", str(ckpt), LORA_A, seed=8) == {"step": 4}
    assert_exactly_equal(restored.adapter_state_dict("A"), engine.adapter_state_dict("A"))
    assert sorted(os.listdir(ckpt.parent)) == ["latest"]


@pytest.mark.parametrize("victim", ["adapter_model.safetensors", "trainer_state.pt", "extra.json", "manifest.json"])
def test_corrupt_checkpoint_is_rejected(model_dir: str, tmp_path: Path, victim: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=2), seed=1)
    engine.train_step("A", make_batch(1), TrainHParams())
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint("A", str(ckpt), {"step": 1})
    path = ckpt / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    fresh = TrainerEngine(model_dir, threads=2)
    with pytest.raises(CheckpointError) as error:
        fresh.load_checkpoint("A", str(ckpt), LoraSpec(rank=2), seed=1)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"checkpoint {ckpt}: ") and victim in message
    assert fresh.jobs() == []


def test_checkpoint_for_another_adapter_shape_is_rejected(model_dir: str, tmp_path: Path) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=2), seed=1)
    engine.save_checkpoint("A", str(tmp_path / "ckpt"), {})
    with pytest.raises(CheckpointError, match="rank"):
        engine.load_checkpoint("B", str(tmp_path / "ckpt"), LoraSpec(rank=4), seed=1)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        engine.load_checkpoint("B", str(tmp_path), LoraSpec(rank=2), seed=1)


def test_a_checkpoint_whose_moments_do_not_fit_leaves_the_resident_job_as_it_was(
    model_dir: str, tmp_path: Path
) -> None:
    from worker.checkpoint_files import MANIFEST, TRAINER_STATE, file_record

    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=2), seed=1)
    engine.train_step("A", make_batch(1), HP_A)
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint("A", str(ckpt), {})
    state = torch.load(ckpt / TRAINER_STATE, weights_only=True)  # another AdamW's: other betas, moments
    state["optimizer"]["param_groups"][0]["betas"] = (0.5, 0.5)
    first = state["optimizer"]["state"][0]
    first["exp_avg"] = torch.zeros(first["exp_avg"].numel() + 1)
    torch.save(state, ckpt / TRAINER_STATE)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"][TRAINER_STATE] = file_record(ckpt / TRAINER_STATE)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    before = {k: v for k, v in engine._job("A").optimizer.param_groups[0].items() if k != "params"}
    with pytest.raises(CheckpointError, match="does not fit the job's AdamW"):
        engine.load_checkpoint("A", str(ckpt), LoraSpec(rank=2), seed=1)
    after = {k: v for k, v in engine._job("A").optimizer.param_groups[0].items() if k != "params"}
    assert after == before and after["betas"] != (0.5, 0.5)


def test_failed_write_leaves_no_temp_dirs(model_dir: str, tmp_path: Path) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=2), seed=1)
    with pytest.raises(TypeError):
        engine.save_checkpoint("A", str(tmp_path / "ckpt"), {"not-json": object()})
    assert os.listdir(tmp_path) == []
    engine.save_checkpoint("A", str(tmp_path / "ckpt"), {"ok": True})
    engine.save_adapter("A", str(tmp_path / "adapter"))
    engine.save_adapter("A", str(tmp_path / "adapter"))
    assert sorted(os.listdir(tmp_path)) == ["adapter", "ckpt"]


# ---------------------------------------------------------------- lifecycle


def slot_storage(engine: TrainerEngine, job_id: str) -> set[int]:
    """Data pointers of the storages under the job's parameters and AdamW state."""
    tensors = [*engine.adapter_state_dict(job_id).values()]
    tensors += [t for s in engine.optimizer_state_dict(job_id)["state"].values() for t in s.values()]
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("foreach", [False, True], ids=["single-tensor", "foreach"])
def test_adapter_and_adamw_state_stay_in_one_flat_buffer(model_dir: str, tmp_path: Path, foreach: bool) -> None:
    """Parameters and AdamW's moments and step counts are views into one buffer, from creation,
    through AdamW steps (either implementation) and a checkpoint restore."""
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LORA_A, seed=3)
    engine._job("A").optimizer.param_groups[0]["foreach"] = foreach
    state = engine.optimizer_state_dict("A")["state"]
    assert len(state) == len(engine.adapter_state_dict("A")) and len(slot_storage(engine, "A")) == 1
    assert len(engine._job("A").slot.runs) == 1  # on CPU a copy moves in one copy_
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in state.values())
    for seed in (1, 2):
        engine.train_step("A", make_batch(seed), HP_A)
    assert len(slot_storage(engine, "A")) == 1
    engine.save_checkpoint("A", str(tmp_path / "ckpt"), {})
    before = {k: v.clone() for k, v in engine.adapter_state_dict("A").items()}
    engine.train_step("A", make_batch(3), HP_A)
    engine.load_checkpoint("A", str(tmp_path / "ckpt"), LORA_A, seed=3)
    assert len(slot_storage(engine, "A")) == 1
    assert_exactly_equal(before, engine.adapter_state_dict("A"))
    assert all(float(s["step"]) == 2 for s in engine.optimizer_state_dict("A")["state"].values())


def test_job_lifecycle_and_state_bytes(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    lora = LoraSpec(rank=4)
    engine.ensure_job("A", lora, seed=1)
    engine.ensure_job("A", lora, seed=1)  # idempotent
    with pytest.raises(JobConfigError):
        engine.ensure_job("A", LoraSpec(rank=8), seed=1)
    adapter = engine.adapter_state_dict("A")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    full_bytes = 3 * adapter_bytes + 4 * len(adapter)  # weights + exp_avg + exp_avg_sq + step counts
    assert engine.state_bytes("A") == full_bytes  # AdamW's state is there from the start
    engine.train_step("A", make_batch(1), TrainHParams())
    assert engine.state_bytes("A") == full_bytes
    engine.ensure_job("B", lora, seed=2)
    assert engine.jobs() == ["A", "B"]
    engine.release("A")
    engine.release("B")
    assert engine.jobs() == []
    with pytest.raises(UnknownJobError):
        engine.state_bytes("A")
    engine.ensure_job("A", lora, seed=1)  # a released job can come back
    assert engine.jobs() == ["A"]


def test_released_jobs_leave_at_most_a_few_parked_adapters_in_the_model(model_dir: str) -> None:
    from worker.trainer_slots import PARKED_ADAPTERS_MAX

    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("kept", LORA_A, seed=1)
    for i in range(PARKED_ADAPTERS_MAX + 4):  # shapes no parked adapter can serve again
        engine.ensure_job(f"gone{i}", LoraSpec(rank=1 + i, alpha=2), seed=i)
        engine.release(f"gone{i}")
    assert engine.jobs() == ["kept"]
    assert len(engine.slots.peft.peft_config) == 1 + PARKED_ADAPTERS_MAX  # the rest deleted from the model
    before = snapshot(engine, "kept")
    engine.train_step("kept", make_batch(5), HP_A)  # the job left trains on
    assert any(not torch.equal(before[k], v) for k, v in snapshot(engine, "kept").items())


# ---------------------------------------------------------------- the base's sleep


class _NewTensors(TorchDispatchMode):
    """Records every CPU tensor an op returns in new memory (not an input's storage) outside
    ``[begin, end)``."""

    def __init__(self, begin: int, end: int) -> None:
        super().__init__()
        self.begin, self.end = begin, end
        self.outside: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
                start = t.untyped_storage().data_ptr()
                if start not in inputs and not self.begin <= start < self.end:
                    self.outside.append(f"{func}: {t.nbytes} bytes")
        return out


def test_a_sleeping_base_lives_in_one_block_of_the_host_arena_and_wakes_bit_for_bit(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=1)
    engine.ensure_job("j", LORA_A, seed=0)
    batch = make_batch(3)
    before = engine.logprobs("j", batch.input_ids, batch.loss_mask)
    state = {k: t.clone() for k, t in engine._base.state_dict().items()}  # every parameter and buffer
    weights = sum(p.numel() * p.element_size() for p in engine._base_params.values())
    arena = engine.host_arena = HostArena(2 * weights)
    for _ in range(2):  # the second sleep reuses the block the first gave back
        with _NewTensors(arena.address, arena.address + arena.capacity) as dispatched:
            engine.sleep()
        assert dispatched.outside == []  # nothing on the host outside the arena
        assert not engine.awake
        assert weights <= arena.stats().in_use <= page_round(weights + 256 * len(engine._base_params))
        assert arena.stats().blocks == 1
        for name, p in engine._base_params.items():
            start = p.data.untyped_storage().data_ptr()
            assert arena.address <= start and p.data_ptr() + p.nbytes <= arena.address + arena.capacity, name
        engine.wake()
        assert engine.awake and arena.stats().in_use == 0
        for k, t in engine._base.state_dict().items():
            assert torch.equal(t, state[k]), k
            assert not arena.address <= t.data_ptr() < arena.address + arena.capacity, k
        assert engine.logprobs("j", batch.input_ids, batch.loss_mask) == before


def test_a_base_its_arena_cannot_hold_sleeps_the_old_way_and_says_so(
    model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = TrainerEngine(model_dir, threads=1)
    state = {k: t.clone() for k, t in engine._base.state_dict().items()}
    engine.host_arena = HostArena(PAGE_BYTES)
    with caplog.at_level("WARNING", logger="worker.trainer"):
        engine.sleep()
    assert "sleeps outside its host arena" in caplog.text and "no host memory" in caplog.text
    assert engine.host_arena.stats().in_use == 0
    engine.wake()
    assert all(torch.equal(t, state[k]) for k, t in engine._base.state_dict().items())


def test_a_base_without_an_arena_gets_one_of_its_size_on_its_first_sleep(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=1)
    assert engine.host_arena is None
    engine.sleep()
    arena = engine.host_arena
    assert arena is not None and not arena.pinned  # pinned on CUDA only
    assert arena.stats().in_use == arena.capacity == page_round(packed_layout(list(engine._base_params.values()))[1])
    engine.wake()
    engine.sleep()
    assert engine.host_arena is arena and arena.stats().in_use == arena.capacity
    engine.wake()
