"""Embeddings: a model's final hidden states (after the last norm, before the LM head), pooled per input.

Mean pooling as sentence-transformers' "mean", last-token pooling as its "lasttoken"; vectors are
L2-normalized float32 by default, as OpenAI's /v1/embeddings returns them.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..cache import make_cache
from ..defaults import PREFILL_CHUNK_TOKENS
from ..errors import EmbeddingError, SamplingError
from ..models.decoder import DecoderLM
from ..models.shared_layers import ScaledLayerNorm, ScaledRMSNorm
from ..untrusted import shown
from .sampling import is_int

POOLINGS = ("mean", "last")


def embeddable(decoder: object, alongside_generation: bool = False) -> str | None:
    """Why `decoder`'s final hidden states cannot be embedded, or None when they can.

    `alongside_generation`: the pass runs on its own thread while a ServingThread may run this same model."""
    if not isinstance(decoder, DecoderLM) or not decoder.verified:
        # models/fallback.py runs mlx-lm's whole __call__: its `hidden` already holds the logits.
        return (
            "it runs through mlx-lm's own model class (an unverified family), whose forward pass gives logits, "
            "not the final hidden states; embeddings need a family mlxinfer runs itself"
        )
    if decoder.sharded:
        # Its passes are collectives that every rank joins in the same order; a pass on rank 0 alone never ends.
        return "it is split over the ranks of a distributed model, whose passes run only in generation turns"
    if alongside_generation and getattr(decoder, "pass_state", None) is not None:
        # Gemma 4 (families/gemma4_text.py) keeps each pass's per-layer inputs and shared keys on the model:
        # a pass on another thread would overwrite those of a generation running at the same time.
        return (
            "its forward pass keeps per-pass state on the model (Gemma 4's per-layer inputs and shared keys), "
            "so it cannot run beside the generations this server runs on it; embed with the Python API instead"
        )
    return None


def split_inputs(value: object) -> list[str | list[int]]:
    """OpenAI's `input` forms as one item per input: a string, a list of strings, a list of token ids (one
    input) or a list of lists of token ids. SamplingError for anything else (the ids are checked by `embed`)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(is_int(item) for item in value):
            return [list(value)]
        if all(isinstance(item, (list, tuple)) for item in value):
            return [list(item) for item in value]
    raise SamplingError(
        "input must be a string, a list of strings, a list of token ids or a list of lists of token ids, "
        f"and not empty; got {_kind(value)}"
    )


def _kind(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return "an empty list" if not value else f"a list of {', '.join(sorted({type(v).__name__ for v in value}))}"
    return type(value).__name__


def embed(
    decoder: DecoderLM,
    token_id_lists: Sequence[Sequence[int]],
    pooling: str = "mean",
    normalize: bool = True,
    *,
    vocab_size: int,
    kv_bits: int | None = None,
    chunk_tokens: int = PREFILL_CHUNK_TOKENS,
    alongside_generation: bool = False,
) -> np.ndarray:
    """One float32 vector per input, shape (inputs, hidden): the final hidden states pooled over its tokens.

    Each input runs alone with a fresh cache, `chunk_tokens` at a time, so memory grows with its KV only.
    EmbeddingError when the model's hidden states cannot be had; SamplingError for bad arguments.

    Example:
        >>> vectors = embed(model.runtime.decoder, [[256, 72, 105]], vocab_size=model.config.vocab_size)
        >>> vectors.shape, float(np.linalg.norm(vectors[0]))
        ((1, 64), 1.0)
    """
    reason = embeddable(decoder, alongside_generation)
    if reason is not None:
        raise EmbeddingError(f"this model cannot give embeddings: {reason}")
    if pooling not in POOLINGS:
        raise SamplingError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise SamplingError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    checked = [check_ids(ids, index, vocab_size) for index, ids in enumerate(token_id_lists)]
    if not checked:
        raise SamplingError("there is nothing to embed: give at least one input")
    vectors = np.stack([_pooled(decoder, ids, pooling, kv_bits, chunk_tokens) for ids in checked])
    if normalize:
        # A zero vector stays zero rather than becoming NaN.
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), np.finfo(np.float32).tiny)
    return vectors


def _pooled(decoder: DecoderLM, ids: list[int], pooling: str, kv_bits: int | None, chunk_tokens: int) -> np.ndarray:
    """The pooled final hidden state of one input, float32 (hidden,)."""
    cache = make_cache(decoder.cache_kinds, kv_bits, positions=len(ids))
    tokens = mx.array(ids, dtype=mx.uint32)
    pooled = None
    for start in range(0, tokens.size, chunk_tokens):
        hidden = decoder.hidden(tokens[None, start : start + chunk_tokens], cache)[0]  # (chunk, hidden)
        if pooling == "mean":
            # Summed in float32: a bf16 running sum over thousands of tokens loses the small ones.
            part = hidden.astype(mx.float32).sum(axis=0)
            pooled = part if pooled is None else pooled + part
        else:
            pooled = hidden[-1].astype(mx.float32)
        # The cache too, so the next chunk's graph does not hold this one's (what bounds the memory).
        mx.eval(pooled, [c.arrays for c in cache])
    if pooling == "mean":
        pooled = pooled / len(ids)
    return np.array(pooled / _head_scale(decoder), dtype=np.float32)


def _head_scale(decoder: DecoderLM) -> float:
    """The factor some families fold into their final norm for the head's sake (granite's 1 / logits_scaling,
    cohere2's logit_scale): transformers' hidden states are the norm's output without it."""
    norm = getattr(decoder.model, decoder.layout.final_norm)
    return float(norm._scale) if isinstance(norm, (ScaledRMSNorm, ScaledLayerNorm)) else 1.0


def check_ids(ids: Sequence[int], index: int, vocab_size: int) -> list[int]:
    """Input `index`'s token ids as ints; SamplingError naming the input when one is out of [0, vocab_size)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise SamplingError(f"input[{index}] must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise SamplingError(f"input[{index}] is empty; give it at least one token")
    bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise SamplingError(f"input[{index}]: token ids must be integers in [0, {vocab_size}), got {shown(bad[:5])}")
    return [int(t) for t in ids]
