"""A loaded model's sizes, in the terms the memory planner uses."""

from __future__ import annotations

import mlx.core as mx

from ..errors import ConfigError
from ..memory import ModelFootprint
from .config import ATTENTION, FULL, SLIDING, ModelConfig
from .decoder import DecoderLM
from .loader import LoadedModel

KV_GROUP_SIZE = 64
# mlx-lm's gemma2 attention softcaps scores itself instead of calling the shared
# attention function, so it cannot read quantized keys.
NO_QUANTIZED_KV = {"gemma2"}


def check_kv_bits(kv_bits: int | None, config: ModelConfig) -> int | None:
    """`kv_bits` if this model can use it, else a ConfigError saying what to pick."""
    if kv_bits is None:
        return None
    if kv_bits not in (4, 8):
        raise ConfigError(f"kv_bits must be 4 or 8 (or None for a float KV cache), got {kv_bits!r}")
    if config.model_type in NO_QUANTIZED_KV:
        raise ConfigError(f"{config.model_type} cannot use a quantized KV cache; load it with kv_bits=None")
    if int(config.args["head_dim"]) % KV_GROUP_SIZE:
        raise ConfigError(f"head_dim {config.args['head_dim']} is not a multiple of {KV_GROUP_SIZE}; use kv_bits=None")
    return kv_bits


def footprint(loaded: LoadedModel, kv_bits: int | None = None) -> ModelFootprint:
    """Weights as they sit in memory (packed bits and scales included), per-position KV as stored, and the
    recurrent layers' state as their caches hold it."""
    args, config = loaded.config.args, loaded.config
    size = loaded.compute_dtype.size
    # quantized: the packed bits plus a scale and a bias (compute dtype) per group
    kv_bytes = size if kv_bits is None else kv_bits / 8 + 2 * size / KV_GROUP_SIZE
    kinds = [kind for kind, _ in loaded.model.cache_kinds]
    has_attention = any(kind in ATTENTION for kind in kinds)
    recurrent = sum(kind not in ATTENTION for kind in kinds)
    return ModelFootprint(
        weights_bytes=loaded.weights_bytes,
        full_layers=kinds.count(FULL),
        # Attention shapes: a model without attention layers stores no KV, whatever its config says.
        kv_heads=int(args["num_key_value_heads"]) if has_attention else 0,
        head_dim=int(args["head_dim"]) if has_attention else 0,
        heads=int(args["num_attention_heads"]) if has_attention else 0,
        hidden=config.hidden_size,
        intermediate=int(args.get("intermediate_size", 4 * config.hidden_size)),
        vocab=config.vocab_size,
        compute_bytes=size,
        kv_bytes=kv_bytes,
        max_positions=int(args.get("max_position_embeddings") or 0) or None,
        sliding_layers=kinds.count(SLIDING),
        window=config.sliding_window,
        recurrent_layers=recurrent,
        state_bytes=recurrent_state_bytes(loaded.model) if recurrent else 0,
    )


def recurrent_state_bytes(model: DecoderLM) -> int:
    """Bytes of state one sequence keeps in the model's recurrent layers (the same at any context).

    Each recurrent layer runs a two-token chunk then one token into a stand-in for
    its cache; MLX knows an array's shape and dtype before computing it, so nothing
    is evaluated and this costs no compute. The larger of the two states counts:
    a decode step may keep the state in another dtype than a prefill chunk.
    """
    h = model.embed(mx.zeros((1, 2), dtype=mx.uint32))  # (1, 2, hidden)
    total = 0
    for layer, (kind, _) in zip(model.layers, model.cache_kinds):
        if kind in ATTENTION:
            continue
        state = _StateProbe()
        layer(h, None, state)
        after_chunk = state.nbytes
        layer(h[:, :1], None, state)
        total += max(after_chunk, state.nbytes)
    return total


class _StateProbe:
    """What a recurrent layer sees of cache/state.py's StateCache (models/ does not import cache/): numbered
    slots, written when the layer calls `advance`. tests/test_memory.py checks that both hold the same bytes."""

    lengths = None  # mlx-lm's per-row lengths: one sequence here

    def __init__(self) -> None:
        self.slots: dict[int, mx.array] = {}
        self._pending: dict[int, mx.array] = {}

    def __getitem__(self, slot: int) -> mx.array | None:
        return self.slots.get(slot)

    def __setitem__(self, slot: int, value: mx.array) -> None:
        self._pending[slot] = value

    def advance(self, n: int) -> None:
        self.slots.update(self._pending)
        self._pending.clear()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.slots.values())
