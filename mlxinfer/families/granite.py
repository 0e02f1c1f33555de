"""Granite 3.x dense (GraniteForCausalLM): its registry row, its four multipliers, and their layers.

mlx-lm's blocks apply attention_multiplier (the softmax scale) and residual_multiplier; the embedding and logit
multipliers sit in mlx-lm's backbone and head `__call__`, which our forward does not run
(models/shared_layers.granite_multipliers sets them).
"""

from __future__ import annotations

from typing import Any

from ..models.config_rules import positive_number
from ..models.registry import ArchSpec
from ..models.shared_layers import granite_multipliers

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
        positive_number(args, key, source)


SPECS = {
    "granite": ArchSpec(
        "granite",
        fixed_head_dim=True,
        defaults=GRANITE3_DEFAULTS,
        check_config=check_granite,
        adapt=granite_multipliers,
    ),
}
