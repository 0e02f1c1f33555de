"""One forward pass for every supported decoder, built from mlx-lm's layers.

mlx-lm's per-architecture `__call__`s disagree with transformers on sliding
windows (gemma2 ignores them, gemma3 and llama read only some config forms), so
we reuse its embedding, blocks and norms and run them here with one mask per
layer type. Parameter paths stay the Hugging Face ones (`model.layers.0...`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from .config import ATTENTION, SLIDING, ModelConfig
from .fallback import build_fallback
from .mlx_lm_modules import model_module
from .shared_layers import MRoPE


@dataclass(frozen=True)
class Layout:
    """Per-model facts the forward pass needs beyond the layers themselves."""

    layer_types: tuple[str, ...]
    sliding_window: int | None
    embed_scale: float | None
    final_logit_softcapping: float | None
    # The attention folds grouped query heads into an extra axis (ArchSpec.folds_query_groups), so a
    # per-row mask needs one more axis to broadcast there.
    grouped_query_mask: bool = False
    final_norm: str = "norm"  # the backbone's attribute holding the last norm


class Placed(Protocol):
    """Images placed in one prefill chunk (engine/images.py): their embeddings and their bidirectional blocks."""

    def blocks_for(self, kind: str) -> Sequence[tuple[int, int]]:
        """Absolute [start, end) positions whose tokens see each other both ways in a `kind` layer."""
        ...

    def place(self, h: mx.array) -> mx.array:
        """`h` (1, chunk, hidden) with the images' embeddings in their tokens' places."""
        ...

    def token_mask(self, length: int) -> mx.array:
        """(length,) bool: which of the chunk's tokens are images'."""
        ...

    @property
    def deep_layers(self) -> int:
        """The first layers after which deepstack features add to the image tokens' hidden states (Qwen3-VL)."""
        ...

    def deepened(self, layer: int, h: mx.array) -> mx.array:
        """`h` (1, chunk, hidden) after layer `layer`, the images' deepstack features for it added at their tokens."""
        ...

    @property
    def positions(self) -> mx.array | None:
        """(3, chunk) time, row and column positions of the chunk's tokens, for M-RoPE (models/shared_layers.py); None
        where the model's images take one position a token."""
        ...


