"""Prefix-cache files are untrusted input, and the cache folder may hold anything.

Attacked here by class: every way a file of ours can be damaged or crafted (each is
quarantined with a warning naming it, and the answer is the uncached one); every
kind of thing that is not ours (other names, other contents, links, hard links,
folders, FIFOs: never read, moved or deleted); links where the cache's folders
should be (a fingerprint folder or quarantine/ that points at a model is never
entered); a full, read-only or size-limited disk (one line from `cache warm`, an
answer from generate); and prefixes longer than the context (refused before work).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mlxinfer
import mlxinfer.engine.prefix_store as prefix_store_module
from mlxinfer import disk
from mlxinfer.cache import PrefixStore, prefix_file
from mlxinfer.cache import prefix as prefix_module
from mlxinfer.cache import store as store_module
from mlxinfer.cache.kv import KVCache, QuantizedKVCache
from mlxinfer.cache.store import KVLayout, clear_prefixes, list_prefixes
from mlxinfer.cli import main
from mlxinfer.engine.prefill import Prefill
from mlxinfer.engine.prefix_store import prefix_store_for
from mlxinfer.errors import CacheError, SamplingError
from mlxinfer.models.loader import load_model
from tests.conftest import ARCHITECTURES, TINY

LLAMA = TINY / "llama_classic"  # 2 layers, 2 KV heads of 16, float32, a context of 256 tokens
PROMPT = list(range(40, 80))
WARMED = PROMPT[:30]
CONTEXT = 256
KV_BYTES = 1 * 2 * 30 * 16 * 4  # one layer's keys (or values) for WARMED


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding one prefix warmed by llama_classic: every test damages a copy."""
    cache = tmp_path_factory.mktemp("template")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXINFER_CACHE_DIR", str(cache))
        mlxinfer.load(LLAMA).warm(WARMED)
    return cache / "prefixes"


@pytest.fixture(scope="module")
def cold() -> list[int]:
    """The answer with nothing cached: what every attacked cache must still give."""
    return mlxinfer.load(LLAMA, prefix_cache_bytes=0).generate(PROMPT, max_tokens=6, use_cache=False).token_ids


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLXINFER_MODELS_DIR", str(tmp_path / "models"))  # `cache ls` lists no model of the user's
    return tmp_path / "cache" / "prefixes"


@pytest.fixture
def warmed(root: Path, template: Path) -> Path:
    """The path of a valid prefix file of ours in `root`."""
    shutil.copytree(template, root)
    (path,) = root.glob("*/*.safetensors")
    return path


@pytest.fixture
def victim(tmp_path: Path, warmed: Path) -> Path:
    """Someone else's folder: a model, a file of ours and a damaged one. Nothing in it may change."""
    folder = tmp_path / "victim"
    shutil.copytree(LLAMA, folder)
    shutil.copy(warmed, folder / warmed.name)
    flip_kv(shutil.copy(warmed, folder / f"{'0' * 32}.safetensors"))
    return folder


def flip_kv(path: Path | str) -> None:
    """Flip the first byte of the first layer's keys: only the checksum can tell."""
    raw = bytearray(Path(path).read_bytes())
    raw[8 + struct.unpack("<Q", raw[:8])[0]] ^= 0x01
    Path(path).write_bytes(raw)


def snapshot(*folders: Path) -> dict[str, tuple]:
    """Every entry under `folders` (links not followed): kind, inode, links and contents."""
    found = {}
    for folder in folders:
        for top, dirs, files in os.walk(folder, followlinks=False):
            for name in dirs + files:
                path = Path(top) / name
                st = path.lstat()
                content = os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else None
                found[str(path)] = (stat.S_IFMT(st.st_mode), st.st_ino, st.st_nlink, content)
    return found


def answer() -> mlxinfer.GenerationResult:
    return mlxinfer.load(LLAMA).generate(PROMPT, max_tokens=6)


def ids_name(ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:32] + ".safetensors"


def one_line_error(output: str) -> bool:
    return output.startswith("Error: ") and output.count("\n") == 1 and "Traceback" not in output


