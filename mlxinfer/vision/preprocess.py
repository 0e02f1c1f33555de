"""A model's image processor, as its preprocessor_config.json states it: RGB pixels in, `pixel_values` out.

NumPy and Pillow only (no torch at run time). The steps and their order are transformers' PIL image processors':
resize with Pillow's filter on the 8-bit image, rescale (1/255), normalize by mean and std, channels first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, UnsupportedModelError
from ..untrusted import is_finite_number, read_json_object, shown

PREPROCESSOR_FILE = "preprocessor_config.json"
MAX_SIDE = 4096  # a processor's target side; real ones use 224-1540
RESAMPLE = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}  # PIL's codes


@dataclass(frozen=True)
class ImageProcessor:
    """Fixed-size resizing (Gemma 3, SigLIP): every image becomes `height` x `width`."""

    height: int
    width: int
    resample: int = 2
    rescale: float | None = 1 / 255
    mean: tuple[float, float, float] | None = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] | None = (0.5, 0.5, 0.5)

    @classmethod
    def from_folder(cls, folder: Path) -> ImageProcessor:
        """The processor of a model folder (ConfigError if its preprocessor_config.json is missing or bad)."""
        path = folder / PREPROCESSOR_FILE
        if not path.is_file():
            raise ConfigError(f"{folder}: {PREPROCESSOR_FILE} is missing; a vision model needs its image processor")
        return cls.from_config(read_json_object(path, ConfigError), str(path))

    @classmethod
    def from_config(cls, raw: dict[str, Any], source: str) -> ImageProcessor:
        if raw.get("do_pan_and_scan"):
            raise UnsupportedModelError(f"{source}: do_pan_and_scan is not supported yet; set it to null")
        size = raw.get("size")
        if not isinstance(size, dict) or not {"height", "width"} <= set(size):
            raise UnsupportedModelError(f"{source}: size must be {{height, width}}, got {shown(size)}")
        height, width = (_side(size[k], f"{source}: size.{k}") for k in ("height", "width"))
        resample = raw.get("resample", 2)
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
        return cls(height, width, resample, rescale, mean, std)

    def pixels(self, rgb: np.ndarray) -> np.ndarray:
        """`pixel_values` of one RGB uint8 image (H, W, 3): float32 (3, height, width)."""
        from PIL import Image

        image = Image.fromarray(rgb, "RGB")
        if image.size != (self.width, self.height):
            image = image.resize((self.width, self.height), resample=Image.Resampling(self.resample))
        values = np.asarray(image, dtype=np.float64)
        if self.rescale is not None:
            values = values * self.rescale
        if self.mean is not None and self.std is not None:
            values = (values - np.array(self.mean)) / np.array(self.std)
        return np.ascontiguousarray(values.transpose(2, 0, 1), dtype=np.float32)


def digest(pixels: np.ndarray) -> bytes:
    """The content hash of an image's pixel_values: equal for equal inputs to the vision tower, whatever file,
    format or request they came from."""
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
