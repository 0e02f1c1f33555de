"""Ministral 3 (Ministral3ForCausalLM; also the text half of model_type "mistral3"): llama blocks plus the llama-4
query scale.

Its attention scales each query after RoPE by 1 + beta * log(1 + floor(position / original_max_position_embeddings))
(llama-4 style, beta = rope_parameters.llama_4_scaling_beta), and its YaRN is transformers' (models/yarn.py).
mlx-lm's own ministral3 layers take the scale as an extra argument that our forward does not pass, so this runs
on mlx-lm's llama module. Reference: transformers' modeling_ministral3.py.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..errors import ConfigError, UnsupportedModelError
from ..models.config import ModelConfig
from ..models.decoder import DecoderLM
from ..models.mlx_lm_modules import model_module
from ..models.registry import ArchSpec
from ..models.shared_layers import FrequencyRoPE
from ..models.yarn import yarn_inverse_frequencies
from ..untrusted import is_finite_number, is_int, shown

# Ministral3Config's RoPE when config.json gives none.
MINISTRAL3_ROPE: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
}  # fmt: skip
MINISTRAL3_DEFAULTS: dict[str, Any] = {"max_position_embeddings": 262144, "rms_norm_eps": 1e-5}


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


_llama, _base = model_module("llama"), model_module("base")


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    args = _llama.ModelArgs.from_dict(config.args)
    beta, original = config.args["llama_4_scaling_beta"], config.args["llama_4_original_positions"]
    scaling = config.args.get("rope_scaling")
    for layer in model.layers:
        attention = ScaledQueryAttention(args, beta, original)
        if scaling is not None and scaling["type"] == "yarn":
            head_dim = attention.head_dim
            attention.rope = FrequencyRoPE(*yarn_inverse_frequencies(head_dim, args.rope_theta, scaling))
        layer.self_attn = attention


class ScaledQueryAttention(_llama.Attention):
    """mlx-lm's llama attention with Ministral 3's position-dependent query scale."""

    def __init__(self, args, beta: float, original_positions: int):
        super().__init__(args)
        self._beta, self._original = beta, original_positions

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, heads, L, head_dim)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        q = q * self.query_scale(L, offset).astype(q.dtype)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = _base.scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def query_scale(self, length: int, offset: int | mx.array) -> mx.array:
        """(1 or B, 1, length, 1): the scale at each query's position (per row when `offset` is)."""
        start = offset[:, None] if isinstance(offset, mx.array) and offset.ndim else mx.array(offset).reshape(1, 1)
        # A left-padded row's padding sits before position 0; clamped, it stays finite (and is masked anyway).
        positions = mx.maximum(start + mx.arange(length)[None], 0)
        scale = 1 + self._beta * mx.log(1 + mx.floor(positions / self._original))
        return scale[:, None, :, None]


SPECS = {
    "ministral3": ArchSpec(
        "llama",
        sliding="all",
        rope_types=frozenset({"default", "linear", "llama3", "yarn"}),
        neutral={"attention_bias": False, "mlp_bias": False},
        defaults=MINISTRAL3_DEFAULTS,
        check_config=check_ministral3,
        adapt=adapt,
    ),
}
