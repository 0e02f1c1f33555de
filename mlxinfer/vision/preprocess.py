"""A model's image processor, as its preprocessor_config.json states it: RGB pixels in, `pixel_values` out.

NumPy and Pillow only (no torch at run time). The steps and their order are transformers' PIL image processors':
resize with Pillow's filter on the 8-bit image, rescale (1/255), normalize by mean and std, channels first.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import ConfigError, ImageError, UnsupportedModelError
from ..untrusted import is_finite_number, read_json_object, shown
from .pan_and_scan import PanAndScan

PREPROCESSOR_FILE = "preprocessor_config.json"
MAX_SIDE = 4096  # a processor's target side; real ones use 224-1540
MAX_TILES = 8  # tiles a side a splitting processor may cut (SmolVLM: 4, Idefics3: 4)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
RESAMPLE = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}  # PIL's codes


class Layout(NamedTuple):
    """How an image is cut: `rows` x `cols` tiles and the whole image after them (before them for Gemma 3's
    pan-and-scan crops), or (0, 0): the whole image alone. `grid`: where the processor sizes the image by its content
    (Pixtral), the one frame's (rows, cols) of tokens."""

    rows: int = 0
    cols: int = 0
    grid: tuple[int, int] | None = None

    @property
    def frames(self) -> int:
        return self.rows * self.cols + 1 if self.rows else 1


@dataclass(frozen=True)
class Normalization:
    """8-bit RGB to pixel_values: times `rescale`, less `mean`, over `std` (each step skipped when None)."""

    rescale: float | None = 1 / 255
    mean: tuple[float, float, float] | None = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] | None = (0.5, 0.5, 0.5)

    def __call__(self, rgb: np.ndarray) -> np.ndarray:
        """float32 (3, H, W) of an RGB uint8 (H, W, 3)."""
        values = np.asarray(rgb, dtype=np.float64)
        if self.rescale is not None:
            values = values * self.rescale
        if self.mean is not None and self.std is not None:
            values = (values - np.array(self.mean)) / np.array(self.std)
        return np.ascontiguousarray(values.transpose(2, 0, 1), dtype=np.float32)


@dataclass(frozen=True)
class ImageProcessor:
    """Fixed-size resizing (Gemma 3, SigLIP): every image becomes `height` x `width`; with Gemma 3's pan-and-scan on,
    a long image is also read as crops (pan_and_scan.py), each a frame after the whole image."""

    height: int
    width: int
    resample: int = 2
    normalized: Normalization = Normalization()
    pan: PanAndScan | None = None

    @classmethod
    def from_config(cls, raw: dict[str, Any], source: str) -> ImageProcessor:
        pan = PanAndScan.from_config(raw, source)
        size = raw.get("size")
        if not isinstance(size, dict) or not {"height", "width"} <= set(size):
            raise UnsupportedModelError(f"{source}: size must be {{height, width}}, got {shown(size)}")
        height, width = (_side(size[k], f"{source}: size.{k}") for k in ("height", "width"))
        resample = raw.get("resample", 2)  # (Idefics3 / SmolVLM state theirs: LANCZOS, 1)
        if resample not in RESAMPLE:
            raise ConfigError(
                f"{source}: resample must be one of {sorted(RESAMPLE)} (PIL's filters), got {shown(resample)}"
            )
        rescale = raw.get("rescale_factor", 1 / 255) if raw.get("do_rescale", True) else None
        if rescale is not None and not (is_finite_number(rescale) and rescale > 0):
            raise ConfigError(f"{source}: rescale_factor must be a positive number, got {shown(rescale)}")
        normalize = raw.get("do_normalize", True)
        mean = _triple(raw.get("image_mean", 0.5), f"{source}: image_mean") if normalize else None
        std = _triple(raw.get("image_std", 0.5), f"{source}: image_std") if normalize else None
        if std is not None and min(std) <= 0:
            raise ConfigError(f"{source}: image_std must be positive, got {list(std)}")
        return cls(height, width, resample, Normalization(rescale, mean, std), pan)

    def layout(self, width: int, height: int) -> Layout:
        """One frame, or with pan-and-scan the crops' (rows, cols): the whole image and then they."""
        return Layout(*self.pan.grid(width, height)) if self.pan else Layout()

    def frames(self, rgb: np.ndarray) -> np.ndarray:
        """`pixel_values` of one RGB uint8 image (H, W, 3): float32 (frames, 3, height, width), the whole image first
        (as Gemma3ImageProcessor orders them; Layout's other users put it last)."""
        crops = self.pan.crops(rgb) if self.pan else []
        return np.stack([self.pixels(image) for image in (rgb, *crops)])

    def pixels(self, rgb: np.ndarray) -> np.ndarray:
        """`pixel_values` of one RGB uint8 image (H, W, 3): float32 (3, height, width)."""
        return self.normalized(_resized(rgb, self.width, self.height, self.resample))


