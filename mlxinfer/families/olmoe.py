"""OLMoE (OlmoeForCausalLM): mlx-lm's blocks compute what transformers' do; only the checkpoint's per-expert
tensors need stacking into mlx-lm's switch_mlp (models/moe_weights.py)."""

from __future__ import annotations

from typing import Any

from ..models.config import ModelConfig
from ..models.config_rules import check_experts, expert_count, require_bools
from ..models.decoder import DecoderLM
from ..models.moe_weights import QWEN, expert_sanitizer
from ..models.registry import ArchSpec

# OlmoeConfig's defaults for keys config.json may leave out and mlx-lm needs.
OLMOE_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "num_experts_per_tok": 8, "norm_topk_prob": False,
}  # fmt: skip


def check_olmoe(args: dict[str, Any], source: str) -> None:
    check_experts(args, source, expert_count(args, source, "num_experts", "num_local_experts", 64), False)
    require_bools(args, source, ("norm_topk_prob",))


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    expert_sanitizer(model, config, QWEN)  # OLMoE names its experts as Qwen3-MoE does


SPECS = {
    "olmoe": ArchSpec(
        "olmoe",
        fixed_head_dim=True,  # its q_norm spans hidden_size, so transformers too needs heads * head_dim == hidden
        whole_qk_norm=True,  # q_norm and k_norm span the whole projection, not one head
        neutral={"clip_qkv": None, "mlp_bias": False},  # mlx-lm never clips; transformers' experts have no bias
        renamed={"num_experts": "num_local_experts"},
        defaults=OLMOE_DEFAULTS,
        check_config=check_olmoe,
        mlx_sanitize=True,
        adapt=adapt,
    ),
}
