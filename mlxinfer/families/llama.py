"""Llama (LlamaForCausalLM) and Mistral (MistralForCausalLM, llama blocks whose every layer slides when
sliding_window is set): mlx-lm's llama module computes what transformers does for both; no adapter. Their GGUF
files (llama.cpp writes both as "llama") store Q/K rows permuted, which models/gguf.py undoes.

SmolVLM (SmolVLMForConditionalGeneration, model_type "smolvlm"; its v1 checkpoints are Idefics3ForConditionalGeneration,
"idefics3", the same model and processor) is a llama text model with a SigLIP tower: each
frame (a tile of the image, or the whole image shrunk to one tile) gives (side / patch)² patches, pixel-shuffled by
scale_factor into fewer, wider ones and projected to the text width. Its prompt spells out the tiles (see
`_expansion`); its attention stays causal."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from ..models.gguf_arch import GGUFArch, Meta
from ..models.multimodal import text_config
from ..models.registry import ArchSpec
from ..models.siglip import SiglipConfig, SiglipVisionTower, renamed
from ..models.vision import ImageFormat, Layout, VisionModel, load_checked
from ..untrusted import is_int, shown


def gguf_config(meta: Meta) -> dict[str, Any]:
    heads, hidden = meta.int("attention.head_count"), meta.int("embedding_length")
    out: dict[str, Any] = {"head_dim": meta.int("rope.dimension_count", hidden // heads)}
    # Llama's biases are switched on by config flags, which GGUF has no key for: the tensors tell.
    out["attention_bias"] = "blk.0.attn_q.bias" in meta.tensors
    out["mlp_bias"] = "blk.0.ffn_down.bias" in meta.tensors
    window = meta.int("attention.sliding_window", None)
    if window is not None:  # a Mistral that keeps its window: transformers' mistral applies it, llama would not
        out.update(model_type="mistral", sliding_window=window)
    return out


GGUF = {"llama": GGUFArch("llama", (1e-5, 10_000.0), gguf_config, permutes_qk=True)}


SPECS = {
    "llama": ArchSpec("llama", neutral={"pretraining_tp": 1}, hf_class="LlamaForCausalLM"),
    "mistral": ArchSpec("llama", sliding="all", hf_class="MistralForCausalLM"),
}


# ---- SmolVLM's image half (model_type "smolvlm") ----
# Stored prefixes (transformers', mlx-vlm's) -> this module's names.
PREFIXES = {"model.vision_model.": "vision_model.", "vision_model.": "vision_model.",
            "model.connector.": "connector.", "connector.": "connector."}  # fmt: skip


class Connector(nn.Module):
    """SmolVLMConnector: pixel shuffle (scale x scale neighbouring patches side by side), then one projection."""

    def __init__(self, vision_width: int, text_width: int, scale: int):
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vision_width * scale * scale, text_width, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        frames, count, width = x.shape
        side, s = math.isqrt(count), self.scale
        x = x.reshape(frames, side, side // s, width * s).transpose(0, 2, 1, 3)
        x = x.reshape(frames, side // s, side // s, width * s * s).transpose(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(frames, count // (s * s), width * s * s))


class SmolVLMVision(VisionModel):
    def __init__(self, tower: SiglipConfig, text_width: int, scale: int, image_format: ImageFormat):
        super().__init__()
        self.vision_model = SiglipVisionTower(tower)
        self.connector = Connector(tower.hidden_size, text_width, scale)
        self.format = image_format

    def activation_bytes(self, frames: int) -> int:
        return self.vision_model.config.activation_bytes(
            frames, self.connector.modality_projection.proj.weight.dtype.size
        )

    def __call__(self, pixels: mx.array) -> mx.array:
        dtype = self.connector.modality_projection.proj.weight.dtype
        return self.connector(self.vision_model(pixels.astype(dtype)))


def _expansion(tokens: int) -> Callable[[Layout], str]:
    """SmolVLMProcessor's image text: each tile marked by its row and column, then the whole image."""
    frame = "<image>" * tokens
    whole = f"<fake_token_around_image><global-img>{frame}<fake_token_around_image>"

    def expansion(layout: Layout) -> str:
        if not layout.rows:
            return whole
        rows = (
            "".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{frame}" for c in range(layout.cols)) + "\n"
            for r in range(layout.rows)
        )
        return "".join(rows) + "\n" + whole

    return expansion


def vision(raw: dict[str, Any], weights: dict[str, mx.array], dtype: mx.Dtype, source: str) -> SmolVLMVision:
    """SmolVLMForConditionalGeneration's (or Idefics3's) image half from its config.json and tensors."""
    tower = SiglipConfig.from_dict(raw.get("vision_config"), source)
    scale, token = raw.get("scale_factor", 2), raw.get("image_token_id")
    if not is_int(scale) or scale < 1 or tower.patches_per_side % scale:
        raise ConfigError(f"{source}: scale_factor must be a positive integer dividing the {tower.patches_per_side} "
                          f"patches per side, got {shown(scale)}")  # fmt: skip
    if not is_int(token) or token < 0:
        raise ConfigError(f"{source}: image_token_id must be a non-negative integer, got {shown(token)}")
    tokens = (tower.patches_per_side // scale) ** 2
    image_format = ImageFormat("<image>", token, tokens, bidirectional=False, expansion=_expansion(tokens))
    model = SmolVLMVision(tower, text_config(raw, source)["hidden_size"], scale, image_format)
    load_checked(
        model,
        renamed(weights, PREFIXES, "vision_model."),
        dtype,
        source,
        (raw.get("quantization") or {}).get("mode", "affine"),
    )
    return model


VISION = {"smolvlm": vision, "idefics3": vision}
