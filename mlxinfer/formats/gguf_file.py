"""A bounds-checked GGUF reader: the whole header (GGUFFile, streaming one tensor at a time) or a few keys.

Every count, length, dimension and offset in the header is checked against the
file before it is used, so a crafted or truncated file raises CorruptFileError
instead of reaching native code. Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks, and Q4_K
and Q5_K sub-blocks (gguf_kquants.py), are repacked into MLX's affine layout exactly
(same grid, no second rounding), MXFP4 blocks into MLX's mxfp4 layout (same codes
and exponents); Q2_K, Q3_K, Q6_K and the IQ and TQ types are dequantized with the `gguf`
package and rounded once onto the MLX affine type that measured closest (gguf_requant.py).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import CorruptFileError, UnsupportedModelError
from ..untrusted import is_int, plain, shown
from .gguf_kquants import K_BLOCKS, by_rows, pack_bits, repack_k
from .gguf_requant import REQUANTIZED, requantize
from .safetensors_header import MAX_DIM

MAGIC = b"GGUF"
MAX_COUNT = 1 << 24  # tensors, metadata keys or array items: far above any real model
MAX_KEY_BYTES = (1 << 16) - 1  # the format's own limit on a metadata key
MAX_DIMS = 4
MAX_DEPTH = 8  # arrays of arrays: real files nest none; each level is a Python call
MAX_ALIGNMENT = 1 << 20  # llama.cpp writes 32
MAX_FILE_BYTES = 1 << 44  # 16 TiB: a larger tensor offset is garbage, not a big model
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16, MXFP4 = 0, 1, 2, 3, 6, 7, 8, 30, 39
# type -> (elements per block, bytes per block)
_BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), MXFP4: (32, 17)}
_BLOCKS.update({Q5_0: (32, 22), Q5_1: (32, 24)})
_BLOCKS.update({kind: (256, block_bytes) for kind, (block_bytes, _) in K_BLOCKS.items()})
# The MLX affine grid (bits, group size) each type is kept on: exactly its own codes (the types of 32-value
# blocks and sub-blocks), or rounded once (gguf_requant.py: 16-value sub-blocks and codebooks). MXFP4 is mxfp4.
AFFINE = {Q4_0: (4, 32), Q4_1: (4, 32), Q5_0: (5, 32), Q5_1: (5, 32), Q8_0: (8, 32)}
AFFINE |= {kind: (bits, 32) for kind, (_, bits) in K_BLOCKS.items()} | REQUANTIZED
REPACKED = (*AFFINE, MXFP4)  # kept quantized (read() returns a QuantizedTensor)
# Bytes of each scale and bias read() returns: float16 as the legacy types store them, float32 otherwise.
SCALE_BYTES = {kind: 2 if kind in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) else 4 for kind in AFFINE}
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major, as numpy sees it (GGUF stores dims innermost first)
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class QuantizedTensor:
    """An MLX-quantized tensor as `mx.quantize` returns it (numpy arrays): affine (weight, scales,
    biases) or mxfp4 (weight and E8M0 exponents, no biases)."""

    weight: np.ndarray  # uint32, packed along the last axis
    # float16 (affine, as stored), float32 (Q4_K/Q5_K: d*sc, which float16 would round; the re-rounded types) or
    # uint8 (mxfp4: the power of two 2**(s - 127)); the loader casts float scales and biases to the compute dtype.
    scales: np.ndarray
    biases: np.ndarray | None  # as scales; None for mxfp4
    bits: int
    group_size: int
    mode: str = "affine"


def is_gguf(path: Path) -> bool:
    """Whether the file at `path` starts with GGUF's magic; raises OSError when it cannot be read."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def read_metadata(
    path: Path,
    wanted: Collection[str],
    *,
    max_keys: int = MAX_COUNT,
    max_value_bytes: int = 1 << 20,
    max_skipped_items: int = MAX_COUNT,
) -> dict[str, Any]:
    """The `wanted` keys' scalar and string values from a GGUF header, reading as little of the file as it can.

    Keys are walked in file order until every wanted one is found; the tensor table is never reached. Every other
    value is stepped over by its size, unread: an array of numbers in one seek, an array of strings (a vocabulary)
    one length per item. The walk ends, returning what it found, after `max_keys` keys or before an array whose
    items would take it past `max_skipped_items` in all. A wanted string longer than `max_value_bytes`, or a wanted
    array, is stepped over as if it were not wanted. The file is read, not mapped, so one that shrinks meanwhile
    raises rather than faulting.

    Raises CorruptFileError for a malformed header (not GGUF, cut off, a length past the file's end),
    UnsupportedModelError for a GGUF version other than 2 or 3, and OSError when the file cannot be read.

    Example:
        >>> read_metadata(Path("SmolLM2.gguf"), {"general.architecture"}, max_keys=64)
        {'general.architecture': 'llama'}
    """
    wanted, found = frozenset(wanted), {}
    with open(path, "rb") as f:
        header = _Header(f, os.fstat(f.fileno()).st_size, Path(path), max_skipped_items)
        _, n_keys = header.start()
        for _ in range(min(n_keys, max_keys)):
            key, label, kind = header.key()
            if key not in wanted or kind == ARRAY:
                if not header.skip_value(kind, label):
                    break  # the next array alone would pass the walk's limit on items
            elif kind == STRING:
                length = header.count(f"length of value of {label}", header.size)
                if length <= max_value_bytes:
                    found[key] = header.text(length, f"value of {label}")
                else:
                    header.skip(length, f"value of {label}")
            else:
                found[key] = header.value(kind, label)
            if len(found) == len(wanted):
                break
    return found