def read_parts(path: Path) -> tuple[dict, dict[str, list]]:
    """(metadata, {name: [dtype, shape, bytes]}) of a file of ours."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = raw[8 + length :]
    metadata = header.pop("__metadata__")
    return metadata, {n: [e["dtype"], e["shape"], data[slice(*e["data_offsets"])]] for n, e in header.items()}


def write_parts(path: Path, metadata: dict, tensors: dict[str, list], edit: Callable | None = None, resign=True):
    """Write as the store does (name order, no gaps), re-made checksum if `resign`; then `edit` the header."""
    header, data, digest = {"__metadata__": metadata}, b"", hashlib.sha256()
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
        digest.update(name.encode() + b"\0" + raw)
    if resign:
        metadata["sha256"] = digest.hexdigest()
    if edit:
        edit(header)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def assert_quarantined(path: Path, root: Path, caplog: pytest.LogCaptureFixture, cold: list[int], why: str) -> None:
    result = answer()
    assert result.stats.cached_tokens == 0 and result.token_ids == cold
    assert not path.exists() and (root / "quarantine" / f"{path.parent.name}-{path.name}").is_file()
    assert f"ignoring prefix cache file {path}: " in caplog.text and "moved to quarantine/" in caplog.text
    assert why in caplog.text


def test_an_untouched_file_is_used(warmed, root, caplog, cold):
    """The control for every attack below: the copied template is a hit."""
    result = answer()
    assert result.stats.cached_tokens == len(WARMED) and result.token_ids == cold
    assert not (root / "quarantine").exists() and "prefix cache" not in caplog.text


# -- the layout a file must have is the model's real KV layout -------------------------------------------------------


# A fixed sample of the architectures x dtypes (each case loads twice): every kind of layer the store keeps (full
# attention, sliding, both, conv, linear attention, mamba), the layouts that differ (MLA's unequal key and value widths,
# gemma4's per-layer head sizes and shared KV, attention sinks, a vision-language wrapper, mixture of experts), each
# in float32, and every dtype for the dense ones (MLX's CPU gather_mm runs mixture-of-experts models in float32 only).
ROUND_TRIPS = {
    "llama_classic": ["float32", "float16", "bfloat16"],  # full attention
    "gemma3": ["float32", "bfloat16"],  # full + sliding
    "mixtral_sliding": ["float32"],  # sliding only; experts
    "lfm2": ["float32", "float16"],  # conv
    "qwen3_5": ["float32", "bfloat16"],  # linear attention
    "granitemoehybrid_nope": ["float32", "float16"],  # mamba
    "deepseek_v3": ["float32"],  # MLA; experts
    "gemma4": ["float32", "float16"],  # per-layer head sizes, shared KV
    "gpt_oss": ["float32"],  # attention sinks, sliding + full; experts
    "qwen3_5_vl": ["float32"],  # a vision-language wrapper
}


def test_the_round_trip_sample_covers_every_cache_kind_and_dtype():
    assert set(ROUND_TRIPS) <= set(ARCHITECTURES)
    assert {d for dtypes in ROUND_TRIPS.values() for d in dtypes} == {"float32", "float16", "bfloat16"}
    model_kinds = {arch: load_model(TINY / arch, with_tokenizer=False).model.cache_kinds for arch in ARCHITECTURES}
    kinds = {arch: {kind for kind, _ in found} for arch, found in model_kinds.items()}
    sampled = set().union(*(kinds[arch] for arch in ROUND_TRIPS))
    assert sampled == set().union(*kinds.values()) and len(sampled) >= 5, sampled


@pytest.mark.slow
@pytest.mark.parametrize("arch, dtype", [(arch, dtype) for arch, dtypes in ROUND_TRIPS.items() for dtype in dtypes])
def test_each_cache_kind_and_dtype_round_trips_its_warmed_prefix(arch, dtype, root, caplog):
    try:
        mlxinfer.load(TINY / arch, dtype=dtype).warm(WARMED)
    except RuntimeError as e:  # MLX's CPU gather_mm (mixture of experts) is float32 only; Metal runs them all
        if "GatherMM" not in str(e) or mx.default_device().type != mx.cpu:
            raise
        pytest.skip(f"{arch} in {dtype} does not run on this CPU: {e}")
    restarted = mlxinfer.load(TINY / arch, dtype=dtype)
    result = restarted.generate(PROMPT, max_tokens=3)
    assert result.stats.cached_tokens == len(WARMED)
    assert not (root / "quarantine").exists() and "prefix cache" not in caplog.text
    if dtype == "float32":
        assert result.token_ids == restarted.generate(PROMPT, max_tokens=3, use_cache=False).token_ids


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [None, 4, 8])
def test_the_layout_is_what_each_kv_cache_kind_holds(bits, head_dim, dtype):
    cache = KVCache() if bits is None else QuantizedKVCache(bits)
    cache.update_and_fetch(*(mx.zeros((1, 3, 7, head_dim), dtype) for _ in range(2)))
    found = {f"layers.0.{j}": (prefix_file.DTYPE_NAMES[a.dtype], a.shape) for j, a in enumerate(cache.state)}
    expected = KVLayout.of(1, 3, head_dim, dtype, CONTEXT, kv_bits=bits).tensors(7)
    assert found == {name: (d, tuple(s)) for name, (d, s) in expected.items() if name != "token_ids"}


@pytest.mark.parametrize("bits", [None, 4, 8])
@pytest.mark.parametrize("written", [[3], [5, 1], [7], [7, 1, 1], [20], [300, 2]])  # chunks: under, at, past 8 - 1
def test_a_window_snapshot_holds_the_last_window_minus_one_positions(bits, written):
    cache = KVCache(8) if bits is None else QuantizedKVCache(bits, window=8)
    for n in written:
        cache.update_and_fetch(*(mx.zeros((1, 2, n, 64), mx.float16) for _ in range(2)))
    found = {f"snapshots.{cache.length}.0.{j}": (prefix_file.DTYPE_NAMES[a.dtype], a.shape)
             for j, a in enumerate(cache.snapshot())}  # fmt: skip
    layout = KVLayout.of(1, 2, 64, mx.float16, 1024, kv_bits=bits, kinds=[("sliding_attention", 8)])
    expected = layout.tensors(cache.length, [cache.length])
    assert found == {name: spec for name, spec in expected.items() if name != "token_ids"}
    held = min(sum(written), 7)
    assert all(shape[2] == held for _, shape in found.values())


# -- files of ours, damaged or crafted: quarantined with a warning, the answer uncached ------------------------------


def _retype(name: str, dtype: str, size: int):
    def edit(metadata: dict, tensors: dict) -> None:
        tensors[name][0] = dtype
        tensors[name][2] = tensors[name][2][: len(tensors[name][2]) * size // 4] if size < 4 else tensors[name][2] * 2

    return edit


def _reshape(name: str, shape: list[int], resize: bool = True):
    def edit(metadata: dict, tensors: dict) -> None:
        tensors[name][1] = shape
        if resize:
            tensors[name][2] = b"\0" * (int(np.prod(shape)) * 4)

    return edit


def _drop(*names: str):
    def edit(metadata: dict, tensors: dict) -> None:
        for name in names:
            del tensors[name]

    return edit


def _add(*names: str):
    def edit(metadata: dict, tensors: dict) -> None:
        for name in names:
            tensors[name] = list(tensors["layers.0.0"])

    return edit


def _meta(key: str, value: str | None):
    def edit(metadata: dict, tensors: dict) -> None:
        metadata.pop(key, None)
        if value is not None:
            metadata[key] = value

    return edit


def _flip_ids(metadata: dict, tensors: dict) -> None:
    tensors["token_ids"][2] = bytes([tensors["token_ids"][2][0] ^ 1]) + tensors["token_ids"][2][1:]


CRAFTED = {  # each with a checksum that matches: only the layout and metadata checks can refuse it
    "keys typed I32, same bytes": (_retype("layers.0.0", "I32", 4), "tensor layers.0.0 is not F32"),
    "keys typed F16": (_retype("layers.0.0", "F16", 2), "tensor layers.0.0 is not F32"),
    "values typed BF16": (_retype("layers.1.1", "BF16", 2), "tensor layers.1.1 is not F32"),
    "token ids typed I64": (_retype("token_ids", "I64", 8), "tensor token_ids is not I32"),
    "heads and head_dim swapped": (_reshape("layers.0.0", [1, 16, 30, 2]), "tensor layers.0.0 is not F32 of shape"),
    "a batch of 2": (_reshape("layers.0.1", [2, 2, 30, 16]), "tensor layers.0.1 is not F32 of shape"),
    "a layer one token short": (_reshape("layers.1.0", [1, 2, 29, 16]), "tensor layers.1.0 is not F32 of shape"),
    "a layer one token long": (_reshape("layers.1.1", [1, 2, 31, 16]), "tensor layers.1.1 is not F32 of shape"),
    "a huge declared shape": (_reshape("layers.0.0", [1, 2, 2**40, 16], False), "tensor layers.0.0 is not F32"),
    "a 3-d array": (_reshape("layers.0.0", [2, 30, 16]), "tensor layers.0.0 is not F32 of shape"),
    "a layer missing": (_drop("layers.1.0", "layers.1.1"), "tensors layers.1.0, layers.1.1 do not match"),
    "the values missing": (_drop("layers.0.1"), "tensors layers.0.1 do not match"),
    "the token ids missing": (_drop("token_ids"), "tensors token_ids do not match"),
    "an extra layer": (_add("layers.2.0", "layers.2.1"), "tensors layers.2.0, layers.2.1 do not match"),
    "an extra array per layer": (_add("layers.0.2", "layers.1.2"), "tensors layers.0.2, layers.1.2 do not match"),
    "an unknown tensor": (_add("zz"), "tensors zz do not match"),
    "tokens 29": (_meta("tokens", "29"), "tensor layers.0.0 is not F32 of shape [1, 2, 29, 16]"),
    "tokens 31": (_meta("tokens", "31"), "tensor layers.0.0 is not F32 of shape [1, 2, 31, 16]"),
    "tokens 0": (_meta("tokens", "0"), "metadata tokens='0' is not a count in [1, 256]"),
    "tokens -30": (_meta("tokens", "-30"), "metadata tokens='-30'"),
    "tokens empty": (_meta("tokens", ""), "metadata tokens=''"),
    "tokens 3e1": (_meta("tokens", "3e1"), "metadata tokens='3e1'"),
    "tokens in Arabic digits": (_meta("tokens", "\u0663\u0660"), "metadata tokens="),
    "tokens of 5000 digits": (_meta("tokens", "9" * 5000), "metadata tokens='99999999999999999999'"),
    "tokens missing": (_meta("tokens", None), "metadata tokens='None'"),
    "tokens past the context": (_meta("tokens", "257"), "metadata tokens='257' is not a count in [1, 256]"),
    "another model's fingerprint": (_meta("fingerprint", "0" * 24), "made for other weights"),
    "no fingerprint": (_meta("fingerprint", None), "made for other weights"),
    "an older format": (_meta("format", "mlxinfer-prefix-v1"), "format 'mlxinfer-prefix-v1' is not mlxinfer-prefix"),
    "format v2": (_meta("format", "mlxinfer-prefix-v2"), "'mlxinfer-prefix-v2' is not mlxinfer-prefix-v3"),
    "snapshots where none can be": (_meta("snapshots", "30"), "metadata snapshots='30' is not empty: this model resu"),
    "snapshots missing": (_meta("snapshots", None), "metadata snapshots=None is not empty"),
    "a newer format": (_meta("format", "mlxinfer-prefix-v9"), "format 'mlxinfer-prefix-v9' is not mlxinfer-prefix"),
    "token ids not those of its name": (_flip_ids, "its token ids do not match the file's name"),
}


@pytest.mark.parametrize("edit, why", CRAFTED.values(), ids=CRAFTED.keys())
def test_a_crafted_file_of_ours_is_quarantined(edit, why, warmed, root, caplog, cold):
    metadata, tensors = read_parts(warmed)
    edit(metadata, tensors)
    write_parts(warmed, metadata, tensors)
    assert_quarantined(warmed, root, caplog, cold, why)


@pytest.mark.parametrize("checksum", [None, "0" * 64, "", 12, "ORIGINAL"])
def test_a_checksum_that_does_not_match_is_quarantined(checksum, warmed, root, caplog, cold):
    metadata, tensors = read_parts(warmed)
    original = metadata["sha256"]
    tensors["layers.1.0"][2] = b"\0" * KV_BYTES  # other KV of the very same layout
    metadata.pop("sha256")
    if checksum is not None:
        metadata["sha256"] = original if checksum == "ORIGINAL" else checksum
    write_parts(warmed, metadata, tensors, resign=False)
    assert_quarantined(warmed, root, caplog, cold, "the checksum of its tensors does not match its sha256 metadata")


def _entry(name: str, key: str, value: object):
    return lambda header: header[name].__setitem__(key, value)


HEADER_EDITS = {  # the raw header entries, past what the store would ever write
    "overlapping tensors": (_entry("layers.0.1", "data_offsets", [0, KV_BYTES]), "tensor layers.0.1 has data_offsets"),
    "offsets past the end": (_entry("layers.1.1", "data_offsets", [3 * KV_BYTES, 10**12]), "layers.1.1 has data_off"),
    "offsets as floats": (_entry("layers.0.0", "data_offsets", [0.0, 3840.0]), "tensor layers.0.0 has data_offsets"),
    "offsets reversed": (_entry("layers.0.0", "data_offsets", [KV_BYTES, 0]), "tensor layers.0.0 has data_offsets"),
    "offsets not a pair": (_entry("layers.0.0", "data_offsets", [0]), "tensor layers.0.0 has data_offsets"),
    "offsets a string": (_entry("layers.0.0", "data_offsets", "0-3840"), "tensor layers.0.0 has data_offsets"),
    "offsets missing": (lambda h: h["token_ids"].pop("data_offsets"), "tensor token_ids has data_offsets None"),
    "shape with true": (_entry("layers.0.0", "shape", [True, 2, 30, 16]), "tensor layers.0.0 is not F32 of shape"),
    "shape with floats": (_entry("layers.0.0", "shape", [1.0, 2, 30, 16]), "tensor layers.0.0 is not F32 of shape"),
    "shape a number": (_entry("layers.0.0", "shape", 960), "tensor layers.0.0 is not F32 of shape"),
    "dtype a number": (_entry("layers.0.0", "dtype", 4), "tensor layers.0.0 is not F32"),
    "an entry that is a list": (lambda h: h.__setitem__("layers.0.0", [1, 2]), "tensor layers.0.0 is not F32"),
}


@pytest.mark.parametrize("edit, why", HEADER_EDITS.values(), ids=HEADER_EDITS.keys())
def test_a_header_of_ours_with_bad_entries_is_quarantined(edit, why, warmed, root, caplog, cold):
    metadata, tensors = read_parts(warmed)
    write_parts(warmed, metadata, tensors, edit=edit)
    assert_quarantined(warmed, root, caplog, cold, why)


@pytest.mark.parametrize("tensor", ["token_ids", "layers.0.0", "layers.0.1", "layers.1.0", "layers.1.1"])
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_flipped_byte_in_any_tensor_is_quarantined(tensor, where, warmed, root, caplog, cold):
    raw = bytearray(warmed.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + length])[tensor]["data_offsets"]
    raw[8 + length + begin + int((end - begin - 1) * where)] ^= 0x01
    warmed.write_bytes(raw)
    why = "its token ids do not match" if tensor == "token_ids" else "checksum of its tensors does not match"
    assert_quarantined(warmed, root, caplog, cold, why)


@pytest.mark.parametrize("keep", [-1, -4, -100, -3000, "the header", "one data byte"])
def test_a_truncated_file_of_ours_is_quarantined(keep, warmed, root, caplog, cold):
    raw = warmed.read_bytes()
    data_start = 8 + struct.unpack("<Q", raw[:8])[0]
    warmed.write_bytes(raw[: {"the header": data_start, "one data byte": data_start + 1}.get(keep, keep)])
    assert_quarantined(warmed, root, caplog, cold, "bytes, but its header describes")


@pytest.mark.parametrize("extra", [1, 8, 1 << 20])
def test_a_file_of_ours_with_bytes_appended_is_quarantined(extra, warmed, root, caplog, cold):
    with warmed.open("ab") as f:
        f.write(b"\0" * extra)
    assert_quarantined(warmed, root, caplog, cold, "bytes, but its header describes")


@pytest.mark.parametrize("tokens", [CONTEXT + 1, 4 * CONTEXT])
def test_a_consistent_file_longer_than_the_context_is_quarantined(tokens, warmed, root, caplog, cold):
    metadata, tensors = read_parts(warmed)
    ids = [t % 250 for t in range(tokens)]
    metadata["tokens"] = str(tokens)
    tensors["token_ids"][2] = np.asarray(ids, dtype="<i4").tobytes()
    for name in tensors:
        if name != "token_ids":
            tensors[name][1:] = [[1, 2, tokens, 16], b"\0" * (2 * tokens * 16 * 4)]
    path = warmed.with_name(ids_name(ids))
    write_parts(path, metadata, tensors)
    warmed.unlink()
    assert_quarantined(path, root, caplog, cold, f"metadata tokens='{tokens}' is not a count in [1, 256]")


def test_many_bad_files_fall_back_a_few_per_lookup_to_a_cold_prefill(root, caplog, cold):
    model = mlxinfer.load(LLAMA)
    for n in range(12):  # nested prefixes of PROMPT: a lookup tries the longest first, then the next
        model.warm(PROMPT[: 6 + 2 * n])
    for path in root.glob("*/*.safetensors"):
        flip_kv(path)
    restarted = mlxinfer.load(LLAMA)
    assert restarted.cache_stats.entries == 12  # their headers are fine: found at start-up
    result = restarted.generate(PROMPT, max_tokens=6)
    assert result.stats.cached_tokens == 0 and result.token_ids == cold
    quarantined = lambda: len(list((root / "quarantine").iterdir()))  # noqa: E731
    assert quarantined() == prefix_module.MAX_LOADS_PER_LOOKUP == 4  # not all 12 files on one prompt's path
    cache = restarted.prefix_cache
    for tried in (8, 12):  # later lookups try the next ones
        cache.clear()  # the entry generate added would be found first
        assert cache.lookup(PROMPT) is None and quarantined() == tried
    assert cache.stats.entries == 0


class _Reads:
    """A file whose reads are recorded: how many bytes each asked for."""

    def __init__(self, f, sizes: list[int]):
        self._f, self._sizes = f, sizes

    def read(self, n=-1):
        self._sizes.append(n)
        return self._f.read(n)

    def readinto(self, buffer):
        self._sizes.append(len(buffer))
        return self._f.readinto(buffer)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_a_stored_prefix_is_read_in_chunks_and_hashed_once_per_file(warmed, root, monkeypatch, caplog, cold):
    sizes, hashes, real_open, real_digest = [], [], store_module._open_file, prefix_file._tensor_digest

    @contextlib.contextmanager
    def recorded(folder, name):
        with real_open(folder, name) as (f, st):
            yield _Reads(f, sizes), st

    monkeypatch.setattr(store_module, "_open_file", recorded)
    monkeypatch.setattr(prefix_file, "READ_CHUNK", 512)
    monkeypatch.setattr(prefix_file, "_tensor_digest", lambda: hashes.append(1) or real_digest())
    model = mlxinfer.load(LLAMA)
    cache = model.prefix_cache
    sizes.clear()
    first = model.generate(PROMPT, max_tokens=6, use_cache=True)
    assert first.stats.cached_tokens == len(WARMED) and first.token_ids == cold and len(hashes) == 1
    assert max(sizes) <= 1024 and sum(s for s in sizes if s > 0) < 2 * warmed.stat().st_size  # no whole-file read
    for _ in range(2):  # evicted and loaded again: the same file is read, not hashed again
        cache.clear()
        again = model.generate(PROMPT, max_tokens=6)
        assert again.stats.cached_tokens == len(WARMED) and again.token_ids == cold and len(hashes) == 1
    cache.clear()
    flip_kv(warmed)  # the file changed: it is checked again, and quarantined
    assert_quarantined(warmed, root, caplog, cold, "the checksum of its tensors does not match")
    assert len(hashes) >= 2


def test_a_file_changed_in_place_with_its_old_mtime_is_hashed_again(warmed, root, caplog, cold):
    model = mlxinfer.load(LLAMA)
    assert model.generate(PROMPT, max_tokens=6).stats.cached_tokens == len(WARMED)
    model.prefix_cache.clear()
    st = warmed.stat()
    flip_kv(warmed)  # same inode, size and (put back) mtime: only the change time says
    os.utime(warmed, ns=(st.st_atime_ns, st.st_mtime_ns))
    result = model.generate(PROMPT, max_tokens=6)
    assert result.stats.cached_tokens == 0 and result.token_ids == cold
    assert "the checksum of its tensors does not match" in caplog.text and not warmed.exists()


def test_the_number_of_files_read_at_start_up_is_bounded(root, monkeypatch, caplog):
    model = mlxinfer.load(LLAMA)
    for n in range(5):
        model.warm(PROMPT[: 5 + n])
    monkeypatch.setattr(store_module, "MAX_FILES", 3)
    assert mlxinfer.load(LLAMA).cache_stats.entries == 3
    assert "holds 5 prefixes; using the first 3" in caplog.text


# -- things that are not ours: never read as a prefix, moved or deleted ---------------------------------------------

Maker = Callable[[Path, Path, Path], Path]  # (fingerprint folder, our valid file in the victim, victim) -> the stranger


def _ours_renamed(rename: Callable[[str], str]) -> Maker:
    return lambda folder, ours, victim: Path(shutil.copy(ours, folder / rename(ours.name)))


def _content(content: bytes) -> Maker:
    def make(folder: Path, ours: Path, victim: Path) -> Path:
        path = folder / ids_name([1, 2, 3])  # our name pattern, so only the contents can say
        path.write_bytes(content)
        return path

    return make


def _header(header: object, data: bytes = b"") -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


def _link(target: Callable[[Path, Path, Path], Path | str]) -> Maker:
    def make(folder: Path, ours: Path, victim: Path) -> Path:
        path = folder / ours.name  # the valid file's own name: followed, it would be a hit
        path.symlink_to(target(folder, ours, victim))
        return path

    return make


def _hard_link(source: Callable[[Path, Path], Path]) -> Maker:
    def make(folder: Path, ours: Path, victim: Path) -> Path:
        path = folder / ours.name
        os.link(source(ours, victim), path)
        return path

    return make


def _duplicate_key(folder: Path, ours: Path, victim: Path) -> Path:
    """Our valid file with a second `layers.0.0` entry first, over the values' bytes: parsers may pick either."""
    raw = ours.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    body = raw[8 : 8 + length].decode().rstrip()
    twin = json.dumps({"dtype": "F32", "shape": [1, 2, 30, 16], "data_offsets": [KV_BYTES, 2 * KV_BYTES]})
    body = body.replace('"layers.0.0":', f'"layers.0.0":{twin},"layers.0.0":', 1).encode()
    path = folder / ours.name
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + length :])
    return path


