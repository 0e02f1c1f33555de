"""OLMo 3 on mlx-lm's layers, made to compute what transformers' Olmo3ForCausalLM does.

mlx-lm's module picks each layer's RoPE from its own default pattern (every 4th layer full) because our
config leaves `layer_types` out of its args; transformers scales RoPE on the full-attention layers that
layer_types names, and YaRN there the way models/yarn.py computes it.
"""

from __future__ import annotations

import mlx.nn as nn

from .config import FULL, ModelConfig
from .decoder import DecoderLM
from .gpt_oss_layers import FrequencyRoPE
from .mlx_lm_modules import model_module
from .yarn import yarn_inverse_frequencies


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    args = config.args
    scaling, theta = args.get("rope_scaling"), args["rope_theta"]
    for layer, kind in zip(model.layers, config.layer_types):
        attention = layer.self_attn
        attention.rope = _rope(attention.head_dim, theta, scaling if kind == FULL else None, args)


def _rope(head_dim: int, theta: float, scaling: dict | None, args: dict) -> nn.Module:
    if scaling is None:
        return nn.RoPE(head_dim, traditional=False, base=theta)
    if scaling["rope_type"] == "yarn":
        return FrequencyRoPE(*yarn_inverse_frequencies(head_dim, theta, scaling))
    initialize_rope = model_module("rope_utils").initialize_rope
    return initialize_rope(head_dim, theta, False, scaling, args.get("max_position_embeddings"))
