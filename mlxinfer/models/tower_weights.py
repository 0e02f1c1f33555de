"""A vision half's stored tensors under its module's names: one renaming for every family's tower and projector."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..errors import ConfigError
from ..untrusted import shown


def renamed(weights: dict[str, mx.array], prefixes: dict[str, str], conv: str) -> dict[str, mx.array]:
    """Each name's first matching prefix (longest first) replaced by its value, and the patch convolution `conv` (its
    name after renaming) turned channels last as MLX convolves: PyTorch's (out, in, kh, kw) becomes (out, kh, kw, in);
    one already channels last (an MLX port's) is left as it is."""
    out = {}
    for name, value in weights.items():
        prefix = next((p for p in prefixes if name.startswith(p)), "")
        out[prefixes.get(prefix, "") + name[len(prefix) :]] = value
    weight = out.get(conv)
    if weight is not None and weight.ndim == 4 and weight.shape[1] == 3 and weight.shape[3] != 3:
        out[conv] = weight.transpose(0, 2, 3, 1)
    return out


def bounded_int(value: Any, high: int, where: str) -> int:
    """A config's size: an integer in [1, high], else ConfigError naming `where`."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
        raise ConfigError(f"{where} must be an integer in [1, {high}], got {shown(value)}")
    return value
