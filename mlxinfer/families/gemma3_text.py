"""Gemma 3's text model (Gemma3ForCausalLM; also the text half of model_type "gemma3", see models/multimodal.py).

mlx-lm picks each layer's RoPE base from sliding_window_pattern; transformers from layer_types, which may follow
any pattern: sliding layers rotate with rope_local_base_freq and no scaling, global ones with rope_theta and the
config's scaling.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModelError
from ..models.config import FULL, MAX_LAYERS, SLIDING, ModelConfig, rope_scaling, rope_section, rope_value
from ..models.decoder import DecoderLM
from ..models.gguf_arch import GGUFArch, Meta
from ..models.mlx_lm_modules import model_module
from ..models.registry import GEMMA, ArchSpec


def rope_args(args: dict[str, Any], source: str, spec: ArchSpec) -> dict[str, Any]:
    """mlx-lm's keys from either form: rope_theta, rope_local_base_freq and rope_scaling at the top level, or
    transformers 5's rope_parameters with a section per layer type (the sliding one unscaled)."""
    params = args.get("rope_parameters")
    nested = isinstance(params, dict) and FULL in params
    full = rope_section(params, FULL, source) if nested else (params or {})
    local = rope_section(params, SLIDING, source) if nested else {}
    out: dict[str, Any] = {}
    out["rope_theta"] = rope_value(full, "rope_theta", args.get("rope_theta", 1_000_000.0), source, FULL)
    base = args.get("rope_local_base_freq", 10_000.0)
    out["rope_local_base_freq"] = rope_value(local, "rope_theta", base, source, SLIDING)
    out["rope_scaling"] = rope_scaling(full, source, spec)
    if not nested and args.get("rope_scaling"):
        out["rope_scaling"] = rope_scaling(args["rope_scaling"], source, spec)
    if rope_scaling(local, source, spec) is not None:
        raise UnsupportedModelError(f"{source}: rope scaling on sliding layers is not supported")
    return out


def adapt(model: DecoderLM, config: ModelConfig) -> None:
    initialize_rope = model_module("rope_utils").initialize_rope
    args = config.args
    for layer, kind in zip(model.layers, config.layer_types):
        attn = layer.self_attn
        if kind == SLIDING:
            attn.rope = initialize_rope(attn.head_dim, base=args["rope_local_base_freq"], traditional=False)
        else:
            attn.rope = initialize_rope(
                attn.head_dim,
                base=args["rope_theta"],
                traditional=False,
                scaling_config=args.get("rope_scaling"),
                max_position_embeddings=args.get("max_position_embeddings"),
            )


def mlx_lm_form(config: ModelConfig) -> dict[str, Any]:
    """mlx-lm places global layers by a period only (`sliding_window_pattern`); transformers reads layer_types."""
    period = _global_period(config.layer_types)
    return {"sliding_window_pattern": period} if period else {}


def _global_period(layer_types: tuple[str, ...]) -> int | None:
    """N when every Nth layer (and only it) is global, as mlx-lm's `sliding_window_pattern` says; else None."""
    n = next((i + 1 for i, kind in enumerate(layer_types) if kind == FULL), len(layer_types))
    expected = tuple(FULL if (i + 1) % n == 0 else SLIDING for i in range(len(layer_types)))
    return n if expected == layer_types else None


SPECS = {
    "gemma3_text": ArchSpec(
        "gemma3_text",
        mlx_lm_form=mlx_lm_form,
        sliding="pattern",
        neutral={"attn_logit_softcapping": None, "final_logit_softcapping": None},
        rope_args=rope_args,
        hf_class="Gemma3ForCausalLM",
        adapt=adapt,
        **GEMMA,
    ),
}


def gguf_config(meta: Meta) -> dict[str, Any]:
    layers, head_dim = meta.int("block_count", high=MAX_LAYERS), meta.int("attention.key_length", 256)
    hidden, heads = meta.int("embedding_length"), meta.int("attention.head_count")
    window = meta.int("attention.sliding_window", None)
    # llama.cpp fixes every 6th layer global (set_swa_pattern(6)) unless the file says otherwise.
    every = meta.int("attention.sliding_window_pattern", 6, high=MAX_LAYERS)
    types = [SLIDING if window is not None and (i + 1) % every else FULL for i in range(layers)]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": window,
        # llama.cpp's f_attention_scale: 1/sqrt(head_dim), but hidden/heads for the 62-layer 27B model.
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        # llama.cpp hard-codes 10000 for the sliding layers; newer files write it.
        "rope_local_base_freq": meta.float("rope.freq_base_swa", 10_000.0),
        "final_logit_softcapping": meta.float("final_logit_softcapping", None),
        "attn_logit_softcapping": meta.float("attn_logit_softcapping", None),
    }
    return out


# llama.cpp's "gemma3": its norms are stored as 1 + w (Gemma3Model.norm_shift), which models/gguf.py undoes.
GGUF = {
    "gemma3": GGUFArch(
        "gemma3_text",
        (1e-6, 1_000_000.0),
        gguf_config,
        names={
            "ffn_norm": "pre_feedforward_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },  # fmt: skip
        norm_shift=1.0,
    ),
}
