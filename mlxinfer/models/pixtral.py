"""Pixtral's vision transformer (transformers' PixtralVisionModel), in MLX: Mistral 3's tower.

An image of any size (whole patches a side) is cut into patches by a strided convolution, RMS-normed, and run through
pre-norm layers whose attention rotates queries and keys by each patch's row and column (2-D axial RoPE, no learned
positions) and whose MLP is gated. One image at a time: transformers' block mask between images is then no mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, UnsupportedModelError
from ..untrusted import is_finite_number, shown
from .tower_weights import bounded_int
from .vision_attention import blocked_attention, rotated, scores_bytes

ACTIVATIONS = {"gelu": nn.gelu, "silu": nn.silu, "gelu_pytorch_tanh": nn.gelu_approx}
MAX_WIDTH = 8192  # hidden and MLP sizes: Mistral Small 3's tower is 1024 / 4096
MAX_LAYERS = 64


@dataclass(frozen=True)
class PixtralConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    rope_theta: float = 10_000.0
    hidden_act: str = "gelu"

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> PixtralConfig:
        """vision_config, checked: sizes bounded, the heads dividing the width into quarters RoPE can split."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: vision_config must be an object, got {shown(raw)}")
        sizes = {"hidden_size": MAX_WIDTH, "intermediate_size": MAX_WIDTH, "num_hidden_layers": MAX_LAYERS,
                 "num_attention_heads": 256, "patch_size": 1024}  # fmt: skip
        values = {key: bounded_int(raw.get(key), high, f"{source}: vision_config.{key}") for key, high in sizes.items()}
        rope = raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10_000.0)) if isinstance(rope, dict) else None
        if not is_finite_number(theta) or theta <= 1:
            raise ConfigError(f"{source}: vision_config's rope_theta must be a number above 1, got {shown(theta)}")
        config = cls(**values, rope_theta=float(theta), hidden_act=raw.get("hidden_act", "gelu"))
        if raw.get("num_channels", 3) != 3:
            raise UnsupportedModelError(f"{source}: vision_config.num_channels must be 3 (RGB)")
        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"{source}: vision_config.hidden_act {shown(config.hidden_act)} is not supported"
            )
        if config.hidden_size % config.num_attention_heads or config.head_dim % 4:
            raise ConfigError(f"{source}: vision_config's heads must divide hidden_size into multiples of 4")
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def activation_bytes(self, patches: int, dtype_size: int) -> int:
        """The most the tower holds beyond its weights for an image of `patches` patches: one block of queries'
        attention scores and their softmax (vision_attention.py), about eight hidden-wide arrays a patch and the
        gated MLP's three widest (siglip.SiglipConfig.activation_bytes's count, with the queries in blocks)."""
        return (
            scores_bytes(self.num_attention_heads, patches)
            + patches * (8 * self.hidden_size + 3 * self.intermediate_size) * dtype_size
        )


def rope_angles(config: PixtralConfig, rows: int, cols: int) -> mx.array:
    """(rows * cols, head_dim / 2) angles, patches row by row: the even frequencies turn with the row, the odd with the
    column (PixtralVisionRotaryEmbedding)."""
    dim = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
    r, c = mx.arange(rows, dtype=mx.float32), mx.arange(cols, dtype=mx.float32)
    by_row = mx.broadcast_to((r[:, None] * freqs[None, ::2])[:, None, :], (rows, cols, dim // 4))
    by_col = mx.broadcast_to((c[:, None] * freqs[None, 1::2])[None, :, :], (rows, cols, dim // 4))
    return mx.concatenate([by_row, by_col], axis=-1).reshape(rows * cols, dim // 2)


class Attention(nn.Module):
    def __init__(self, config: PixtralConfig):
        super().__init__()
        width, self.heads = config.hidden_size, config.num_attention_heads
        self.scale = config.head_dim**-0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False) for _ in range(4))

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        n, width = x.shape

        def heads(t: mx.array) -> mx.array:
            return t.reshape(n, self.heads, -1).transpose(1, 0, 2)

        q = rotated(heads(self.q_proj(x)), cos, sin).astype(x.dtype)
        k = rotated(heads(self.k_proj(x)), cos, sin).astype(x.dtype)
        out = blocked_attention(q, k, heads(self.v_proj(x)), self.scale)
        return self.o_proj(out.transpose(1, 0, 2).reshape(n, width))


class MLP(nn.Module):
    def __init__(self, config: PixtralConfig):
        super().__init__()
        width, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)
        self.activation = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: PixtralConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=1e-5)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=1e-5)
        self.feed_forward = MLP(config)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: PixtralConfig):
        super().__init__()
        self.layers = [Layer(config) for _ in range(config.num_hidden_layers)]


class PixtralVisionTower(nn.Module):
    """One image's pixel_values (3, H, W), whole patches a side -> its patches' hidden states (rows * cols, hidden),
    row by row, after `layers` layers (all of them unless fewer are asked for: Mistral 3 may read an earlier one)."""

    def __init__(self, config: PixtralConfig):
        super().__init__()
        self.config = config
        self.patch_conv = nn.Conv2d(3, config.hidden_size, config.patch_size, stride=config.patch_size, bias=False)
        self.ln_pre = nn.RMSNorm(config.hidden_size, eps=1e-5)
        self.transformer = Transformer(config)

    def __call__(self, pixels: mx.array, layers: int | None = None) -> mx.array:
        patches = self.patch_conv(pixels.transpose(1, 2, 0)[None])[0]  # MLX convolves channels last
        rows, cols, width = patches.shape
        h = self.ln_pre(patches.reshape(rows * cols, width))
        angles = rope_angles(self.config, rows, cols)
        cos, sin = (mx.concatenate([f(angles)] * 2, axis=-1) for f in (mx.cos, mx.sin))
        for layer in self.transformer.layers[:layers]:
            h = layer(h, cos, sin)
        return h
