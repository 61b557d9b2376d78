"""The config.json of a model to plan for: the model directory's own, else a known public shape.

``plexctl plan`` runs on login nodes where the model files are often absent, so this module
carries the public ``config.json`` fields (the ones a memory plan reads, copied from the
models' Hugging Face repositories) of the real-scale models the examples use. A shape is
looked up by the model directory's basename, case-insensitively, and only when the directory
has no ``config.json``: a model that is present always speaks for itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plexctl.common.errors import UsageError
from plexctl.common.state_size import model_config

_QWEN2_5_0_5B: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}

_QWEN2_5_3B: dict[str, Any] = {
    **_QWEN2_5_0_5B,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
}

_QWEN2_5_7B: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}

_QWEN2_5_14B: dict[str, Any] = {
    **_QWEN2_5_7B,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
}

_QWEN2_5_32B: dict[str, Any] = {**_QWEN2_5_14B, "intermediate_size": 27648, "num_hidden_layers": 64}

_QWEN2_5_72B: dict[str, Any] = {
    **_QWEN2_5_7B,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}

_LLAMA_3_1_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
}

_LLAMA_3_1_70B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
}

# Lower-case directory basename -> config.json fields. The Llama 3.1 base and instruct models
# share their architecture; so do the Qwen2.5 base and instruct models (the 0.5B and 3B tie their
# embeddings; the 0.5B listed is the instruct model).
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-instruct": _QWEN2_5_0_5B,
    "qwen2.5-3b-instruct": _QWEN2_5_3B,
    "qwen2.5-3b": _QWEN2_5_3B,
    "qwen2.5-7b-instruct": _QWEN2_5_7B,
    "qwen2.5-7b": _QWEN2_5_7B,
    "qwen2.5-14b-instruct": _QWEN2_5_14B,
    "qwen2.5-14b": _QWEN2_5_14B,
    "qwen2.5-32b-instruct": _QWEN2_5_32B,
    "qwen2.5-32b": _QWEN2_5_32B,
    "qwen2.5-72b-instruct": _QWEN2_5_72B,
    "qwen2.5-72b": _QWEN2_5_72B,
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "llama-3.1-8b-instruct": _LLAMA_3_1_8B,
    "meta-llama-3.1-8b": _LLAMA_3_1_8B,
    "meta-llama-3.1-8b-instruct": _LLAMA_3_1_8B,
    "llama-3.1-70b": _LLAMA_3_1_70B,
    "llama-3.1-70b-instruct": _LLAMA_3_1_70B,
    "meta-llama-3.1-70b": _LLAMA_3_1_70B,
    "meta-llama-3.1-70b-instruct": _LLAMA_3_1_70B,
}


class UnknownModelShape(UsageError):
    """A model directory without config.json whose name is not a known shape."""


def known_shape(name: str) -> dict[str, Any] | None:
    """The known config of a model named like ``name``'s basename (case-insensitive), or None."""
    shape = KNOWN_SHAPES.get(Path(str(name).rstrip("/")).name.lower())
    return dict(shape) if shape is not None else None


def model_config_for(path: str | Path) -> dict[str, Any]:
    """``path/config.json`` if present, else the known shape of ``path``'s basename.

    Raises ``UnknownModelShape`` (one line, the known names) when neither exists."""
    if (Path(path) / "config.json").is_file():
        return dict(model_config(str(path)))
    shape = known_shape(str(path))
    if shape is None:
        known = ", ".join(sorted(KNOWN_SHAPES))
        raise UnknownModelShape(
            f"no config.json in {path} and no known shape named {Path(str(path)).name!r} (known: {known})"
        )
    return shape
