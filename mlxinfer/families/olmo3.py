"""OLMo 2 (Olmo2ForCausalLM) and OLMo 3 (Olmo3ForCausalLM): post-norms only, q/k RMSNorm over the whole
projection (mlx-lm's modules do both); OLMo 3 adds sliding layers, and RoPE scaling on the full-attention ones.

transformers 5 writes `rope_parameters` per layer type ({"sliding_attention": ..., "full_attention": ...});
the classic form (the real checkpoints) has top-level rope_theta and a rope_scaling that transformers applies
to the full-attention layers only. Both become the flat form config.py reads. mlx-lm's module picks each layer's
RoPE from its own default pattern (every 4th layer full) because our config leaves `layer_types` out of its
args; `adapt` gives the scaling to the full layers layer_types names, and YaRN there the way models/yarn.py
computes it.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from ..errors import ConfigError, UnsupportedModelError
from ..models.config import FULL, SLIDING, ModelConfig
from ..models.decoder import DecoderLM
from ..models.mlx_lm_modules import model_module
from ..models.registry import ArchSpec
from ..models.shared_layers import FrequencyRoPE
from ..models.yarn import yarn_inverse_frequencies
from ..untrusted import shown

# Olmo3Config's defaults (transformers 5) for keys config.json may leave out.
OLMO3_DEFAULTS: dict[str, Any] = {
    "rope_theta": 500000.0,
    "sliding_window": 4096,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
}
MIN_LAYERS = 4  # mlx-lm's olmo3 module derives its own 3-sliding-1-full pattern and needs both kinds in it


def check_olmo3(args: dict[str, Any], source: str) -> None:
    n = args["num_hidden_layers"]
    if n < MIN_LAYERS:
        raise UnsupportedModelError(f"{source}: num_hidden_layers={n} is not supported for olmo3 (at least 4)")
    if args.get("layer_types") is None:  # transformers' default: every 4th layer is full
        args["layer_types"] = [SLIDING if (i + 1) % 4 else FULL for i in range(n)]
    params = args.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        args["rope_parameters"] = _flat_rope(params, args["rope_theta"], source)


def _flat_rope(params: dict[str, Any], theta: Any, source: str) -> dict[str, Any]:
    """The full layers' section, once the sliding layers' one is known to be plain RoPE with the same base."""
    full, local = (_section(params, kind, source) for kind in (FULL, SLIDING))
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


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    args = config.args
    scaling, theta = args.get("rope_scaling"), args["rope_theta"]
    for layer, kind in zip(model.layers, config.layer_types):
        attention = layer.self_attn
        attention.rope = _rope(attention.head_dim, theta, scaling if kind == FULL else None, args)


def _rope(head_dim: int, theta: float, scaling: dict | None, args: dict) -> nn.Module:
    if scaling is None:
        return nn.RoPE(head_dim, traditional=False, base=theta)
    if scaling["rope_type"] == "yarn":
        return FrequencyRoPE(*yarn_inverse_frequencies(head_dim, theta, scaling))
    initialize_rope = model_module("rope_utils").initialize_rope
    return initialize_rope(head_dim, theta, False, scaling, args.get("max_position_embeddings"))


def check_olmo2(args: dict[str, Any], source: str) -> None:
    """transformers' Olmo2MLP has no biases whatever mlp_bias says; mlx-lm's would build them."""
    args.pop("mlp_bias", None)


SPECS = {
    "olmo2": ArchSpec("olmo2", whole_qk_norm=True, defaults={"rms_norm_eps": 1e-5}, check_config=check_olmo2),
    "olmo3": ArchSpec(
        "olmo3",
        whole_qk_norm=True,
        sliding="declared",  # check_olmo3 writes transformers' default layer_types when absent
        rope_types=frozenset({"default", "linear", "llama3", "yarn"}),
        defaults=OLMO3_DEFAULTS,
        check_config=check_olmo3,
        adapt=adapt,
    ),
}
