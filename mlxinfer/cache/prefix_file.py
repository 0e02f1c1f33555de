"""The file format of a warmed prefix: what one file holds and the checks before its KV is used.

One safetensors file per prefix, named after the hash of its token ids: the ids,
the full-attention layers' keys and values over all of them and, on a model with
layers that cannot be cut back (sliding windows, recurrent state), those layers'
state at each snapshot position listed in the metadata. The string metadata also
holds the format version, fingerprint, token count, model name and the sha256 of
the tensors; nothing names code to run. Tensors are written in name order, 8-byte
aligned after the header.

Files on disk are untrusted input. Before a file's KV is used, its header must
match the layout derived from the model exactly (names, dtypes, shapes, a token
count within the context, snapshot positions within it, offsets that tile the
file) and its tensors must hash to the checksum written with them; the arrays are
then made from those checked bytes, so no second parser reads the file. The
tensors are read once, in chunks, each into one buffer hashed as it fills (no copy
of the whole file); a file the store has already verified, unchanged since
(store.py), is read without hashing again.
A header that does not say it is ours raises NotOurs (the file is left alone);
one of ours that fails raises CacheError.
store.py decides what happens to the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import numpy as np

from ..errors import CacheError
from ..untrusted import listed, shown
from .layers import RECURRENT, SLIDING, LayerKind

FORMAT = "mlxinfer-prefix-v3"  # v3: state snapshots of the layers that cannot be cut back
_FORMAT_FAMILY = "mlxinfer-prefix-"  # any version of ours; an older one is quarantined, not left alone
READ_CHUNK = 1 << 24  # bytes per read (and hash update) while loading a file's tensors
MAX_HEADER_BYTES = 1 << 22  # ours take ~100 bytes a tensor: room for 6 arrays x 5000 layers
MAX_SNAPSHOTS = 64  # snapshot positions one file holds: its header stays far below MAX_HEADER_BYTES
DTYPE_NAMES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.int32: "I32"}
# The safetensors dtypes of our files, as numpy reads them (little-endian; bfloat16's bits as uint16).
_NUMPY_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "U32": "<u4", "I32": "<i4"}

Spec = tuple[str, tuple[int, ...]]  # a tensor's safetensors dtype and shape
LayerState = tuple[mx.array, ...]
Snapshots = dict[int, list["LayerState | None"]]  # position -> per layer: state of an uncuttable one, else None


class NotOurs(CacheError):
    """A path in the cache that mlxinfer did not write: never read as a prefix, moved or deleted."""


@dataclass(frozen=True)
class LayerLayout:
    """The arrays one layer keeps in a prefix file.

    `window` None and no `state`: full attention, every position, cut at the prefix's
    length. `window` set: a sliding window's last window - 1 positions, per snapshot.
    `state`: a recurrent layer's slots, of fixed shapes, per snapshot."""

    arrays: tuple[Spec, ...]  # attention: shapes with 0 positions on axis 2
    window: int | None = None
    state: bool = False

    @property
    def cuttable(self) -> bool:
        return self.window is None and not self.state

    def shapes(self, position: int) -> tuple[Spec, ...]:
        """The arrays of this layer in a file, for a prefix (or a snapshot) ending at `position`."""
        if self.state:
            return self.arrays
        held = position if self.window is None else min(position, self.window - 1)
        return tuple((dtype, (*shape[:2], held, *shape[3:])) for dtype, shape in self.arrays)


