"""Gemma 4 text on mlx-lm's gemma4_text layers, run by our forward (models/decoder.py) with our caches.

What transformers' Gemma4TextModel computes beyond a plain decoder, and how it is done here:
- Per-layer embeddings (PLE): a second embedding of the token ids plus a projection of the input embeddings,
  one slice per layer; computed when the tokens are embedded and handed to each layer.
- KV sharing: the last `num_kv_shared_layers` layers attend over the keys/values that the last earlier layer of
  their type computed in the same pass. Each such layer keeps a copy of them in its own cache, so every cache
  advances, trims and snapshots like any other (at the cost of the copy's memory).
- Per-layer-type head_dim and kv heads, as models/gemma4_config.py resolves them.
mlx-lm's blocks already match transformers otherwise (norms, scale-free v norm, attention scale 1, proportional
RoPE, the MoE block, layer_scalar); its backbone `__call__` is not used.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from .config import ModelConfig
from .decoder import DecoderLM
from .mlx_lm_modules import model_module

_gemma4, _base = model_module("gemma4_text"), model_module("base")


class PassState:
    """What one forward pass shares across layers: per-layer inputs, each layer type's newest keys/values."""

    def __init__(self) -> None:
        self.per_layer: mx.array | None = None  # (B, L, layers, hidden_size_per_layer_input)
        self.kv: dict[str, tuple[mx.array, mx.array]] = {}


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    args = _gemma4.ModelArgs.from_dict({**config.args, "layer_types": list(config.layer_types)})
    state = PassState()
    layers = []
    for index, kind in enumerate(config.layer_types):
        head_dim, kv_heads = config.args["gemma4_attention"][kind]
        # mlx-lm picks global or plain sizes by layer type; both name this layer's own.
        sized = replace(args, head_dim=head_dim, global_head_dim=head_dim,
                        num_key_value_heads=kv_heads, num_global_key_value_heads=kv_heads)  # fmt: skip
        layers.append(Gemma4Layer(sized, index, state))
    model.model.layers = layers
    model.__class__ = Gemma4LM  # a DecoderLM whose `embed` also computes the per-layer inputs
    model.pass_state = state


class Gemma4LM(DecoderLM):
    pass_state: PassState

    def embed(self, tokens: mx.array) -> mx.array:
        h = super().embed(tokens)  # scaled by sqrt(hidden_size)
        backbone = self.model
        self.pass_state.kv.clear()
        if backbone.hidden_size_per_layer_input:
            by_token = backbone._get_per_layer_inputs(tokens)
            self.pass_state.per_layer = backbone._project_per_layer_inputs(h, by_token)
        return h


class Gemma4Layer(_gemma4.DecoderLayer):
    """mlx-lm's block, called as our forward calls every layer: (h, mask, cache) -> h."""

    def __init__(self, args: Any, index: int, state: PassState):
        super().__init__(args, index)
        self.self_attn = SharedKVAttention(args, index, state)
        self._state, self._index = state, index

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        per_layer = self._state.per_layer
        per_layer = per_layer[:, :, self._index] if self.hidden_size_per_layer_input else None
        return super().__call__(x, mask, cache, per_layer_input=per_layer)[0]


class SharedKVAttention(_gemma4.Attention):
    """mlx-lm's Gemma 4 attention; a KV-shared layer takes the keys/values its producer wrote into the pass state."""

    def __init__(self, args: Any, index: int, state: PassState):
        super().__init__(args, index)
        self._state = state

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None, **_unused) -> tuple:
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=offset)  # (B, heads, L, head_dim)
        if self.has_kv:
            k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            v = k if self.use_k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset=offset)
            v = self.v_norm(v).transpose(0, 2, 1, 3)
            self._state.kv[self.layer_type] = (k, v)  # the last of its type before the shared layers wins
        else:
            k, v = self._state.kv[self.layer_type]
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = _base.scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1)), None, None
