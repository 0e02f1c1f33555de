"""A loaded model's sizes, in the terms the memory planner uses."""

from __future__ import annotations

from ..errors import ConfigError
from ..memory import ModelFootprint
from .config import ModelConfig
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
    """Weights as they sit in memory (packed bits and scales included) and per-token KV as stored."""
    args, config = loaded.config.args, loaded.config
    size = loaded.compute_dtype.size
    # quantized: the packed bits plus a scale and a bias (compute dtype) per group
    kv_bytes = size if kv_bits is None else kv_bits / 8 + 2 * size / KV_GROUP_SIZE
    return ModelFootprint(
        weights_bytes=loaded.weights_bytes,
        layers=config.num_layers,
        kv_heads=int(args["num_key_value_heads"]),
        head_dim=int(args["head_dim"]),
        heads=int(args["num_attention_heads"]),
        hidden=config.hidden_size,
        intermediate=int(args.get("intermediate_size", 4 * config.hidden_size)),
        vocab=config.vocab_size,
        compute_bytes=size,
        kv_bytes=kv_bytes,
        max_positions=int(args.get("max_position_embeddings") or 0) or None,
    )
