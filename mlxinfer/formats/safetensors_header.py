"""Check a safetensors file's header before MLX reads it.

The format is an 8-byte little-endian header length, a JSON header mapping each
tensor to dtype/shape/data_offsets, then the data. A truncated or crafted file
(offsets past the end, overlapping tensors, shapes that do not match their byte
span) would otherwise reach native code; here it becomes a CorruptFileError.
See https://github.com/huggingface/safetensors#format
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptFileError
from ..untrusted import shown

# The dtypes MLX loads; safetensors also defines F8_* and F64, which it does not.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8,
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})
MAX_DIM = 2**31 - 1  # MLX shapes are 32-bit
MAX_DIMS = 8  # real tensors have at most 5
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Return every tensor's dtype and shape, or raise CorruptFileError naming the problem."""
    raw, size, header_len = _read_raw_header(path)
    try:
        header = parse_json(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptFileError(f"{path}: header is not valid JSON ({type(e).__name__}); re-download the file") from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: header must be a JSON object")
    metadata = header.pop("__metadata__", None) or {}  # MLX writes null
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptFileError(f"{path}: __metadata__ must map strings to strings")
    return check_tensors(path, header, size - 8 - header_len)


def parse_json(raw: bytes) -> object:
    """A header's JSON, refusing NaN and Infinity (not JSON, yet Python's parser takes them); ValueError if bad."""
    return json.loads(raw, parse_constant=_refuse_constant)


def check_tensors(source: Path | str, header: dict, data_bytes: int) -> dict[str, TensorInfo]:
    """Every entry of a parsed header (without __metadata__) checked against the `data_bytes` after it: dtype,
    shape, offsets inside the data and no two tensors overlapping; CorruptFileError naming `source` if not."""
    tensors = {name: _check_entry(source, name, entry, data_bytes) for name, entry in header.items()}
    _check_no_overlap(source, header)
    return tensors


def _read_raw_header(path: Path) -> tuple[bytes, int, int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CorruptFileError(f"{path}: {size} bytes is too short for a safetensors file; re-download it")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CorruptFileError(
                    f"{path}: header length {header_len} exceeds the file ({size} bytes); "
                    "the file is truncated or not safetensors"
                )
            return f.read(header_len), size, header_len
    except OSError as e:
        raise CorruptFileError(f"{path}: cannot be read ({e.strerror or e})") from None


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _check_entry(path: Path, name: str, entry: object, data_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CorruptFileError(f"{path}: tensor {shown(name)} has a malformed header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise CorruptFileError(f"{path}: tensor {shown(name)} has dtype {shown(dtype)}, which is not supported")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) and d <= MAX_DIM for d in shape):
        raise CorruptFileError(f"{path}: tensor {shown(name)} has invalid shape {shown(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CorruptFileError(f"{path}: tensor {shown(name)} has invalid data_offsets {shown(offsets)}")
    begin, end = offsets
    if not begin <= end <= data_bytes:
        raise CorruptFileError(
            f"{path}: tensor {shown(name)} spans bytes [{begin}, {end}) but the data section has {data_bytes}; "
            "the file is truncated — re-download it"
        )
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise CorruptFileError(
            f"{path}: tensor {shown(name)} of shape {shown(shape)} {dtype} needs {expected} bytes "
            f"but spans {end - begin}"
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape))


def _check_no_overlap(path: Path, header: dict) -> None:
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], n) for n, e in header.items())
    furthest, owner = 0, None
    for begin, end, name in spans:
        if end == begin:
            continue  # empty tensors take no bytes
        if begin < furthest:
            raise CorruptFileError(f"{path}: tensors {shown(owner)} and {shown(name)} overlap")
        if end > furthest:
            furthest, owner = end, name


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
