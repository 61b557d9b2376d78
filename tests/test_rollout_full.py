"""A full fine-tuning job's rollouts from its own weights on the shared vLLM engine (CPU build).

What a user relies on: once a full job published a version, its generates sample from those
weights (log-probs as transformers computes them with the weights loaded); a LoRA job, or the
base, on the same engine never samples from another job's weights, whatever was loaded between
its calls; weights are loaded only when they change.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_tiny_and_rollout import PROMPTS, hf_logprobs, make_adapter
from transformers import AutoModelForCausalLM

from plexctl.common.protocol import AdapterRef, GenRequest, Sampling, TrainBatch, TrainHParams
from plexctl.tiny_models import TinyPaths, build_tiny
from worker.rollout import AdapterError, RolloutEngine
from worker.trainer import FULL_WEIGHTS_FILE, TrainerEngine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyPaths:
    return build_tiny(tmp_path_factory.mktemp("plexrl"))


@pytest.fixture(scope="module")
def published(tiny: TinyPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Version 1 of a full job: one large step of every weight, published by the trainer."""
    trainer = TrainerEngine(str(tiny.model_dir), threads=2)
    trainer.ensure_job("full", None, seed=1)
    ids = [[1, 5, 6, 7, 8, 9], [1, 9, 8, 7, 6, 5]]
    mask = [[0, 0, 1, 1, 1, 1]] * 2
    old = trainer.logprobs("full", ids, mask)
    trainer.train_step("full", TrainBatch(ids, mask, old, [1.0, -1.0]), TrainHParams(lr=5e-2))
    out = tmp_path_factory.mktemp("published") / "v000001"
    trainer.save_adapter("full", str(out))
    return out


@pytest.fixture(scope="module")
def engine(tiny: TinyPaths) -> Iterator[RolloutEngine]:
    eng = RolloutEngine(str(tiny.model_dir), max_loras=2, max_cpu_loras=2, max_model_len=64)
    yield eng
    eng.close()


SAMPLING = Sampling(temperature=1.0, max_tokens=4, n=2, seed=3)


def test_a_full_job_samples_from_its_published_weights(engine: RolloutEngine, published: Path, tiny: TinyPaths) -> None:
    from safetensors.torch import load_file

    ref = AdapterRef("full", 1, str(published), full=True)
    [completions] = engine.generate([GenRequest("full", PROMPTS[::11], SAMPLING, ref)])
    assert engine.loaded_weights == "full@v1"
    model = AutoModelForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32)
    model.load_state_dict(load_file(str(published / FULL_WEIGHTS_FILE)), strict=False)
    worst = max(max(abs(a - b) for a, b in zip(c.logprobs, hf_logprobs(model.eval(), c))) for c in completions)
    assert worst < 1e-3, worst
    base = AutoModelForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32).eval()
    assert max(max(abs(a - b) for a, b in zip(c.logprobs, hf_logprobs(base, c))) for c in completions) > 1e-2


def test_lora_and_base_generations_are_unchanged_by_a_full_jobs_weight_loads(
    engine: RolloutEngine, published: Path, tiny: TinyPaths, tmp_path: Path
) -> None:
    adapter = make_adapter(tiny.model_dir, tmp_path / "lora", seed=7)
    lora = GenRequest("lora", PROMPTS[::7], SAMPLING, AdapterRef("lora", 1, str(adapter)))
    base = GenRequest("base", PROMPTS[::5], SAMPLING)
    full = GenRequest("full", PROMPTS[::5], SAMPLING, AdapterRef("full", 1, str(published), full=True))
    engine.generate([base])
    loads = engine.weight_loads
    before = engine.generate([lora, base])
    assert engine.weight_loads == loads  # the base was already there: nothing loaded

    got_full = engine.generate([full])
    engine.generate([full])
    assert engine.weight_loads == loads + 1  # loaded once for both
    after = engine.generate([lora, base])
    assert engine.loaded_weights == "base" and engine.weight_loads == loads + 2
    for b, a in zip(before, after):
        assert [c.token_ids for c in b] == [c.token_ids for c in a]
        assert [c.logprobs for c in b] == [c.logprobs for c in a]
    assert [c.logprobs for c in got_full[0]] != [c.logprobs for c in after[1]]  # same prompts, other weights

    # continuous batching: a full job's request waits for the base's in flight, each on its own weights
    engine.start("b", base)
    engine.start("f", full)
    done: dict[str, list] = {}
    while engine.in_flight:
        done.update(engine.step())
    assert [c.logprobs for c in done["b"]] == [c.logprobs for c in after[1]]
    assert [c.logprobs for c in done["f"]] == [c.logprobs for c in got_full[0]]


def test_missing_weights_are_a_typed_error_and_the_engine_keeps_serving(engine: RolloutEngine, tmp_path: Path) -> None:
    bad = GenRequest("ghost", PROMPTS[:2], SAMPLING, AdapterRef("ghost", 1, str(tmp_path), full=True))
    with pytest.raises(AdapterError, match="ghost@v1"):
        engine.generate([bad])
    [ok] = engine.generate([GenRequest("base", PROMPTS[:2], SAMPLING)])
    assert len(ok) == 4 and engine.loaded_weights == "base"
