"""Ministral 3 on mlx-lm's llama layers, made to compute what transformers' Ministral3ForCausalLM does.

Its attention scales each query after RoPE by 1 + beta * log(1 + floor(position / original_max_position_embeddings))
(llama-4 style, beta = rope_parameters.llama_4_scaling_beta), and its YaRN is transformers' (models/yarn.py).
mlx-lm's own ministral3 layers take the scale as an extra argument that our forward does not pass.
"""

from __future__ import annotations

import mlx.core as mx

from .config import ModelConfig
from .decoder import DecoderLM
from .gpt_oss_layers import FrequencyRoPE
from .mlx_lm_modules import model_module
from .yarn import yarn_inverse_frequencies

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
