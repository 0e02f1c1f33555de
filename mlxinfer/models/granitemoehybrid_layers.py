"""Granite 4.0 hybrid on mlx-lm's layers, made to compute what transformers' GraniteMoeHybridForCausalLM does.

Our forward (models/decoder.py) runs mlx-lm's blocks but not its backbone's or head's `__call__`, so the
two scalings those apply are set here: embeddings times `embedding_multiplier`, logits divided by
`logits_scaling`. With several Mamba groups, transformers' gated norm normalizes each group on its own
(mlx-lm's, the whole width).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .decoder import DecoderLM


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    args = config.args
    model.layout = replace(model.layout, embed_scale=float(args["embedding_multiplier"]))
    model.model.norm = ScaledRMSNorm(config.hidden_size, args["rms_norm_eps"], 1 / args["logits_scaling"])
    groups = args["mamba_n_groups"]
    for layer in model.layers:
        if groups > 1 and hasattr(layer, "mamba"):
            layer.mamba.norm = GroupedGatedRMSNorm(layer.mamba.intermediate_size, groups, args["rms_norm_eps"])


class ScaledRMSNorm(nn.RMSNorm):
    """The final norm, its output times `scale`: it feeds only the head, so this divides the logits
    by logits_scaling as transformers does after the head."""

    def __init__(self, dims: int, eps: float, scale: float):
        super().__init__(dims, eps)
        self._scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) * self._scale


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(gate) over each of `groups` equal slices of the last axis, then the weight."""

    def __init__(self, dims: int, groups: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self._groups, self._eps = groups, eps

    def __call__(self, x: mx.array, gate: mx.array | None = None) -> mx.array:
        if gate is not None:
            x = x * nn.silu(gate)
        grouped = x.reshape(*x.shape[:-1], self._groups, -1)  # (..., groups, dims / groups)
        normed = mx.fast.rms_norm(grouped, None, self._eps).reshape(x.shape)
        return self.weight * normed