def _model_weights(folder: Path, ours: Path, victim: Path) -> Path:
    return Path(shutil.copy(victim / "model.safetensors", folder / ids_name([11])))


def _fifo(folder: Path, ours: Path, victim: Path) -> Path:
    path = folder / ids_name([9])
    os.mkfifo(path)
    return path


def _folder(folder: Path, ours: Path, victim: Path) -> Path:
    path = folder / ids_name([10])
    path.mkdir()
    (path / "inside").write_text("x")
    return path


NOT_OURS: dict[str, Maker] = {
    "our file under another name": _ours_renamed(lambda name: "stranger.safetensors"),
    "our file under an upper-case name": _ours_renamed(lambda name: name[:32].upper() + ".safetensors"),
    "our file with a .bak suffix": _ours_renamed(lambda name: name + ".bak"),
    "our file under a 31-digit name": _ours_renamed(lambda name: name[1:]),
    "an empty file": _content(b""),
    "7 bytes": _content(b"\x01" * 7),
    "random bytes": _content(np.random.default_rng(0).bytes(4096)),
    "a 2**63-byte header": _content(struct.pack("<Q", 2**63) + b"{}"),
    "a header longer than the file": _content(struct.pack("<Q", 100) + b"{}"),
    "a header over the size limit": _content(struct.pack("<Q", (1 << 22) + 1) + b" " * ((1 << 22) + 1)),
    "a header that is not JSON": _content(struct.pack("<Q", 4) + b"\xff\xfe{]"),
    "a header that is a list": _content(_header([1, 2])),
    "a deeply nested header": _content(struct.pack("<Q", 100_000) + b"[" * 100_000),
    "no metadata": _content(_header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)),
    "metadata of another program": _content(_header({"__metadata__": {"format": "pt"}})),
    "metadata that is a list": _content(_header({"__metadata__": ["mlxinfer-prefix-v2"]})),
    "a format that is a number": _content(_header({"__metadata__": {"format": 2}})),
    "our file with a key twice in its header": _duplicate_key,
    "model weights": _model_weights,
    "a FIFO": _fifo,
    "a folder": _folder,
    "a link to our valid file elsewhere": _link(lambda folder, ours, victim: ours),
    "a link to a damaged file of ours": _link(lambda folder, ours, victim: victim / f"{'0' * 32}.safetensors"),
    "a link to model weights": _link(lambda folder, ours, victim: victim / "model.safetensors"),
    "a relative link out of the root": _link(lambda f, ours, v: os.path.relpath(v / "model.safetensors", f)),
    "a dangling link": _link(lambda folder, ours, victim: victim / "missing.safetensors"),
    "a link to itself": _link(lambda folder, ours, victim: folder / ours.name),
    "a link to /dev/zero": _link(lambda folder, ours, victim: "/dev/zero"),
    "a hard link to model weights": _hard_link(lambda ours, victim: victim / "model.safetensors"),
    "a hard link to our valid file elsewhere": _hard_link(lambda ours, victim: ours),
}