@dataclass(frozen=True)
class KVLayout:
    """What every prefix file of one model must hold, derived from the model, never from the file."""

    layers: tuple[LayerLayout, ...]
    max_tokens: int  # the model's context: no prefix is longer

    @classmethod
    def of(cls, layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, max_tokens: int,
           kv_bits: int | None = None, group_size: int = 64, kinds: Sequence[LayerKind] | None = None,
           states: Mapping[int, Sequence[mx.array]] | None = None) -> KVLayout:  # fmt: skip
        """The layout of cache/layers.py's caches for `kinds` (default: all full attention).

        Attention layers keep keys and values, or their (packed, scales, biases) triplets;
        recurrent layer i keeps arrays shaped like `states[i]` (its slots after any input). An attention
        layer with `states[i]` (its cache's arrays after one token) keeps arrays of those widths: layers of
        one model may differ (Gemma 4's global layers, DeepSeek's keys and values)."""
        name = DTYPE_NAMES[dtype]
        if kv_bits is None:
            kv = ((name, (1, kv_heads, 0, head_dim)),) * 2
        else:
            packed = ("U32", (1, kv_heads, 0, head_dim * kv_bits // 32))
            group = (name, (1, kv_heads, 0, head_dim // group_size))
            kv = (packed, group, group) * 2
        found = []
        for i, (kind, window) in enumerate(kinds or [("full_attention", None)] * layers):
            if kind in RECURRENT:
                found.append(LayerLayout(tuple(_spec(a) for a in (states or {})[i]), state=True))
            else:
                arrays = (states or {}).get(i)
                held = kv if arrays is None else tuple(_no_positions(_spec(a)) for a in arrays)
                found.append(LayerLayout(held, window if kind == SLIDING else None))
        return cls(tuple(found), max_tokens)

    @property
    def cuttable(self) -> bool:
        """Whether every layer is cut at the prefix's length (then a file holds no snapshots)."""
        return all(layer.cuttable for layer in self.layers)

    def tensors(self, tokens: int, positions: Sequence[int] = ()) -> dict[str, Spec]:
        """Name -> (dtype, shape) of every tensor in the file of a `tokens`-long prefix with snapshots at
        `positions`."""
        found = {"token_ids": ("I32", (tokens,))}
        for i, layer in enumerate(self.layers):
            if layer.cuttable:
                found.update({f"layers.{i}.{j}": spec for j, spec in enumerate(layer.shapes(tokens))})
                continue
            for p in positions:
                found.update({f"snapshots.{p}.{i}.{j}": spec for j, spec in enumerate(layer.shapes(p))})
        return found

    def data_bytes(self, tokens: int, positions: Sequence[int] = ()) -> int:
        return sum(_nbytes(dtype, shape) for dtype, shape in self.tensors(tokens, positions).values())

    def file_bytes(self, tokens: int, positions: Sequence[int] | None = None) -> int:
        """The size of the file, rounded up (a header takes well under 128 bytes a tensor, plus its metadata).

        `positions` None: a snapshot at the end only, where the model needs snapshots (what `warm` keeps)."""
        if positions is None:
            positions = () if self.cuttable else (tokens,)
        return self.data_bytes(tokens, positions) + 4096 + 128 * len(self.tensors(tokens, positions))


def _no_positions(spec: Spec) -> Spec:
    dtype, shape = spec
    return dtype, (*shape[:2], 0, *shape[3:])


def _spec(array: mx.array | None) -> Spec:
    if array is None:  # a slot the layer did not write: nothing to say what its snapshots hold
        raise CacheError("a recurrent layer leaves a state slot unset after a token; its state cannot be stored")
    return DTYPE_NAMES[array.dtype], tuple(array.shape)


@dataclass(frozen=True)
class Header:
    metadata: dict
    entries: dict  # tensor name -> its raw header entry, checked against the layout before use
    data_start: int
    size: int


def file_name(token_ids: Sequence[int]) -> str:
    """The name of the file of a prefix: a hash of its token ids."""
    digest = hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]
    return f"{digest}.safetensors"


# --- writing -----------------------------------------------------------------------------------------------------


def encode(token_ids: Sequence[int], layers: Sequence[LayerState | None], snapshots: Snapshots | None,
           layout: KVLayout, fingerprint: str, label: str) -> list[bytes | memoryview]:  # fmt: skip
    """The chunks of a prefix file: its header (with the checksum of the tensors), then each tensor.

    `layers`: each full-attention layer's arrays over `token_ids` (None for the others);
    `snapshots`: position -> the state of every other layer there (None: the model has none)."""
    positions = sorted(snapshots or {})
    if check_positions(",".join(map(str, positions)), len(token_ids)) is None or layout.cuttable != (not positions):
        raise CacheError(f"{label}: snapshots at {listed([str(p) for p in positions], 3)} cannot be stored with "
                         f"a {len(token_ids)}-token prefix (at most {MAX_SNAPSHOTS}, the last at its end)")  # fmt: skip
    tensors = {"token_ids": mx.array(list(token_ids), dtype=mx.int32)}
    for i, state in enumerate(layers):
        tensors.update(_named(f"layers.{i}", state))
    for p in positions:
        for i, state in enumerate(snapshots[p]):
            tensors.update(_named(f"snapshots.{p}.{i}", state))
    mx.eval(tensors)
    _check_arrays(tensors, layout, len(token_ids), positions, label)
    data = {name: memoryview(tensors[name]).cast("B") for name in sorted(tensors)}
    metadata = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "tokens": str(len(token_ids)),
        "snapshots": ",".join(map(str, positions)),
        "model": label,
        "sha256": _checksum(data.items()),
    }
    header = _encode_header(metadata, tensors)
    if len(header) - 8 > MAX_HEADER_BYTES:  # every later read would take the file for a stranger's
        raise CacheError(f"{label}: a prefix file of {len(tensors)} tensors has a header over {MAX_HEADER_BYTES} bytes")
    return [header, *data.values()]


def _named(prefix: str, state: Sequence[mx.array | None] | None) -> dict[str, mx.array]:
    # An unset slot of a recurrent state is left out: _check_arrays then names the missing tensor.
    return {f"{prefix}.{j}": mx.contiguous(a) for j, a in enumerate(state or ()) if a is not None}


def _check_arrays(tensors: dict[str, mx.array], layout: KVLayout, tokens: int, positions: Sequence[int],
                  label: str) -> None:  # fmt: skip
    # A layout that differs from the model's real KV would write files that every load rejects.
    found = {name: (DTYPE_NAMES.get(a.dtype, str(a.dtype)), tuple(a.shape)) for name, a in tensors.items()}
    expected = layout.tensors(tokens, positions)
    if found != expected:
        wrong = sorted(set(found.items()) ^ set(expected.items()))[:2]
        raise CacheError(f"{label}: its KV does not have the layout the prefix cache expects ({wrong})")


def _encode_header(metadata: dict[str, str], tensors: dict[str, mx.array]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        a, end = tensors[name], offset + tensors[name].nbytes
        header[name] = {"dtype": DTYPE_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensors start 8-byte aligned, as the format recommends
    return struct.pack("<Q", len(raw)) + raw


# --- reading -----------------------------------------------------------------------------------------------------


def read_header(f: BinaryIO, size: int) -> Header:
    """The header of a prefix file of ours; NotOurs for anything whose header does not say so."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise NotOurs(f"{size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise NotOurs(f"it declares a {length}-byte header in a {size}-byte file")
    try:
        header = json.loads(f.read(length), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise NotOurs("its header is not JSON with unique keys") from None
    metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not str(metadata.get("format", "")).startswith(_FORMAT_FAMILY):
        raise NotOurs("its header does not say it is an mlxinfer prefix")
    return Header(metadata, header, 8 + length, size)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    # With a name twice, which entry counts would depend on the parser: refused instead.
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a key appears twice")
    return found


def read_index(path: Path, f: BinaryIO, header: Header, fingerprint: str,
               layout: KVLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    """The token ids and snapshot positions of a file whose header checks out for this model, and whose ids
    match its name."""
    tokens, positions = _check_header(path, header, fingerprint, layout)
    f.seek(header.data_start + header.entries["token_ids"]["data_offsets"][0])
    raw = f.read(4 * tokens)
    if len(raw) != 4 * tokens:
        raise CacheError(f"{path}: truncated in its token ids")
    ids = tuple(int(t) for t in np.frombuffer(raw, dtype="<i4"))
    if path.name != file_name(ids):
        raise CacheError(f"{path}: its token ids do not match the file's name")
    return ids, positions


def read_kv(path: Path, f: BinaryIO, size: int, token_ids: tuple[int, ...], positions: tuple[int, ...],
            fingerprint: str, layout: KVLayout,
            verified: bool = False) -> tuple[list[LayerState | None], Snapshots | None]:  # fmt: skip
    """The full-attention layers' arrays (None for the others) and the snapshots at `positions` (None when
    the model needs none) of the file of `token_ids`, once every check passed on the bytes read once.

    Read in chunks, tensor by tensor, hashing as it goes: no copy of the whole file besides
    the arrays themselves. `verified`: this very file (same identity) already hashed to its
    checksum, so it is read but not hashed again; the header is still checked."""
    header = read_header(f, size)
    ids, found = read_index(path, f, header, fingerprint, layout)
    if ids != token_ids:
        raise CacheError(f"{path}: its token ids changed since start-up")
    if not set(positions) <= set(found):  # the trie resumes there: each must have its snapshot
        raise CacheError(f"{path}: its snapshot positions changed since start-up")
    expected = layout.tensors(len(token_ids), found)
    digest = None if verified else _tensor_digest()
    f.seek(header.data_start)  # the tensors tile the rest of the file in name order (_check_tensors)
    arrays = {name: _read_array(path, f, name, *expected[name], digest) for name in sorted(expected)}
    if f.read(1):
        raise CacheError(f"{path}: it grew while being read")
    if digest is not None and digest.hexdigest() != header.metadata.get("sha256"):
        raise CacheError(f"{path}: the checksum of its tensors does not match its sha256 metadata")
    # Arrays made from the checked bytes by the checked dtypes and shapes: no second parser reads the file.
    return _layers(arrays, layout, "layers", cuttable=True), (
        None if layout.cuttable else {p: _layers(arrays, layout, f"snapshots.{p}", cuttable=False) for p in positions}
    )


def _layers(arrays: dict[str, mx.array], layout: KVLayout, prefix: str, cuttable: bool) -> list[LayerState | None]:
    """Per layer, its arrays named `prefix`.i.j if the layer is `cuttable` or not as asked, else None."""
    return [
        tuple(arrays[f"{prefix}.{i}.{j}"] for j in range(len(layer.arrays))) if layer.cuttable == cuttable else None
        for i, layer in enumerate(layout.layers)
    ]


def _read_array(path: Path, f: BinaryIO, name: str, dtype: str, shape: tuple[int, ...], digest) -> mx.array:
    """One tensor read in chunks into one buffer (hashed per chunk), then made an MLX array (its one copy)."""
    buffer = np.empty(_nbytes(dtype, shape), dtype=np.uint8)
    view = memoryview(buffer)
    if digest is not None:
        digest.update(name.encode() + b"\0")
    done = 0
    while done < len(view):
        got = f.readinto(view[done : done + READ_CHUNK])
        if not got:
            raise CacheError(f"{path}: truncated in tensor {name}")
        if digest is not None:
            digest.update(view[done : done + got])
        done += got
    array = mx.array(buffer.view(_NUMPY_DTYPES[dtype]).reshape(shape))
    return array.view(mx.bfloat16) if dtype == "BF16" else array


def _check_header(path: Path, header: Header, expected_fingerprint: str,
                  layout: KVLayout) -> tuple[int, tuple[int, ...]]:  # fmt: skip
    """The token count and snapshot positions, once the header matches this model's layout exactly;
    CacheError names what differs."""
    metadata = header.metadata
    if metadata.get("format") != FORMAT:
        raise CacheError(f"{path}: format {shown(metadata.get('format'))} is not {FORMAT}; warm the prefix again")
    if metadata.get("fingerprint") != expected_fingerprint:
        raise CacheError(f"{path}: made for other weights, tokenizer or settings")
    tokens = token_count(metadata.get("tokens"))
    if tokens is None or not 0 < tokens <= layout.max_tokens:
        found = str(metadata.get("tokens"))[:20]
        raise CacheError(f"{path}: metadata tokens={found!r} is not a count in [1, {layout.max_tokens}] (the context)")
    positions = check_positions(metadata.get("snapshots"), tokens)
    if positions is None or layout.cuttable != (not positions):
        found = shown(metadata.get("snapshots"))[:40]
        rule = ("empty: this model resumes anywhere" if layout.cuttable else
                f"1 to {MAX_SNAPSHOTS} increasing positions in [1, {tokens}], the last {tokens}")  # fmt: skip
        raise CacheError(f"{path}: metadata snapshots={found} is not {rule}")
    _check_tensors(path, header, layout.tensors(tokens, positions))
    return tokens, positions


def token_count(value: object) -> int | None:
    """A token count written as a short decimal string, else None (never int() of a huge or odd string)."""
    ok = isinstance(value, str) and 0 < len(value) <= 12 and value.isascii() and value.isdigit()
    return int(value) if ok else None


def check_positions(value: object, tokens: int) -> tuple[int, ...] | None:
    """Snapshot positions written as increasing decimals joined by commas, at most MAX_SNAPSHOTS, in
    (0, tokens] and ending at `tokens` (the end of a prefix is where it resumes); "" is none. Else None."""
    if not isinstance(value, str) or len(value) > 13 * MAX_SNAPSHOTS:
        return None
    if not value:
        return ()
    positions = [token_count(part) for part in value.split(",")]
    if len(positions) > MAX_SNAPSHOTS or None in positions or positions[-1] != tokens:
        return None
    if positions[0] < 1 or any(a >= b for a, b in zip(positions, positions[1:])):
        return None
    return tuple(positions)


def _check_tensors(path: Path, header: Header, expected: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Exactly the expected tensors, written in name order with no gap, ending at the end of the file."""
    if set(header.entries) != set(expected):
        odd = sorted(set(header.entries) ^ set(expected))
        raise CacheError(
            f"{path}: tensors {listed(odd, 3)} do not match the {len(expected)} that the model's layers and the "
            "header's snapshot positions call for"
        )
    offset = 0
    for name in sorted(expected):
        entry, (dtype, shape) = header.entries[name], expected[name]
        if not isinstance(entry, dict) or entry.get("dtype") != dtype or not _same_ints(entry.get("shape"), shape):
            raise CacheError(f"{path}: tensor {name} is not {dtype} of shape {list(shape)}, as the model needs")
        end = offset + _nbytes(dtype, shape)
        if not _same_ints(entry.get("data_offsets"), (offset, end)):
            found = shown(entry.get("data_offsets"))
            raise CacheError(f"{path}: tensor {name} has data_offsets {found}, not {[offset, end]}")
        offset = end
    if header.data_start + offset != header.size:
        raise CacheError(f"{path}: {header.size} bytes, but its header describes {header.data_start + offset}")


def _same_ints(value: object, expected: tuple[int, ...]) -> bool:
    # type() is int: JSON's true or 2.0 compare equal to 1 or 2 but are not what we wrote.
    return isinstance(value, list) and all(type(v) is int for v in value) and tuple(value) == expected


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize


def _checksum(tensors: Iterable[tuple[str, bytes | memoryview]]) -> str:
    """sha256 over each tensor's name and bytes, in name order (the order the file holds them)."""
    digest = _tensor_digest()
    for name, data in tensors:
        digest.update(name.encode() + b"\0")
        digest.update(data)
    return digest.hexdigest()


def _tensor_digest() -> hashlib._Hash:
    """The hash of a file's tensors (a function of its own so tests can count how often files are hashed)."""
    return hashlib.sha256()
