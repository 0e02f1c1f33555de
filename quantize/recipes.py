"""Recipes: which bits and group size each layer gets.

- uniform: every quantizable layer at the same bits.
- mixed-4-8: 4-bit body, 8-bit embeddings and output head (they hurt most per weight).
- sensitivity: measured per-layer error on calibration text decides which layers get
  8 bits, within a bits-per-weight budget (see sensitivity.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxinfer.errors import ConversionError

from .affine import bits_per_weight


@dataclass(frozen=True)
class LayerQuant:
    bits: int
    group_size: int
    mode: str = "affine"  # or one of MLX's float formats: mxfp4, nvfp4, mxfp8 (models/quantized.FLOAT_FORMATS)


# A recipe maps a module path and its weight shape to LayerQuant, or None to keep it in float.
Recipe = Callable[[str, tuple[int, ...]], "LayerQuant | None"]

RECIPES = ("uniform", "mixed-4-8", "sensitivity")
EDGE_LAYERS = ("model.embed_tokens", "lm_head")


def uniform(bits: int, group_size: int) -> Recipe:
    def choose(path: str, shape: tuple[int, ...]) -> LayerQuant | None:
        return LayerQuant(bits, group_size) if _fits(shape, group_size) else None

    return choose


def mixed_4_8(group_size: int) -> Recipe:
    def choose(path: str, shape: tuple[int, ...]) -> LayerQuant | None:
        if not _fits(shape, group_size):
            return None
        return LayerQuant(8 if path in EDGE_LAYERS else 4, group_size)

    return choose


def make_recipe(name: str | None, bits: int, group_size: int, bpw: float | None) -> Recipe | None:
    """The recipe for CLI-style settings; None means no quantization (--bits 16)."""
    name = name or ("sensitivity" if bpw is not None else "uniform")
    if name not in RECIPES:
        raise ConversionError(f"--recipe {name!r} is not one of {', '.join(RECIPES)}")
    if bits == 16:
        if name != "uniform" or bpw is not None:
            raise ConversionError("--bits 16 keeps weights unquantized; drop --recipe/--bpw or pick 4 or 8 bits")
        return None
    if bits not in (4, 8):
        raise ConversionError(f"--bits {bits} is not supported; use 4, 8 or 16")
    if group_size not in (32, 64, 128):
        raise ConversionError(f"--group-size {group_size} is not supported; use 32, 64 or 128")
    if name == "sensitivity":
        low, high = bits_per_weight(4, group_size), bits_per_weight(8, group_size)
        if bpw is None or not low <= bpw <= high:
            raise ConversionError(f"--bpw must be between {low:g} and {high:g} at group size {group_size}, got {bpw}")
    elif bpw is not None:
        raise ConversionError("--bpw needs --recipe sensitivity")
    if name == "mixed-4-8":
        return mixed_4_8(group_size)
    return uniform(bits, group_size)  # sensitivity starts uniform at 4 bits; the table replaces it


def _fits(shape: tuple[int, ...], group_size: int) -> bool:
    # A matrix (out, in), or one per expert (experts, out, in) as mlx-lm's SwitchLinear holds them.
    return len(shape) in (2, 3) and shape[-1] % group_size == 0 and shape[-1] >= group_size
