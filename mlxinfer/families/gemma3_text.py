"""Gemma 3: the text model (Gemma3ForCausalLM, also the text half of model_type "gemma3", see models/multimodal.py)
and the image half of Gemma3ForConditionalGeneration (a SigLIP tower and Gemma 3's projector).

mlx-lm picks each layer's RoPE base from sliding_window_pattern; transformers from layer_types, which may follow
any pattern: sliding layers rotate with rope_local_base_freq and no scaling, global ones with rope_theta and the
config's scaling.

An image is 4096 SigLIP patches (896 / 14 per side) average-pooled 4 x 4 into 256 embeddings, RMS-normed (1 + w)
and projected to the text width. Its 256 tokens attend to each other both ways (transformers' token_type_ids mask);
the text around them stays causal.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, UnsupportedModelError
from ..models.config import FULL, MAX_LAYERS, SLIDING, ModelConfig, rope_scaling, rope_section, rope_value
from ..models.decoder import DecoderLM
from ..models.gguf_arch import GGUFArch, Meta
from ..models.mlx_lm_modules import model_module
from ..models.multimodal import text_config
from ..models.registry import GEMMA, ArchSpec
from ..models.siglip import SiglipConfig, SiglipVisionTower
from ..models.tower_weights import renamed
from ..models.vision import ImageFormat, VisionModel, load_checked
from ..untrusted import is_int, shown


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


# ---- the image half (model_type "gemma3") ----
# Stored prefixes (transformers 4 and 5, mlx-vlm's) -> this module's names.
PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.",
    "vision_tower.vision_model.": "vision_tower.",
    "model.vision_tower.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# transformers' Gemma3Config defaults (google/gemma-3-4b-it states them all).
IMAGE_DEFAULTS = {"mm_tokens_per_image": 256, "image_token_index": 262_144, "boi_token_index": 255_999,
                  "eoi_token_index": 256_000}  # fmt: skip


class Projector(nn.Module):
    """Gemma3MultiModalProjector: pool the patch grid to tokens_per_side², norm, project to the text width."""

    def __init__(self, vision_width: int, text_width: int, pool: int, eps: float):
        super().__init__()
        self.mm_input_projection_weight = mx.zeros((vision_width, text_width))
        self.mm_soft_emb_norm = nn.RMSNorm(vision_width, eps=eps)
        self.pool = pool

    def __call__(self, patches: mx.array) -> mx.array:
        images, count, width = patches.shape
        side, k = math.isqrt(count), self.pool
        grid = patches.reshape(images, side // k, k, side // k, k, width)
        pooled = grid.mean(axis=(2, 4)).reshape(images, -1, width)
        norm = self.mm_soft_emb_norm  # Gemma's norms scale by 1 + w
        return mx.fast.rms_norm(pooled, 1.0 + norm.weight, norm.eps) @ self.mm_input_projection_weight


class Gemma3Vision(VisionModel):
    converts_whole = True  # mlx-lm's gemma3 module reads the wrapper's layout (and drops the image half)

    def __init__(self, tower: SiglipConfig, text_width: int, image_format: ImageFormat):
        super().__init__()
        self.vision_tower = SiglipVisionTower(tower)
        pool = tower.patches_per_side // math.isqrt(image_format.tokens_per_frame)
        self.multi_modal_projector = Projector(tower.hidden_size, text_width, pool, tower.layer_norm_eps)
        self.format = image_format

    def activation_bytes(self, frames: int) -> int:
        return self.vision_tower.config.activation_bytes(
            frames, self.multi_modal_projector.mm_input_projection_weight.dtype.size
        )

    def exported(self, name: str) -> str:
        # mlx-vlm's Gemma 3 nests the SigLIP model one level deeper (its tower keeps channels-last convolutions).
        tower = name.startswith("vision_tower.")
        return "vision_tower.vision_model." + name.removeprefix("vision_tower.") if tower else name

    def __call__(self, pixels: mx.array) -> mx.array:
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        return self.multi_modal_projector(self.vision_tower(pixels.astype(dtype)))


def vision(raw: dict[str, Any], weights: dict[str, mx.array], dtype: mx.Dtype, source: str) -> Gemma3Vision:
    """Gemma3ForConditionalGeneration's image half from its config.json and tensors."""
    tower = SiglipConfig.from_dict(raw.get("vision_config"), source)
    ids = {k: raw.get(k, raw.get(k.replace("_index", "_id"), v)) for k, v in IMAGE_DEFAULTS.items()}
    bad = next((k for k, v in ids.items() if not is_int(v) or v < 0), None)
    if bad is not None:
        raise ConfigError(f"{source}: {bad} must be a non-negative integer, got {shown(ids[bad])}")
    tokens = ids["mm_tokens_per_image"]
    side = math.isqrt(tokens)
    if side * side != tokens or not 0 < side <= tower.patches_per_side or tower.patches_per_side % side:
        raise ConfigError(
            f"{source}: mm_tokens_per_image {tokens} must be a square whose side divides the "
            f"{tower.patches_per_side} patches per side"
        )
    sequence = f"\n\n<start_of_image>{'<image_soft_token>' * tokens}<end_of_image>\n\n"  # Gemma3Processor's
    image_format = ImageFormat(
        placeholder="<start_of_image>",
        image_token_id=ids["image_token_index"],
        tokens_per_frame=tokens,
        bidirectional=True,
        expansion=lambda layout: _with_crops(sequence, layout.frames - 1),
    )
    model = Gemma3Vision(tower, text_config(raw, source)["hidden_size"], image_format)
    load_checked(
        model,
        renamed(weights, PREFIXES, "vision_tower.embeddings.patch_embedding.weight"),
        dtype,
        source,
        (raw.get("quantization") or {}).get("mode", "affine"),
    )
    return model


def _with_crops(sequence: str, crops: int) -> str:
    """Gemma3Processor.replace_image_token: an image's tokens, or with pan-and-scan crops (vision/pan_and_scan.py)
    the whole image's and then each crop's, introduced in words."""
    if not crops:
        return sequence
    return f"Here is the original image {sequence} and here are some crops to help you see better " + " ".join(
        [sequence] * crops
    )


VISION = {"gemma3": vision}
