"""A loaded model's sizes, in the terms the memory planner uses."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ConfigError
from ..memory import ModelFootprint
from .config import ATTENTION, FULL, SLIDING, ModelConfig
from .decoder import DecoderLM
from .loader import LoadedModel
from .mlx_lm_modules import model_module
from .sizing import moe_layout

KV_GROUP_SIZE = 64
# mlx-lm's gemma2 attention softcaps scores itself instead of calling the shared
# attention function, so it cannot read quantized keys; its deepseek_v3 (MLA) multiplies the cached latent.
NO_QUANTIZED_KV = {"gemma2", "deepseek_v3"}


def check_kv_bits(kv_bits: int | None, config: ModelConfig) -> int | None:
    """`kv_bits` if this model can use it, else a ConfigError saying what to pick."""
    if kv_bits is None:
        return None
    if kv_bits not in (4, 8):
        raise ConfigError(f"kv_bits must be 4 or 8 (or None for a float KV cache), got {kv_bits!r}")
    if not config.verified:
        raise ConfigError(
            f"model_type {config.model_type} is unverified (mlx-lm's model code): a quantized KV cache is not "
            "supported for it; load it with kv_bits=None"
        )
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
    width, state = _probe(loaded.model)  # what the caches will really hold
    if recurrent and config.verified:  # the larger of a prefill chunk's and a decode step's state
        state = recurrent_state_bytes(loaded.model)
    moe = moe_layout(config, str(loaded.path))
    experts = resident_experts(loaded.model, moe.experts_per_token if moe else 0)
    intermediate = int(args.get("intermediate_size", 4 * config.hidden_size))
    if moe:  # a prefill chunk runs each token through experts_per_token experts and the shared ones
        intermediate = max(intermediate, moe.experts_per_token * moe.expert_width + moe.shared_width)
    return ModelFootprint(
        weights_bytes=loaded.weights_bytes,
        full_layers=kinds.count(FULL),
        **_attention_shape(loaded, width if has_attention else 0),
        hidden=config.hidden_size,
        intermediate=intermediate,
        vocab=config.vocab_size,
        compute_bytes=size,
        kv_bytes=kv_bytes,
        max_positions=int(args.get("max_position_embeddings") or 0) or None,
        sliding_layers=kinds.count(SLIDING),
        window=config.sliding_window,
        recurrent_layers=recurrent,
        state_bytes=state,
        experts=experts.experts,
        experts_per_token=experts.experts_per_token,
        expert_bytes=experts.nbytes,
        active_expert_bytes=experts.active_nbytes,
    )


@dataclass(frozen=True)
class ResidentExperts:
    """The routed experts a model holds, as they sit in memory (packed bits and scales included)."""

    experts: int = 0  # per MoE layer (the most of any layer); 0: a dense model
    experts_per_token: int = 0
    nbytes: int = 0  # all of them, every layer
    active_nbytes: int = 0  # what one decoded token reads of them: experts_per_token of each layer's experts


def resident_experts(model: nn.Module, experts_per_token: int) -> ResidentExperts:
    """The routed experts in `model` (ours or mlx-lm's), from its actual arrays.

    mlx-lm keeps each MoE layer's experts in SwitchLinear modules (QuantizedSwitchLinear once quantized)
    whose every array has the experts first: weights (experts, out, in), scales, biases (experts, out).
    A decoded token reads experts_per_token of them in each layer; shared experts and routers are
    ordinary Linear layers, read in full like every dense weight.

    Example:
        >>> resident_experts(load_model("tests/fixtures/tiny/qwen3_next").model, 2)
        ResidentExperts(experts=4, experts_per_token=2, nbytes=294912, active_nbytes=147456)
    """
    switch = model_module("switch_layers")
    experts = nbytes = active = 0
    for _, module in model.named_modules():
        if isinstance(module, (switch.SwitchLinear, switch.QuantizedSwitchLinear)):
            count = module.num_experts
            held = sum(v.nbytes for _, v in tree_flatten(module.parameters()))
            experts, nbytes = max(experts, count), nbytes + held
            active += held * min(experts_per_token, count) // count
    return ResidentExperts(experts, experts_per_token if experts else 0, nbytes, active)


def _attention_shape(loaded: LoadedModel, width: int) -> dict[str, int]:
    """kv_heads, head_dim and heads of the attention layers, whose widest keeps `width` K and V elements per
    position (0: no attention layers, no KV whatever the config says)."""
    args = loaded.config.args
    if not width:
        return {"kv_heads": 0, "head_dim": 0, "heads": 0}
    if loaded.config.verified:
        shape = {k: int(args[key]) for k, key in _ATTENTION_KEYS.items()}
        if 2 * shape["kv_heads"] * shape["head_dim"] == width:
            return shape
    # Layers of other widths (Gemma 4's wider global layers, DeepSeek's latent attention) or an unverified
    # module: the planner counts one "head" holding the widest layer's K and V widths together.
    return {"kv_heads": 1, "head_dim": (width + 1) // 2, "heads": int(args.get("num_attention_heads") or 1)}


_ATTENTION_KEYS = {"kv_heads": "num_key_value_heads", "head_dim": "head_dim", "heads": "num_attention_heads"}


def _probe(model) -> tuple[int, int]:
    """(widest K + V elements per position of any attention layer, recurrent state bytes), learned from one
    lazy token through stand-ins for the model's caches: nothing is computed, MLX knows the shapes before it
    evaluates anything."""
    probes = [_StateProbe() if kind not in ATTENTION else _KVProbe() for kind, _ in model.cache_kinds]
    model.hidden(mx.zeros((1, 1), dtype=mx.uint32), probes)
    width = max((p.width for p in probes if isinstance(p, _KVProbe)), default=0)
    return width, sum(p.nbytes for p in probes if isinstance(p, _StateProbe))


class _KVProbe:
    """What an attention layer sees of cache/kv.py's KVCache, enough to learn the widths it would store."""

    offset = length = 0  # what mlx-lm's layers and our decoder read of a cache
    left_padding = None
    width = 0

    def key_start(self, new: int) -> int:
        return 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.width = max(self.width, keys.shape[1] * keys.shape[-1] + values.shape[1] * values.shape[-1])
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> None:
        return None


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
    length = 0  # what our decoder reads of a model's first cache
    left_padding = None

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