class DecoderLM(nn.Module):
    """A causal LM: embeddings -> blocks -> norm -> head, with per-layer masks."""

    verified = True  # a family checked against transformers (models/fallback.py runs the others)
    batchable = True  # rows of any length decode together (per-row masks)
    stage = None  # a pipeline rank's place (models/shard.py): its layers only, hidden states to and fro
    sharded = False  # split over the ranks of an mx.distributed group (pipeline or tensor, models/shard.py)
    mrope: MRoPE | None = None  # the attention layers' RoPE where it reads image positions (Qwen3.5, Qwen3-VL)

    def __init__(self, backbone: nn.Module, lm_head: nn.Module | None, layout: Layout):
        super().__init__()
        self.model = backbone
        if lm_head is not None:
            self.lm_head = lm_head
        self.layout = layout

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def hidden(
        self,
        tokens: mx.array,
        cache: Sequence[Any] | None = None,
        images: Placed | None = None,
        shifts: int | mx.array | None = None,
    ) -> mx.array:
        """Final-norm hidden states, shape (B, L, hidden); `images` (one row) replace their tokens' embeddings.
        `shifts`: what each row's images moved its RoPE positions by (an M-RoPE model's; None: nothing)."""
        if self.mrope is None:
            return self._hidden(tokens, cache, images)
        with self.mrope.around(images.positions if images is not None else None, shifts):
            return self._hidden(tokens, cache, images)

    def _hidden(self, tokens: mx.array, cache: Sequence[Any] | None, images: Placed | None) -> mx.array:
        h = self.embed_with(tokens, images)
        if self.stage is not None:  # a later rank: the previous rank's hidden states, shaped like these
            h = self.stage.receive(h)
        caches = cache if cache is not None else [None] * len(self.layers)
        first = caches[0]
        offset = first.length if first is not None else 0
        padding = first.left_padding if first is not None else None
        masks = {}
        for kind, layer_cache in zip(self.layout.layer_types, caches):
            if kind not in masks and kind in ATTENTION:
                # A window's cache returns keys from its `start`, which a long write moves forward.
                start = layer_cache.key_start(h.shape[1]) if layer_cache is not None else 0
                blocks = images.blocks_for(kind) if images else ()
                masks[kind] = self.mask(h.shape[1], offset, kind, padding, start, blocks)
        deep = images.deep_layers if images is not None else 0
        for i, (layer, kind, layer_cache) in enumerate(zip(self.layers, self.layout.layer_types, caches)):
            # Recurrent layers need no mask: each row is prefilled alone and keeps its own state.
            h = layer(h, masks.get(kind), layer_cache)
            if i < deep:
                h = images.deepened(i, h)
        if self.stage is not None:
            h = self.stage.finish(h)
        return getattr(self.model, self.layout.final_norm)(h)

    @property
    def cache_kinds(self) -> tuple[tuple[str, int | None], ...]:
        """Each layer's type and, for a sliding layer, its window: what `cache.make_cache` builds from."""
        window = self.layout.sliding_window
        return tuple((kind, window if kind == SLIDING else None) for kind in self.layout.layer_types)

    def embed_with(self, tokens: mx.array, images: Placed | None) -> mx.array:
        """Input embeddings of `tokens`, the images' in their tokens' places."""
        h = self.embed(tokens)
        return h if images is None else images.place(h)

    def embed(self, tokens: mx.array) -> mx.array:
        """Input embeddings of `tokens`, scaled where the architecture does."""
        h = self.model.embed_tokens(tokens)
        if self.layout.embed_scale is not None:
            h = h * mx.array(self.layout.embed_scale, dtype=h.dtype)
        return h

    def head(self, h: mx.array) -> mx.array:
        """Logits for hidden states `h`, shape (..., vocab)."""
        if "lm_head" in self:
            logits = self.lm_head(h)
        else:
            logits = self.model.embed_tokens.as_linear(h)
        cap = self.layout.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def __call__(self, tokens: mx.array, cache: Sequence[Any] | None = None) -> mx.array:
        return self.head(self.hidden(tokens, cache))

    def mask(
        self,
        length: int,
        offset: int,
        kind: str,
        left_padding: Sequence[int] | None = None,
        key_start: int = 0,
        blocks: Sequence[tuple[int, int]] = (),
    ) -> mx.array | None:
        """Attention mask for `length` queries after `offset` positions in a `kind` layer whose cache returns
        keys from position `key_start` on.

        With `left_padding` (a batch of right-aligned rows) the mask is per row,
        shape (rows, 1, length, offset + length - key_start), and hides each row's padding. Within each
        [start, end) of `blocks` (an image's tokens, all in this chunk) positions also see later ones."""
        # Keys cover positions [key_start, offset + length); query i sits at offset + i.
        window = self.layout.sliding_window if kind == SLIDING else None
        keys = offset + length - key_start
        if left_padding is not None and not any(left_padding):  # rows of one length (a lone one): nothing to hide
            left_padding = None
        if left_padding is None and length == 1 and (window is None or keys <= window):
            return None
        query = mx.arange(offset, offset + length)[:, None]
        key = mx.arange(key_start, offset + length)[None]
        mask = query >= key
        for start, end in blocks:  # transformers: OR(causal, same block), then AND the window
            mask = mask | ((query >= start) & (query < end) & (key >= start) & (key < end))
        if window is not None:
            mask = mask & (query < key + window)
        if left_padding is not None:
            mask = (mask[None] & (key[None] >= mx.array(left_padding)[:, None, None]))[:, None]
            if self.layout.grouped_query_mask:
                mask = mask[:, None]
        return mask


def build_model(config: ModelConfig) -> DecoderLM:
    """Instantiate the architecture for `config` (weights still random)."""
    if not config.verified:
        return build_fallback(config.spec.mlx_module, config.args, config.source)
    module = model_module(config.spec.mlx_module)
    # A copy: some mlx-lm modules rewrite their args in place (qwen3_5 renames rope_parameters keys).
    reference = module.Model(module.ModelArgs.from_dict(copy.deepcopy(config.args)))
    backbone = reference.model
    lm_head = None
    if not config.tie_word_embeddings:
        lm_head = getattr(reference, "lm_head", None) or nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    layout = Layout(
        layer_types=config.layer_types,
        sliding_window=config.sliding_window,
        embed_scale=math.sqrt(config.hidden_size) if config.spec.scales_embeddings else None,
        final_logit_softcapping=config.args.get("final_logit_softcapping"),
        grouped_query_mask=config.spec.folds_query_groups
        and config.args["num_attention_heads"] != config.args["num_key_value_heads"],
        final_norm=config.spec.final_norm,
    )
    model = DecoderLM(backbone, lm_head, layout)
    if config.spec.mlx_sanitize:
        model.mlx_sanitize = reference.sanitize  # the checkpoint's tensor layout -> this module's
    if config.spec.adapt is not None:  # where mlx-lm's layers differ from transformers (mlxinfer/families/)
        config.spec.adapt(model, config)
    return model
