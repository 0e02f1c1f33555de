"""Config checks for Qwen3-Next and Qwen3.5 (text): Gated DeltaNet sizes, experts, and the layer layout.

transformers picks each layer's block from `layer_types` (or, without it, puts full
attention on every `full_attention_interval`-th layer); mlx-lm's modules always use
the interval. So the interval handed to mlx-lm is rewritten from layer_types, and a
layout no interval describes is refused. Reference: transformers' configuration_qwen3_next.py.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import is_int, shown

FULL, LINEAR = "full_attention", "linear_attention"
MAX_EXPERTS = 16_384  # the largest real MoE models route among a few hundred
MAX_LAYERS = 10_000  # as config.MAX_LAYERS (config.py imports this module through the registry)
MAX_CONV_KERNEL = 64  # the short convolution before the delta rule: 4 in every real model

# transformers' defaults (Qwen3NextConfig / Qwen3_5TextConfig) for keys mlx-lm needs or defaults differently.
_LINEAR_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10_000.0,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}  # fmt: skip
QWEN3_5_DEFAULTS: dict[str, Any] = dict(_LINEAR_DEFAULTS)
QWEN3_NEXT_DEFAULTS: dict[str, Any] = {
    **_LINEAR_DEFAULTS,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": [],
}  # fmt: skip


def check_qwen3_next(args: dict[str, Any], source: str) -> None:
    """Refuse sizes that cannot build, and make mlx-lm's full_attention_interval say what layer_types says."""
    _check_linear_attention(args, source)
    _check_experts(args, source)
    _set_full_attention_interval(args, source)


def check_qwen3_5_text(args: dict[str, Any], source: str) -> None:
    """As check_qwen3_next, for Qwen3.5's dense text model (no experts)."""
    _check_linear_attention(args, source)
    _set_full_attention_interval(args, source)


def _int_in(args: dict[str, Any], key: str, low: int, high: int, source: str) -> int:
    value = args.get(key)
    if not (is_int(value) and low <= value <= high):
        raise ConfigError(f"{source}: {key} must be an integer from {low} to {high}, got {shown(value)}")
    return value


def _check_linear_attention(args: dict[str, Any], source: str) -> None:
    key_heads = _int_in(args, "linear_num_key_heads", 1, MAX_DIM, source)
    value_heads = _int_in(args, "linear_num_value_heads", 1, MAX_DIM, source)
    key_dim = _int_in(args, "linear_key_head_dim", 1, MAX_DIM, source)
    value_dim = _int_in(args, "linear_value_head_dim", 1, MAX_DIM, source)
    # A kernel of 1 keeps no state; it would also make the two conv weight layouts indistinguishable.
    _int_in(args, "linear_conv_kernel_dim", 2, MAX_CONV_KERNEL, source)
    if value_heads % key_heads:
        raise ConfigError(
            f"{source}: linear_num_value_heads={value_heads} is not a multiple of linear_num_key_heads={key_heads}"
        )
    # in_proj_qkvz's output (q, k, v, z) is one dimension: keep it 32-bit.
    fused = 2 * key_heads * key_dim + 2 * value_heads * value_dim
    if fused > MAX_DIM:
        raise ConfigError(f"{source}: the linear attention projections ({fused} outputs) exceed {MAX_DIM}")


def _check_experts(args: dict[str, Any], source: str) -> None:
    if args.get("mlp_only_layers") is None:  # transformers reads null as "none"
        args["mlp_only_layers"] = []
    only = args["mlp_only_layers"]
    if not isinstance(only, list) or len(only) > MAX_LAYERS or not all(is_int(i) for i in only):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {shown(only)}")
    experts = _int_in(args, "num_experts", 0, MAX_EXPERTS, source)
    if experts == 0:  # every layer is a dense MLP of intermediate_size
        return
    _int_in(args, "num_experts_per_tok", 1, experts, source)
    _int_in(args, "moe_intermediate_size", 1, MAX_DIM, source)
    _int_in(args, "shared_expert_intermediate_size", 1, MAX_DIM, source)
    _int_in(args, "decoder_sparse_step", 1, MAX_LAYERS, source)
    if not isinstance(args.get("norm_topk_prob"), bool):
        raise ConfigError(f"{source}: norm_topk_prob must be true or false, got {shown(args.get('norm_topk_prob'))}")


def _set_full_attention_interval(args: dict[str, Any], source: str) -> None:
    n = args["num_hidden_layers"]
    declared = args.get("layer_types")
    if declared is None:  # transformers' rule, which is also mlx-lm's
        args.setdefault("full_attention_interval", 4)
        every = _int_in(args, "full_attention_interval", 1, MAX_LAYERS, source)
        args["layer_types"] = [LINEAR if (i + 1) % every else FULL for i in range(n)]
        return
    types = declared[: n + 1]  # one past n is enough to refuse a wrong length
    if len(types) != n or not all(t in (FULL, LINEAR) for t in types):
        raise UnsupportedModelError(
            f"{source}: layer_types must list num_hidden_layers={n} entries of {FULL!r}/{LINEAR!r}, "
            f"got {shown(declared)}"
        )
    # The first full layer fixes the interval; without one, an interval past the last layer builds none.
    every = types.index(FULL) + 1 if FULL in types else n + 1
    if any((t == FULL) != ((i + 1) % every == 0) for i, t in enumerate(types)):
        raise UnsupportedModelError(
            f"{source}: layer_types {shown(declared)} does not put full attention on every Nth layer, "
            f"the only layout {args['model_type']} is implemented for"
        )
    args["full_attention_interval"] = every
