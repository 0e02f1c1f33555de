"""Layer pieces more than one family puts over mlx-lm's blocks: RoPE from given frequencies, Qwen's multimodal
RoPE, and final norms that also scale the logits (the head is linear without bias, so scaling its input scales
its output)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from ..untrusted import is_int, shown

if TYPE_CHECKING:
    from .config import ModelConfig
    from .decoder import DecoderLM


class FrequencyRoPE(nn.Module):
    """Rotary embedding with given inverse frequencies (rotated half-split, as transformers), its cos and
    sin scaled by `scale`: the same as scaling the rotated vector, since the rotation is linear."""

    def __init__(self, inverse: list[float], scale: float = 1.0):
        super().__init__()
        self.dims = 2 * len(inverse)
        self.scale = scale
        self._freqs = 1 / mx.array(inverse, dtype=mx.float32)  # mx.fast.rope takes periods (1 / frequency)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.scale != 1.0:
            x = x * self.scale
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


# ---- M-RoPE ----
#
# Qwen's multimodal RoPE (M-RoPE, interleaved): positions in time, row and column, for image tokens.
#
# A text token sits at one position p (p in all three), so its rotation is plain RoPE at p. An image's tokens sit at
# (s, s + row, s + col) from the position s where the image starts, and the text after it goes on from s plus the
# image's longer side in tokens, not plus its token count: every row's positions are shifted from its cache index by
# what its images saved (models/vision.ImageFormat.grid_positions; engine/images.py counts it). transformers:
# Qwen3VLTextRotaryEmbedding (Qwen3-VL, Qwen3.5) and get_rope_index.
#
# The attention layers call `rope(x, offset=cache.offset)` as mlx-lm's do. What a forward pass adds, a shift per row
# or a prefill chunk's explicit positions, is set around the pass (`DecoderLM.hidden`) in a thread-local slot.


class MRoPE:
    """Rotates the first `dims` features of queries or keys; frequency i turns with the time position unless i % 3
    is 1 (row) or 2 (column) within the first 3 * sections[1] or 3 * sections[2] frequencies."""

    def __init__(self, dims: int, base: float, sections: Sequence[int]):
        self.dims, self.base = dims, base
        half = dims // 2
        self.axis = mx.array(
            [
                1 if i % 3 == 1 and i < 3 * sections[1] else 2 if i % 3 == 2 and i < 3 * sections[2] else 0
                for i in range(half)
            ]  # fmt: skip
        )
        self.inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
        self._pass = threading.local()

    @contextmanager
    def around(self, positions: mx.array | None, shift: int | mx.array | None) -> Iterator[None]:
        """For one forward pass: the chunk's (3, length) positions (one row), else each row's shift."""
        self._pass.state = (positions, shift)
        try:
            yield
        finally:
            self._pass.state = None

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        positions, shift = getattr(self._pass, "state", None) or (None, None)
        if positions is not None:
            return self._at(x, positions)
        if shift is not None:
            offset = offset + shift
        return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=1.0, offset=offset)

    def _at(self, x: mx.array, positions: mx.array) -> mx.array:
        """x (1, heads, length, head dim) rotated at explicit (3, length) positions."""
        angles = positions[self.axis].T.astype(mx.float32) * self.inv_freq  # (length, dims / 2)
        cos, sin = mx.cos(angles), mx.sin(angles)
        half = self.dims // 2
        x1, x2 = x[..., :half].astype(mx.float32), x[..., half : self.dims].astype(mx.float32)
        turned = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        return mx.concatenate([*(t.astype(x.dtype) for t in turned), x[..., self.dims :]], axis=-1)


def mrope_sections(
    args: dict[str, Any], half: int, source: str, default: tuple[int, int, int] | None = None
) -> tuple[int, int, int] | None:
    """The text config's mrope_section (from rope_parameters or rope_scaling: models/config.py keeps it), checked
    to cover the rotated half `half`; `default` where the config has none (None: a text model rotated by one
    position)."""
    sections = args.get("mrope_section", list(default) if default is not None else None)
    if sections is None:
        return None
    if not (isinstance(sections, list) and len(sections) == 3 and all(is_int(s) and s >= 0 for s in sections)):
        raise ConfigError(f"{source}: mrope_section must be 3 non-negative integers, got {shown(sections)}")
    if sum(sections) != half:
        raise ConfigError(f"{source}: mrope_section {sections} must add up to the rotated frequencies, {half}")
    return tuple(sections)  # type: ignore[return-value]


def shared_mrope(model: DecoderLM, args: dict[str, Any], dims: int, source: str,
                 default: tuple[int, int, int] | None = None) -> MRoPE | None:  # fmt: skip
    """The model's one M-RoPE (made on first call, for `dims` rotated features), which every attention layer
    shares; None where the config states no mrope_section and there is no `default`."""
    sections = mrope_sections(args, dims // 2, source, default)
    if sections is None:
        return None
    if model.mrope is None:
        model.mrope = MRoPE(dims, args["rope_theta"], sections)
    return model.mrope


class ScaledRMSNorm(nn.RMSNorm):
    """The final norm, its output times `scale`: it feeds only the head, so this divides the logits
    by logits_scaling as transformers does after the head."""

    def __init__(self, dims: int, eps: float, scale: float):
        super().__init__(dims, eps)
        self._scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) * self._scale


class ScaledLayerNorm(nn.LayerNorm):
    """LayerNorm without bias, its output times `scale`: it feeds only the head, so this scales the logits."""

    def __init__(self, dims: int, eps: float, scale: float):
        super().__init__(dims, eps=eps, bias=False)
        self._scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) * self._scale


def granite_multipliers(model: DecoderLM, config: ModelConfig) -> None:
    """Embeddings times `embedding_multiplier`, logits divided by `logits_scaling` (every Granite family).

    Our forward (models/decoder.py) runs mlx-lm's blocks but not its backbone's or head's `__call__`, which
    is where mlx-lm applies these two; the blocks apply attention_multiplier and residual_multiplier."""
    args = config.args
    model.layout = replace(model.layout, embed_scale=float(args["embedding_multiplier"]))
    model.model.norm = ScaledRMSNorm(config.hidden_size, args["rms_norm_eps"], 1 / args["logits_scaling"])
