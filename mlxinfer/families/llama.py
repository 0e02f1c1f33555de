"""Llama (LlamaForCausalLM) and Mistral (MistralForCausalLM, llama blocks whose every layer slides when
sliding_window is set): mlx-lm's llama module computes what transformers does for both; no adapter. Their GGUF
files (llama.cpp writes both as "llama") store Q/K rows permuted, which models/gguf.py undoes.

SmolVLM (SmolVLMForConditionalGeneration, model_type "smolvlm"; its v1 checkpoints are Idefics3ForConditionalGeneration,
"idefics3", the same model and processor) is a llama text model with a SigLIP tower: each
frame (a tile of the image, or the whole image shrunk to one tile) gives (side / patch)² patches, pixel-shuffled by
scale_factor into fewer, wider ones and projected to the text width. Its prompt spells out the tiles (see
`_expansion`); its attention stays causal.

Mistral 3 (Mistral3ForConditionalGeneration, "mistral3") is a mistral (or ministral3) text model with a Pixtral
tower (models/pixtral.py): an image keeps its shape, up to the processor's longest edge, as one frame of whole
merged patches; its projector RMS-norms the patches, merges each 2 x 2 into one and projects it to the text width.
Its prompt holds the image row by row, each row of [IMG] tokens ended by [IMG_BREAK] and the last by [IMG_END]."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, UnsupportedModelError
from ..models.gguf_arch import GGUFArch, Meta
from ..models.multimodal import text_config
from ..models.pixtral import ACTIVATIONS, PixtralConfig, PixtralVisionTower
from ..models.registry import ArchSpec
from ..models.siglip import SiglipConfig, SiglipVisionTower
from ..models.tower_weights import renamed
from ..models.vision import ImageFormat, Layout, VisionModel, load_checked
from ..untrusted import is_int, shown
from ..vision import PatchProcessor, Processor


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
        renamed(weights, PREFIXES, "vision_model.embeddings.patch_embedding.weight"),
        dtype,
        source,
        (raw.get("quantization") or {}).get("mode", "affine"),
    )
    return model


# ---- Mistral 3's image half (model_type "mistral3") ----
MISTRAL3_PREFIXES = {"vision_tower.vision_model.": "vision_tower.",  # mlx-vlm's (what `convert` writes)
                     "model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
                     "model.multi_modal_projector.": "multi_modal_projector.",
                     "multi_modal_projector.": "multi_modal_projector."}  # fmt: skip


class PatchMerger(nn.Module):
    """Mistral3PatchMerger: each merge x merge block of patches side by side (torch's unfold order: channel, then the
    block's row, then its column), projected back to one patch's width."""

    def __init__(self, width: int, merge: int):
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(width * merge * merge, width, bias=False)

    def __call__(self, x: mx.array, rows: int, cols: int) -> mx.array:
        s, width = self.merge, x.shape[-1]
        blocks = x.reshape(rows // s, s, cols // s, s, width).transpose(0, 2, 4, 1, 3)
        return self.merging_layer(blocks.reshape(-1, width * s * s))


class Projector(nn.Module):
    """Mistral3MultiModalProjector: RMS norm, patch merger, linear, activation, linear."""

    def __init__(self, width: int, text_width: int, merge: int, bias: bool, act: str, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=eps)
        self.patch_merger = PatchMerger(width, merge)
        self.linear_1 = nn.Linear(width, text_width, bias=bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)
        self.activation = ACTIVATIONS[act]

    def __call__(self, x: mx.array, rows: int, cols: int) -> mx.array:
        x = self.patch_merger(self.norm(x), rows, cols)
        return self.linear_2(self.activation(self.linear_1(x)))


class Mistral3Vision(VisionModel):
    converts_whole = True  # mlx-lm's mistral3 module reads the wrapper's layout (and drops the image half)

    def __init__(self, tower: PixtralConfig, projector: Projector, layers: int, image_format: ImageFormat):
        super().__init__()
        self.vision_tower = PixtralVisionTower(tower)
        self.multi_modal_projector = projector
        self.read_after = layers  # the tower layers whose output the projector reads (vision_feature_layer)
        self.format = image_format

    def fitted(self, processor: Processor) -> Processor:
        """PixtralProcessor's sizing: the image's sides in whole merged patches, each a token."""
        if not isinstance(processor, PatchProcessor):
            raise UnsupportedModelError(f"Mistral 3 reads images with PixtralImageProcessor, not {processor!r}")
        merge = self.multi_modal_projector.patch_merger.merge
        fitted = replace(processor, patch=self.vision_tower.config.patch_size * merge)
        if fitted.most_tokens > self.format.tokens_per_frame:
            raise ConfigError(
                f"preprocessor_config.json: size.longest_edge {processor.longest_edge} gives images of up to "
                f"{fitted.most_tokens} tokens; config.json's vision_config.image_size allows "
                f"{self.format.tokens_per_frame}"
            )
        return fitted

    def exported(self, name: str) -> str:
        # mlx-vlm's Mistral 3 nests the Pixtral model one level deeper (as its Gemma 3 does SigLIP).
        tower = name.startswith("vision_tower.")
        return "vision_tower.vision_model." + name.removeprefix("vision_tower.") if tower else name

    def activation_bytes(self, frames: int) -> int:
        patches = self.format.tokens_per_frame * self.multi_modal_projector.patch_merger.merge**2
        return frames * self.vision_tower.config.activation_bytes(patches, self._dtype.size)

    @property
    def _dtype(self) -> mx.Dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    def __call__(self, pixels: mx.array) -> mx.array:
        """One image's pixel_values (1, 3, H, W) -> (1, tokens, text hidden), tokens row by row."""
        patch = self.vision_tower.config.patch_size
        rows, cols = pixels.shape[2] // patch, pixels.shape[3] // patch
        h = self.vision_tower(pixels[0].astype(self._dtype), self.read_after)
        return self.multi_modal_projector(h, rows, cols)[None]


def _rows_of_tokens(layout: Layout) -> tuple[int, int]:
    if layout.grid is None:
        raise ConfigError("Mistral 3 sizes images by their content; its processor must give a grid of tokens")
    return layout.grid


def _mistral3_expansion(layout: Layout) -> str:
    """PixtralProcessor.replace_image_token: each row of [IMG] ends with [IMG_BREAK], the last with [IMG_END]."""
    rows, cols = _rows_of_tokens(layout)
    return ("[IMG]" * cols + "[IMG_BREAK]") * (rows - 1) + "[IMG]" * cols + "[IMG_END]"


def _mistral3_runs(layout: Layout) -> list[tuple[int, ...]]:
    """The one frame's runs of [IMG]: one a row, the breaks between them text."""
    rows, cols = _rows_of_tokens(layout)
    return [(cols,) * rows]


def mistral3_vision(raw: dict[str, Any], weights: dict[str, mx.array], dtype: mx.Dtype, source: str) -> Mistral3Vision:
    """Mistral3ForConditionalGeneration's image half from its config.json and tensors."""
    tower = PixtralConfig.from_dict(raw.get("vision_config"), source)
    merge, token = raw.get("spatial_merge_size", 2), raw.get("image_token_index", raw.get("image_token_id", 10))
    layer, act = raw.get("vision_feature_layer", -1), raw.get("projector_hidden_act", "gelu")
    side = (raw.get("vision_config") or {}).get("image_size", 1540)
    if not is_int(merge) or not 1 <= merge <= 8:
        raise ConfigError(f"{source}: spatial_merge_size must be an integer in [1, 8], got {shown(merge)}")
    if not is_int(token) or token < 0:
        raise ConfigError(f"{source}: image_token_index must be a non-negative integer, got {shown(token)}")
    if not is_int(layer) or not -tower.num_hidden_layers - 1 <= layer <= tower.num_hidden_layers:
        raise UnsupportedModelError(f"{source}: vision_feature_layer must be one layer's index, got {shown(layer)}")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{source}: projector_hidden_act {shown(act)} is not supported")
    if not is_int(side) or side < 1:
        raise ConfigError(f"{source}: vision_config.image_size must be a positive integer, got {shown(side)}")
    most = math.ceil(side / (tower.patch_size * merge)) ** 2
    image_format = ImageFormat("[IMG]", token, most, bidirectional=False, expansion=_mistral3_expansion,
                               frame_runs=_mistral3_runs)  # fmt: skip
    text = text_config(raw, source)
    projector = Projector(tower.hidden_size, text["hidden_size"], merge, bool(raw.get("multimodal_projector_bias")),
                          act, float(text.get("rms_norm_eps", 1e-5)))  # fmt: skip
    model = Mistral3Vision(tower, projector, layer % (tower.num_hidden_layers + 1), image_format)
    load_checked(
        model,
        renamed(weights, MISTRAL3_PREFIXES, "vision_tower.patch_conv.weight"),
        dtype,
        source,
        (raw.get("quantization") or {}).get("mode", "affine"),
    )
    return model


VISION = {"smolvlm": vision, "idefics3": vision, "mistral3": mistral3_vision}
