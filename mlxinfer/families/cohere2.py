"""Cohere2 (Command R7B, Cohere2ForCausalLM): parallel attention + MLP, RoPE on sliding layers only, logit_scale.

mlx-lm rotates (interleaved RoPE) on the layers its `sliding_window_pattern` calls sliding; transformers on the
layers `layer_types` calls sliding, and none on the full ones. Our forward runs mlx-lm's blocks but not its head,
so the logit_scale multiplication is folded into the final norm (the head is linear without bias).
Reference: transformers' configuration_cohere2.py.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..models.config import SLIDING, ModelConfig
from ..models.decoder import DecoderLM
from ..models.registry import ArchSpec
from ..models.shared_layers import ScaledLayerNorm
from ..untrusted import is_finite_number, shown

COHERE2_DEFAULTS: dict[str, Any] = {
    "layer_norm_eps": 1e-5,
    "logit_scale": 0.0625,
    "max_position_embeddings": 8192,
    "rope_theta": 10_000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 4,  # the BC key of configs without layer_types (transformers' default)
}


def check_cohere2(args: dict[str, Any], source: str) -> None:
    """transformers' Cohere2 LayerNorm never has a bias, and its logits are multiplied by logit_scale."""
    args["layer_norm_bias"] = False
    scale = args["logit_scale"]
    if not (is_finite_number(scale) and scale != 0):
        raise ConfigError(f"{source}: logit_scale must be a finite nonzero number, got {shown(scale)}")
    eps = args["layer_norm_eps"]
    if not (is_finite_number(eps) and 0 < eps < 1):
        raise ConfigError(f"{source}: layer_norm_eps must be a number between 0 and 1, got {shown(eps)}")


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    for layer, kind in zip(model.layers, config.layer_types):
        layer.self_attn.use_sliding_window = kind == SLIDING  # mlx-lm's name for "rotate this layer"
    args = config.args
    model.model.norm = ScaledLayerNorm(config.hidden_size, args["layer_norm_eps"], args["logit_scale"])


SPECS = {
    "cohere2": ArchSpec(
        "cohere2",
        sliding="pattern",
        fixed_head_dim=True,  # transformers derives head_dim = hidden_size / num_attention_heads
        rope_types=frozenset({"default"}),  # mlx-lm's module builds a plain (interleaved) RoPE
        tied_by_default=True,
        defaults=COHERE2_DEFAULTS,
        check_config=check_cohere2,
        adapt=adapt,
    ),
}
