"""Qwen's vision transformer (transformers' Qwen3_5VisionModel and Qwen3VLVisionModel), in MLX.

An image of any size (whole merged tokens a side) is cut into patches by a strided convolution; a learned square
grid of position embeddings is resampled (bilinear, corners aligned) to the image's grid and added; pre-norm blocks
attend over all patches, rotating queries and keys by each patch's row and column (2-D RoPE); a merger turns each
2 x 2 block of patches into one token of the text model's width. Qwen3-VL also merges the output of some blocks
(`deepstack`), which its text model adds to the image tokens' hidden states in its first layers.

transformers orders the patches merged block by merged block (the block's 2 x 2 patches together); so does this.
One image at a time: its patches attend to each other only, as transformers' per-image segments do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ConfigError, UnsupportedModelError
from ..untrusted import is_finite_number, is_int, shown
from .tower_weights import bounded_int
from .vision_attention import blocked_attention, rotated, scores_bytes

ACTIVATIONS = {"gelu": nn.gelu, "silu": nn.silu, "gelu_pytorch_tanh": nn.gelu_approx}
MAX_WIDTH = 8192  # hidden and MLP sizes: Qwen3-VL's tower is 1152 / 4304
MAX_LAYERS = 64
MAX_GRID = 4096  # positions a side of the learned grid (Qwen3-VL: 48)


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    grid_side: int  # the learned position grid's side (num_position_embeddings is its square)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0
    deepstack: tuple[int, ...] = ()  # blocks whose output is merged for the text model's first layers (Qwen3-VL)

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> QwenVisionConfig:
        """vision_config, checked: sizes bounded, the heads dividing the width into quarters RoPE can split."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: vision_config must be an object, got {shown(raw)}")
        where = f"{source}: vision_config"
        sizes = {"depth": MAX_LAYERS, "hidden_size": MAX_WIDTH, "intermediate_size": MAX_WIDTH, "num_heads": 256,
                 "patch_size": 1024, "spatial_merge_size": 8, "out_hidden_size": 65_536}  # fmt: skip
        values = {key: bounded_int(raw.get(key), high, f"{where}.{key}") for key, high in sizes.items()}
        positions = bounded_int(raw.get("num_position_embeddings"), MAX_GRID**2, f"{where}.num_position_embeddings")
        side = int(round(positions**0.5))
        if side * side != positions:
            raise ConfigError(f"{where}.num_position_embeddings must be a square, got {positions}")
        rope = raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", 10_000.0) if isinstance(rope, dict) else None
        if not is_finite_number(theta) or theta <= 1:
            raise ConfigError(f"{where}'s rope_theta must be a number above 1, got {shown(theta)}")
        act = raw.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"{where}.hidden_act {shown(act)} is not supported")
        if raw.get("in_channels", 3) != 3:
            raise UnsupportedModelError(f"{where}.in_channels must be 3 (RGB)")
        deepstack = raw.get("deepstack_visual_indexes") or []
        if not (isinstance(deepstack, list) and all(is_int(i) and 0 <= i < values["depth"] for i in deepstack)
                and len(set(deepstack)) == len(deepstack)):  # fmt: skip
            raise ConfigError(
                f"{where}.deepstack_visual_indexes must be distinct block indexes, got {shown(deepstack)}"
            )
        config = cls(**values, grid_side=side, hidden_act=act, rope_theta=float(theta), deepstack=tuple(deepstack))
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ConfigError(f"{where}'s heads must divide hidden_size into multiples of 4")
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def activation_bytes(self, patches: int, dtype_size: int) -> int:
        """The most the tower holds beyond its weights for an image of `patches` patches: one block of queries'
        attention scores and their softmax, about eight hidden-wide arrays a patch and the MLP's two widest
        (pixtral.PixtralConfig.activation_bytes's count)."""
        return (
            scores_bytes(self.num_heads, patches)
            + patches * (8 * self.hidden_size + 2 * self.intermediate_size) * dtype_size
        )


