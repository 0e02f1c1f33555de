"""A model's sizes in the terms the memory planner uses: from its config alone (pull, the distributed split,
and the start of every loaded model's footprint), refined by what a loaded model's arrays and caches show.

Each formula has one home here: bytes per stored K/V element, a recurrent layer's state, weights at some bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ConfigError
from ..memory import ModelFootprint
from .config import ATTENTION, FULL, SLIDING, ModelConfig
from .loader import LoadedModel
from .mlx_lm_modules import model_module
from .sizing import moe_layout

KV_GROUP_SIZE = 64
QUANT_GROUP_SIZE = 64  # weights: mlx's affine quantization keeps a 16-bit scale and bias per group of this many
RECURRENCE_ELEMENT_BYTES = 4  # mlx-lm's Mamba-2 and Gated DeltaNet keep their state in float32 at any dtype


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
    if config.spec.float_kv_only:
        raise ConfigError(f"{config.model_type} cannot use a quantized KV cache; load it with kv_bits=None")
    if int(config.args["head_dim"]) % KV_GROUP_SIZE:
        raise ConfigError(f"head_dim {config.args['head_dim']} is not a multiple of {KV_GROUP_SIZE}; use kv_bits=None")
    return kv_bits


def kv_element_bytes(compute_bytes: int, kv_bits: int | None) -> float:
    """Bytes per stored K or V element: the compute dtype's, or (quantized) the packed bits plus a scale and a
    bias in the compute dtype per group of KV_GROUP_SIZE."""
    return compute_bytes if kv_bits is None else kv_bits / 8 + 2 * compute_bytes / KV_GROUP_SIZE


def quantized_bytes(parameters: int, bits: int) -> int:
    """Bytes of `parameters` weights quantized to `bits`, with a 16-bit scale and bias per group of 64."""
    return int(parameters * (bits / 8 + 4 / QUANT_GROUP_SIZE))


def layer_kinds(config: ModelConfig) -> tuple[str, ...]:
    """Each layer's cache kind; a model whose module decides (unverified) is counted as full attention."""
    return config.layer_types if len(config.layer_types) == config.num_layers else (FULL,) * config.num_layers


def config_footprint(
    config: ModelConfig, compute_bytes: int, kv_bits: int | None = None, parameters: int = 0, bits: int | None = None
) -> ModelFootprint:
    """The planner's sizes of a model from its normalized config alone (nothing built, nothing loaded).

    Weights are `parameters` at `bits` (None: the compute dtype); 0 leaves weights and expert bytes to the
    caller (the checkpoint's headers or the loaded arrays know them better). Recurrent state and the experts'
    width in a prefill chunk are counted; attention wider than the config's heads (Gemma 4's global layers)
    is not: footprint() measures it on a loaded model.

    Example (SmolLM2-135M: 30 layers of 3 KV heads x 64 dims, K and V, in 2-byte floats):
        >>> config_footprint(normalize_config(json.load(open("config.json"))), 2).kv_bytes_per_token
        23040
    """
    a, kinds = config.args, layer_kinds(config)
    heads = int(a.get("num_attention_heads") or 1)
    moe = moe_layout(config, config.source)
    intermediate = int(a.get("intermediate_size") or 4 * config.hidden_size)
    if moe:  # a prefill chunk runs each token through experts_per_token experts and the shared ones
        intermediate = max(intermediate, moe.experts_per_token * moe.expert_width + moe.shared_width)
    weigh = (lambda n: quantized_bytes(n, bits)) if bits else (lambda n: n * compute_bytes)
    routed = len(moe.sparse_layers) if moe and parameters else 0  # layers whose expert bytes are counted here
    return ModelFootprint(
        weights_bytes=weigh(parameters),
        full_layers=kinds.count(FULL),
        **_config_attention(config, heads),
        heads=heads,
        hidden=config.hidden_size,
        intermediate=intermediate,
        vocab=config.vocab_size,
        compute_bytes=compute_bytes,
        kv_bytes=kv_element_bytes(compute_bytes, kv_bits),
        max_positions=int(a.get("max_position_embeddings") or 0) or None,
        sliding_layers=kinds.count(SLIDING),
        window=config.sliding_window,
        recurrent_layers=sum(kind not in ATTENTION for kind in kinds),
        state_bytes=sum(layer_state_bytes(config, kind, compute_bytes) for kind in kinds),
        experts=moe.experts if moe else 0,
        experts_per_token=moe.experts_per_token if moe else 0,
        expert_bytes=weigh(routed * moe.expert_parameters(config.hidden_size)) if routed else 0,
        active_expert_bytes=weigh(routed * moe.expert_parameters(config.hidden_size, active=True)) if routed else 0,
    )


