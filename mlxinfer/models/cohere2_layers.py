"""Cohere2 (Command R7B) on mlx-lm's layers, made to compute what transformers' Cohere2ForCausalLM does.

mlx-lm rotates (interleaved RoPE) on the layers its `sliding_window_pattern` calls sliding; transformers on the
layers `layer_types` calls sliding, and none on the full ones. Our forward runs mlx-lm's blocks but not its head,
so the logit_scale multiplication is folded into the final norm (the head is linear without bias).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import SLIDING, ModelConfig
from .decoder import DecoderLM


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    for layer, kind in zip(model.layers, config.layer_types):
        layer.self_attn.use_sliding_window = kind == SLIDING  # mlx-lm's name for "rotate this layer"
    args = config.args
    model.model.norm = ScaledLayerNorm(config.hidden_size, args["layer_norm_eps"], args["logit_scale"])


class ScaledLayerNorm(nn.LayerNorm):
    """LayerNorm without bias, its output times `scale`: it feeds only the head, so this scales the logits."""

    def __init__(self, dims: int, eps: float, scale: float):
        super().__init__(dims, eps=eps, bias=False)
        self._scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) * self._scale
