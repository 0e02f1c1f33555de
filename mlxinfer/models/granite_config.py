"""Granite 3.x (dense) config.json rules beyond the common checks in config.py: its four multipliers."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..untrusted import is_finite_number, shown

# GraniteConfig's defaults (transformers 5); mlx-lm's granite module has none for these.
GRANITE3_DEFAULTS: dict[str, Any] = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "embedding_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "logits_scaling": 1.0,
}
_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def check_granite(args: dict[str, Any], source: str) -> None:
    for key in _MULTIPLIERS:  # logits are divided by logits_scaling; a zero or negative scale is no model
        value = args[key]
        if not (is_finite_number(value) and value > 0):
            raise ConfigError(f"{source}: {key} must be a positive finite number, got {shown(value)}")
