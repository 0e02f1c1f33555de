"""Granite 3 MoE (GraniteMoeForCausalLM): Granite's multipliers (models/shared_layers.granite_multipliers, as
for Granite 4.0 hybrid) and its fused expert tensors split for mlx-lm (models/moe_weights.py)."""

from __future__ import annotations

from typing import Any

from ..models.config import ModelConfig
from ..models.config_rules import check_experts, positive_number
from ..models.decoder import DecoderLM
from ..models.moe_weights import ExpertLayout, expert_sanitizer
from ..models.registry import ArchSpec
from ..models.shared_layers import granite_multipliers

# GraniteMoeConfig's defaults for keys config.json may leave out and mlx-lm needs (the expert count among them:
# Granite has one name for it).
GRANITEMOE_DEFAULTS: dict[str, Any] = {
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
    "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
    "num_local_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip
# The checkpoint's experts: fused input_linear (gate and up halves) and output_linear; the router's own name.
GRANITE = ExpertLayout(
    "block_sparse_moe",
    "router.layer.weight",
    "num_local_experts",
    fused=("input_linear.weight", "output_linear.weight"),
)
_MULTIPLIERS = ("embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier")


def check_granitemoe(args: dict[str, Any], source: str) -> None:
    check_experts(args, source, "num_local_experts", False)  # GraniteMoeConfig knows no other name
    for key in _MULTIPLIERS:
        positive_number(args, key, source)


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    granite_multipliers(model, config)
    expert_sanitizer(model, config, GRANITE)


SPECS = {
    "granitemoe": ArchSpec(
        "granitemoe",
        fixed_head_dim=True,
        defaults=GRANITEMOE_DEFAULTS,
        check_config=check_granitemoe,
        mlx_sanitize=True,
        adapt=adapt,
    ),
}
