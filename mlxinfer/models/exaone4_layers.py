"""EXAONE 4.0 on mlx-lm's layers, made to compute what transformers' Exaone4ForCausalLM does.

transformers rotates queries and keys on a layer when it slides or when the model has no sliding window
at all; the global layers of a hybrid model run without positions. exaone4_config.py nulls
sliding_window_pattern, so mlx-lm builds RoPE on every layer, and this switches it off where it must be.
"""

from __future__ import annotations

from .config import SLIDING, ModelConfig
from .decoder import DecoderLM


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    hybrid = config.sliding_window is not None
    for layer, kind in zip(model.layers, config.layer_types):
        layer.self_attn.use_rope = not hybrid or kind == SLIDING