def _config_attention(config: ModelConfig, heads: int) -> dict[str, int]:
    """kv_heads and head_dim of what an attention layer caches per position, as the config describes it."""
    a = config.args
    if "kv_lora_rank" in a:  # latent attention (DeepSeek, as mlx-lm caches it): one latent and one rotary key
        width = int(a["kv_lora_rank"]) + int(a.get("qk_rope_head_dim") or 0)
        return {"kv_heads": 1, "head_dim": (width + 1) // 2}
    return {
        "kv_heads": int(a.get("num_key_value_heads") or heads),
        "head_dim": int(a.get("head_dim") or config.hidden_size // heads),
    }


def layer_state_bytes(config: ModelConfig, kind: str, compute_bytes: int) -> int:
    """One layer's recurrent state for one sequence (0 for an attention layer), the same at any context.

    Each recurrent kind keeps its short convolution's last kernel - 1 inputs in the compute dtype; Mamba-2 and
    Gated DeltaNet add their recurrence's state in float32 (mlx-lm's layers, as tests/test_footprint.py measures).
    """
    a = config.args
    if kind in ATTENTION:
        return 0
    if kind == "conv":  # LFM2: a convolution over the hidden state (transformers' default kernel: 3)
        return (int(a.get("conv_L_cache") or 3) - 1) * config.hidden_size * compute_bytes
    if kind == "mamba":  # (heads, head_dim, d_state); the convolution sees x, B and C
        inner, groups_state = a["mamba_n_heads"] * a["mamba_d_head"], a["mamba_n_groups"] * a["mamba_d_state"]
        conv = (a["mamba_d_conv"] - 1) * (inner + 2 * groups_state) * compute_bytes
        return conv + inner * a["mamba_d_state"] * RECURRENCE_ELEMENT_BYTES
    if kind == "linear_attention":  # Gated DeltaNet: (value heads, value dim, key dim); the convolution sees q, k, v
        keys = a["linear_num_key_heads"] * a["linear_key_head_dim"]
        values = a["linear_num_value_heads"] * a["linear_value_head_dim"]
        conv = (a["linear_conv_kernel_dim"] - 1) * (2 * keys + values) * compute_bytes
        return conv + values * a["linear_key_head_dim"] * RECURRENCE_ELEMENT_BYTES
    raise ConfigError(f"{config.source}: no state size is known for layer kind {kind!r}; add it to layer_state_bytes")


def layer_cache_bytes(config: ModelConfig, footprint: ModelFootprint, context: int) -> tuple[int, ...]:
    """Each decoder layer's cache for one sequence at `context` tokens: its KV allocation, or its state.

    Together they are footprint.cache_bytes(context), the planner's number for the whole model.
    """
    one = replace(footprint, full_layers=0, sliding_layers=0)
    return tuple(
        replace(one, **{_LAYER_COUNT[kind]: 1}).kv_cache_bytes(context)
        if kind in ATTENTION
        else layer_state_bytes(config, kind, footprint.compute_bytes)
        for kind in layer_kinds(config)
    )


_LAYER_COUNT = {FULL: "full_layers", SLIDING: "sliding_layers"}


def footprint(loaded: LoadedModel, kv_bits: int | None = None) -> ModelFootprint:
    """config_footprint() with what the loaded model shows: weights as they sit in memory (packed bits and
    scales included), the widest attention layer's KV as its cache stores it, and for a model whose module
    decides (unverified) its layer kinds and recurrent state."""
    config = loaded.config
    estimate = config_footprint(config, loaded.compute_dtype.size, kv_bits)
    kinds = [kind for kind, _ in loaded.model.cache_kinds]
    width, state = _probe(loaded.model)  # what the caches will really hold
    experts = resident_experts(loaded.model, estimate.experts_per_token)
    return replace(
        estimate,
        weights_bytes=loaded.weights_bytes,
        full_layers=kinds.count(FULL),
        sliding_layers=kinds.count(SLIDING),
        recurrent_layers=sum(kind not in ATTENTION for kind in kinds),
        state_bytes=estimate.state_bytes if config.verified else state,
        **_attention_shape(estimate, width, config.verified),
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


def _attention_shape(estimate: ModelFootprint, width: int, verified: bool) -> dict[str, int]:
    """kv_heads, head_dim and heads of the attention layers, whose widest keeps `width` K and V elements per
    position (0: no attention layers, no KV whatever the config says)."""
    if not width:
        return {"kv_heads": 0, "head_dim": 0, "heads": 0}
    if verified and 2 * estimate.kv_heads * estimate.head_dim == width:
        return {"kv_heads": estimate.kv_heads, "head_dim": estimate.head_dim, "heads": estimate.heads}
    # Layers of other widths (Gemma 4's wider global layers) or an unverified module: the planner counts one
    # "head" holding the widest layer's K and V widths together.
    return {"kv_heads": 1, "head_dim": (width + 1) // 2, "heads": estimate.heads}


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


class _StateProbe:
    """What a recurrent layer sees of cache/state.py's StateCache (models/ does not import cache/): numbered
    slots, written when the layer calls `advance`. tests/test_footprint.py checks that both hold the same bytes."""

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
