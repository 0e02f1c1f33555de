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

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Return every tensor's dtype and shape, or raise CorruptFileError naming the problem."""
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
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path}: header is not valid JSON ({e}); re-download the file") from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: header must be a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_len
    tensors = {name: _check_entry(path, name, entry, data_bytes) for name, entry in header.items()}
    _check_no_overlap(path, header)
    return tensors


def _check_entry(path: Path, name: str, entry: object, data_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CorruptFileError(f"{path}: tensor {name!r} has a malformed header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CorruptFileError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CorruptFileError(f"{path}: tensor {name!r} has invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CorruptFileError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not begin <= end <= data_bytes:
        raise CorruptFileError(
            f"{path}: tensor {name!r} spans bytes [{begin}, {end}) but the data section has {data_bytes}; "
            "the file is truncated — re-download it"
        )
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise CorruptFileError(
            f"{path}: tensor {name!r} of shape {shape} {dtype} needs {expected} bytes but spans {end - begin}"
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape))


def _check_no_overlap(path: Path, header: dict) -> None:
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], n) for n, e in header.items())
    for (_, prev_end, prev_name), (begin, end, name) in zip(spans, spans[1:]):
        if begin < prev_end and end > begin:
            raise CorruptFileError(f"{path}: tensors {prev_name!r} and {name!r} overlap")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
