"""Images from callers, read as hostile input: one RGB picture each, or an ImageError naming what is wrong.

A picture arrives as a path, bytes, a `data:` URL, a PIL image or a NumPy array. Every decoder here bounds its
work before it runs: the byte count first, then the dimensions Pillow reads from the header, before any pixel is
decoded (a decompression bomb states its size up front). Only raster formats Pillow decodes natively are opened
(PNG, JPEG, WebP, GIF, BMP); SVG and the rest are refused with what to do. The pixels come out as transformers'
image processors see them: EXIF orientation applied, transparency composited onto white, 16-bit samples scaled to
8 bits, the first frame of an animation.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError
from ..untrusted import NotRegularFileError, TooLargeError, read_capped, shown, shown_path

log = logging.getLogger(__name__)

MAX_IMAGE_BYTES = 32 << 20  # an encoded image; a 12-megapixel photo is 3-8 MB
MAX_IMAGE_PIXELS = 50_000_000  # decoded width x height: a 50-megapixel RGB image is 150 MB of pixels
MAX_IMAGES = 16  # per request
MAX_REQUEST_PIXELS = 100_000_000  # per request, all images together
MAX_FETCHED_BYTES = 64 << 20  # per request, all images fetched from web addresses together
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[\w.+-]+)*(?P<b64>;base64)?,", re.ASCII)


@dataclass(frozen=True)
class Limits:
    """What reading images may cost: each one (encoded bytes, decoded pixels) and a request's together."""

    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    max_images: int = MAX_IMAGES
    max_total_pixels: int = MAX_REQUEST_PIXELS
    max_fetched_bytes: int = MAX_FETCHED_BYTES
    rest_of_request: bool = False  # max_pixels is what the request's earlier images left of max_total_pixels


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Opened:
    """An image whose header was read and checked: its upright size is known, its pixels not decoded yet."""

    where: str
    size: tuple[int, int]  # (width, height), as it will be seen (EXIF rotation applied)
    decode: Callable[[], np.ndarray]  # -> RGB uint8 (height, width, 3); ImageError if the data is corrupt

    def rgb(self) -> np.ndarray:
        return self.decode()


def open_images(sources: list[tuple[str, Any]], limits: Limits = DEFAULT_LIMITS) -> list[Opened]:
    """Each (where, source) opened as `open_image` does: refused past `limits.max_images` before any is read, and
    past `limits.max_total_pixels` at the header of the image that would cross it (no pixel decoded yet)."""
    check_count(len(sources), limits)
    out: list[Opened] = []
    left = limits.max_total_pixels
    for where, source in sources:
        each = replace(limits, max_pixels=min(limits.max_pixels, left), rest_of_request=left < limits.max_pixels)
        out.append(open_image(source, where, each))
        left -= out[-1].size[0] * out[-1].size[1]
    return out


