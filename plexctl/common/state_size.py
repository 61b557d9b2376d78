"""How many bytes a job's trainer state takes, from its spec and the base model's config.

Pure arithmetic over ``config.json`` (no torch), so the daemon and the simulator can do
admission control by tier capacity before a job starts. Two kinds of state:

- a LoRA job's (``job_state_bytes``): the fp32 adapter, AdamW's two moments, per-parameter
  step counts and the RNG state; the worker's state store measures the real copies and a test
  keeps the two in agreement;
- a full fine-tuning job's (``full_state_size``): every weight in the training dtype, an fp32
  master copy when that dtype is narrower than fp32 (bf16, fp16: AdamW's update is lost in
  their rounding), AdamW's two fp32 moments, a step count per parameter tensor and the RNG
  state. For a 7B model in bf16 that is 2 + 4 + 8 = 14 bytes a parameter (~107 GB).

It also owns the model's parameter count (``parameter_count``), which both need. It does not
count gradients or activations (the memory plan's, ``plexctl.common.memplan``): they live
only while a step runs and are not part of what moves between tiers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

FP32_BYTES = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RNG_STATE_BYTES = 5056  # torch CPU generator state (torch.get_rng_state().numel())
CUDA_RNG_STATE_BYTES = 16


def lora_module_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-targetable linear of a Llama/Qwen-style layer."""
    hidden = int(config["hidden_size"])
    intermediate = int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def job_state_bytes(rank: int, target_modules: list[str], config: Mapping[str, Any], cuda: bool = False) -> int:
    shapes = lora_module_shapes(config)
    unknown = sorted(set(target_modules) - set(shapes))
    if unknown:
        raise ValueError(f"no known shape for target modules {unknown} (known: {sorted(shapes)})")
    layers = int(config["num_hidden_layers"])
    targets = set(target_modules)
    params = layers * sum(rank * (shapes[m][0] + shapes[m][1]) for m in targets)
    step_counts = layers * len(targets) * 2  # one per lora_A and lora_B
    rng = RNG_STATE_BYTES + (CUDA_RNG_STATE_BYTES if cuda else 0)
    return 3 * params * FP32_BYTES + step_counts * FP32_BYTES + rng


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPE_BYTES)})")
    return DTYPE_BYTES[dtype]


def _biased_modules(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The projections with a bias: q/k/v for Qwen2; ``attention_bias`` / ``mlp_bias`` when a config says so."""
    biased: tuple[str, ...]
    if "attention_bias" in config:
        biased = ("q_proj", "k_proj", "v_proj", "o_proj") if config["attention_bias"] else ()
    else:
        biased = ("q_proj", "k_proj", "v_proj") if config.get("model_type") == "qwen2" else ()
    if config.get("mlp_bias"):
        biased += ("gate_proj", "up_proj", "down_proj")
    return biased


def parameter_count(config: Mapping[str, Any]) -> int:
    """Parameters of the base model: embeddings, lm_head (unless tied), attention (GQA), MLP, norms
    and biases (q/k/v biases for Qwen2; ``attention_bias`` / ``mlp_bias`` when a config says so)."""
    hidden, vocab, layers = int(config["hidden_size"]), int(config["vocab_size"]), int(config["num_hidden_layers"])
    shapes = lora_module_shapes(config)
    linear = sum(n_in * n_out for n_in, n_out in shapes.values())
    biases = sum(shapes[m][1] for m in _biased_modules(config))
    per_layer = linear + biases + 2 * hidden  # two RMSNorms
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + embeddings + hidden  # + the final norm


def parameter_tensors(config: Mapping[str, Any]) -> int:
    """Parameter tensors of the base model (AdamW keeps one step count for each)."""
    per_layer = len(lora_module_shapes(config)) + len(_biased_modules(config)) + 2
    heads = 1 if config.get("tie_word_embeddings", False) else 2
    return int(config["num_hidden_layers"]) * per_layer + heads + 1


@dataclass(frozen=True)
class FullStateSize:
    """A full fine-tuning job's state, by part (bytes)."""

    params: int
    dtype: str  # the training dtype of its weights
    weights: int  # every weight in ``dtype``
    masters: int  # fp32 master copy (0 when ``dtype`` is fp32)
    moments: int  # AdamW's exp_avg and exp_avg_sq, fp32
    extra: int  # step counts (one fp32 per parameter tensor) and the RNG state

    @property
    def total(self) -> int:
        return self.weights + self.masters + self.moments + self.extra

    def describe(self) -> str:
        """``weights 14.2 GiB bfloat16 + fp32 masters 28.4 GiB + AdamW moments 56.7 GiB``."""
        gib = 1 << 30
        parts = [f"weights {self.weights / gib:.1f} GiB {self.dtype}"]
        if self.masters:
            parts.append(f"fp32 masters {self.masters / gib:.1f} GiB")
        parts.append(f"AdamW moments {self.moments / gib:.1f} GiB")
        return " + ".join(parts)


def full_state_size(config: Mapping[str, Any], dtype: str = "bfloat16", cuda: bool = False) -> FullStateSize:
    """What a full fine-tuning job of this model, training in ``dtype``, holds between steps."""
    params = parameter_count(config)
    rng = RNG_STATE_BYTES + (CUDA_RNG_STATE_BYTES if cuda else 0)
    return FullStateSize(
        params=params,
        dtype=dtype,
        weights=params * dtype_bytes(dtype),
        masters=params * FP32_BYTES if dtype_bytes(dtype) < FP32_BYTES else 0,
        moments=2 * params * FP32_BYTES,
        extra=parameter_tensors(config) * FP32_BYTES + rng,
    )


def full_state_bytes(config: Mapping[str, Any], dtype: str = "bfloat16", cuda: bool = False) -> int:
    return full_state_size(config, dtype, cuda).total


@lru_cache(maxsize=64)
def model_config(model_dir: str) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())
