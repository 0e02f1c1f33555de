"""LFM2 (Lfm2ForCausalLM): attention layers between short-convolution ones, each conv layer a fixed-size state.

mlx-lm's module computes what transformers does; its sanitize brings the conv weights into MLX's layout. LFM2-VL
(lfm2_vl) holds this text model; its image half is at the end of this file."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, UnsupportedModelError
from ..models.multimodal import text_config
from ..models.registry import ArchSpec
from ..models.siglip import ACTIVATIONS, NaflexTower, SiglipConfig
from ..models.tower_weights import bounded_int, renamed
from ..models.vision import ImageFormat, VisionModel, load_checked
from ..untrusted import is_int, shown
from ..vision import Layout, Processor, TileProcessor

SPECS = {
    "lfm2": ArchSpec(
        "lfm2",
        activation_keys=(),
        sliding="declared",
        recurrent_kinds=frozenset({"conv"}),
        final_norm="embedding_norm",
        renamed={"block_dim": "hidden_size"},
        mlx_sanitize=True,
        tied_by_default=True,
        neutral={"conv_bias": False},
        hf_class="Lfm2ForCausalLM",
    ),
}


# ---- Images (LFM2-VL): SigLIP2's NaFlex tower, a pixel-unshuffle projector. Reference: modeling_lfm2_vl.py ----


class Projector(nn.Module):
    """Lfm2VlMultiModalProjector: each merge x merge block of patches (row by row, each patch's features whole) as
    one vector, layer-normed, through two linear layers around an activation."""

    def __init__(self, width: int, text_width: int, hidden: int, merge: int, bias: bool, norm: bool, act: str):
        super().__init__()
        self.merge = merge
        if norm:
            self.layer_norm = nn.LayerNorm(width * merge * merge)
        self.linear_1 = nn.Linear(width * merge * merge, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, text_width, bias=bias)
        self.activation = ACTIVATIONS[act]

    def __call__(self, x: mx.array) -> mx.array:
        """(rows, cols, width) patches -> (rows * cols / merge², text width) tokens, row by row."""
        rows, cols, width = x.shape
        m = self.merge
        blocks = x.reshape(rows // m, m, cols // m, m, width).swapaxes(1, 2).reshape(-1, m * m * width)
        if "layer_norm" in self:
            blocks = self.layer_norm(blocks)
        return self.linear_2(self.activation(self.linear_1(blocks)))


class Lfm2VlVision(VisionModel):
    def __init__(self, tower: SiglipConfig, projector: Projector, image_format: ImageFormat):
        super().__init__()
        self.vision_tower = NaflexTower(tower)
        self.multi_modal_projector = projector
        self.format = image_format

    def fitted(self, processor: Processor) -> Processor:
        """Lfm2VlImageProcessor, its patches the tower's and its merged blocks the projector's; the format then spells
        out its tiles, and allows its largest frame's tokens."""
        config, merge = self.vision_tower.config, self.multi_modal_projector.merge
        if not isinstance(processor, TileProcessor):
            raise UnsupportedModelError(f"LFM2-VL reads images with Lfm2VlImageProcessor, not {processor!r}")
        if (processor.patch, processor.merge) != (config.patch_size, merge):
            raise ConfigError(
                f"preprocessor_config.json: encoder_patch_size {processor.patch} and downsample_factor "
                f"{processor.merge} must be config.json's vision_config.patch_size {config.patch_size} and "
                f"downsample_factor {merge}"
            )
        tile = processor.tile_tokens
        self.format = replace(self.format, tokens_per_frame=max(tile, processor.max_tokens),
                              expansion=partial(_expansion, tile), frame_runs=partial(_runs, tile))  # fmt: skip
        return processor

    def activation_bytes(self, frames: int) -> int:
        patches = self.format.tokens_per_frame * self.multi_modal_projector.merge**2
        return self.vision_tower.config.activation_bytes(frames, self._dtype.size, patches)

    @property
    def _dtype(self) -> mx.Dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    def __call__(self, pixels: mx.array) -> mx.array:
        """One frame's pixel_values (1, 3, H, W) -> (1, tokens, text hidden), tokens row by row."""
        return self.multi_modal_projector(self.vision_tower(pixels[0].astype(self._dtype)))[None]


def _expansion(tile_tokens: int, layout: Layout) -> str:
    """Lfm2VlProcessor._build_image_tokens: each tile's tokens after its row-and-column marker, then the whole image's
    after <|img_thumbnail|>; an image not cut is its tokens alone. Between <|image_start|> and <|image_end|>."""
    whole = "<image>" * math.prod(layout.grid or (0, 0))
    if not layout.rows:
        return f"<|image_start|>{whole}<|image_end|>"
    tiles = "".join(f"<|img_row_{r + 1}_col_{c + 1}|>" + "<image>" * tile_tokens for r in range(layout.rows)
                    for c in range(layout.cols))  # fmt: skip
    return f"<|image_start|>{tiles}<|img_thumbnail|>{whole}<|image_end|>"


def _runs(tile_tokens: int, layout: Layout) -> list[tuple[int, ...]]:
    return [(tile_tokens,)] * (layout.rows * layout.cols) + [(math.prod(layout.grid or (0, 0)),)]


PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.",  # transformers 4's Siglip2VisionModel nests one level more
    "model.vision_tower.": "vision_tower.",
    "vision_tower.vision_model.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}


def vision(raw: dict[str, Any], weights: dict[str, mx.array], dtype: mx.Dtype, source: str) -> Lfm2VlVision:
    """Lfm2VlForConditionalGeneration's image half from its config.json and tensors (the tower's pooling head, which
    LFM2-VL never runs, is not read)."""
    config = raw.get("vision_config")
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: vision_config must be an object, got {shown(config)}")
    positions = config.get("num_patches", 256)  # the learned grid of positions: 16 x 16 in every LFM2-VL
    side = math.isqrt(positions) if is_int(positions) and 0 < positions <= 256**2 else 0
    if side * side != positions:
        raise ConfigError(f"{source}: vision_config.num_patches must be a square up to 256², got {shown(positions)}")
    patch = bounded_int(config.get("patch_size", 16), 64, f"{source}: vision_config.patch_size")
    # SigLIP's checks read the grid as an image: side patches of `patch` pixels (NaFlex resizes it to each frame).
    tower = SiglipConfig.from_dict({**config, "vision_use_head": False, "image_size": side * patch}, source)
    merge, hidden = raw.get("downsample_factor", 2), raw.get("projector_hidden_size", 2560)
    token, act = raw.get("image_token_id", raw.get("image_token_index", 396)), raw.get("projector_hidden_act", "gelu")
    for value, key, low, high in ((merge, "downsample_factor", 1, 8), (hidden, "projector_hidden_size", 1, 65_536),
                                  (token, "image_token_id", 0, 1 << 31)):  # fmt: skip
        if not is_int(value) or not low <= value <= high:
            raise ConfigError(f"{source}: {key} must be an integer in [{low}, {high}], got {shown(value)}")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{source}: projector_hidden_act {shown(act)} is not supported")
    bias, norm = bool(raw.get("projector_bias", True)), bool(raw.get("projector_use_layernorm", True))
    projector = Projector(tower.hidden_size, text_config(raw, source)["hidden_size"], hidden, merge, bias, norm, act)
    # expansion and runs come with the processor (fitted): its tiles' size decides them
    image_format = ImageFormat("<image>", token, 1, bidirectional=False, expansion=partial(_expansion, 0),
                               frame_runs=partial(_runs, 0))  # fmt: skip
    model = Lfm2VlVision(tower, projector, image_format)
    kept = {k: v for k, v in renamed(weights, PREFIXES, "").items() if not k.startswith("vision_tower.head.")}
    load_checked(model, kept, dtype, source, (raw.get("quantization") or {}).get("mode", "affine"))
    return model


VISION = {"lfm2_vl": vision, "lfm2-vl": vision}