@pytest.mark.parametrize("make", NOT_OURS.values(), ids=NOT_OURS.keys())
def test_what_is_not_ours_is_never_used_moved_or_deleted(make, warmed, root, victim, caplog, cold):
    warmed.unlink()  # only the stranger is in the folder; the victim holds a valid copy
    stranger = make(warmed.parent, victim / warmed.name, victim)
    before = snapshot(root, victim)
    result = answer()
    assert result.stats.cached_tokens == 0 and result.token_ids == cold
    assert not (root / "quarantine").exists()
    assert list_prefixes(root) == [] and clear_prefixes(root) == []
    assert snapshot(root, victim) == before and os.path.lexists(stranger)
    assert f"{stranger} alone" in caplog.text  # said why, by scan or by clear


@pytest.mark.parametrize("make", list(NOT_OURS.values())[:8], ids=list(NOT_OURS)[:8])
def test_clear_removes_ours_and_only_ours_next_to_strangers(make, warmed, root, victim):
    stranger = make(warmed.parent, victim / warmed.name, victim)
    assert clear_prefixes(root) == [warmed] and not warmed.exists() and stranger.exists()


# -- links where the cache expects its own folders -----------------------------------------------------------------

LINKED_FOLDERS = {
    "a model folder": lambda folder, victim: victim,
    "a model folder, relative": lambda folder, victim: Path("..") / ".." / "victim",
    "a file": lambda folder, victim: victim / "model.safetensors",
    "nothing": lambda folder, victim: victim / "missing",
    "itself": lambda folder, victim: folder,
    "the root": lambda folder, victim: folder.parent,
}


