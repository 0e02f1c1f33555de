"""Model folders: safetensors header validation, shards, pickles, weight checks."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from mlxinfer.errors import CorruptFileError, ModelNotFoundError, UnsupportedModelError, WeightMismatchError
from mlxinfer.formats.safetensors_header import read_header
from tests.conftest import golden


def write_raw(path: Path, header: dict, data: bytes) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def test_valid_header_is_read(tmp_path):
    path = write_raw(
        tmp_path / "a.safetensors", {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16)
    )
    assert read_header(path)["w"].shape == (2, 2)


@pytest.mark.parametrize(
    "header, data, words",
    [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), "truncated"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, bytes(16), "needs 12 bytes"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "invalid shape"),
        ({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), "not supported"),
        ({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8), "'F64', which is not supported"),
        ({"w": {"dtype": "F32", "shape": [2**31, 0], "data_offsets": [0, 0]}}, b"", "invalid shape"),
        ({"__metadata__": {"a": 1}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), "strings"),
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            },
            bytes(16),
            "overlap",
        ),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4), "spans"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            "overlap",
        ),
    ],
)
def test_crafted_headers_are_refused(tmp_path, header, data, words):
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CorruptFileError, match=words):
        read_header(path)


@pytest.mark.parametrize("header", [b'{"w": NaN}', b"[" * 50_000 + b"]" * 50_000, b"\xff\xfe"])
def test_header_that_is_not_strict_json_is_refused(tmp_path, header):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        read_header(path)


def test_weights_path_that_is_a_folder_is_refused(tiny_copy):
    folder = tiny_copy()
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    with pytest.raises(CorruptFileError, match="cannot be read"):
        mlxinfer.load(folder)


def test_float_weights_stored_as_integers_are_refused(tiny_copy):
    folder = tiny_copy()
    weights = mx.load(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(mx.int32)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(WeightMismatchError, match=r"wrong dtype \(1\): model.norm.weight \(mlx.core.int32\)"):
        mlxinfer.load(folder)


def test_header_length_past_the_end_is_refused(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CorruptFileError, match="exceeds the file"):
        read_header(path)


def test_truncated_model_file_gives_a_clear_error(tiny_copy):
    folder = tiny_copy()
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CorruptFileError, match="model.safetensors.*truncated"):
        mlxinfer.load(folder)


def test_config_with_model_file_is_refused(tiny_copy):
    folder = tiny_copy()
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_file": "evil.py"}))
    with pytest.raises(UnsupportedModelError, match="never imports code"):
        mlxinfer.load(folder)


def test_pickle_only_folder_is_refused_without_unpickling(tiny_copy):
    folder = tiny_copy()
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not read")
    with pytest.raises(UnsupportedModelError, match="never unpickles"):
        mlxinfer.load(folder)


def test_weight_mismatches_are_listed_once_and_sorted(tiny_copy):
    folder = tiny_copy()
    weights = mx.load(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"]
    weights["model.extra.weight"] = mx.zeros((2,))
    weights["model.norm.weight"] = mx.zeros((3,))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(WeightMismatchError) as info:
        mlxinfer.load(folder)
    message = str(info.value)
    assert "missing (2): model.layers.0.mlp.up_proj.weight, model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected (1): model.extra.weight" in message
    assert "wrong shape (1): model.norm.weight (file (3,), model (64,))" in message


def shard(folder: Path) -> None:
    """Split model.safetensors into two shards with an index, as save_pretrained does."""
    weights = mx.load(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in parts.items():
        mx.save_safetensors(str(folder / file), {k: weights[k] for k in keys})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_loads_like_a_single_file(tiny_copy):
    folder = tiny_copy("qwen3")
    shard(folder)
    ref = golden("qwen3")
    logits = mlxinfer.load(folder).logits(ref["input_ids"].tolist())
    assert np.abs(logits - np.array(ref["logits"])).max() < 1e-3


def test_missing_shard_is_named(tiny_copy):
    folder = tiny_copy()
    shard(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="model-00002-of-00002.safetensors"):
        mlxinfer.load(folder)


def test_tensor_in_two_shards_is_refused(tiny_copy):
    folder = tiny_copy()
    shard(folder)
    first = mx.load(str(folder / "model-00001-of-00002.safetensors"))
    second = mx.load(str(folder / "model-00002-of-00002.safetensors"))
    second[next(iter(first))] = first[next(iter(first))]
    mx.save_safetensors(str(folder / "model-00002-of-00002.safetensors"), second)
    with pytest.raises(CorruptFileError, match="also appears in"):
        mlxinfer.load(folder)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(ModelNotFoundError):
        mlxinfer.load(tmp_path / "nope")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        mlxinfer.load(tmp_path)
