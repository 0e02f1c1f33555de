"""OLMo 3's config.json rules beyond the common checks in config.py.

transformers 5 writes `rope_parameters` per layer type ({"sliding_attention": ..., "full_attention": ...});
the classic form (the real checkpoints) has top-level rope_theta and a rope_scaling that transformers applies
to the full-attention layers only. Both become the flat form config.py reads; models/olmo3_layers.py then
gives the scaling to the full layers alone.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from ..untrusted import shown

# Olmo3Config's defaults (transformers 5) for keys config.json may leave out.
OLMO3_DEFAULTS: dict[str, Any] = {
    "rope_theta": 500000.0,
    "sliding_window": 4096,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
}
_FULL, _SLIDING = "full_attention", "sliding_attention"
MIN_LAYERS = 4  # mlx-lm's olmo3 module derives its own 3-sliding-1-full pattern and needs both kinds in it


def check_olmo3(args: dict[str, Any], source: str) -> None:
    n = args["num_hidden_layers"]
    if n < MIN_LAYERS:
        raise UnsupportedModelError(f"{source}: num_hidden_layers={n} is not supported for olmo3 (at least 4)")
    if args.get("layer_types") is None:  # transformers' default: every 4th layer is full
        args["layer_types"] = [_SLIDING if (i + 1) % 4 else _FULL for i in range(n)]
    params = args.get("rope_parameters")
    if isinstance(params, dict) and (_FULL in params or _SLIDING in params):
        args["rope_parameters"] = _flat_rope(params, args["rope_theta"], source)


def _flat_rope(params: dict[str, Any], theta: Any, source: str) -> dict[str, Any]:
    """The full layers' section, once the sliding layers' one is known to be plain RoPE with the same base."""
    full, local = (_section(params, kind, source) for kind in (_FULL, _SLIDING))
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise UnsupportedModelError(
            f"{source}: rope_parameters.sliding_attention.rope_type {shown(local.get('rope_type'))} is not "
            "supported for olmo3 (only default: the real checkpoints scale full-attention layers only)"
        )
    full_theta, local_theta = full.get("rope_theta", theta), local.get("rope_theta", theta)
    if full_theta != local_theta:
        raise UnsupportedModelError(
            f"{source}: rope_parameters gives sliding and full layers different rope_theta "
            f"({shown(local_theta)} and {shown(full_theta)}); olmo3 is supported with one base"
        )
    return {**full, "rope_theta": full_theta}


def _section(params: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = params.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: rope_parameters.{key} must be an object, got {shown(value)}")
    return value
