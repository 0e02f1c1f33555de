"""config.json rules of SmolLM3, Cohere2 (Command R7B) and Ministral 3 beyond the common checks in config.py.

Each `check_*` rewrites the family's keys into what mlx-lm's module (or our adapter) reads, the way
transformers reads them (configuration_smollm3.py, configuration_cohere2.py, modeling_ministral3.py).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from ..untrusted import is_finite_number, is_int, shown

FULL, SLIDING = "full_attention", "sliding_attention"
MAX_LAYERS = 10_000  # as config.MAX_LAYERS (config.py imports this module through the registry)

SMOLLM3_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 2_000_000.0}
COHERE2_DEFAULTS: dict[str, Any] = {
    "layer_norm_eps": 1e-5,
    "logit_scale": 0.0625,
    "max_position_embeddings": 8192,
    "rope_theta": 10_000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": 4,  # the BC key of configs without layer_types (transformers' default)
}
# Ministral3Config's RoPE when config.json gives none.
MINISTRAL3_ROPE: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
}  # fmt: skip
MINISTRAL3_DEFAULTS: dict[str, Any] = {"max_position_embeddings": 262144, "rms_norm_eps": 1e-5}


def check_smollm3(args: dict[str, Any], source: str) -> None:
    """NoPE layers (no_rope_layers, else every no_rope_layer_interval-th layer) and which layers slide."""
    n = args["num_hidden_layers"]
    flags = args.get("no_rope_layers")
    if flags is None:
        interval = args.get("no_rope_layer_interval", 4)
        if not (is_int(interval) and 0 < interval <= MAX_LAYERS):
            raise ConfigError(f"{source}: no_rope_layer_interval must be a positive integer, got {shown(interval)}")
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if not (isinstance(flags, list) and len(flags) == n and all(f in (0, 1) for f in flags)):
        raise ConfigError(
            f"{source}: no_rope_layers must list num_hidden_layers={n} entries of 1 (RoPE) or 0 (none), "
            f"got {shown(flags)}"
        )
    args["no_rope_layers"] = [int(f) for f in flags]
    # transformers slides a layer only with use_sliding_window; by default the NoPE layers are the sliding ones.
    slides = bool(args.get("use_sliding_window")) and args.get("sliding_window") is not None
    if not slides:
        args["layer_types"] = [FULL] * n
    elif args.get("layer_types") is None:
        args["layer_types"] = [FULL if rope else SLIDING for rope in args["no_rope_layers"]]


def check_cohere2(args: dict[str, Any], source: str) -> None:
    """transformers' Cohere2 LayerNorm never has a bias, and its logits are multiplied by logit_scale."""
    args["layer_norm_bias"] = False
    scale = args["logit_scale"]
    if not (is_finite_number(scale) and scale != 0):
        raise ConfigError(f"{source}: logit_scale must be a finite nonzero number, got {shown(scale)}")
    eps = args["layer_norm_eps"]
    if not (is_finite_number(eps) and 0 < eps < 1):
        raise ConfigError(f"{source}: layer_norm_eps must be a number between 0 and 1, got {shown(eps)}")


def check_ministral3(args: dict[str, Any], source: str) -> None:
    """Take llama_4_scaling_beta out of the RoPE settings (our attention applies it), and every layer slides
    when sliding_window is set: transformers ignores layer_types here."""
    key = "rope_parameters" if args.get("rope_parameters") is not None else "rope_scaling"
    rope = args.get(key)
    if rope is None:
        key, rope = "rope_parameters", {**MINISTRAL3_ROPE, "rope_theta": args.get("rope_theta", 1_000_000.0)}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: {key} must be an object, got {shown(rope)}")
    rope = dict(rope)
    beta = rope.pop("llama_4_scaling_beta", None)
    rope.pop("max_position_embeddings", None)  # a copy of the top-level key; transformers' RoPE ignores it
    if not is_finite_number(beta):
        raise UnsupportedModelError(
            f"{source}: {key}.llama_4_scaling_beta must be a number for ministral3 (transformers reads it), "
            f"got {shown(beta)}"
        )
    original = rope.get("original_max_position_embeddings")
    if not (is_int(original) and original > 0):
        raise ConfigError(
            f"{source}: {key}.original_max_position_embeddings must be a positive integer for ministral3 "
            f"(the llama-4 query scaling divides by it), got {shown(original)}"
        )
    args[key] = rope
    args["llama_4_scaling_beta"], args["llama_4_original_positions"] = float(beta), original
    args.pop("layer_types", None)