def _in_blocks(x: mx.array, rows: int, cols: int, merge: int) -> mx.array:
    """(rows, cols, ...) -> (rows * cols, ...), merged block by merged block (each block's patches row by row)."""
    rest = x.shape[2:]
    x = x.reshape(rows // merge, merge, cols // merge, merge, *rest).swapaxes(1, 2)
    return x.reshape(rows * cols, *rest)


def _taps(size: int, side: int) -> np.ndarray:
    """(size, side) weights resampling a `side`-long axis to `size` points, bilinear with corners aligned: what
    transformers' get_vision_interpolation_indices_and_weights computes, in float32 as there."""
    src = np.arange(size, dtype=np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    out = np.zeros((size, side), np.float32)
    for offset in (0, 1):
        tap = np.clip(floor + offset, 0, side - 1).astype(np.int64)
        np.add.at(out, (np.arange(size), tap), np.clip(1 - np.abs(src - floor - offset), 0, None))
    return out


class Attention(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        width, self.heads = config.hidden_size, config.num_heads
        self.scale = config.head_dim**-0.5
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        n, width = x.shape
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).transpose(1, 2, 0, 3)
        q, k = (rotated(t.astype(mx.float32), cos, sin).astype(x.dtype) for t in (q, k))
        return self.proj(blocked_attention(q, k, v, self.scale).transpose(1, 0, 2).reshape(n, width))


class MLP(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.activation = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, config: QwenVisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.mlp = MLP(config)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """Each merged block's patches (merge² in a row) -> one token of the text model's width. The main merger norms
    each patch first; deepstack's norm the concatenated block (use_postshuffle_norm)."""

    def __init__(self, config: QwenVisionConfig, after_shuffle: bool):
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.after_shuffle = after_shuffle
        self.norm = nn.LayerNorm(self.width if after_shuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, config.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x.reshape(-1, self.width)) if self.after_shuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class QwenVisionTower(nn.Module):
    """One image's pixel_values (3, H, W), whole merged tokens a side -> its tokens (rows * cols / merge², text
    width), merged block by merged block (row by row of tokens), and deepstack's merged features, one a listed
    block."""

    def __init__(self, config: QwenVisionConfig, temporal_patch: int):
        super().__init__()
        self.config = config
        p, width = config.patch_size, config.hidden_size
        # A still image's time steps are equal, so transformers' 3-D convolution is a 2-D one with its weights summed
        # over time; stored as MLX's Conv3d (out, time, kh, kw, in), as an mlx-vlm conversion writes it.
        self.patch_embed = {"proj": nn.Conv3d(3, width, (temporal_patch, p, p), stride=(temporal_patch, p, p))}
        self.pos_embed = nn.Embedding(config.grid_side**2, width)
        self.blocks = [Block(config) for _ in range(config.depth)]
        self.merger = Merger(config, after_shuffle=False)
        self.deepstack_merger_list = [Merger(config, after_shuffle=True) for _ in config.deepstack]

    def __call__(self, pixels: mx.array) -> tuple[mx.array, list[mx.array]]:
        c = self.config
        proj = self.patch_embed["proj"]
        patches = mx.conv2d(pixels.transpose(1, 2, 0)[None], proj.weight.sum(axis=1), stride=c.patch_size)[0]
        rows, cols, _ = patches.shape
        h = _in_blocks(patches + proj.bias + self._positions(rows, cols), rows, cols, c.spatial_merge_size)
        cos, sin = self._rope(rows, cols)
        deep = []
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin)
            if i in c.deepstack:
                deep.append(self.deepstack_merger_list[c.deepstack.index(i)](h))
        return self.merger(h), deep

    def _positions(self, rows: int, cols: int) -> mx.array:
        """(rows, cols, hidden): the learned grid resampled to the image's patches."""
        side, width = self.config.grid_side, self.config.hidden_size
        table = self.pos_embed.weight.astype(mx.float32)
        by_row = mx.array(_taps(rows, side)) @ table.reshape(side, side * width)  # (rows, side * width)
        grid = by_row.reshape(rows, side, width).swapaxes(1, 2) @ mx.array(_taps(cols, side)).T  # (rows, width, cols)
        return grid.swapaxes(1, 2).astype(self.pos_embed.weight.dtype)

    def _rope(self, rows: int, cols: int) -> tuple[mx.array, mx.array]:
        """cos and sin (patches, head_dim): the first half of the frequencies turn with the row, the second with
        the column, each over a quarter of the head, the halves repeated (Qwen3_5VisionRotaryEmbedding)."""
        quarter = self.config.head_dim // 2
        freqs = 1.0 / (self.config.rope_theta ** (mx.arange(0, quarter, 2, dtype=mx.float32) / quarter))
        r = mx.broadcast_to(mx.arange(rows, dtype=mx.float32)[:, None, None], (rows, cols, 1))
        c = mx.broadcast_to(mx.arange(cols, dtype=mx.float32)[None, :, None], (rows, cols, 1))
        angles = _in_blocks(mx.concatenate([r * freqs, c * freqs], axis=-1), rows, cols, self.config.spatial_merge_size)
        return tuple(mx.concatenate([f(angles)] * 2, axis=-1) for f in (mx.cos, mx.sin))  # type: ignore[return-value]
