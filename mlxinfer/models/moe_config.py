"""config.json rules of the MoE families Qwen3-MoE, Qwen3.5-MoE, Mixtral, OLMoE and Granite 3 MoE.

Each `check_*` validates the family's expert keys and rewrites them into what mlx-lm's module reads where it
would compute something else than transformers (the reference): the expert count under mlx-lm's name, Qwen3-MoE's
window only when use_sliding_window says so, Qwen3.5-MoE's always renormalized top-k weights.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import is_finite_number, is_int, shown
from .family_config import check_experts
from .qwen3_next_config import MAX_LAYERS, QWEN3_5_DEFAULTS, check_qwen3_5_text

# transformers' config defaults (Qwen3MoeConfig, Qwen3_5MoeTextConfig, MixtralConfig, OlmoeConfig,
# GraniteMoeConfig) for keys config.json may leave out and mlx-lm needs. The expert count is among them only
# for Granite, which has one name for it; the others read it under either name first (see _expert_count).
QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 6144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1, "norm_topk_prob": False,
    "sliding_window": 4096,
}  # fmt: skip
QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    **QWEN3_5_DEFAULTS, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
}  # fmt: skip
MIXTRAL_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "num_experts_per_tok": 2,
}  # fmt: skip
OLMOE_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "num_experts_per_tok": 8, "norm_topk_prob": False,
}  # fmt: skip
GRANITEMOE_DEFAULTS: dict[str, Any] = {
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
    "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
    "num_local_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip
_GRANITE_MULTIPLIERS = ("embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier")


def check_qwen3_moe(args: dict[str, Any], source: str) -> None:
    """Experts (0: every layer dense), which layers have them, and the window every layer slides in or none."""
    if check_experts(args, source, _expert_count(args, source, "num_experts", "num_local_experts", 128), True):
        _positive_int(args, "moe_intermediate_size", source)
        _positive_int(args, "decoder_sparse_step", source, MAX_LAYERS)
        _bool(args, "norm_topk_prob", source)
    if args.get("mlp_only_layers") is None:  # transformers reads null as "none"
        args["mlp_only_layers"] = []
    only = args["mlp_only_layers"]
    if not isinstance(only, list) or len(only) > MAX_LAYERS or not all(is_int(i) for i in only):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {shown(only)}")
    # Qwen3MoeConfig keeps the window only with use_sliding_window, and then every layer slides
    # (max_window_layers is not read); the registry row derives layer_types from the window alone.
    if not args.get("use_sliding_window"):
        args["sliding_window"] = None


def check_qwen3_5_moe(args: dict[str, Any], source: str) -> None:
    """As Qwen3.5's text model, with experts and a gated shared expert on every layer."""
    check_qwen3_5_text(args, source)
    check_experts(args, source, _expert_count(args, source, "num_experts", "num_local_experts", 256), False)
    _positive_int(args, "moe_intermediate_size", source)
    _positive_int(args, "shared_expert_intermediate_size", source)
    # transformers always renormalizes the top-k weights and puts experts on every layer (it reads neither key);
    # mlx-lm's block reads norm_topk_prob.
    args["norm_topk_prob"], args["decoder_sparse_step"], args["mlp_only_layers"] = True, 1, []


def check_mixtral(args: dict[str, Any], source: str) -> None:
    check_experts(args, source, _expert_count(args, source, "num_local_experts", "num_experts", 8), False)


def check_olmoe(args: dict[str, Any], source: str) -> None:
    check_experts(args, source, _expert_count(args, source, "num_experts", "num_local_experts", 64), False)
    _bool(args, "norm_topk_prob", source)


def check_granitemoe(args: dict[str, Any], source: str) -> None:
    check_experts(args, source, "num_local_experts", False)  # GraniteMoeConfig knows no other name
    for key in _GRANITE_MULTIPLIERS:
        value = args.get(key)
        if not (is_finite_number(value) and value > 0):
            raise ConfigError(f"{source}: {key} must be a positive finite number, got {shown(value)}")


def _expert_count(args: dict[str, Any], source: str, key: str, alias: str, default: int) -> str:
    """Put the expert count under `key`, mlx-lm's name, from either name transformers accepts (its attribute_map);
    returns `key`. transformers 5 writes Qwen3-MoE's as num_local_experts, the Hub's configs say num_experts."""
    value, other = args.get(key), args.get(alias)
    if value is not None and other is not None and value != other:
        raise ConfigError(f"{source}: {key}={shown(value)} and {alias}={shown(other)} disagree; keep one of them")
    args[key] = next((v for v in (value, other) if v is not None), default)
    return key


def _positive_int(args: dict[str, Any], key: str, source: str, limit: int = MAX_DIM) -> int:
    value = args.get(key)
    if not (is_int(value) and 0 < value <= limit):
        raise ConfigError(f"{source}: {key} must be a positive integer of at most {limit}, got {shown(value)}")
    return value


def _bool(args: dict[str, Any], key: str, source: str) -> None:
    if not isinstance(args.get(key), bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {shown(args.get(key))}")
