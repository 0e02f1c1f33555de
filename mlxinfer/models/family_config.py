"""config.json rules of single families (gpt-oss, Granite 4.0 hybrid) beyond the common checks in config.py.

Each `check_*` validates the family's own keys and rewrites them into what mlx-lm's module reads, where
the two disagree with transformers (the reference). The registry runs it after the common size checks.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import is_finite_number, is_int, shown

MAX_EXPERTS = 65_536  # real MoE models have at most a few hundred

# GptOssConfig's defaults (transformers 5) for keys config.json may leave out.
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "head_dim": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}
# The RoPE GptOssConfig falls back to when config.json names none.
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}  # fmt: skip

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


def check_gpt_oss(args: dict[str, Any], source: str) -> None:
    if not args.get("rope_parameters") and not args.get("rope_scaling"):
        args["rope_parameters"] = dict(GPT_OSS_YARN)  # what GptOssConfig does
    _check_experts(args, source, allow_dense=False)
    for key in ("swiglu_alpha", "swiglu_limit"):  # the experts' clamped SwiGLU: x * sigmoid(alpha * x), |x| <= limit
        _positive_number(args, key, source)


def check_olmo2(args: dict[str, Any], source: str) -> None:
    """transformers' Olmo2MLP has no biases whatever mlp_bias says; mlx-lm's would build them."""
    args.pop("mlp_bias", None)


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
    for key in _GRANITE_BOOLS:
        if not isinstance(args[key], bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {shown(args[key])}")
    for key in _GRANITE_MULTIPLIERS:
        _positive_number(args, key, source)
    _check_mamba(args, source)
    args["time_step_limit"] = _time_step_limit(args["time_step_limit"], source)
    # transformers rotates only when the type is "rope"; mlx-lm unless it is "nope" (so also when it is absent).
    kind = args.get("position_embedding_type")
    if kind not in (None, "rope", "nope"):
        raise UnsupportedModelError(f"{source}: position_embedding_type {shown(kind)} is not supported (rope or none)")
    args["position_embedding_type"] = "rope" if kind == "rope" else "nope"
    _check_experts(args, source, allow_dense=True)
    shared = _positive_int(args, "shared_intermediate_size", source)
    if 2 * shared > MAX_DIM:
        raise ConfigError(f"{source}: 2 * shared_intermediate_size = {2 * shared} is more than {MAX_DIM}")
    if not args["num_local_experts"]:
        # Dense: transformers runs only the shared MLP; mlx-lm builds it as `mlp` sized by intermediate_size.
        args["intermediate_size"], args["mlp_bias"] = shared, False


def _check_mamba(args: dict[str, Any], source: str) -> None:
    hidden = args["hidden_size"]
    heads = _positive_int(args, "mamba_n_heads", source)
    groups = _positive_int(args, "mamba_n_groups", source)
    state = _positive_int(args, "mamba_d_state", source)
    _positive_int(args, "mamba_d_conv", source, limit=MAX_CONV_KERNEL)
    expand = _positive_int(args, "mamba_expand", source)
    inner = expand * hidden
    if args["mamba_d_head"] == "auto":
        args["mamba_d_head"] = inner // heads
    head = _positive_int(args, "mamba_d_head", source)
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


def _check_experts(args: dict[str, Any], source: str, allow_dense: bool) -> None:
    check_experts(args, source, "num_local_experts", allow_dense)


def check_experts(args: dict[str, Any], source: str, key: str, allow_dense: bool) -> int:
    """The expert count `args[key]` (num_local_experts, num_experts: families name it differently), checked with
    num_experts_per_tok; 0 only where `allow_dense` (every layer a dense MLP)."""
    low = 0 if allow_dense else 1
    experts = args.get(key)
    if not (is_int(experts) and low <= experts <= MAX_EXPERTS):
        raise ConfigError(f"{source}: {key} must be an integer from {low} to {MAX_EXPERTS}, got {shown(experts)}")
    if experts:
        top = args.get("num_experts_per_tok")
        if not (is_int(top) and 0 < top <= experts):
            raise ConfigError(f"{source}: num_experts_per_tok must be from 1 to {key}={experts}, got {shown(top)}")
    return experts


def _positive_int(args: dict[str, Any], key: str, source: str, limit: int = MAX_DIM) -> int:
    value = args.get(key)
    if not (is_int(value) and 0 < value <= limit):
        raise ConfigError(f"{source}: {key} must be a positive integer of at most {limit}, got {shown(value)}")
    return value


def _positive_number(args: dict[str, Any], key: str, source: str) -> float:
    value = args.get(key)
    if not (is_finite_number(value) and value > 0):
        raise ConfigError(f"{source}: {key} must be a positive finite number, got {shown(value)}")
    return value
