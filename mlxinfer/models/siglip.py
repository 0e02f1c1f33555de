"""SigLIP's vision transformer (transformers' SiglipVisionModel without its pooling head), in MLX.

Gemma 3's tower; SmolVLM / Idefics3 and PaliGemma use the same one. Patches are cut by a strided convolution,
given learned positions, run through pre-norm encoder layers with full (unmasked) attention, and normed once more.
SigLIP2's NaFlex tower (LFM2-VL's) reads a frame of any size: its patches go through a linear layer and its square
grid of learned positions is resized to the frame's patches (bilinear, antialiased), the same layers after that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ConfigError, UnsupportedModelError
from ..untrusted import shown
from .tower_weights import bounded_int

ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}
MAX_SIDE = 4096  # pixels: real towers read 224-896
MAX_WIDTH = 8192  # hidden and MLP sizes: SigLIP-so400m is 1152 / 4304
MAX_LAYERS = 64


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> SiglipConfig:
        """vision_config, checked: sizes bounded, the heads dividing the width, the patches tiling the image."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: vision_config must be an object, got {shown(raw)}")
        sizes = {"hidden_size": MAX_WIDTH, "intermediate_size": MAX_WIDTH, "num_hidden_layers": MAX_LAYERS,
                 "num_attention_heads": 256, "image_size": MAX_SIDE, "patch_size": MAX_SIDE}  # fmt: skip
        values = {key: bounded_int(raw.get(key), high, f"{source}: vision_config.{key}") for key, high in sizes.items()}
        config = cls(**values, layer_norm_eps=float(raw.get("layer_norm_eps", 1e-6)),
                     hidden_act=raw.get("hidden_act", "gelu_pytorch_tanh"))  # fmt: skip
        if raw.get("num_channels", 3) != 3:
            raise UnsupportedModelError(f"{source}: vision_config.num_channels must be 3 (RGB)")
        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"{source}: vision_config.hidden_act {shown(config.hidden_act)} is not supported"
            )
        if config.hidden_size % config.num_attention_heads or config.image_size % config.patch_size:
            raise ConfigError(f"{source}: vision_config's heads must divide hidden_size and patches tile image_size")
        if raw.get("vision_use_head"):
            raise UnsupportedModelError(f"{source}: a SigLIP tower with its pooling head is not supported")
        return config

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def activation_bytes(self, frames: int, dtype_size: int, patches: int | None = None) -> int:
        """The most the tower holds beyond its weights while `frames` frames (of `patches` patches; default: the
        image's) run through it together: one layer's attention scores and their softmax (float32, every head: what
        a CPU's attention materializes), about eight hidden-wide arrays a token (the residual, the norm, queries, keys,
        values, attention out, projections) and the MLP's two widest, for every frame. Measured on SmolVLM-256M's
        tower here: 129 MiB a frame, this 144."""
        n = self.patches_per_side**2 if patches is None else patches
        scores = 2 * self.num_attention_heads * n * n * 4
        per_token = (8 * self.hidden_size + 2 * self.intermediate_size) * dtype_size
        return frames * (scores + n * per_token)


class Embeddings(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, config.hidden_size, config.patch_size, stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        """(images, 3, H, W) channels first, as processors write them -> (images, patches, hidden)."""
        patches = self.patch_embedding(pixels.transpose(0, 2, 3, 1))  # MLX convolves channels last
        h = patches.reshape(patches.shape[0], -1, patches.shape[-1])
        return h + self.position_embedding.weight[None, : h.shape[1]]


class Attention(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        width, self.heads = config.hidden_size, config.num_attention_heads
        self.scale = (width // self.heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.out_proj = nn.Linear(width, width)

    def __call__(self, x: mx.array) -> mx.array:
        batch, length, width = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(batch, length, self.heads, -1).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.activation = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.activation(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.layers = [EncoderLayer(config) for _ in range(config.num_hidden_layers)]


class SiglipVisionTower(nn.Module):
    """pixel_values (images, 3, H, W) -> the last hidden states (images, patches, hidden), post-normed."""

    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        h = self.embeddings(pixels)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class NaflexEmbeddings(nn.Module):
    """Siglip2VisionEmbeddings: patches (each patch x patch x RGB, row by row) through a linear layer, plus the learned
    grid of positions (`patches_per_side` a side) resized to the frame's patches."""

    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.patch = config.patch_size
        self.patch_embedding = nn.Linear(3 * config.patch_size**2, config.hidden_size)
        self.position_embedding = nn.Embedding(config.patches_per_side**2, config.hidden_size)

    def __call__(self, pixels: mx.array) -> tuple[mx.array, int, int]:
        """(3, H, W) -> (patches, hidden), and the frame's rows and columns of patches."""
        p, (_, height, width) = self.patch, pixels.shape
        rows, cols = height // p, width // p
        patches = pixels.reshape(3, rows, p, cols, p).transpose(1, 3, 2, 4, 0).reshape(rows * cols, p * p * 3)
        return self.patch_embedding(patches) + self._positions(rows, cols), rows, cols

    def _positions(self, rows: int, cols: int) -> mx.array:
        """(rows * cols, hidden): the grid resized along each axis in turn (resizing is linear, so this is the
        two-axis resize transformers computes at once)."""
        table = self.position_embedding.weight
        side, width = math.isqrt(table.shape[0]), table.shape[1]
        by_row = mx.array(_antialiased(rows, side)) @ table.astype(mx.float32).reshape(side, side * width)
        grid = by_row.reshape(rows, side, width).swapaxes(1, 2) @ mx.array(_antialiased(cols, side)).T
        return grid.swapaxes(1, 2).reshape(rows * cols, width).astype(table.dtype)


def _antialiased(size: int, side: int) -> np.ndarray:
    """(size, side) weights resizing a `side`-long axis to `size` points: F.interpolate(mode="bilinear",
    align_corners=False, antialias=True), as Siglip2VisionEmbeddings.resize_positional_embeddings writes it out (in
    float32, as there): a triangle as wide as the step when shrinking, each row's weights summing to one."""
    scale = np.float32(side) / np.float32(size)
    support = max(scale, np.float32(1))
    center = (np.arange(size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    weights = np.clip(1 - np.abs(np.arange(side, dtype=np.float32)[None] - center[:, None]) / support, 0, None)
    return (weights / weights.sum(-1, keepdims=True)).astype(np.float32)


class NaflexTower(SiglipVisionTower):
    """SigLIP2's NaFlex tower without its head (Siglip2VisionModel): one frame (3, H, W), whole patches a side ->
    (rows, cols, hidden), post-normed. SigLIP's layers, NaFlex's embeddings."""

    def __init__(self, config: SiglipConfig):
        super().__init__(config)
        self.embeddings = NaflexEmbeddings(config)

    def __call__(self, pixels: mx.array) -> mx.array:
        h, rows, cols = self.embeddings(pixels)
        h = h[None]
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h[0]).reshape(rows, cols, -1)
