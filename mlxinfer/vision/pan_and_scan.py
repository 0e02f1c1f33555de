"""Gemma 3's pan-and-scan: an image far wider than tall (or taller than wide) is also read as crops side by side.

transformers' Gemma3ImageProcessor.pan_and_scan, in NumPy. Past `min_ratio` between its sides, the image is cut
along its longer side into as many crops as its aspect ratio (rounded half up), within [2, max_crops], and no more
than leave each crop `min_crop` pixels along that side; a crop under `min_crop` on either side cancels the cut. The
frames are the whole image, then the crops row by row, each resized as the whole image is. Gemma3Processor
introduces them in the prompt ("Here is the original image ... and here are some crops to help you see better ...";
families/gemma3_text.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..untrusted import is_finite_number, shown

MAX_CROPS = 8  # a config's pan_and_scan_max_num_crops at most (transformers' default: 4)
MAX_CROP_SIDE = 4096


@dataclass(frozen=True)
class PanAndScan:
    """The settings, Gemma3Processor's defaults where preprocessor_config.json leaves them null."""

    min_crop: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2

    @classmethod
    def from_config(cls, raw: dict[str, Any], source: str) -> PanAndScan | None:
        """None unless `do_pan_and_scan` is true; ConfigError naming the field for a value out of bounds."""
        on = raw.get("do_pan_and_scan")
        if on is not None and not isinstance(on, bool):
            raise ConfigError(f"{source}: do_pan_and_scan must be true, false or null, got {shown(on)}")
        if not on:
            return None
        defaults = cls()
        min_crop = _whole(raw, "pan_and_scan_min_crop_size", defaults.min_crop, 1, MAX_CROP_SIDE, source)
        max_crops = _whole(raw, "pan_and_scan_max_num_crops", defaults.max_crops, 2, MAX_CROPS, source)
        ratio = raw.get("pan_and_scan_min_ratio_to_activate")
        ratio = defaults.min_ratio if ratio is None else ratio
        if not (is_finite_number(ratio) and 1 <= ratio <= MAX_CROP_SIDE):
            raise ConfigError(
                f"{source}: pan_and_scan_min_ratio_to_activate must be a number in [1, {MAX_CROP_SIDE}], "
                f"got {shown(ratio)}"
            )
        return cls(min_crop, max_crops, float(ratio))

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of crops of an image this size (its header's, before any pixel is read); (0, 0): none."""
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio:
            return 0, 0
        crops = int(math.floor(long / short + 0.5))  # half rounds up
        crops = min(self.max_crops, max(2, min(long // self.min_crop, crops)))
        if min(math.ceil(long / crops), short) < self.min_crop:
            return 0, 0
        return (1, crops) if width >= height else (crops, 1)

    def crops(self, rgb: np.ndarray) -> list[np.ndarray]:
        """The crops of an RGB image (H, W, 3), row by row; the last of a row or column may be narrower."""
        height, width = rgb.shape[:2]
        rows, cols = self.grid(width, height)
        if not rows:
            return []
        tall, wide = math.ceil(height / rows), math.ceil(width / cols)
        return [np.ascontiguousarray(rgb[r * tall : (r + 1) * tall, c * wide : (c + 1) * wide])
                for r in range(rows) for c in range(cols)]  # fmt: skip


def _whole(raw: dict[str, Any], key: str, default: int, low: int, high: int, source: str) -> int:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{source}: {key} must be an integer in [{low}, {high}], got {shown(value)}")
    return value