def check_count(images: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """An ImageError for more images in one request than `limits.max_images`."""
    if images > limits.max_images:
        raise ImageError(f"{images} images in one request; at most {limits.max_images} are allowed")


def read_images(sources: list[tuple[str, Any]], limits: Limits = DEFAULT_LIMITS) -> list[np.ndarray]:
    """`open_images`, then each decoded."""
    return [opened.rgb() for opened in open_images(sources, limits)]


def read_image(source: Any, where: str = "image", limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """The picture in `source` as an RGB uint8 array of shape (height, width, 3).

    `source`: a path (str or Path), bytes, a `data:image/...;base64,` URL, a PIL image or a NumPy array (H, W),
    (H, W, 3) or (H, W, 4), uint8 or float in [0, 1]. `where` names it in errors ("messages[0].content[1]").

    Example:
        >>> read_image("photo.jpg").shape
        (600, 512, 3)
    """
    return open_image(source, where, limits).rgb()


def open_image(source: Any, where: str = "image", limits: Limits = DEFAULT_LIMITS) -> Opened:
    """`source` (as read_image takes it) with its header read and its size checked; decoded by `.rgb()`."""
    if isinstance(source, np.ndarray):
        size = _array_size(source, where)
        _check_size(size, where, limits)
        return Opened(where, size, lambda: _from_array(source, where, limits))
    if _is_pil(source):
        _check_size(source.size, where, limits)
        return Opened(where, _upright(source), lambda: _from_pil(source, where, limits))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _open_encoded(bytes(source), where, limits)
    if isinstance(source, str) and source.startswith("data:"):
        return _open_encoded(data_url_bytes(source, where, limits), where, limits)
    if isinstance(source, (str, Path)):
        return _open_encoded(_file_bytes(Path(source).expanduser(), where, limits), where, limits)
    raise ImageError(f"{where}: expected a path, bytes, a data: URL, a PIL image or a NumPy array, got {shown(source)}")


def file_data_url(path: str | Path, where: str = "image", limits: Limits = DEFAULT_LIMITS) -> str:
    """An image file's bytes as a base64 `data:` URL (what a server reads), checked to be an image first."""
    data = _file_bytes(Path(path).expanduser(), where, limits)
    decode_image(data, f"{where} {shown_path(path)}", limits)  # fails here, naming the file, not in an answer
    return "data:;base64," + base64.b64encode(data).decode("ascii")


def data_url_bytes(url: str, where: str, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The bytes of a base64 `data:` URL (an image type or none), bounded before decoding."""
    match = _DATA_URL.match(url[:256])
    if match is None or not match.group("b64"):
        raise ImageError(f"{where}: a data: URL must be data:image/<type>;base64,<data>")
    kind = match.group("type") or "image/*"
    if not kind.startswith("image/"):
        raise ImageError(f"{where}: the data: URL holds {shown(kind)}, not an image")
    return base64_bytes(url[match.end() :], where, limits)


def base64_bytes(text: str, where: str, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Standard base64 text decoded, refused unread when it would decode past `limits.max_bytes`."""
    if len(text) > (limits.max_bytes + 2) // 3 * 4 + 4:
        raise ImageError(f"{where}: the image is more than {limits.max_bytes >> 20} MiB; send a smaller one")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: not valid base64; encode the image's bytes with standard base64") from None


def decode_image(data: bytes, where: str, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """An encoded image's pixels (RGB uint8), its size checked from the header before decoding."""
    return _open_encoded(data, where, limits).rgb()


def _open_encoded(data: bytes, where: str, limits: Limits) -> Opened:
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: the image is more than {limits.max_bytes >> 20} MiB; send a smaller one")
    if _looks_like_svg(data):
        raise ImageError(f"{where}: SVG images are not supported; convert it to PNG first")
    from PIL import Image  # Pillow is a dependency; imported where images are read

    with _decoding(where, limits):
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        _check_size(image.size, where, limits)
        size = _upright(image)

    def decode() -> np.ndarray:
        with _decoding(where, limits):
            return _from_pil(image, where, limits)

    return Opened(where, size, decode)


@contextmanager
def _decoding(where: str, limits: Limits) -> Iterator[None]:
    """Pillow's errors while opening or decoding, as one-line ImageErrors naming `where`."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{where}: not an image in a supported format ({', '.join(FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(
            f"{where}: the image states more than {limits.max_pixels:,} pixels; send a smaller one"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt data, a bad header field
        raise ImageError(f"{where}: the image is truncated or corrupt ({_reason(e)}); send the whole file") from None


def _upright(image: Any) -> tuple[int, int]:
    """(width, height) once EXIF orientation is applied (read from the header: 5-8 turn the picture a quarter)."""
    width, height = image.size
    orientation = image.getexif().get(0x0112, 1)
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def _file_bytes(path: Path, where: str, limits: Limits) -> bytes:
    try:
        return read_capped(path, limits.max_bytes)
    except TooLargeError:
        raise ImageError(f"{where}: {shown_path(path)} is more than {limits.max_bytes >> 20} MiB") from None
    except NotRegularFileError:
        raise ImageError(f"{where}: {shown_path(path)} is not a regular file") from None
    except OSError as e:
        raise ImageError(f"{where}: {shown_path(path)} cannot be read ({e.strerror or type(e).__name__})") from None


def _from_pil(image: Any, where: str, limits: Limits) -> np.ndarray:
    """A PIL image's first frame, upright, as RGB uint8 (alpha composited onto white)."""
    from PIL import Image, ImageOps

    _check_size(image.size, where, limits)
    frames = getattr(image, "n_frames", 1)
    if frames > 1:
        log.info("%s is animated (%d frames): its first frame is used", where, frames)
        image.seek(0)
    image = ImageOps.exif_transpose(image)  # as transformers' load_image; a rotated photo reads upright
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        return _gray16(np.asarray(image))
    if image.mode == "F":
        return _from_array(np.asarray(image), where, limits)
    if image.mode == "RGB":
        return np.asarray(image.convert("RGB"))
    # transformers' convert_rgb: through RGBA, composited onto white (palette, LA, CMYK, RGBA alike).
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))


def _gray16(samples: np.ndarray) -> np.ndarray:
    """16-bit (or 32-bit integer) grayscale scaled to 8 bits, as RGB: Pillow's own conversion clips at 255."""
    top = 65535 if samples.max(initial=0) > 255 or samples.dtype != np.int32 else 255
    gray = np.clip(samples.astype(np.float64) * (255.0 / top), 0, 255).round().astype(np.uint8)
    return np.repeat(gray[..., None], 3, axis=2)


def _array_size(array: np.ndarray, where: str) -> tuple[int, int]:
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
        raise ImageError(f"{where}: an image array must be (H, W), (H, W, 3) or (H, W, 4), got {array.shape}")
    return array.shape[1], array.shape[0]


def _from_array(array: np.ndarray, where: str, limits: Limits) -> np.ndarray:
    _check_size(_array_size(array, where), where, limits)
    if array.dtype.kind == "f":
        if not np.isfinite(array).all():
            raise ImageError(f"{where}: the image array holds NaN or infinite values")
        array = np.clip(array, 0.0, 1.0) * 255.0 + 0.5
    elif array.dtype != np.uint8:
        raise ImageError(f"{where}: an image array must be uint8 (0-255) or float (0-1), got {array.dtype}")
    array = array.astype(np.uint8)
    if array.ndim == 2 or array.shape[2] == 1:
        return np.repeat(array.reshape(array.shape[0], array.shape[1], 1), 3, axis=2)
    if array.shape[2] == 4:
        alpha = array[..., 3:].astype(np.float32) / 255.0
        return (array[..., :3] * alpha + 255.0 * (1 - alpha) + 0.5).astype(np.uint8)
    return np.ascontiguousarray(array)


def _check_size(size: tuple[int, int], where: str, limits: Limits) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"{where}: the image is empty ({width}x{height})")
    if width * height > limits.max_pixels and limits.rest_of_request:
        raise ImageError(
            f"{where}: with it the request's images are more than the {limits.max_total_pixels:,} pixels allowed "
            "together; send fewer or smaller ones"
        )
    if width * height > limits.max_pixels:
        raise ImageError(
            f"{where}: the image is {width}x{height} pixels, more than the {limits.max_pixels:,} allowed; "
            "send a smaller one"
        )


def _looks_like_svg(data: bytes) -> bool:
    head = data[:512].lstrip().lower()
    return head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in data[:4096].lower())


def _is_pil(source: Any) -> bool:
    return type(source).__module__.startswith("PIL.") and hasattr(source, "convert")


def _reason(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text[:120]
