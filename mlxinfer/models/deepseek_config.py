"""Config checks for GLM-4.5 (glm4_moe) and DeepSeek-V3 (deepseek_v3): grouped sigmoid routing, MLA sizes.

Both route like DeepSeek-V3: sigmoid scores plus `e_score_correction_bias` pick `topk_group` of `n_group`
expert groups, then the top `num_experts_per_tok` experts inside them, weighted by their plain sigmoid
scores (renormalized with norm_topk_prob) times routed_scaling_factor; a shared expert always runs.
References: transformers' configuration_glm4_moe.py / configuration_deepseek_v3.py and their modeling files.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import is_finite_number, is_int, shown

MAX_EXPERTS = 65_536  # as family_config.MAX_EXPERTS: real MoE models have at most a few hundred
MAX_MTP_LAYERS = 16  # multi-token-prediction layers stored after the decoder's own (1 in real checkpoints)

# transformers' defaults (Glm4MoeConfig; partial_rotary_factor is its __post_init__ default) for keys
# config.json may leave out, where mlx-lm has none or another.
GLM4_MOE_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 10944, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 10_000.0,
    "attention_bias": False, "use_qk_norm": False, "partial_rotary_factor": 0.5,
    "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
}  # fmt: skip
# DeepseekV3Config's; mlx-lm's differ for most MoE keys (no shared expert, scaling 1.0, one group, top-1).
DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 18432, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
    "attention_bias": False, "rope_interleave": True,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True,
}  # fmt: skip


def check_glm4_moe(args: dict[str, Any], source: str) -> None:
    """GLM-4.5: the routing sizes and the attention switches."""
    _check_routing(args, source)
    _check_bools(args, source, ("attention_bias", "use_qk_norm"))


def check_deepseek_v3(args: dict[str, Any], source: str) -> None:
    """DeepSeek-V3 (also Kimi-K2, Moonlight): the routing and the Multi-head Latent Attention sizes."""
    _check_routing(args, source)
    _check_bools(args, source, ("attention_bias", "rope_interleave"))
    if args["q_lora_rank"] is not None:  # null: queries come from one q_proj (Moonlight)
        _positive_int(args, "q_lora_rank", source)
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        _positive_int(args, key, source)
    if args["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim={args['qk_rope_head_dim']} must be even (RoPE turns pairs)")
    heads = args["num_attention_heads"]
    if heads * (args["qk_nope_head_dim"] + max(args["qk_rope_head_dim"], args["v_head_dim"])) > MAX_DIM:
        raise ConfigError(f"{source}: the attention projections are wider than {MAX_DIM}, the largest MLX dimension")
    # The keys and values MLA expands from its latent have one head per query head; transformers' attention
    # fails for any other num_key_value_heads.
    if args["num_key_value_heads"] != heads:
        raise ConfigError(
            f"{source}: num_key_value_heads={shown(args['num_key_value_heads'])} must equal "
            f"num_attention_heads={heads} for deepseek_v3 (latent attention expands one key head per query head)"
        )
    args["head_dim"] = args["qk_rope_head_dim"]  # as DeepseekV3Config: the rotated width


def _check_routing(args: dict[str, Any], source: str) -> None:
    experts = _positive_int(args, "n_routed_experts", source, MAX_EXPERTS)
    top = _positive_int(args, "num_experts_per_tok", source, experts)
    groups = _positive_int(args, "n_group", source, experts)
    kept = _positive_int(args, "topk_group", source, groups)
    # Each group is scored by its two best experts, so a group needs two.
    if experts % groups or experts // groups < 2:
        raise ConfigError(
            f"{source}: n_routed_experts={experts} must split into n_group={groups} equal groups of at least 2 experts"
        )
    if top > kept * (experts // groups):
        raise ConfigError(
            f"{source}: num_experts_per_tok={top} is more than the {kept * (experts // groups)} experts in the "
            f"topk_group={kept} groups the router keeps"
        )
    _positive_int(args, "moe_intermediate_size", source)
    _positive_int(args, "n_shared_experts", source, MAX_DIM // args["moe_intermediate_size"])
    dense = args["first_k_dense_replace"]
    if not (is_int(dense) and 0 <= dense <= args["num_hidden_layers"]):
        raise ConfigError(
            f"{source}: first_k_dense_replace must be an integer from 0 to num_hidden_layers="
            f"{args['num_hidden_layers']}, got {shown(dense)}"
        )
    scale = args["routed_scaling_factor"]
    if not (is_finite_number(scale) and scale > 0):
        raise ConfigError(f"{source}: routed_scaling_factor must be a positive finite number, got {shown(scale)}")
    _check_bools(args, source, ("norm_topk_prob",))
    mtp = args.get("num_nextn_predict_layers") or 0
    if not (is_int(mtp) and 0 <= mtp <= MAX_MTP_LAYERS):
        raise ConfigError(
            f"{source}: num_nextn_predict_layers must be an integer from 0 to {MAX_MTP_LAYERS}, got {shown(mtp)}"
        )


def _check_bools(args: dict[str, Any], source: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(args[key], bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {shown(args[key])}")


def _positive_int(args: dict[str, Any], key: str, source: str, limit: int = MAX_DIM) -> int:
    value = args.get(key)
    if not (is_int(value) and 0 < value <= limit):
        raise ConfigError(f"{source}: {key} must be a positive integer of at most {limit}, got {shown(value)}")
    return value