@pytest.mark.parametrize("target", LINKED_FOLDERS.values(), ids=LINKED_FOLDERS.keys())
def test_a_fingerprint_folder_that_is_a_link_is_never_entered(target, warmed, root, victim, caplog, cold):
    folder = warmed.parent  # the victim holds the right file for this model, behind the link
    shutil.rmtree(folder)
    folder.symlink_to(target(folder, victim))
    before = snapshot(root, victim)
    result = answer()
    assert result.stats.cached_tokens == 0 and result.token_ids == cold
    assert f"not using the warmed prefixes in {folder}" in caplog.text
    refused = f"cannot write warmed prefixes to {re.escape(str(folder))}: .*links below the cache root are never"
    with pytest.raises(CacheError, match=refused):
        mlxinfer.load(LLAMA).warm(WARMED)
    assert list_prefixes(root) == [] and clear_prefixes(root) == []
    assert snapshot(root, victim) == before


@pytest.mark.parametrize("target", ["a model folder", "nothing", "a file"])
def test_a_quarantine_that_is_a_link_is_never_moved_into(target, warmed, root, victim, caplog, cold):
    (root / "quarantine").symlink_to(LINKED_FOLDERS[target](root, victim))
    flip_kv(warmed)
    before = snapshot(victim)
    result = answer()
    assert result.stats.cached_tokens == 0 and result.token_ids == cold
    assert f"ignoring prefix cache file {warmed}: " in caplog.text and "left in place, not quarantined" in caplog.text
    assert warmed.exists() and snapshot(victim) == before
    assert clear_prefixes(root) == [warmed]  # ours, so cleared; the link is left alone
    assert (root / "quarantine").is_symlink() and snapshot(victim) == before


def test_quarantine_never_replaces_what_is_there(warmed, root, caplog, cold):
    taken = root / "quarantine" / f"{warmed.parent.name}-{warmed.name}"
    taken.parent.mkdir()
    taken.write_text("someone's notes under the very name quarantine would use")
    flip_kv(warmed)
    assert answer().token_ids == cold and taken.read_text().startswith("someone's")
    (moved,) = [p for p in taken.parent.iterdir() if p != taken]
    assert re.fullmatch(rf"{warmed.parent.name}-{warmed.stem}\.[0-9a-f]{{8}}\.safetensors", moved.name)
    assert clear_prefixes(root) == [moved] and taken.exists()


def test_a_root_that_is_a_link_is_used_and_only_ours_inside_it_is_cleared(tmp_path, root, cold):
    real = tmp_path / "elsewhere"
    real.mkdir()
    root.parent.mkdir(parents=True)
    root.symlink_to(real)
    mlxinfer.load(LLAMA).warm(WARMED)
    (real / "notes.txt").write_text("mine")
    result = answer()
    assert result.stats.cached_tokens == len(WARMED) and result.token_ids == cold
    removed = clear_prefixes(root)
    assert len(removed) == 1 and removed[0].parent.parent == root
    assert root.is_symlink() and sorted(p.name for p in real.iterdir()) == ["notes.txt"]


