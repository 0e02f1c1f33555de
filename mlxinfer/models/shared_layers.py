"""Layer pieces more than one family puts over mlx-lm's blocks: RoPE from given frequencies, and final norms
that also scale the logits (the head is linear without bias, so scaling its input scales its output)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from .config import ModelConfig
    from .decoder import DecoderLM


class FrequencyRoPE(nn.Module):
    """Rotary embedding with given inverse frequencies (rotated half-split, as transformers), its cos and
    sin scaled by `scale`: the same as scaling the rotated vector, since the rotation is linear."""

    def __init__(self, inverse: list[float], scale: float = 1.0):
        super().__init__()
        self.dims = 2 * len(inverse)
        self.scale = scale
        self._freqs = 1 / mx.array(inverse, dtype=mx.float32)  # mx.fast.rope takes periods (1 / frequency)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.scale != 1.0:
            x = x * self.scale
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


class ScaledRMSNorm(nn.RMSNorm):
    """The final norm, its output times `scale`: it feeds only the head, so this divides the logits
    by logits_scaling as transformers does after the head."""

    def __init__(self, dims: int, eps: float, scale: float):
        super().__init__(dims, eps)
        self._scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) * self._scale


class ScaledLayerNorm(nn.LayerNorm):
    """LayerNorm without bias, its output times `scale`: it feeds only the head, so this scales the logits."""

    def __init__(self, dims: int, eps: float, scale: float):
        super().__init__(dims, eps=eps, bias=False)
        self._scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) * self._scale


def granite_multipliers(model: DecoderLM, config: ModelConfig) -> None:
    """Embeddings times `embedding_multiplier`, logits divided by `logits_scaling` (every Granite family).

    Our forward (models/decoder.py) runs mlx-lm's blocks but not its backbone's or head's `__call__`, which
    is where mlx-lm applies these two; the blocks apply attention_multiplier and residual_multiplier."""
    args = config.args
    model.layout = replace(model.layout, embed_scale=float(args["embedding_multiplier"]))
    model.model.norm = ScaledRMSNorm(config.hidden_size, args["rms_norm_eps"], 1 / args["logits_scaling"])
