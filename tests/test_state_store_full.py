"""A full fine-tuning job's state (every weight, AdamW moments, step counts) through the state
store's tiers (worker/state/store.py), beside a LoRA job, with real torch on a tiny Qwen2.

What a user relies on: the same store moves a full job's weights and moments between device,
host and nvme (write-behind, checksummed chunks) and the job trains on bit-for-bit as alone; a
corrupt copy of it is refused, never imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_state_store import JOBS, assert_like_alone, batch_for, engine, job_state, model_dir, train
from test_trainer import without_seconds

from plexctl.common.protocol import TrainHParams
from worker.errors import CorruptCopyError
from worker.state import files as copy_files
from worker.state.store import StateStore

__all__ = ["model_dir"]  # the module's fixture, shared

HP_FULL = TrainHParams(lr=1e-3, kl_coef=0.05, weight_decay=0.01, max_grad_norm=1.0)
STEPS = 3


def full_step(trainer: Any, step: int) -> dict[str, float]:
    return trainer.train_step("F", batch_for("j0", 10 + step), HP_FULL)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_full_job_through_a_tier_trains_like_alone(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str
) -> None:
    monkeypatch.setattr(copy_files, "IO_CHUNK_BYTES", 64 * copy_files.DIRECT_ALIGN)  # many chunks per copy
    alone = engine(model_dir)
    alone.ensure_job("F", None, seed=5)
    expected = [without_seconds(full_step(alone, step)) for step in range(STEPS)]

    trainer = engine(model_dir)
    probe = engine(model_dir)
    probe.ensure_job("F", None, seed=5)
    full_bytes = probe.state_bytes("F")
    del probe
    store = StateStore(
        trainer,
        device_slots=1,
        host_bytes=4 * full_bytes if tier == "host" else 0,
        nvme_dir=tmp_path / "nvme",
        nvme_bytes=1 << 30,
        write_behind_bytes=2 * full_bytes,
    )
    lora, seed, hp = JOBS["j1"]
    got, sources = [], []
    for step in range(STEPS):
        store.set_upcoming(["F", "j1"] if step % 2 else [])  # the scheduler's order, or none
        sources.append(store.ensure_resident("F", None, 5)["swap_in"])
        got.append(without_seconds(full_step(trainer, step)))
        store.ensure_resident("j1", lora, seed)
        trainer.train_step("j1", batch_for("j1", step), hp)
        assert store.wait_written(timeout=60)
    assert got == expected
    assert sources == [None] + [tier] * (STEPS - 1)  # swapped out and in every step
    # the moves by kind: the whole model's and the adapter's, adding up to those by direction
    inventory = store.inventory()
    by_kind, by_direction = inventory["swaps_by_kind"], inventory["swaps"].values()
    assert by_kind["model"]["count"] >= STEPS - 1 and by_kind["adapter"]["count"] >= STEPS - 1
    assert by_kind["model"]["bytes"] >= (STEPS - 1) * full_bytes > by_kind["adapter"]["bytes"]
    for field in ("count", "bytes"):
        assert sum(k[field] for k in by_kind.values()) == sum(d[field] for d in by_direction)
    store.ensure_resident("F", None, 5)
    assert_like_alone(trainer, "F", job_state(alone, "F"))


def test_corrupt_full_copy_is_refused(model_dir: str, tmp_path: Path) -> None:
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=0, nvme_dir=tmp_path / "nvme")
    store.ensure_resident("F", None, 5)
    train_full = full_step(trainer, 0)
    assert train_full["grad_norm"] > 0
    store.ensure_resident("j1", JOBS["j1"][0], JOBS["j1"][1])
    train(trainer, "j1", 0)
    copy = store._records["F"].nvme
    assert copy is not None and copy.nbytes >= trainer.state_bytes("j1") * 10  # weights, not an adapter
    data = bytearray(copy.path.read_bytes())
    data[copy.nbytes // 2] ^= 0x01
    copy.path.write_bytes(bytes(data))
    with pytest.raises(CorruptCopyError):
        store.ensure_resident("F", None, 5)
    assert trainer.jobs() == ["j1"] and store.where("F") == "nvme"


def test_job_bytes_of_a_full_job_matches_its_real_copy(model_dir: str) -> None:
    trainer = engine(model_dir)
    trainer.ensure_job("F", None, seed=5)
    full_step(trainer, 0)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert StateStore.job_bytes(None, config) == trainer.export_state("F").nbytes
