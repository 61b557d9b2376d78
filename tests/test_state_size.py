"""The state a job moves between tiers: a full fine-tuning job's weights, fp32 masters and AdamW
moments, held to hand-computed figures and published parameter counts (pure arithmetic)."""

from __future__ import annotations

import pytest

from plexctl.common.model_shapes import known_shape
from plexctl.common.state_size import (
    RNG_STATE_BYTES,
    full_state_bytes,
    full_state_size,
    job_state_bytes,
    parameter_count,
    parameter_tensors,
)

GB = 10**9
# one layer, hidden 4, MLP 8, 2 heads of 2 (no GQA), vocabulary 10, untied, Llama-style (no biases)
HAND = {
    "model_type": "llama",
    "hidden_size": 4,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 10,
    "tie_word_embeddings": False,
}
# q, k, v, o: 4 x 16; gate, up, down: 3 x 32; two norms: 8; embeddings and lm_head: 2 x 40; final norm 4
HAND_PARAMS = 64 + 96 + 8 + 80 + 4
HAND_TENSORS = 7 + 2 + 2 + 1


def test_parameter_count_and_tensors_of_a_hand_counted_model() -> None:
    assert parameter_count(HAND) == HAND_PARAMS == 252
    assert parameter_tensors(HAND) == HAND_TENSORS


def test_bf16_full_state_is_weights_masters_and_two_moments_14_bytes_a_parameter() -> None:
    size = full_state_size(HAND, "bfloat16")
    assert (size.weights, size.masters, size.moments) == (2 * 252, 4 * 252, 8 * 252)
    assert size.extra == 4 * HAND_TENSORS + RNG_STATE_BYTES
    assert size.total == 14 * 252 + size.extra == full_state_bytes(HAND)


def test_fp32_full_state_needs_no_master_copy() -> None:
    size = full_state_size(HAND, "float32")
    assert (size.weights, size.masters, size.moments) == (4 * 252, 0, 8 * 252)
    assert "masters" not in size.describe()


def test_7b_bf16_is_14_gb_weights_28_gb_masters_56_gb_moments_per_7_billion_parameters() -> None:
    size = full_state_size(known_shape("Qwen2.5-7B-Instruct") or {}, "bfloat16", cuda=True)
    assert size.params == 7_615_616_512  # the published safetensors total
    per_7b = 7e9 / size.params
    assert size.weights * per_7b / GB == pytest.approx(14.0)
    assert size.masters * per_7b / GB == pytest.approx(28.0)
    assert size.moments * per_7b / GB == pytest.approx(56.0)
    assert size.total / GB == pytest.approx(106.6, abs=0.1)
    assert "weights 14.2 GiB bfloat16 + fp32 masters 28.4 GiB + AdamW moments 56.7 GiB" == size.describe()


@pytest.mark.parametrize(
    "name, published_b, state_gb",
    [
        ("Llama-3.1-8B", 8.03, 112.4),
        ("Qwen2.5-14B", 14.77, 206.8),
        ("Qwen2.5-32B", 32.76, 458.7),
        ("Llama-3.1-70B", 70.55, 987.8),
        ("Qwen2.5-72B", 72.71, 1017.9),
    ],
)
def test_full_states_from_7b_to_70b_class(name: str, published_b: float, state_gb: float) -> None:
    shape = known_shape(name)
    assert shape is not None
    assert parameter_count(shape) / 1e9 == pytest.approx(published_b, abs=0.01)
    assert full_state_bytes(shape) / GB == pytest.approx(state_gb, abs=0.1)


def test_a_full_state_dwarfs_a_lora_state_of_the_same_model() -> None:
    shape = known_shape("Qwen2.5-7B-Instruct") or {}
    lora = job_state_bytes(32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], shape)
    assert full_state_bytes(shape) > 100 * lora
