"""gpt-oss (GptOssForCausalLM): its config rules, layers over mlx-lm's gpt_oss module, the expert tensors of
transformers' and the Hub's MXFP4 layout, llama.cpp's GGUF conventions, and its registry row.

What mlx-lm's module does differently from transformers, and what this file sets right:
- RoPE: transformers' YaRN frequencies (models/yarn.py) instead of mlx-lm's YarnRoPE, which always rounds
  the correction range (gpt-oss says `truncate: false`).
- Experts: the clamped SwiGLU with the config's swiglu_alpha and swiglu_limit (mlx-lm fixes 1.702 and 7.0).
- Attention sinks with a quantized KV cache, which mlx-lm refuses: each head's sink is one more logit
  column of the softmax that carries no value, as in transformers' eager attention.
- Weights: transformers' fused expert tensors -> mlx-lm's layout (convert_gpt_oss_weights, below).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx

from ..errors import UnsupportedModelError, WeightMismatchError
from ..models.config import ModelConfig
from ..models.config_rules import check_experts, positive_number
from ..models.decoder import DecoderLM
from ..models.gguf_arch import EXPERT_NAMES, GGUFArch, Meta
from ..models.mlx_lm_modules import model_module
from ..models.registry import ArchSpec
from ..models.shared_layers import FrequencyRoPE
from ..models.yarn import yarn_inverse_frequencies
from ..untrusted import shown

# GptOssConfig's defaults (transformers 5) for keys config.json may leave out.
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "head_dim": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}
# The RoPE GptOssConfig falls back to when config.json names none.
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}  # fmt: skip


def check_gpt_oss(args: dict[str, Any], source: str) -> None:
    if not args.get("rope_parameters") and not args.get("rope_scaling"):
        args["rope_parameters"] = dict(GPT_OSS_YARN)  # what GptOssConfig does
    check_experts(args, source, "num_local_experts", allow_dense=False)
    for key in ("swiglu_alpha", "swiglu_limit"):  # the experts' clamped SwiGLU: x * sigmoid(alpha * x), |x| <= limit
        positive_number(args, key, source)


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


# ---- Expert tensors: from the layout transformers saves to the one mlx-lm's SwitchGLU holds.
#
# transformers (GptOssExperts) keeps each layer's experts fused and stored (in, out):
#     gate_up_proj (E, hidden, 2I), gate and up interleaved on the last axis, + gate_up_proj_bias (E, 2I)
#     down_proj    (E, I, hidden) + down_proj_bias (E, hidden)
# mlx-lm wants experts.{gate,up,down}_proj.{weight,bias}, weights stored (E, out, in). mlx-lm's own sanitize
# only knows the MXFP4 layout of the Hub checkpoints; applied to this one it slices the wrong axis. That layout,
# stored (out, in) with gate and up interleaved on the rows, is kept as MLX mxfp4 (as mlx-lm's sanitize does):
#     gate_up_proj_blocks (E, 2I, H/32, 16) uint8 + gate_up_proj_scales (E, 2I, H/32) uint8 (E8M0 exponents)
#     down_proj_blocks    (E, H, I/32, 16)        + down_proj_scales    (E, H, I/32)
# Each 16-byte block holds 32 E2M1 codes, element 2j in the low nibble of byte j: read as little-endian uint32
# words, that is MLX's mxfp4 packing, and the exponents are its scales. Folders already in mlx-lm's layout
# (mlxinfer or mlx-lm output) pass.

_FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_MXFP4 = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def convert_gpt_oss_weights(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """`weights` with every layer's fused expert tensors split into mlx-lm's names and shapes."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        prefix, found, leaf = name.rpartition(".experts.")
        if not found or leaf not in _FUSED + _MXFP4:
            out[name] = value
            continue
        _check_shape(name, value, _expected(leaf, config))
        experts = f"{prefix}.experts"
        if leaf in _MXFP4:
            out.update(_mxfp4_experts(experts, leaf, value, name))
            continue
        if leaf == "gate_up_proj":  # (E, H, 2I) -> gate, up (E, I, H)
            out[f"{experts}.gate_proj.weight"] = mx.contiguous(value[..., ::2].swapaxes(1, 2))
            out[f"{experts}.up_proj.weight"] = mx.contiguous(value[..., 1::2].swapaxes(1, 2))
        elif leaf == "gate_up_proj_bias":  # (E, 2I) -> (E, I) each
            out[f"{experts}.gate_proj.bias"] = mx.contiguous(value[..., ::2])
            out[f"{experts}.up_proj.bias"] = mx.contiguous(value[..., 1::2])
        elif leaf == "down_proj":  # (E, I, H) -> (E, H, I)
            out[f"{experts}.down_proj.weight"] = mx.contiguous(value.swapaxes(1, 2))
        else:
            out[f"{experts}.down_proj.bias"] = value
    return out


