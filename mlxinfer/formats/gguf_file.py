"""A bounds-checked GGUF reader that streams one tensor at a time.

Every count, length, dimension and offset in the header is checked against the
file before it is used, so a crafted or truncated file raises CorruptFileError
instead of reaching native code. Q4_0, Q4_1 and Q8_0 blocks are repacked into
MLX's affine layout exactly (same grid, no second rounding), MXFP4 blocks into
MLX's mxfp4 layout (same codes and exponents); other types are dequantized with
the `gguf` package. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptFileError, UnsupportedModelError
from ..untrusted import is_int, plain, shown
from .safetensors_header import MAX_DIM

MAX_COUNT = 1 << 24  # tensors, metadata keys or array items: far above any real model
MAX_DIMS = 4
MAX_DEPTH = 8  # arrays of arrays: real files nest none; each level is a Python call
MAX_ALIGNMENT = 1 << 20  # llama.cpp writes 32
MAX_FILE_BYTES = 1 << 44  # 16 TiB: a larger tensor offset is garbage, not a big model
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
F32, F16, Q4_0, Q4_1, Q8_0, BF16, MXFP4 = 0, 1, 2, 3, 8, 30, 39
# type -> (elements per block, bytes per block)
_BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), MXFP4: (32, 17)}
REPACKED = (Q4_0, Q4_1, Q8_0, MXFP4)  # kept quantized (read() returns a QuantizedTensor); other types become floats


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
    scales: np.ndarray  # float16 (affine) or uint8 (mxfp4: the power of two 2**(s - 127))
    biases: np.ndarray | None  # float16; None for mxfp4
    bits: int
    group_size: int
    mode: str = "affine"


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
        self._pos = 0
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

    def read(self, name: str) -> np.ndarray | QuantizedTensor:
        """One tensor: a float array, or a QuantizedTensor for Q4_0/Q4_1/Q8_0/MXFP4."""
        info = self.tensors[name]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if info.ggml_type == F32:
            return raw.view(np.float32).reshape(info.shape)
        if info.ggml_type == F16:
            return raw.view(np.float16).reshape(info.shape)
        if info.ggml_type == BF16:
            return raw.view(np.uint16).reshape(info.shape)  # caller views as bfloat16
        if info.ggml_type == MXFP4:
            return _repack_mxfp4(raw, info)
        if info.ggml_type in REPACKED:
            return _repack(raw, info)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(raw, GGMLQuantizationType(info.ggml_type)).reshape(info.shape)

    # -- header parsing, every read bounds-checked -------------------------------------

    def _take(self, n: int, what: str) -> bytes:
        if n < 0 or self._pos + n > len(self._map):
            raise CorruptFileError(
                f"{self.path}: the file ends inside its header ({what}): it is incomplete or not GGUF; "
                "download it again"
            )
        data = self._map[self._pos : self._pos + n]
        self._pos += n
        return data

    def _scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), what))[0]

    def _count(self, what: str, limit: int = MAX_COUNT) -> int:
        value = self._scalar("<Q", what)
        if value > limit:
            raise CorruptFileError(f"{self.path}: {what} is {value}, more than the limit {limit}")
        return value

    def _string(self, what: str) -> str:
        length = self._count(f"length of {what}", limit=len(self._map))
        try:
            return self._take(length, what).decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptFileError(f"{self.path}: {what} is not UTF-8") from None

    def _value(self, kind: int, key: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind], f"value of {key}")
        if kind == STRING:
            return self._string(f"value of {key}")
        if kind == ARRAY:
            if depth >= MAX_DEPTH:
                raise CorruptFileError(f"{self.path}: metadata {key} nests arrays deeper than {MAX_DEPTH}")
            item_kind = self._scalar("<I", f"item type of {key}")
            count = self._count(f"item count of {key}")
            if item_kind in _SCALARS:  # read numeric arrays in one go
                size = struct.calcsize(_SCALARS[item_kind])
                data = self._take(count * size, f"items of {key}")
                return np.frombuffer(data, dtype=np.dtype(_SCALARS[item_kind])).tolist()
            return [self._value(item_kind, key, depth + 1) for _ in range(count)]
        raise CorruptFileError(f"{self.path}: metadata {key} has unknown value type {kind}")

    def _parse(self) -> None:
        if self._take(4, "magic") != b"GGUF":
            raise CorruptFileError(f"{self.path}: not a GGUF file (bad magic)")
        version = self._scalar("<I", "version")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors = self._count("tensor count")
        n_keys = self._count("metadata key count")
        for _ in range(n_keys):
            key = self._string("metadata key")
            label = plain(key)
            if key in self.metadata:
                raise CorruptFileError(f"{self.path}: metadata key {label} appears twice")
            self.metadata[key] = self._value(self._scalar("<I", f"type of {label}"), label)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", 32)
        if not is_int(alignment) or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
            raise CorruptFileError(
                f"{self.path}: general.alignment={shown(alignment)} is not a power of two up to {MAX_ALIGNMENT}"
            )
        data_start = -(-self._pos // alignment) * alignment
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
        # download (the case) needs no more than that packed span; an end past it is an
        # offset no writer wrote: a damaged or crafted header, not a short file.
        packed = data_start + sum(-(-t.nbytes // alignment) * alignment for t in self.tensors.values())
        why = "it is incomplete" if end <= packed else "its header is damaged (the offset is past all the tensors)"
        raise CorruptFileError(
            f"{self.path}: the file is cut off or corrupt: tensor {plain(last.name)} needs bytes up to {end:,} "
            f"but the file has {size:,}; {why}: download it again"
        )

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("tensor name")
        label = plain(name)
        n_dims = self._scalar("<I", f"dimension count of {label}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CorruptFileError(f"{self.path}: tensor {label} has {n_dims} dimensions")
        limit = min(MAX_DIM, len(self._map) * 32)
        dims = [self._count(f"dimension of {label}", limit=limit) for _ in range(n_dims)]
        kind = self._scalar("<I", f"type of {label}")
        offset = self._count(f"offset of {label}", limit=MAX_FILE_BYTES)  # past the end: checked once, in _parse
        return name, tuple(reversed(dims)), kind, offset

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
    """GGUF Q4_0/Q4_1/Q8_0 blocks of 32 -> MLX affine (w = scale * q + bias), exactly."""
    rows, cols = int(np.prod(info.shape[:-1])), info.shape[-1]
    _, block_bytes = _BLOCKS[info.ggml_type]
    blocks = raw.reshape(rows, cols // 32, block_bytes)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if info.ggml_type == Q8_0:
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128  # signed -> unsigned grid
        bias = (scale.astype(np.float32) * -128).astype(np.float16)
        return _shaped(QuantizedTensor(_pack(q.reshape(rows, cols), 8), scale, bias, 8, 32), info.shape)
    if info.ggml_type == Q4_1:
        bias, nibbles = blocks[..., 2:4].copy().view(np.float16)[..., 0], blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8)
        bias, nibbles = (scale.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]
    # Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return _shaped(QuantizedTensor(_pack(q.reshape(rows, cols), 4), scale, bias, 4, 32), info.shape)


def _repack_mxfp4(raw: np.ndarray, info: TensorInfo) -> QuantizedTensor:
    """GGUF MXFP4 blocks of 32 -> MLX mxfp4, exactly: the same 4-bit codes and E8M0 exponents, reordered.

    llama.cpp's block_mxfp4 is one exponent byte e, then 16 bytes whose low nibble is element j and high
    nibble element j + 16. Its values kvalues_mxfp4[q] * 2**(e - 127) / 2 are OCP E2M1[q] * 2**(e - 127)
    (the table is E2M1 doubled), which is how MLX's mxfp4 reads code q with scale byte e."""
    rows, cols = int(np.prod(info.shape[:-1])), info.shape[-1]
    blocks = raw.reshape(rows, cols // 32, 17)
    exponents, nibbles = blocks[..., 0].copy(), blocks[..., 1:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # (rows, cols / 32, 32), in element order
    return _shaped(QuantizedTensor(_pack(q.reshape(rows, cols), 4), exponents, None, 4, 32, "mxfp4"), info.shape)


def _shaped(t: QuantizedTensor, shape: tuple[int, ...]) -> QuantizedTensor:
    """The tensor with its leading axes back (stacked experts are (experts, out, in))."""
    lead = shape[:-1]
    biases = None if t.biases is None else t.biases.reshape(*lead, -1)
    return QuantizedTensor(
        t.weight.reshape(*lead, -1), t.scales.reshape(*lead, -1), biases, t.bits, t.group_size, t.mode
    )


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned values (rows, cols) into uint32 words, value k at bits [k*bits, (k+1)*bits)."""
    per_word = 32 // bits
    q = q.astype(np.uint32).reshape(q.shape[0], -1, per_word)
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    return np.bitwise_or.reduce(q << shifts, axis=-1)