class _Header:
    """A cursor over a GGUF header in `stream` (the file, or its mmap) of `size` bytes.

    Every length is checked against `size` before anything is read or skipped, and a read that comes back short
    (a file cut meanwhile) is refused the same way. `skip_budget` bounds the array items skip_value() steps over
    one by one (the only skipping whose cost grows with the file)."""

    def __init__(self, stream: BinaryIO | mmap.mmap, size: int, path: Path, skip_budget: int = MAX_COUNT):
        self.stream, self.size, self.path, self.pos, self.skip_budget = stream, size, path, 0, skip_budget

    def start(self) -> tuple[int, int]:
        """Checks the magic and version; returns (tensor count, metadata key count)."""
        if self.take(4, "magic") != MAGIC:
            raise CorruptFileError(f"{self.path}: not a GGUF file (bad magic)")
        version = self.scalar("<I", "version")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        return self.count("tensor count"), self.count("metadata key count")

    def key(self) -> tuple[str, str, int]:
        """The next metadata key, as read and as shown in messages, and its value type."""
        key = self.string("metadata key", limit=MAX_KEY_BYTES)
        label = plain(key)
        return key, label, self.scalar("<I", f"type of {label}")

    def _cut(self, what: str) -> CorruptFileError:
        return CorruptFileError(
            f"{self.path}: the file ends inside its header ({what}): it is incomplete or not GGUF; download it again"
        )

    # take, count and string run for each entry of a vocabulary (10^5 of them): each stays one flat call.

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if n < 0 or end > self.size:
            raise self._cut(what)
        data = self.stream.read(n)
        if len(data) < n:  # the file was cut after its size was taken
            raise self._cut(what)
        self.pos = end
        return data

    def skip(self, n: int, what: str) -> None:
        end = self.pos + n
        if n < 0 or end > self.size:
            raise self._cut(what)
        self.pos = end
        self.stream.seek(end)

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, limit: int = MAX_COUNT) -> int:
        value = _U64.unpack(self.take(8, what))[0]
        if value > limit:
            raise CorruptFileError(f"{self.path}: {what} is {value}, more than the limit {limit}")
        return value

    def string(self, what: str, limit: int | None = None) -> str:
        """A UTF-8 string of at most `limit` bytes (default: the file's size)."""
        return self.text(self.count(f"length of {what}", self.size if limit is None else limit), what)

    def text(self, length: int, what: str) -> str:
        """The UTF-8 text of a string whose length was just read."""
        try:
            return self.take(length, what).decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptFileError(f"{self.path}: {what} is not UTF-8") from None

    def value(self, kind: int, key: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], f"value of {key}")
        if kind == STRING:
            return self.string(f"value of {key}")
        if kind == ARRAY:
            item_kind, count = self._array(key, depth)
            if item_kind in _SCALARS:  # read numeric arrays in one go
                size = struct.calcsize(_SCALARS[item_kind])
                data = self.take(count * size, f"items of {key}")
                return np.frombuffer(data, dtype=np.dtype(_SCALARS[item_kind])).tolist()
            if item_kind == STRING:  # a vocabulary: no value() call per item
                what = f"value of {key}"
                return [self.string(what) for _ in range(count)]
            return [self.value(item_kind, key, depth + 1) for _ in range(count)]
        raise CorruptFileError(f"{self.path}: metadata {key} has unknown value type {kind}")

    def skip_value(self, kind: int, key: str, depth: int = 0) -> bool:
        """Step over one value without reading it; False (nothing more read) when an array's items would spend more
        than what is left of skip_budget."""
        if kind in _SCALARS:
            self.skip(struct.calcsize(_SCALARS[kind]), f"value of {key}")
        elif kind == STRING:
            self.skip(self.count(f"length of value of {key}", limit=self.size), f"value of {key}")
        elif kind == ARRAY:
            item_kind, count = self._array(key, depth)
            if item_kind in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[item_kind]), f"items of {key}")
                return True
            if count > self.skip_budget:
                return False
            self.skip_budget -= count
            if item_kind == STRING:  # a vocabulary: one length read and one seek per item
                what = f"value of {key}"
                length = f"length of {what}"
                for _ in range(count):
                    self.skip(self.count(length, self.size), what)
                return True
            return all(self.skip_value(item_kind, key, depth + 1) for _ in range(count))
        else:
            raise CorruptFileError(f"{self.path}: metadata {key} has unknown value type {kind}")
        return True

    def _array(self, key: str, depth: int) -> tuple[int, int]:
        """An array's item type and count."""
        if depth >= MAX_DEPTH:
            raise CorruptFileError(f"{self.path}: metadata {key} nests arrays deeper than {MAX_DEPTH}")
        return self.scalar("<I", f"item type of {key}"), self.count(f"item count of {key}")

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string("tensor name")
        label = plain(name)
        n_dims = self.scalar("<I", f"dimension count of {label}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CorruptFileError(f"{self.path}: tensor {label} has {n_dims} dimensions")
        limit = min(MAX_DIM, self.size * 32)
        dims = [self.count(f"dimension of {label}", limit=limit) for _ in range(n_dims)]
        kind = self.scalar("<I", f"type of {label}")
        offset = self.count(f"offset of {label}", limit=MAX_FILE_BYTES)  # past the end: checked once, in _parse
        return name, tuple(reversed(dims)), kind, offset


class GGUFFile:
    """Open with `GGUFFile(path)`; `metadata`, `tensors`, then `read(name)` per tensor."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        try:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            self._file.close()
            raise CorruptFileError(f"{self.path}: empty file, not GGUF") from None
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            # numpy views of the map are still alive (a traceback being handled holds
            # them): the map closes when they go. Raising here would hide that error.
            pass
        self._file.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def raw(self, name: str) -> np.ndarray:
        """One tensor's stored bytes (uint8, a view of the file)."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def read(self, name: str) -> np.ndarray | QuantizedTensor:
        """One tensor: a float array, or a QuantizedTensor for the REPACKED types."""
        info = self.tensors[name]
        raw = self.raw(name)
        if info.ggml_type == F32:
            return raw.view(np.float32).reshape(info.shape)
        if info.ggml_type == F16:
            return raw.view(np.float16).reshape(info.shape)
        if info.ggml_type == BF16:
            return raw.view(np.uint16).reshape(info.shape)  # caller views as bfloat16
        if info.ggml_type == MXFP4:
            return _repack_mxfp4(raw, info)
        if info.ggml_type in K_BLOCKS:
            rows = math.prod(info.shape[:-1])
            weight, scales, biases, bits = repack_k(raw, rows, info.shape[-1], info.ggml_type)
            return _shaped(QuantizedTensor(weight, scales, biases, bits, 32), info.shape)
        if info.ggml_type in REQUANTIZED:
            rows = math.prod(info.shape[:-1])
            weight, scales, biases, bits, group = requantize(raw, rows, info.shape[-1], info.ggml_type)
            return _shaped(QuantizedTensor(weight, scales, biases, bits, group), info.shape)
        if info.ggml_type in REPACKED:
            return _repack(raw, info)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(raw, GGMLQuantizationType(info.ggml_type)).reshape(info.shape)

    def _parse(self) -> None:
        header = _Header(self._map, len(self._map), self.path)
        n_tensors, n_keys = header.start()
        for _ in range(n_keys):
            key, label, kind = header.key()
            if key in self.metadata:
                raise CorruptFileError(f"{self.path}: metadata key {label} appears twice")
            self.metadata[key] = header.value(kind, label)
        infos = [header.tensor_info() for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", 32)
        if not is_int(alignment) or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
            raise CorruptFileError(
                f"{self.path}: general.alignment={shown(alignment)} is not a power of two up to {MAX_ALIGNMENT}"
            )
        data_start = -(-header.pos // alignment) * alignment
        for name, shape, kind, offset in infos:
            if name in self.tensors:
                raise CorruptFileError(f"{self.path}: tensor {plain(name)} appears twice")
            self.tensors[name] = self._locate(name, shape, kind, data_start + offset)
        self._check_tensor_end(data_start, alignment)

    def _check_tensor_end(self, data_start: int, alignment: int) -> None:
        """Refuse a file whose tensor data runs past its end, naming the tensor; nothing is read before this."""
        size = len(self._map)
        last = max(self.tensors.values(), key=lambda t: t.offset + t.nbytes, default=None)
        if last is None or last.offset + last.nbytes <= size:
            return
        end = last.offset + last.nbytes
        # Writers pack the tensors one after another (each padded to the alignment), so a cut-off
        # download (the issue's case) needs no more than that packed span; an end past it is an
        # offset no writer wrote: a damaged or crafted header, not a short file.
        packed = data_start + sum(-(-t.nbytes // alignment) * alignment for t in self.tensors.values())
        why = "it is incomplete" if end <= packed else "its header is damaged (the offset is past all the tensors)"
        raise CorruptFileError(
            f"{self.path}: the file is cut off or corrupt: tensor {plain(last.name)} needs bytes up to {end:,} "
            f"but the file has {size:,}; {why}: download it again"
        )

    def _locate(self, name: str, shape: tuple[int, ...], kind: int, offset: int) -> TensorInfo:
        block, block_bytes = _block_size(kind, name, self.path)
        elements = math.prod(shape)  # exact: numpy's product would wrap around at 2**63
        if shape[-1] % block:
            raise CorruptFileError(f"{self.path}: tensor {plain(name)} row of {shape[-1]} is not a multiple of {block}")
        nbytes = elements // block * block_bytes
        return TensorInfo(name, shape, kind, offset, nbytes)


def _block_size(kind: int, name: str, path: Path) -> tuple[int, int]:
    if kind in _BLOCKS:
        return _BLOCKS[kind]
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        return GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ImportError, ValueError, KeyError):
        raise UnsupportedModelError(
            f"{path}: tensor {plain(name)} has GGML type {kind}, which is not supported"
        ) from None


def _repack(raw: np.ndarray, info: TensorInfo) -> QuantizedTensor:
    """GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks of 32 -> MLX affine (w = scale * q + bias), exactly; a slice of rows
    at a time (a 262,144-row Q8_0 embedding would otherwise hold ~2 GB of temporaries)."""
    rows, cols = int(np.prod(info.shape[:-1])), info.shape[-1]
    _, block_bytes = _BLOCKS[info.ggml_type]
    blocks = raw.reshape(rows, cols // 32, block_bytes)
    weight, scale, bias = by_rows(rows, cols, lambda part: _repack_rows(blocks[part], info.ggml_type))
    return _shaped(QuantizedTensor(weight, scale, bias, AFFINE[info.ggml_type][0], 32), info.shape)


def _repack_rows(blocks: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks (rows, blocks, bytes) of one legacy type -> (packed codes, float16 scales, float16 biases)."""
    rows = blocks.shape[0]
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == Q8_0:
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128  # signed -> unsigned grid
        return pack_bits(q.reshape(rows, -1), 8), scale, (scale.astype(np.float32) * -128).astype(np.float16)
    if kind in (Q5_0, Q5_1):  # d, [m (Q5_1)], 4 bytes whose bit j is element j's fifth bit, nibbles
        return _repack_q5(blocks, scale, kind == Q5_1)
    if kind == Q4_1:
        bias, nibbles = blocks[..., 2:4].copy().view(np.float16)[..., 0], blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8)
        bias, nibbles = (scale.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]
    # Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return pack_bits(q.reshape(rows, -1), 4), scale, bias


def _repack_q5(blocks: np.ndarray, scale: np.ndarray, has_min: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_1 (w = d * q + m) or Q5_0 (w = d * (q - 16)) blocks (rows, blocks, bytes) -> MLX affine 5-bit."""
    rows = blocks.shape[0]
    start = 4 if has_min else 2
    bias = (
        blocks[..., 2:4].copy().view(np.float16)[..., 0]
        if has_min
        else (scale.astype(np.float32) * -16).astype(np.float16)
    )
    high = (blocks[..., start : start + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1  # (rows, n, 32)
    nibbles = blocks[..., start + 4 :]  # as Q4_0's: element j low, element j + 16 high
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1) | (high << 4).astype(np.uint8)
    return pack_bits(q.reshape(rows, -1), 5), scale, bias


def _repack_mxfp4(raw: np.ndarray, info: TensorInfo) -> QuantizedTensor:
    """GGUF MXFP4 blocks of 32 -> MLX mxfp4, exactly: the same 4-bit codes and E8M0 exponents, reordered.

    llama.cpp's block_mxfp4 is one exponent byte e, then 16 bytes whose low nibble is element j and high
    nibble element j + 16. Its values kvalues_mxfp4[q] * 2**(e - 127) / 2 are OCP E2M1[q] * 2**(e - 127)
    (the table is E2M1 doubled), which is how MLX's mxfp4 reads code q with scale byte e."""
    rows, cols = int(np.prod(info.shape[:-1])), info.shape[-1]
    blocks = raw.reshape(rows, cols // 32, 17)

    def rows_of(part: slice) -> tuple[np.ndarray, np.ndarray]:
        nibbles = blocks[part, :, 1:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # (rows, cols / 32, 32), in element order
        return pack_bits(q.reshape(len(q), cols), 4), blocks[part, :, 0].copy()

    weight, exponents = by_rows(rows, cols, rows_of)
    return _shaped(QuantizedTensor(weight, exponents, None, 4, 32, "mxfp4"), info.shape)


def _shaped(t: QuantizedTensor, shape: tuple[int, ...]) -> QuantizedTensor:
    """The tensor with its leading axes back (stacked experts are (experts, out, in))."""
    lead = shape[:-1]
    biases = None if t.biases is None else t.biases.reshape(*lead, -1)
    return QuantizedTensor(
        t.weight.reshape(*lead, -1), t.scales.reshape(*lead, -1), biases, t.bits, t.group_size, t.mode
    )