def test_a_root_that_points_at_a_model_folder_loses_nothing(root, victim, cold):
    shutil.rmtree(root)
    root.symlink_to(victim)  # holding a file of ours, a damaged one, and the model
    before = snapshot(victim)
    assert answer().token_ids == cold
    assert list_prefixes(root) == [] and clear_prefixes(root) == []
    assert snapshot(victim) == before


# -- the disk refuses: cache warm says so in one line; generate still answers ---------------------------------------

FAULTS = {  # errno -> the words the one-line error must hold (the OS's own for one without fixed words)
    errno.ENOSPC: "no space left on the device; free some space or point MLXINFER_CACHE_DIR",
    errno.EROFS: "read-only file system; point MLXINFER_CACHE_DIR",
    errno.EACCES: "permission denied; point MLXINFER_CACHE_DIR",
    errno.EFBIG: "(file-size limit, `ulimit -f`); raise the limit or point MLXINFER_CACHE_DIR",
    errno.EDQUOT: "disk quota exceeded; free some space or point MLXINFER_CACHE_DIR",
    errno.EIO: f"{os.strerror(errno.EIO)}; point MLXINFER_CACHE_DIR",
    errno.EPERM: "operation not permitted; point MLXINFER_CACHE_DIR",
}


def _fail_on(mp: pytest.MonkeyPatch, stage: str, code: int) -> None:
    """Make one kind of system call fail with `code` (os.open only where it creates a file)."""
    name = {"rename": "replace"}.get(stage, stage)
    real = getattr(os, name)

    def failing(*args, **kwargs):
        if stage == "open" and not args[1] & os.O_CREAT:
            return real(*args, **kwargs)
        raise OSError(code, os.strerror(code))

    mp.setattr(store_module.os, name, failing)


@pytest.mark.parametrize("code", FAULTS, ids=[errno.errorcode[c] for c in FAULTS])
@pytest.mark.parametrize("stage", ["mkdir", "open", "write", "rename"])
def test_a_failing_disk_makes_warm_raise_one_cache_error(stage, code, root, monkeypatch, cold):
    model = mlxinfer.load(LLAMA)
    if stage != "mkdir":
        root.mkdir(parents=True)
    with monkeypatch.context() as mp, pytest.raises(CacheError) as raised:
        _fail_on(mp, stage, code)
        model.warm(WARMED)
    message = str(raised.value)
    assert message.startswith(f"cannot write warmed prefixes to {root}/") and FAULTS[code] in message
    assert "\n" not in message
    assert not [p for p in root.rglob("*") if p.is_file()]  # no file, no temporary
    assert model.generate(PROMPT, max_tokens=6).token_ids == cold  # the model still answers


@pytest.mark.parametrize("code", FAULTS, ids=[errno.errorcode[c] for c in FAULTS])
def test_cache_warm_prints_one_line_for_a_failing_disk(code, root, tmp_path, monkeypatch):
    text = tmp_path / "system.txt"
    text.write_text("You are terse.")
    _fail_on(monkeypatch, "write", code)
    result = CliRunner().invoke(main, ["cache", "warm", str(LLAMA), "--prefix-file", str(text)])
    assert result.exit_code == 1 and one_line_error(result.output), result.output
    assert "cannot write warmed prefixes" in result.output and FAULTS[code] in result.output


ODD_NAMES = ["plain", "new\nline", "esc\x1b[2J", "rtl\u202eevil", "tab\there", "x" * 200]


def test_any_failed_write_of_the_cache_is_one_line_naming_the_folder_and_what_to_do(tmp_path, monkeypatch):
    """Every errno this system has, each under every odd folder name; one test, failures named by errno."""
    layout = KVLayout.of(2, 2, 16, mx.float32, CONTEXT)
    failures = []
    for code in sorted(errno.errorcode):

        def failing(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))

        for name in ODD_NAMES:
            store = PrefixStore(tmp_path / name / "prefixes", "0" * 24, layout)
            try:
                with monkeypatch.context() as mp:
                    mp.setattr(store_module.os, "open", failing)
                    store.check_room(10)
            except CacheError as e:
                message, folder = str(e), str(store.folder)
            else:
                failures.append(f"{errno.errorcode[code]} {name!r}: no CacheError")
                continue
            shown = folder if folder.isprintable() else repr(folder)
            why = disk.reason(OSError(code, os.strerror(code)))
            if not (message.isprintable() and message.startswith(f"cannot write warmed prefixes to {shown}: ")):
                failures.append(f"{errno.errorcode[code]} {name!r}: {message!r}")
            elif not (why and why in message and "MLXINFER_CACHE_DIR" in message):
                failures.append(f"{errno.errorcode[code]} {name!r}: no reason or remedy in {message!r}")
    assert len(errno.errorcode) > 100 and not failures, "\n".join(failures)


def _a_file(tmp: Path) -> Path:
    (tmp / "f").write_text("x")
    return tmp / "f"


def _prefixes_a_file(tmp: Path) -> Path:
    (tmp / "c").mkdir()
    (tmp / "c" / "prefixes").write_text("x")
    return tmp / "c"


def _a_link_to(target: Callable[[Path], Path]) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        (tmp / "link").symlink_to(target(tmp))
        return tmp / "link"

    return make


CACHE_DIRS = {  # MLXINFER_CACHE_DIR pointing at something that cannot hold a cache
    "a file": _a_file,
    "a folder whose prefixes is a file": _prefixes_a_file,
    "a dangling link": _a_link_to(lambda tmp: tmp / "missing"),
    "a link loop": _a_link_to(lambda tmp: tmp / "link"),
    "a link to a file": _a_link_to(_a_file),
    "a folder in /proc": lambda tmp: Path("/proc/self/mlxinfer-cache"),
}


@pytest.mark.parametrize("make", CACHE_DIRS.values(), ids=CACHE_DIRS.keys())
def test_an_unusable_cache_folder_fails_warm_in_one_line_and_generate_still_answers(make, tmp_path, monkeypatch):
    if make is CACHE_DIRS["a folder in /proc"] and not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(make(tmp_path)))
    text = tmp_path / "system.txt"
    text.write_text("You are terse.")
    runner = CliRunner()
    warmed = runner.invoke(main, ["cache", "warm", str(LLAMA), "--prefix-file", str(text)])
    assert warmed.exit_code == 1 and one_line_error(warmed.output), warmed.output
    assert "cannot write warmed prefixes to " in warmed.output
    generated = runner.invoke(main, ["generate", str(LLAMA), "-p", "Hello", "--raw", "--max-tokens", "4"])
    assert generated.exit_code == 0 and "Traceback" not in generated.output
    for command in (["cache", "ls"], ["cache", "clear"]):
        result = runner.invoke(main, command)
        assert result.exit_code == 0 or one_line_error(result.output), result.output


