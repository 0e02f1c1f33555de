"""Granite 4.0 hybrid (GraniteMoeHybridForCausalLM): Mamba-2 layers between attention ones, MoE or dense MLPs.

Its registry row, config rules, and the layers that make mlx-lm's granitemoehybrid module compute what
transformers does: the embedding and logit multipliers (models/shared_layers.py), and with several Mamba groups
transformers' gated norm, which normalizes each group on its own (mlx-lm's, the whole width).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, UnsupportedModelError
from ..formats.safetensors_header import MAX_DIM
from ..models.config import ModelConfig
from ..models.config_rules import check_experts, positive_int, positive_number, require_bools
from ..models.decoder import DecoderLM
from ..models.registry import ArchSpec
from ..models.shared_layers import granite_multipliers
from ..untrusted import is_finite_number, shown

# GraniteMoeHybridConfig's defaults; mlx-lm has none for most of them, or others (time_step_limit, tied).
GRANITE_DEFAULTS: dict[str, Any] = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "embedding_multiplier": 1.0,
    "logits_scaling": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "shared_intermediate_size": 1024,
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_head": "auto",
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "time_step_limit": [0.0, math.inf],
}
_GRANITE_LAYER_NAMES = frozenset({"mamba", "linear_attention", "attention", "full_attention"})
_GRANITE_BOOLS = ("attention_bias", "mamba_conv_bias", "mamba_proj_bias")
_GRANITE_MULTIPLIERS = ("embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier")
MAX_CONV_KERNEL = 64  # Mamba's short convolution: 4 in every real model


def check_granitemoehybrid(args: dict[str, Any], source: str) -> None:
    """Granite 4.0 hybrid: layer names, the Mamba-2 sizes, time_step_limit, NoPE, and the dense variant."""
    n = args["num_hidden_layers"]
    if args.get("layer_types") is None:  # transformers' older key, then its default: every layer Mamba
        args["layer_types"] = args.get("layers_block_type") or ["mamba"] * n
        if not isinstance(args["layer_types"], list):
            raise ConfigError(f"{source}: layers_block_type must be a list, got {shown(args['layer_types'])}")
    # transformers builds attention for any name but "linear_attention", always full: refuse what it would misread.
    odd = [t for t in args["layer_types"] if not isinstance(t, str) or t not in _GRANITE_LAYER_NAMES]
    if odd:
        names = "/".join(sorted(_GRANITE_LAYER_NAMES))
        raise UnsupportedModelError(f"{source}: layer type {shown(odd[0])} is not supported for Granite ({names})")
    require_bools(args, source, _GRANITE_BOOLS)
    for key in _GRANITE_MULTIPLIERS:
        positive_number(args, key, source)
    _check_mamba(args, source)
    args["time_step_limit"] = _time_step_limit(args["time_step_limit"], source)
    # transformers rotates only when the type is "rope"; mlx-lm unless it is "nope" (so also when it is absent).
    kind = args.get("position_embedding_type")
    if kind not in (None, "rope", "nope"):
        raise UnsupportedModelError(f"{source}: position_embedding_type {shown(kind)} is not supported (rope or none)")
    args["position_embedding_type"] = "rope" if kind == "rope" else "nope"
    check_experts(args, source, "num_local_experts", allow_dense=True)
    shared = positive_int(args, "shared_intermediate_size", source)
    if 2 * shared > MAX_DIM:
        raise ConfigError(f"{source}: 2 * shared_intermediate_size = {2 * shared} is more than {MAX_DIM}")
    if not args["num_local_experts"]:
        # Dense: transformers runs only the shared MLP; mlx-lm builds it as `mlp` sized by intermediate_size.
        args["intermediate_size"], args["mlp_bias"] = shared, False


def _check_mamba(args: dict[str, Any], source: str) -> None:
    hidden = args["hidden_size"]
    heads = positive_int(args, "mamba_n_heads", source)
    groups = positive_int(args, "mamba_n_groups", source)
    state = positive_int(args, "mamba_d_state", source)
    positive_int(args, "mamba_d_conv", source, limit=MAX_CONV_KERNEL)
    expand = positive_int(args, "mamba_expand", source)
    inner = expand * hidden
    if args["mamba_d_head"] == "auto":
        args["mamba_d_head"] = inner // heads
    head = positive_int(args, "mamba_d_head", source)
    if head * heads != inner:
        raise ConfigError(
            f"{source}: mamba_n_heads * mamba_d_head = {heads} * {head} must equal mamba_expand * hidden_size = {inner}"
        )
    if heads % groups:
        raise ConfigError(f"{source}: mamba_n_heads={heads} is not a multiple of mamba_n_groups={groups}")
    # in_proj's output: gate, x, B and C for every group, and one time step per head.
    if 2 * inner + 2 * groups * state + heads > MAX_DIM:
        raise ConfigError(
            f"{source}: the Mamba input projection is wider than {MAX_DIM}, the largest dimension MLX has"
        )


def _time_step_limit(value: Any, source: str) -> tuple[float, float]:
    """transformers clamps each time step to [low, high]; (0, inf) clamps nothing."""
    if not (isinstance(value, list) and len(value) == 2):
        raise ConfigError(f"{source}: time_step_limit must be a list [low, high], got {shown(value)}")
    low, high = value
    high_ok = is_finite_number(high) or high == math.inf
    if not (is_finite_number(low) and high_ok and 0 <= low < high):
        raise ConfigError(f"{source}: time_step_limit must be [low, high] with 0 <= low < high, got {shown(value)}")
    return float(low), float(high)


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    granite_multipliers(model, config)
    groups = config.args["mamba_n_groups"]
    for layer in model.layers:
        if groups > 1 and hasattr(layer, "mamba"):
            layer.mamba.norm = GroupedGatedRMSNorm(layer.mamba.intermediate_size, groups, config.args["rms_norm_eps"])


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(gate) over each of `groups` equal slices of the last axis, then the weight."""

    def __init__(self, dims: int, groups: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self._groups, self._eps = groups, eps

    def __call__(self, x: mx.array, gate: mx.array | None = None) -> mx.array:
        if gate is not None:
            x = x * nn.silu(gate)
        grouped = x.reshape(*x.shape[:-1], self._groups, -1)  # (..., groups, dims / groups)
        normed = mx.fast.rms_norm(grouped, None, self._eps).reshape(x.shape)
        return self.weight * normed


def mlx_lm_form(config: ModelConfig) -> dict[str, Any]:
    """The values mlxinfer computed: legacy layer names, a dense model's MLP width, NoPE."""
    return {key: config.args[key] for key in ("layer_types", "intermediate_size", "position_embedding_type")}


SPECS = {
    "granitemoehybrid": ArchSpec(
        "granitemoehybrid",
        mlx_lm_form=mlx_lm_form,
        sliding="declared",
        recurrent_kinds=frozenset({"mamba"}),
        layer_aliases={"linear_attention": "mamba", "attention": "full_attention"},
        mlx_layer_names={"full_attention": "attention"},
        rope_types=frozenset({"default"}),
        fixed_head_dim=True,
        defaults=GRANITE_DEFAULTS,
        check_config=check_granitemoehybrid,
        mlx_sanitize=True,
        adapt=adapt,
        hf_class="GraniteMoeHybridForCausalLM",
        # The dense variant's shared MLP, which mlx-lm's sanitize splits into a plain MLP (gate rows, then up)
        fused_outputs={
            "shared_mlp.input_linear": ("mlp.gate_proj", "mlp.up_proj"),
            "shared_mlp.output_linear": ("mlp.down_proj",),
        },  # fmt: skip
    ),
}
