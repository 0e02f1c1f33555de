"""Mixtral (MixtralForCausalLM): mlx-lm's blocks compute what transformers' do; only the checkpoint's per-expert
tensors (w1/w3/w2) need stacking into mlx-lm's switch_mlp (models/moe_weights.py)."""

from __future__ import annotations

from typing import Any

from ..models.config import ModelConfig
from ..models.config_rules import check_experts, expert_count
from ..models.decoder import DecoderLM
from ..models.moe_weights import ExpertLayout, expert_sanitizer
from ..models.registry import ArchSpec

# MixtralConfig's defaults for keys config.json may leave out and mlx-lm needs.
MIXTRAL_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "num_experts_per_tok": 2,
}  # fmt: skip
# The checkpoint's experts: block_sparse_moe.experts.N.{w1,w3,w2} = gate, up, down.
MIXTRAL = ExpertLayout(
    "block_sparse_moe",
    "gate.weight",
    "num_local_experts",
    names=(("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")),
)


def check_mixtral(args: dict[str, Any], source: str) -> None:
    check_experts(args, source, expert_count(args, source, "num_local_experts", "num_experts", 8), False)


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    expert_sanitizer(model, config, MIXTRAL)


SPECS = {
    "mixtral": ArchSpec(
        "mixtral",
        sliding="all",
        fixed_head_dim=True,
        rope_types=frozenset({"default"}),  # mlx-lm's module builds a plain RoPE
        renamed={"num_local_experts": "num_experts"},
        defaults=MIXTRAL_DEFAULTS,
        check_config=check_mixtral,
        mlx_sanitize=True,
        adapt=adapt,
    ),
}