def test_an_unreadable_cache_folder_is_a_warning_for_generate_and_one_error_for_clear(warmed, root, monkeypatch, cold):
    real = os.scandir

    def denied(path="."):  # folders the store opens by descriptor; Path.glob of model files still works
        if isinstance(path, int):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(path)

    monkeypatch.setattr(store_module.os, "scandir", denied)
    with pytest.raises(CacheError, match=f"cannot read the prefix cache {re.escape(str(root))}: permission denied"):
        clear_prefixes(root)
    result = CliRunner().invoke(main, ["cache", "ls"])
    assert result.exit_code == 1 and one_line_error(result.output)
    assert answer().token_ids == cold and warmed.exists()


def test_an_unreadable_fingerprint_folder_is_a_warning_for_generate(warmed, monkeypatch, caplog, cold):
    real = os.open

    def denied(path, flags, *args, **kwargs):
        if path == warmed.parent.name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(store_module.os, "open", denied)
    result = answer()
    assert result.token_ids == cold and result.stats.cached_tokens == 0
    assert f"not using the warmed prefixes in {warmed.parent} (permission denied)" in caplog.text


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (needs root); skipped where mounting is not allowed."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    except OSError as e:
        pytest.skip(f"no mount command here: {e}")
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip() or made.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_refused_before_the_prefill(tmpfs, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmpfs))
    model = mlxinfer.load(LLAMA)
    monkeypatch.setattr(Prefill, "step", lambda *a, **k: pytest.fail("prefilled before refusing"))
    with pytest.raises(CacheError, match=r"free but a 200-token prefix takes .*; free some space"):
        model.warm(list(range(200)))  # 100 KiB of KV
    assert not [p for p in tmpfs.rglob("*") if p.is_file()]


def test_a_disk_that_fills_up_while_writing_leaves_no_file(tmpfs, monkeypatch, cold):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmpfs))
    plenty = shutil.disk_usage(tmpfs)._replace(free=1 << 40)  # the free-space check passes: the write itself fails
    monkeypatch.setattr(store_module.shutil, "disk_usage", lambda path: plenty)
    model = mlxinfer.load(LLAMA)
    (tmpfs / "filler").write_bytes(b"\0" * 40_000)
    with pytest.raises(CacheError, match=f"cannot write warmed prefixes to {tmpfs}/prefixes/.*: no space left"):
        model.warm(list(range(60)))  # 30 KiB of KV, 24 KiB free
    assert sorted(p.name for p in tmpfs.rglob("*") if p.is_file()) == ["filler"]
    assert model.generate(PROMPT, max_tokens=6).token_ids == cold


