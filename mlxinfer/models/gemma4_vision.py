"""Gemma 4's vision encoder (transformers' Gemma4VisionModel), in MLX.

An image of any shape (whole blocks of patches a side) is cut into patches, each flattened (row, column, channel)
and projected, plus a learned embedding of its column and one of its row. The layers are Gemma's: RMS norms before
and after attention and MLP, query and key norms, a scale-free value norm, attention scale 1, and 2-D RoPE: the
first half of each head turns with the patch's column, the second with its row. Then each pooling x pooling block
of patches is averaged into one token, scaled by sqrt(hidden), and (where the config says so) standardized. Linear
layers may clip their inputs and outputs to stored bounds (use_clipped_linears). One image at a time: the padding
transformers' batches need never exists here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, UnsupportedModelError
from ..untrusted import is_finite_number, shown
from .tower_weights import bounded_int
from .vision_attention import blocked_attention, scores_bytes

ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu, "silu": nn.silu}
MAX_WIDTH = 8192
MAX_LAYERS = 64
MAX_POSITIONS = 1 << 16  # patches a side the position tables may hold (Gemma 4: 10,240)


@dataclass(frozen=True)
class Gemma4VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    hidden_activation: str = "gelu_pytorch_tanh"
    use_clipped_linears: bool = False
    standardize: bool = False

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> Gemma4VisionConfig:
        """vision_config, checked: sizes bounded, the heads grouping evenly, each head in quarters RoPE can split."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: vision_config must be an object, got {shown(raw)}")
        sizes = {"hidden_size": MAX_WIDTH, "intermediate_size": MAX_WIDTH, "num_hidden_layers": MAX_LAYERS,
                 "num_attention_heads": 256, "num_key_value_heads": 256, "head_dim": 1024, "patch_size": 1024,
                 "pooling_kernel_size": 64, "position_embedding_size": MAX_POSITIONS}  # fmt: skip
        defaults = {"num_key_value_heads": raw.get("num_attention_heads"), "head_dim": 64, "pooling_kernel_size": 3,
                    "position_embedding_size": 10 * 1024}  # fmt: skip
        values = {
            key: bounded_int(raw.get(key, defaults.get(key)), high, f"{source}: vision_config.{key}")
            for key, high in sizes.items()
        }
        rope = raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", 100.0) if isinstance(rope, dict) else None
        eps = raw.get("rms_norm_eps", 1e-6)
        if not is_finite_number(theta) or theta <= 1 or not is_finite_number(eps) or not 0 < eps < 1:
            raise ConfigError(f"{source}: vision_config's rope_theta and rms_norm_eps must be numbers in range")
        flags = {k: raw.get(k, False) for k in ("use_clipped_linears", "standardize")}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise ConfigError(f"{source}: vision_config's use_clipped_linears and standardize must be true or false")
        config = cls(**values, rms_norm_eps=float(eps), rope_theta=float(theta),
                     hidden_activation=raw.get("hidden_activation", "gelu_pytorch_tanh"), **flags)  # fmt: skip
        if config.hidden_activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"{source}: vision_config.hidden_activation {shown(config.hidden_activation)} is not supported"
            )
        if config.num_attention_heads % config.num_key_value_heads or config.head_dim % 4:
            raise ConfigError(f"{source}: vision_config's key/value heads must divide its heads, head_dim by 4")
        return config

    def activation_bytes(self, patches: int, dtype_size: int) -> int:
        """The most the tower holds beyond its weights for an image of `patches` patches: one block of queries'
        scores (vision_attention.py), about eight hidden-wide arrays a patch and the gated MLP's three widest."""
        per_patch = (8 * self.hidden_size + 3 * self.intermediate_size) * dtype_size
        return scores_bytes(self.num_attention_heads, patches) + patches * per_patch


class ClippableLinear(nn.Module):
    """Gemma4ClippableLinear: a bias-free linear layer, its input and output clamped to stored bounds if asked."""

    def __init__(self, inputs: int, outputs: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs, bias=False)
        if clipped:  # loaded from the checkpoint (transformers' buffers; infinite until trained)
            self.input_min, self.input_max = mx.array(-mx.inf), mx.array(mx.inf)
            self.output_min, self.output_max = mx.array(-mx.inf), mx.array(mx.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if "input_min" not in self:
            return self.linear(x)
        x = mx.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))
        out = self.linear(x)
        return mx.clip(out, self.output_min.astype(out.dtype), self.output_max.astype(out.dtype))