def _mxfp4_experts(experts: str, leaf: str, value: mx.array, name: str) -> dict[str, mx.array]:
    """One Hub MXFP4 tensor as mlx-lm's packed weight or scales: gate and up are the even and odd rows."""
    if value.dtype != mx.uint8:
        raise WeightMismatchError(f"{name}: dtype {value.dtype}, expected uint8 (MXFP4 blocks and exponents)")
    fused, _, part = leaf.rpartition("_")  # gate_up_proj | down_proj, blocks | scales
    if part == "blocks":  # (E, out, in/32, 16) bytes -> (E, out, in/8) words
        value = value.view(mx.uint32).flatten(-2)
    kind = "weight" if part == "blocks" else "scales"
    if fused == "down_proj":
        return {f"{experts}.down_proj.{kind}": value}
    return {
        f"{experts}.gate_proj.{kind}": mx.contiguous(value[:, ::2]),
        f"{experts}.up_proj.{kind}": mx.contiguous(value[:, 1::2]),
    }


def _expected(leaf: str, config: ModelConfig) -> tuple[int, ...]:
    a = config.args
    experts, hidden, inner = int(a["num_local_experts"]), config.hidden_size, int(a["intermediate_size"])
    return {
        "gate_up_proj": (experts, hidden, 2 * inner),
        "gate_up_proj_bias": (experts, 2 * inner),
        "down_proj": (experts, inner, hidden),
        "down_proj_bias": (experts, hidden),
        # MXFP4 (Hub): (experts, out, in / 32 blocks, 16 bytes) and one exponent per block.
        "gate_up_proj_blocks": (experts, 2 * inner, hidden // 32, 16),
        "gate_up_proj_scales": (experts, 2 * inner, hidden // 32),
        "down_proj_blocks": (experts, hidden, inner // 32, 16),
        "down_proj_scales": (experts, hidden, inner // 32),
    }[leaf]


def _check_shape(name: str, value: mx.array, expected: tuple[int, ...]) -> None:
    # The split axis depends on the layout: a tensor stored the other way round must not be cut wrongly.
    if tuple(value.shape) != expected:
        layout = {"_blocks": "experts, out, in / 32, 16 bytes", "_scales": "experts, out, in / 32"}.get(
            name[name.rfind("_") :], "experts, in, out"
        )
        raise WeightMismatchError(
            f"{name}: shape {tuple(value.shape)}, expected {expected} (transformers' layout: {layout})"
        )


# ---- GGUF: llama.cpp's "gpt-oss" (its MXFP4 experts load as MLX mxfp4, see formats/gguf_file.py) ----


def gguf_config(meta: Meta) -> dict[str, Any]:
    experts = meta.int("expert_count")
    out: dict[str, Any] = {
        "num_local_experts": experts,
        "num_experts_per_tok": meta.int("expert_used_count", high=experts),
        "intermediate_size": meta.int("expert_feed_forward_length"),
        "sliding_window": meta.int("attention.sliding_window", 128),
        "attention_bias": True,
    }
    kind = meta.str("rope.scaling.type")
    if kind == "yarn":
        # gpt-oss's own config has truncate: false and betas 32/1; llama.cpp writes neither.
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": meta.float("rope.scaling.factor", 32.0),
            "original_max_position_embeddings": meta.int("rope.scaling.original_context_length", 4096),
            "beta_fast": meta.float("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": meta.float("rope.scaling.yarn_beta_slow", 1.0),
            "truncate": False,
        }
    elif kind not in (None, "none"):
        raise UnsupportedModelError(f"{meta.path}: gpt-oss GGUF rope.scaling.type={shown(kind)} is not supported")
    return out


GGUF = {
    "gpt-oss": GGUFArch(
        "gpt_oss",
        (1e-5, 150_000.0),
        gguf_config,
        names={
            "post_attention_norm": "post_attention_layernorm",
            "attn_sinks": "self_attn.sinks",
            "ffn_gate_inp": "mlp.router",
            **{k: f"mlp.experts.{v}" for k, v in EXPERT_NAMES.items()},
        },  # fmt: skip
    ),
}

SPECS = {
    "gpt_oss": ArchSpec(
        "gpt_oss",
        activation_keys=(),  # the experts' clamped SwiGLU is fixed; hidden_act is unused
        sliding="alternate",
        rope_types=frozenset({"default", "yarn"}),
        neutral={"attention_bias": True},
        native_quantization=frozenset({"mxfp4"}),  # the Hub's experts, run as MLX mxfp4 (convert_gpt_oss_weights)
        hf_class="GptOssForCausalLM",
        defaults=GPT_OSS_DEFAULTS,
        check_config=check_gpt_oss,
        mlx_sanitize=True,
        adapt=adapt,
    ),
}