def test_a_read_only_cache_refuses_warm_and_generate_still_answers(tmpfs, monkeypatch, caplog, cold):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmpfs))
    mlxinfer.load(LLAMA).warm(WARMED)
    (path,) = (tmpfs / "prefixes").glob("*/*.safetensors")
    flip_kv(path)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    with pytest.raises(CacheError, match="cannot write warmed prefixes to .*: read-only file system"):
        mlxinfer.load(LLAMA).warm(PROMPT[:10])
    result = answer()
    assert result.token_ids == cold and result.stats.cached_tokens == 0
    assert "left in place, not quarantined: read-only file system" in caplog.text and path.exists()
    assert clear_prefixes(tmpfs / "prefixes") == [] and path.exists()  # what it really removed: nothing
    assert f"left {path} alone: read-only file system" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage, expected", [("check", "file-size limit of 0.0 MiB"), ("write", "larger than this process may write")]
)
def test_a_file_size_limit_is_one_line_from_cache_warm(stage, expected, tmp_path):
    text = tmp_path / "system.txt"
    text.write_text("You are terse.")
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY)); "
        "import mlxinfer.disk as d; from mlxinfer.cli import main\n"
        "if sys.argv[1] == 'write': d.file_size_limit = lambda: None  # the check passes: the write fails\n"
        f"sys.argv[1:] = ['cache', 'warm', {str(LLAMA)!r}, '--prefix-file', {str(text)!r}]; main()"
    )
    env = {**os.environ, "MLXINFER_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code, stage], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and one_line_error(done.stderr) and expected in done.stderr, done.stderr
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


# -- warm refuses a prefix longer than the context, before any work ------------------------------------------------


@pytest.mark.parametrize("prefix", [
    list(range(CONTEXT + 1)),
    [3] * (4 * CONTEXT),
    "a" * (CONTEXT * 64 + 1),
    "word " * 100_000,
    [{"role": "system", "content": "x" * (CONTEXT * 64 + 1)}],
    [{"role": "system", "content": "short"}, {"role": "user", "content": "y" * (CONTEXT * 64)}],
], ids=["257 ids", "1024 ids", "16385 chars", "500k chars", "one long message", "two messages"])  # fmt: skip
def test_warm_refuses_a_prefix_longer_than_the_context(prefix, root, monkeypatch):
    model = mlxinfer.load(LLAMA)
    monkeypatch.setattr(Prefill, "step", lambda *a, **k: pytest.fail("prefilled before refusing"))
    with pytest.raises(SamplingError, match=f"the prefix to warm .*context (of|is) {CONTEXT}"):
        model.warm(prefix)
    assert not root.exists()


def test_warm_accepts_a_prefix_of_exactly_the_context(root):
    assert mlxinfer.load(LLAMA).warm([5] * CONTEXT) == CONTEXT
    assert mlxinfer.load(LLAMA).cache_stats.entries == 1


def test_a_text_far_over_the_context_is_refused_before_tokenizing(root, monkeypatch):
    model = mlxinfer.load(LLAMA)
    monkeypatch.setattr(type(model.tokenizer), "encode", lambda *a, **k: pytest.fail("tokenized before refusing"))
    with pytest.raises(SamplingError, match="far longer than the model's context of 256 tokens"):
        model.warm("z" * 10**7)


def _write(content: bytes) -> Callable[[Path], Path]:
    def make(path: Path) -> Path:
        path.write_bytes(content)
        return path

    return make


PREFIX_FILES = {
    "over the byte bound": (_write(b"a" * (CONTEXT * 64 * 4 + 1)), "is longer than the model's context could hold"),
    "endless (/dev/zero)": (lambda path: Path("/dev/zero"), "is longer than the model's context could hold"),
    "not UTF-8": (_write(b"caf\xe9 au lait"), "is not UTF-8 text (byte 3)"),
    "blank": (_write(b" \n\t"), "is empty"),
    "tokens over the context": (_write(b"x " * 2000), "the model's context is 256"),
}


@pytest.mark.parametrize("make, why", PREFIX_FILES.values(), ids=PREFIX_FILES.keys())
def test_cache_warm_refuses_a_prefix_file_in_one_line(make, why, root, tmp_path):
    path = make(tmp_path / "prefix.txt")
    result = CliRunner().invoke(main, ["cache", "warm", str(LLAMA), "--prefix-file", str(path), "--raw"])
    assert result.exit_code == 1 and one_line_error(result.output) and why in result.output, result.output
    assert not list(root.rglob("*.safetensors"))


# -- cache ls and cache clear report what is really there and what really went -----------------------------------


def test_clear_removes_a_probe_and_empty_unfinished_files_left_by_a_kill(warmed, root, caplog):
    probe = warmed.parent / ".probe.4242.0badf00d.safetensors"  # what check_room writes, if killed before its unlink
    empty = warmed.parent / f".{warmed.stem}.4242.deadbeef.safetensors"  # killed before writing a byte
    probe.touch()
    empty.touch()
    result = CliRunner().invoke(main, ["cache", "clear"])
    assert result.exit_code == 0 and "removed 1 warmed prefix (3 files)" in result.stdout, result.output
    assert not probe.exists() and not empty.exists() and not warmed.exists() and "alone" not in caplog.text


def test_the_probe_of_check_room_has_a_name_clear_removes(root, monkeypatch):
    store = mlxinfer.load(LLAMA).prefix_cache.store
    names = []
    real = store_module.os.open

    def recorded(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            names.append(path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(store_module.os, "open", recorded)
    store.check_room(10)
    (name,) = names
    assert name.startswith(".probe.") and store_module._FOLDER_FILES.fullmatch(name)


def test_clear_reports_exactly_the_files_it_removed(warmed, root, caplog):
    mlxinfer.load(TINY / "qwen2").warm(WARMED)
    (qwen,) = [p for p in root.glob("*/*.safetensors") if p != warmed]
    unfinished = Path(shutil.copy(warmed, warmed.parent / f".{warmed.stem}.123.deadbeef.safetensors"))  # a crash
    flip_kv(qwen)
    mlxinfer.load(TINY / "qwen2").generate(PROMPT, max_tokens=2)  # quarantines it
    quarantined = root / "quarantine" / f"{qwen.parent.name}-{qwen.name}"
    strangers = [warmed.parent / "notes.txt", root / "quarantine" / "evidence.txt", root / "README"]
    for path in strangers:
        path.write_text("not the cache's")
    strangers.append(warmed.parent / f".{'1' * 32}.1.deadbeef.safetensors")  # a temporary's name, not our header
    strangers[-1].write_bytes(b"partial")
    listed = CliRunner().invoke(main, ["cache", "ls"])
    assert listed.exit_code == 0 and listed.stdout.count("\n") == 1 and "llama_classic" in listed.stdout
    assert str(warmed) in listed.stdout and "1 warmed prefix " in listed.stderr
    result = CliRunner().invoke(main, ["cache", "clear"])
    assert result.exit_code == 0 and f"removed 1 warmed prefix (3 files) from {root}" in result.stdout
    for path in (warmed, unfinished, quarantined):
        assert f"removed {path}\n" in result.stderr and not path.exists()
    assert all(path.exists() for path in strangers) and not qwen.parent.exists()
    assert all(f"left {path} alone" in caplog.text for path in strangers)


LABELS = ["\x1b[31mred\x1b[0m", "two\nlines", "tab\there", "\u202eevil", "\x00", "", "x" * 500, "y" * 120, "z" * 121]
LABELS += [123, None, True, ["\x1b[31m"], {"k": "two\nlines" * 1000}, [[[["deep"]]]] * 1000]  # any JSON, not only text


@pytest.mark.parametrize("label", LABELS)
def test_ls_never_prints_control_characters_from_a_file(label, warmed, root):
    metadata, tensors = read_parts(warmed)
    metadata["model"] = label
    write_parts(warmed, metadata, tensors)
    result = CliRunner().invoke(main, ["cache", "ls"])
    line = result.stdout.rstrip("\n")
    assert result.exit_code == 0 and result.stdout.count("\n") == 1 and line.endswith(str(warmed))
    assert all(c.isprintable() for c in line) and len(line) <= 120 + 40 + len(str(warmed))  # names up to 120 as is


# -- the model folder that the fingerprint reads ---------------------------------------------------------------------


def _fifo_in(folder: Path) -> None:
    os.mkfifo(folder / "extra.safetensors")


MODEL_FOLDER_EXTRAS = {
    "a FIFO": _fifo_in,
    "a dangling link": lambda folder: (folder / "gone.safetensors").symlink_to(folder / "missing"),
    "a link to /dev/zero": lambda folder: (folder / "zero.safetensors").symlink_to("/dev/zero"),
    "a folder": lambda folder: (folder / "shards.safetensors").mkdir(),
}


@pytest.mark.slow
@pytest.mark.parametrize("add", MODEL_FOLDER_EXTRAS.values(), ids=MODEL_FOLDER_EXTRAS.keys())
def test_odd_entries_in_the_model_folder_do_not_block_or_break_the_fingerprint(add, tiny_copy, tmp_path):
    model = tiny_copy("llama_classic")
    add(model)
    code = f"import mlxinfer; m = mlxinfer.load({str(model)!r}); m.warm({WARMED!r}); print(m.generate({PROMPT!r}, max_tokens=2).stats.cached_tokens)"  # noqa: E501
    env = {**os.environ, "MLXINFER_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == str(len(WARMED)), done.stderr


def test_a_model_that_cannot_be_fingerprinted_answers_and_warms_in_memory_only(
    root, monkeypatch, caplog, cold, tmp_path
):
    def unreadable(*args):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(prefix_store_module, "fingerprint", unreadable)
    model = mlxinfer.load(LLAMA)
    assert f"not using warmed prefixes: cannot fingerprint {LLAMA} (Permission denied)" in caplog.text
    assert model.generate(PROMPT, max_tokens=6, use_cache=False).token_ids == cold
    assert model.warm(WARMED) == len(WARMED)  # as before there was a store: in memory, with a warning
    assert f"{LLAMA}: warming the prefix in memory only; it will not be kept on disk" in caplog.text
    result = model.generate(PROMPT, max_tokens=6)
    assert result.stats.cached_tokens == len(WARMED) and result.token_ids == cold
    assert not root.exists()
    text = tmp_path / "system.txt"  # `cache warm` is for the file: it fails in one line
    text.write_text("You are terse.")
    warmed = CliRunner().invoke(main, ["cache", "warm", str(LLAMA), "--prefix-file", str(text)])
    assert warmed.exit_code == 1 and warmed.output.endswith(
        f"Error: {LLAMA}: warmed prefixes cannot be kept on disk for this model (see the warning)\n"
    ), warmed.output
    assert "Traceback" not in warmed.output and not root.exists()


def test_a_model_without_a_tokenizer_warms_token_ids_in_memory(root, caplog):
    model = mlxinfer.load(LLAMA)
    model._loaded.tokenizer = None  # as a model loaded without one
    model.prefix_cache.store = prefix_store_for(model._loaded, model.footprint, model.kv_bits, model.context_tokens)
    assert model.prefix_cache.store is None
    assert model.warm(WARMED) == len(WARMED) and "will not be kept on disk" in caplog.text
    assert model.cache_stats.entries == 1 and not root.exists()