@dataclass(frozen=True)
class SplitProcessor:
    """Idefics3 / SmolVLM: the longest side scaled to `longest_edge`, both sides rounded up to whole `tile`s, cut
    into tile x tile frames, and the whole image at tile x tile after them (one frame if it fits in one tile)."""

    longest_edge: int
    tile: int
    resample: int = 1
    normalized: Normalization = Normalization()
    split: bool = True

    def layout(self, width: int, height: int) -> Layout:
        """Rows and columns of tiles for an image of this size (its header's), before any pixel is read."""
        if not self.split:
            return Layout()
        width, height = self._tiled(*self._scaled(width, height))
        if height <= self.tile and width <= self.tile:
            return Layout()
        return Layout((height - self.tile) // self.tile + 1, (width - self.tile) // self.tile + 1)

    def frames(self, rgb: np.ndarray) -> np.ndarray:
        """The tiles, then the whole image: float32 (frames, 3, tile, tile)."""
        if not self.split:
            whole = _resized(_resized(rgb, *self._scaled(rgb.shape[1], rgb.shape[0]), self.resample), self.tile,
                             self.tile, self.resample)  # fmt: skip
            return self.normalized(whole)[None]
        image = _resized(rgb, *self._scaled(rgb.shape[1], rgb.shape[0]), self.resample)
        image = _resized(image, *self._tiled(image.shape[1], image.shape[0]), self.resample)
        rows, cols, _ = self.layout(rgb.shape[1], rgb.shape[0])
        t = self.tile
        tiles = [image[r * t : (r + 1) * t, c * t : (c + 1) * t] for r in range(rows) for c in range(cols)]
        if tiles:
            tiles.append(_resized(image, t, t, self.resample))
        else:
            tiles = [image]
        return np.stack([self.normalized(tile) for tile in tiles])

    def _scaled(self, width: int, height: int) -> tuple[int, int]:
        """transformers' resize to the longest edge: the other side kept in proportion, rounded up to even, then
        both within 4096."""
        aspect = width / height
        if width >= height:
            width, height = self.longest_edge, int(self.longest_edge / aspect)
            height += height % 2
        else:
            height, width = self.longest_edge, int(self.longest_edge * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        if width >= height and width > MAX_SIDE:
            width, height = MAX_SIDE, int(MAX_SIDE / aspect)
        elif height > width and height > MAX_SIDE:
            height, width = MAX_SIDE, int(MAX_SIDE * aspect)
        return max(width, 1), max(height, 1)

    def _tiled(self, width: int, height: int) -> tuple[int, int]:
        """Both sides rounded up to whole tiles, the longer one first (transformers' resize_for_vision_encoder)."""
        aspect, t = width / height, self.tile
        if width >= height:
            width = math.ceil(width / t) * t
            height = math.ceil(int(width / aspect) / t) * t
        else:
            height = math.ceil(height / t) * t
            width = math.ceil(int(height * aspect) / t) * t
        return width, height


@dataclass(frozen=True)
class PatchProcessor:
    """Pixtral (Mistral 3): one frame per image, at most `longest_edge` a side, each side rounded up to whole `patch`es
    (the tower's patch times the patches merged into one token: each is a token) and the image stretched to it."""

    longest_edge: int
    patch: int
    resample: int = 3
    normalized: Normalization = Normalization()

    def layout(self, width: int, height: int) -> Layout:
        """The frame's token grid for an image of this size (its header's), before any pixel is read."""
        width, height = self._sized(width, height)
        return Layout(grid=(height // self.patch, width // self.patch))

    def frames(self, rgb: np.ndarray) -> np.ndarray:
        """float32 (1, 3, height, width), both sides whole patches."""
        image = _resized(rgb, *self._sized(rgb.shape[1], rgb.shape[0]), self.resample)
        return self.normalized(image)[None]

    def _sized(self, width: int, height: int) -> tuple[int, int]:
        """transformers' get_resize_output_image_size (Pixtral): shrunk (floored) to fit `longest_edge`, then each
        side rounded up to whole patches."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = max(int(math.floor(height / ratio)), 1), max(int(math.floor(width / ratio)), 1)
        return math.ceil(width / self.patch) * self.patch, math.ceil(height / self.patch) * self.patch

    @property
    def most_tokens(self) -> int:
        """The largest frame's tokens (a square image at longest_edge)."""
        return math.ceil(self.longest_edge / self.patch) ** 2


@dataclass(frozen=True)
class BudgetProcessor:
    """Gemma 4: one frame per image, its shape kept and scaled (up or down) to the most patches within
    `max_soft_tokens` tokens (each token a pooling x pooling block of patches), each side whole blocks."""

    patch: int
    pooling: int
    max_soft_tokens: int
    resample: int = 3
    normalized: Normalization = Normalization(1 / 255, None, None)

    def layout(self, width: int, height: int) -> Layout:
        """The frame's token grid for an image of this size (its header's), before any pixel is read."""
        height, width = self._sized(height, width)
        side = self.patch * self.pooling
        return Layout(grid=(height // side, width // side))

    def frames(self, rgb: np.ndarray) -> np.ndarray:
        """float32 (1, 3, height, width), both sides whole blocks of patches."""
        height, width = self._sized(rgb.shape[0], rgb.shape[1])
        return self.normalized(_resized(rgb, width, height, self.resample))[None]

    def _sized(self, height: int, width: int) -> tuple[int, int]:
        """transformers' get_aspect_ratio_preserving_size (Gemma 4): (height, width)."""
        budget = self.max_soft_tokens * self.pooling**2 * self.patch**2  # pixels
        factor = math.sqrt(budget / (height * width))
        side = self.pooling * self.patch
        target_height = int(math.floor(factor * height / side)) * side
        target_width = int(math.floor(factor * width / side)) * side
        longest = self.max_soft_tokens * side  # a one-token-high strip's length
        if target_height == 0:
            target_height, target_width = side, min(int(math.floor(width / height)) * side, longest)
        elif target_width == 0:
            target_width, target_height = side, min(int(math.floor(height / width)) * side, longest)
        return target_height, target_width

    @property
    def most_tokens(self) -> int:
        return self.max_soft_tokens


@dataclass(frozen=True)
class PixelRangeProcessor:
    """Qwen2-VL's (Qwen3-VL, Qwen3.5): one frame per image, its shape kept, its pixels brought within [min_pixels,
    max_pixels], each side whole tokens of `patch` x `merge` pixels."""

    min_pixels: int
    max_pixels: int
    patch: int
    merge: int
    resample: int = 3
    normalized: Normalization = Normalization(1 / 255, CLIP_MEAN, CLIP_STD)

    def layout(self, width: int, height: int) -> Layout:
        """The frame's token grid for an image of this size (its header's), before any pixel is read. ImageError
        past most_tokens (a strip so thin that a side stays one token however far the other shrinks)."""
        return Layout(grid=_token_grid(*self._sized(height, width), self.patch * self.merge, self.most_tokens))

    def frames(self, rgb: np.ndarray) -> np.ndarray:
        """float32 (1, 3, height, width), both sides whole tokens."""
        height, width = self._sized(rgb.shape[0], rgb.shape[1])
        return self.normalized(_resized(rgb, width, height, self.resample))[None]

    def _sized(self, height: int, width: int) -> tuple[int, int]:
        """transformers' smart_resize (Qwen2-VL): (height, width). Python's round, as there (halves to even)."""
        if max(height, width) > 200 * min(height, width):
            raise ImageError(f"an image of {width} x {height} pixels is over 200 times longer than wide; crop it")
        factor = self.patch * self.merge
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    @property
    def most_tokens(self) -> int:
        """The most tokens an image may take: max_pixels of whole tokens."""
        return self.max_pixels // (self.patch * self.merge) ** 2


@dataclass(frozen=True)
class TileProcessor:
    """LFM2-VL's (Lfm2VlImageProcessor): an image brought within [min_tokens, max_tokens] tokens of `patch` x `merge`
    pixels, its shape kept, is one frame; one past `tolerance` times the most pixels is cut into `tile`-pixel tiles
    (min_tiles to max_tiles, the grid nearest its shape) followed by that frame as a thumbnail. Frames differ in size:
    `frames` gives a list."""

    patch: int
    merge: int
    min_tokens: int
    max_tokens: int
    tile: int
    min_tiles: int
    max_tiles: int
    tolerance: float
    split: bool = True
    resample: int = 2
    normalized: Normalization = Normalization()

    def layout(self, width: int, height: int) -> Layout:
        """Tiles (rows, cols; 0 where the image is one frame) and the whole frame's token grid, from its size.
        ImageError past max_tokens (a strip so thin that a side stays one token however far the other shrinks)."""
        rows, cols = self._tiles(height, width)
        return Layout(rows, cols, _token_grid(*self._sized(height, width), self.patch * self.merge, self.max_tokens))

    def frames(self, rgb: np.ndarray) -> list[np.ndarray]:
        """float32 (3, H, W) frames: the tiles row by row, then the whole image (or the whole image alone)."""
        height, width = rgb.shape[:2]
        rows, cols = self._tiles(height, width)
        frames = []
        if rows:
            grid = _resized(rgb, cols * self.tile, rows * self.tile, self.resample)
            t = self.tile
            frames = [self.normalized(grid[r * t : (r + 1) * t, c * t : (c + 1) * t]) for r in range(rows)
                      for c in range(cols)]  # fmt: skip
        frame_height, frame_width = self._sized(height, width)
        return [*frames, self.normalized(_resized(rgb, frame_width, frame_height, self.resample))]

    @property
    def tile_tokens(self) -> int:
        return math.ceil(self.tile // self.patch / self.merge) ** 2

    def _sized(self, height: int, width: int) -> tuple[int, int]:
        """Lfm2VlImageProcessor.smart_resize: (height, width), each side whole tokens (Python's round: halves to
        even, as there)."""
        factor = self.patch * self.merge
        low, high = self.min_tokens * factor**2, self.max_tokens * factor**2
        h_bar, w_bar = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
        if h_bar * w_bar > high:
            beta = math.sqrt(height * width / high)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < low:
            beta = math.sqrt(low / (height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def _tiles(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles, (0, 0) where the image is not cut: _is_image_too_large, then _get_grid_layout."""
        factor = self.patch * self.merge
        h_bar = max(self.patch, round(height / factor) * factor)
        w_bar = max(self.patch, round(width / factor) * factor)
        if not self.split or h_bar * w_bar <= self.max_tokens * factor**2 * self.tolerance:
            return 0, 0
        cols, rows = _closest_grid(width / height, width * height, self.tile, self.min_tiles, self.max_tiles)
        return rows, cols


def _token_grid(height: int, width: int, side: int, most: int) -> tuple[int, int]:
    """(rows, cols) of `side`-pixel tokens of a frame sized (height, width); ImageError past `most` tokens (a strip so
    thin that a side stays one token however far the other shrinks)."""
    rows, cols = height // side, width // side
    if rows * cols > most:
        raise ImageError(f"an image this long and thin would take {rows * cols} tokens, more than {most}; crop it")
    return rows, cols


def _closest_grid(aspect: float, area: int, tile: int, low: int, high: int) -> tuple[int, int]:
    """find_closest_aspect_ratio over transformers' candidate grids (smallest first): (cols, rows)."""
    grids = sorted({(w, h) for n in range(low, high + 1) for w in range(1, n + 1) for h in range(1, n + 1)
                    if low <= w * h <= high}, key=lambda g: g[0] * g[1])  # fmt: skip
    best, best_diff = (1, 1), float("inf")
    for w, h in grids:
        diff = abs(aspect - w / h)
        if diff < best_diff:
            best, best_diff = (w, h), diff
        elif diff == best_diff and area > 0.5 * tile * tile * w * h:
            best = (w, h)
    return best


def _resized(rgb: np.ndarray, width: int, height: int, resample: int) -> np.ndarray:
    """Pillow's resize of 8-bit RGB, as transformers' PIL processors do it (each step back to 8 bits)."""
    from PIL import Image

    if rgb.shape[1] == width and rgb.shape[0] == height:
        return rgb
    return np.asarray(Image.fromarray(rgb, "RGB").resize((width, height), resample=Image.Resampling(resample)))


Processor = ImageProcessor | SplitProcessor | PatchProcessor | BudgetProcessor | PixelRangeProcessor | TileProcessor


def processor_from_folder(folder: Path) -> Processor:
    """The image processor preprocessor_config.json describes (ConfigError if it is missing or bad)."""
    path = folder / PREPROCESSOR_FILE
    if not path.is_file():
        raise ConfigError(f"{folder}: {PREPROCESSOR_FILE} is missing; a vision model needs its image processor")
    raw = read_json_object(path, ConfigError)
    kind = raw.get("image_processor_type")
    if kind in SPLITTING:
        return _split_processor(raw, str(path))
    if kind in ("PixtralImageProcessor", "PixtralImageProcessorFast"):
        return _patch_processor(raw, str(path))
    if kind in ("Gemma4ImageProcessor", "Gemma4ImageProcessorFast"):
        return _budget_processor(raw, str(path))
    if kind in ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast"):
        return _pixel_range_processor(raw, str(path))
    if kind in ("Lfm2VlImageProcessor", "Lfm2VlImageProcessorFast"):
        return _tile_processor(raw, str(path))
    return ImageProcessor.from_config(raw, str(path))


SPLITTING = (
    "SmolVLMImageProcessor",
    "Idefics3ImageProcessor",
    "SmolVLMImageProcessorFast",
    "Idefics3ImageProcessorFast",
)


def _split_processor(raw: dict[str, Any], source: str) -> SplitProcessor:
    size, tile = raw.get("size"), raw.get("max_image_size")
    if not isinstance(size, dict) or not isinstance(tile, dict):
        raise ConfigError(f"{source}: size and max_image_size must be {{longest_edge}} objects")
    longest = _side(size.get("longest_edge"), f"{source}: size.longest_edge")
    side = _side(tile.get("longest_edge"), f"{source}: max_image_size.longest_edge")
    fixed = ImageProcessor.from_config({**raw, "size": {"height": side, "width": side}}, source)
    if longest > MAX_TILES * side:  # each tile is a frame through the tower and a run of prompt tokens
        raise ConfigError(f"{source}: size.longest_edge {longest} asks for more than {MAX_TILES} tiles a side")
    split = raw.get("do_image_splitting", True)
    return SplitProcessor(longest, side, fixed.resample, fixed.normalized, bool(split))


def _patch_processor(raw: dict[str, Any], source: str) -> PatchProcessor:
    """PixtralImageProcessor's settings. Its `patch_size` is the tower's; the model multiplies it by the patches it
    merges into a token (models/vision.VisionModel.fitted), as PixtralProcessor does."""
    size, patch = raw.get("size", {"longest_edge": 1024}), raw.get("patch_size", {"height": 16, "width": 16})
    if not isinstance(size, dict) or "longest_edge" not in size:
        raise UnsupportedModelError(f"{source}: size must be {{longest_edge}}, got {shown(size)}")
    if isinstance(patch, dict) and patch.get("height") == patch.get("width"):
        patch = patch.get("height")
    longest, side = _side(size["longest_edge"], f"{source}: size.longest_edge"), _side(patch, f"{source}: patch_size")
    defaults = {"resample": 3, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD)}  # PixtralImageProcessor's
    fixed = ImageProcessor.from_config({**defaults, **raw, "size": {"height": side, "width": side}}, source)
    return PatchProcessor(longest, side, fixed.resample, fixed.normalized)


SOFT_TOKENS = (70, 140, 280, 560, 1120)  # Gemma4ImageProcessor's budgets


def _budget_processor(raw: dict[str, Any], source: str) -> BudgetProcessor:
    """Gemma4ImageProcessor's settings: patch_size, pooling_kernel_size, max_soft_tokens (one of five budgets, which
    bound the pixels of any image: 1120 tokens of 3 x 3 patches of 16 pixels are 2.6 megapixels)."""
    budget = raw.get("max_soft_tokens", 280)
    if budget not in SOFT_TOKENS or isinstance(budget, bool):
        raise ConfigError(f"{source}: max_soft_tokens must be one of {list(SOFT_TOKENS)}, got {shown(budget)}")
    patch = _side(raw.get("patch_size", 16), f"{source}: patch_size")
    pooling = _side(raw.get("pooling_kernel_size", 3), f"{source}: pooling_kernel_size")
    if budget * (pooling * patch) ** 2 > MAX_SIDE**2:  # the pixels every image is scaled to
        raise ConfigError(f"{source}: max_soft_tokens of pooling_kernel_size² patches would pass {MAX_SIDE}² pixels")
    defaults = {"resample": 3, "do_normalize": False}  # Gemma4ImageProcessor's: [0, 1] pixels
    fixed = ImageProcessor.from_config({**defaults, **raw, "size": {"height": patch, "width": patch}}, source)
    return BudgetProcessor(patch, pooling, budget, fixed.resample, fixed.normalized)


def _pixel_range_processor(raw: dict[str, Any], source: str) -> PixelRangeProcessor:
    """Qwen2VLImageProcessor's settings: size {shortest_edge, longest_edge} (in pixels, not sides; older files say
    min_pixels / max_pixels), patch_size, merge_size. max_pixels at most MAX_SIDE² bounds every image's pixels."""
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    low = raw.get("min_pixels", size.get("shortest_edge", 56 * 56))
    high = raw.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))
    for value, key in ((low, "size.shortest_edge"), (high, "size.longest_edge")):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIDE**2:
            raise ConfigError(f"{source}: {key} (pixels) must be an integer in [1, {MAX_SIDE**2}], got {shown(value)}")
    if low > high:
        raise ConfigError(f"{source}: size.shortest_edge {low} is above size.longest_edge {high}")
    patch = _side(raw.get("patch_size", 14), f"{source}: patch_size")
    merge = _side(raw.get("merge_size", 2), f"{source}: merge_size")
    defaults = {"resample": 3, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD)}  # Qwen2VLImageProcessor's
    fixed = ImageProcessor.from_config({**defaults, **raw, "size": {"height": patch, "width": patch}}, source)
    return PixelRangeProcessor(low, high, patch, merge, fixed.resample, fixed.normalized)


MAX_TOKENS = 16_384  # an LFM2-VL frame's: max_image_tokens is 256 in every released model


def _tile_processor(raw: dict[str, Any], source: str) -> TileProcessor:
    """Lfm2VlImageProcessor's settings (its defaults where absent). Tiles and tokens are bounded: at most 64 tiles, at
    most MAX_TOKENS tokens a frame, and neither the tiles together nor the largest frame past MAX_SIDE² pixels."""
    settings = {"encoder_patch_size": 16, "downsample_factor": 2, "min_image_tokens": 64, "max_image_tokens": 256,
                "tile_size": 512, "min_tiles": 2, "max_tiles": 10}  # fmt: skip
    highs = {"min_image_tokens": MAX_TOKENS, "max_image_tokens": MAX_TOKENS, "min_tiles": 64, "max_tiles": 64}
    values = {}
    for key, default in settings.items():
        value = raw.get(key, default)
        high = highs.get(key, MAX_SIDE)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise ConfigError(f"{source}: {key} must be an integer in [1, {high}], got {shown(value)}")
        values[key] = value
    tolerance = raw.get("max_pixels_tolerance", 2.0)
    if not is_finite_number(tolerance) or not 0 < tolerance <= 64:
        raise ConfigError(f"{source}: max_pixels_tolerance must be a number in (0, 64], got {shown(tolerance)}")
    split = bool(raw.get("do_image_splitting", True))
    if values["min_image_tokens"] > values["max_image_tokens"] or (split and values["min_tiles"] > values["max_tiles"]):
        raise ConfigError(f"{source}: min_image_tokens and min_tiles must not pass their max_")
    token_side = values["encoder_patch_size"] * values["downsample_factor"]
    tiles = values["max_tiles"] * values["tile_size"] ** 2 if split else 0
    if max(tiles, values["max_image_tokens"] * token_side**2) > MAX_SIDE**2:  # the pixels an image is resized to
        raise ConfigError(f"{source}: its tiles or its largest frame would pass {MAX_SIDE}² pixels")
    if split and (not raw.get("use_thumbnail", True) or values["min_tiles"] < 2):
        raise UnsupportedModelError(f"{source}: splitting without a thumbnail, or into one tile, is not supported")
    defaults = {"resample": 2}  # Lfm2VlImageProcessor's (bilinear), mean and std 0.5
    fixed = ImageProcessor.from_config({**defaults, **raw, "size": {"height": 1, "width": 1}}, source)
    return TileProcessor(values["encoder_patch_size"], values["downsample_factor"], values["min_image_tokens"],
                         values["max_image_tokens"], values["tile_size"], values["min_tiles"], values["max_tiles"],
                         float(tolerance), split, fixed.resample, fixed.normalized)  # fmt: skip


def digest(pixels: np.ndarray | list[np.ndarray]) -> bytes:
    """The content hash of an image's pixel_values (one array of frames, or a list of frames of different sizes):
    equal for equal inputs to the vision tower, whatever file, format or request they came from."""
    if not isinstance(pixels, np.ndarray):
        h = hashlib.sha256(b"frames")
        for frame in pixels:
            h.update(digest(frame))
        return h.digest()
    h = hashlib.sha256(repr((pixels.shape, str(pixels.dtype))).encode())
    h.update(np.ascontiguousarray(pixels).data)
    return h.digest()


def _side(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIDE:
        raise ConfigError(f"{where} must be an integer in [1, {MAX_SIDE}], got {shown(value)}")
    return value


def _triple(value: Any, where: str) -> tuple[float, float, float]:
    values = [value] * 3 if is_finite_number(value) else value
    if not isinstance(values, list) or len(values) != 3 or not all(is_finite_number(v) for v in values):
        raise ConfigError(f"{where} must be a number or a list of 3 numbers, got {shown(value)}")
    return tuple(float(v) for v in values)  # type: ignore[return-value]