class PatchEmbedder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.patch = config.patch_size
        self.input_proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, config.position_embedding_size, config.hidden_size))

    def __call__(self, pixels: mx.array) -> tuple[mx.array, int, int]:
        """(3, H, W) in [0, 1] -> (patches, hidden) row by row, and the patch grid's rows and columns."""
        p, (_, height, width) = self.patch, pixels.shape
        rows, cols = height // p, width // p
        table = self.position_embedding_table
        if max(rows, cols) > table.shape[1]:
            raise ConfigError(f"an image of {rows} x {cols} patches passes the tower's {table.shape[1]} positions")
        patches = pixels.transpose(1, 2, 0).reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
        h = self.input_proj((2 * (patches.reshape(rows * cols, -1) - 0.5)).astype(self.input_proj.weight.dtype))
        positions = table[0][None, :cols] + table[1][:rows, None]  # column's, then row's
        return h + positions.reshape(rows * cols, -1).astype(h.dtype), rows, cols


def rope_angles(config: Gemma4VisionConfig, rows: int, cols: int) -> tuple[mx.array, mx.array]:
    """(patches, head_dim / 4) angles by column and by row (Gemma4VisionRotaryEmbedding)."""
    half = config.head_dim // 2
    freqs = 1.0 / (config.rope_theta ** (mx.arange(0, half, 2, dtype=mx.float32) / half))
    col = mx.tile(mx.arange(cols, dtype=mx.float32), rows)[:, None] * freqs
    row = mx.repeat(mx.arange(rows, dtype=mx.float32), cols)[:, None] * freqs
    return col, row


def _rotated(x: mx.array, angles: mx.array) -> mx.array:
    """rotate_half RoPE of x (..., n, 2 * len(angles)) by angles (n, d)."""
    cos, sin = (mx.concatenate([f(angles)] * 2, axis=-1) for f in (mx.cos, mx.sin))
    half = x.shape[-1] // 2
    return x * cos + mx.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def rope_2d(x: mx.array, col: mx.array, row: mx.array) -> mx.array:
    """apply_multidimensional_rope with (column, row) positions: each half of the head turns by one of them."""
    half = x.shape[-1] // 2
    return mx.concatenate([_rotated(x[..., :half], col), _rotated(x[..., half:], row)], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        width, dim, clip = config.hidden_size, config.head_dim, config.use_clipped_linears
        self.heads, self.kv_heads, self.dim, self.eps = (config.num_attention_heads, config.num_key_value_heads,
                                                         dim, config.rms_norm_eps)  # fmt: skip
        self.q_proj = ClippableLinear(width, self.heads * dim, clip)
        self.k_proj = ClippableLinear(width, self.kv_heads * dim, clip)
        self.v_proj = ClippableLinear(width, self.kv_heads * dim, clip)
        self.o_proj = ClippableLinear(self.heads * dim, width, clip)
        self.q_norm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(dim, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, col: mx.array, row: mx.array) -> mx.array:
        n = x.shape[0]

        def heads(t: mx.array, count: int) -> mx.array:
            return t.reshape(n, count, self.dim).transpose(1, 0, 2)

        q = rope_2d(heads(self.q_norm(self.q_proj(x).reshape(n, self.heads, self.dim)), self.heads), col, row)
        k = rope_2d(heads(self.k_norm(self.k_proj(x).reshape(n, self.kv_heads, self.dim)), self.kv_heads), col, row)
        v = heads(mx.fast.rms_norm(self.v_proj(x).reshape(n, self.kv_heads, self.dim), None, self.eps), self.kv_heads)
        out = blocked_attention(q, k, v, 1.0)  # Gemma 4's attention does not scale its scores
        return self.o_proj(out.transpose(1, 0, 2).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        width, inner, clip = config.hidden_size, config.intermediate_size, config.use_clipped_linears
        self.gate_proj = ClippableLinear(width, inner, clip)
        self.up_proj = ClippableLinear(width, inner, clip)
        self.down_proj = ClippableLinear(inner, width, clip)
        self.activation = ACTIVATIONS[config.hidden_activation]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = nn.RMSNorm(width, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(width, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(width, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(width, eps=eps)

    def __call__(self, x: mx.array, col: mx.array, row: mx.array) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), col, row))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Encoder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.layers = [Layer(config) for _ in range(config.num_hidden_layers)]


class Gemma4VisionTower(nn.Module):
    """One image's pixel_values (3, H, W) in [0, 1], whole pooling blocks of patches a side -> its tokens
    (H / patch / pooling x W / patch / pooling, hidden) row by row, in float32 (before the embedder)."""

    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = Encoder(config)
        if config.standardize:
            self.std_bias, self.std_scale = mx.zeros((config.hidden_size,)), mx.ones((config.hidden_size,))

    def __call__(self, pixels: mx.array) -> mx.array:
        h, rows, cols = self.patch_embedder(pixels)
        col, row = rope_angles(self.config, rows, cols)
        for layer in self.encoder.layers:
            h = layer(h, col, row)
        k, width = self.config.pooling_kernel_size, h.shape[-1]
        pooled = h.astype(mx.float32).reshape(rows // k, k, cols // k, k, width).mean(axis=(1, 3))
        pooled = pooled.reshape(-1, width) * width**0.5  # in float32: it may pass float16's range
        if self.config.standardize:
            pooled = (pooled - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return pooled
