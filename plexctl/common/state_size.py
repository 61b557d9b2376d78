"""How many bytes a job's trainer state takes, from its spec and the base model's config.

Pure arithmetic over ``config.json`` (no torch), so the daemon and the simulator can do
admission control by tier capacity before a job starts. The state is the fp32 LoRA adapter,
AdamW's two moments, per-parameter step counts and the RNG state; the worker's state store
measures the real copies and a test keeps the two in agreement.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

FP32_BYTES = 4
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


@lru_cache(maxsize=64)
def model_config(model_dir: str) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())
