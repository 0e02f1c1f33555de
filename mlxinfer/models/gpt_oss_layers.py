"""gpt-oss on mlx-lm's layers, made to compute what transformers' GptOssForCausalLM does.

- RoPE: transformers' YaRN frequencies (models/yarn.py) instead of mlx-lm's YarnRoPE, which always rounds
  the correction range (gpt-oss says `truncate: false`).
- Experts: the clamped SwiGLU with the config's swiglu_alpha and swiglu_limit (mlx-lm fixes 1.702 and 7.0).
- Attention sinks with a quantized KV cache, which mlx-lm refuses: each head's sink is one more logit
  column of the softmax that carries no value, as in transformers' eager attention.
- Weights: transformers' fused expert tensors -> mlx-lm's layout (models/weights_gpt_oss.py).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .decoder import DecoderLM
from .mlx_lm_modules import model_module
from .weights_gpt_oss import convert_gpt_oss_weights
from .yarn import yarn_inverse_frequencies

_gpt_oss, _activations = model_module("gpt_oss"), model_module("activations")


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    args = _gpt_oss.ModelArgs.from_dict(config.args)
    scaling = config.args.get("rope_scaling")
    alpha, limit = config.args["swiglu_alpha"], config.args["swiglu_limit"]
    for layer in model.layers:
        attention = SinkAttention(args)
        if scaling is not None:  # "yarn", the only scaling config.py lets through for gpt_oss
            attention.rope = FrequencyRoPE(*yarn_inverse_frequencies(args.head_dim, args.rope_theta, scaling))
        layer.self_attn = attention
        layer.mlp.experts.activation = _activations.SwigluOAI(alpha=alpha, limit=limit)
    model.mlx_sanitize = partial(convert_gpt_oss_weights, config=config)


class FrequencyRoPE(nn.Module):
    """Rotary embedding with given inverse frequencies (rotated half-split, as transformers), its cos and
    sin scaled by `scale`: the same as scaling the rotated vector, since the rotation is linear."""

    def __init__(self, inverse: list[float], scale: float = 1.0):
        super().__init__()
        self.dims = 2 * len(inverse)
        self.scale = scale
        self._freqs = 1 / mx.array(inverse, dtype=mx.float32)  # mx.fast.rope takes periods (1 / frequency)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.scale != 1.0:
            x = x * self.scale
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


class SinkAttention(_gpt_oss.AttentionBlock):
    """mlx-lm's gpt-oss attention, also with a quantized KV cache (`cache.bits`)."""

    def __call__(self, x: mx.array, mask: mx.array | None, cache=None) -> mx.array:
        B, L, _ = x.shape
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (p(x).reshape(B, L, -1, self.head_dim).swapaxes(1, 2) for p in projections)  # (B, heads, L, D)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if hasattr(cache, "bits"):
            out = quantized_attention_with_sinks(q, k, v, self.sm_scale, mask, self.sinks, cache.group_size, cache.bits)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.sm_scale, mask=mask, sinks=self.sinks)
        return self.o_proj(out.swapaxes(1, 2).reshape(B, L, -1))  # (B, L, heads * head_dim)


def quantized_attention_with_sinks(
    q: mx.array, keys: tuple, values: tuple, scale: float, mask: mx.array | None, sinks: mx.array,
    group_size: int, bits: int,
) -> mx.array:  # fmt: skip
    """Attention of q (B, heads, L, D) over quantized (packed, scales, biases) keys and values
    (B, kv_heads, T, ...), with a boolean mask (..., L, T) or none, and one sink logit per head."""
    B, heads, L, D = q.shape
    kv_heads = keys[0].shape[1]
    groups = heads // kv_heads
    q = (q * scale).reshape(B, kv_heads, groups, L, D)  # grouped query heads share one key/value head
    keys, values = ([a[:, :, None] for a in t] for t in (keys, values))
    scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=group_size, bits=bits)  # (B, kv, g, L, T)
    if mask is not None:
        mask = mask.reshape(*mask.shape[:-3], 1, *mask.shape[-3:]) if mask.ndim > 3 else mask
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, kv_heads, groups, 1, 1), (*scores.shape[:-1], 1))
    weights = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :-1]
    out = mx.quantized_matmul(weights, *values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, heads, L, D)
