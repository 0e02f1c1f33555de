"""GGUF Q4_K and Q5_K kept as MLX affine 4-/5-bit, group size 32: the file's codes, scales and mins, exactly;
Q2_K, Q3_K, Q6_K and the IQ and TQ types rounded once onto the MLX type gguf_requant.py names.

Blocks are built byte by byte in ggml's layout (the `gguf` package cannot quantize K-, IQ- or TQ-types), written
with its GGUFWriter and compared with its own dequantize, the reference for what the bytes mean.
"""

from __future__ import annotations

import json

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlxinfer.convert import convert

import mlxinfer
from mlxinfer.formats.gguf_file import GGUFFile, QuantizedTensor
from mlxinfer.formats.gguf_kquants import pack_bits
from mlxinfer.formats.gguf_requant import FINE_BITS, REQUANTIZED
from mlxinfer.models.gguf import gguf_tensors, note_requantized
from tests.test_gguf import write_tiny_gguf

Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 = (gguf.GGMLQuantizationType[k] for k in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"))
BITS = {Q4_K: 4, Q5_K: 5}


def k_blocks(kind: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random codes, 6-bit scales and mins, high bits; f16 d and dmin spread over 2**-14..2**-3 (as real files)."""
    per, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // per, size), dtype=np.uint8)
    for at in (0, 2):  # d, then dmin
        values = rng.uniform(1, 2, len(blocks)) * 2.0 ** rng.integers(-14, -3, len(blocks))
        blocks[:, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // per * size)


def write_one(path, kind, blocks: np.ndarray, shape: tuple[int, ...]):
    """One tensor of logical `shape` from its block bytes (the writer reads the shape off the bytes' own)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", blocks.reshape(*shape[:-1], -1), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_bits_is_mlx_packing(bits):
    """The words mx.quantize packs, rebuilt from its codes (3, 5 and 6 bits straddle words)."""
    w = mx.array(np.random.default_rng(bits).standard_normal((4, 128)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    values = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
    codes = np.rint((np.array(values) - np.repeat(biases, 32, 1)) / np.repeat(scales, 32, 1)).astype(np.uint8)
    assert np.array_equal(pack_bits(codes, bits), np.array(packed))


@pytest.mark.parametrize("kind", [Q4_K, Q5_K])
def test_k_tensor_reads_as_gguf_dequantizes_it_exactly(tmp_path, kind):
    """Exactly equal, not close: d*sc and dmin*m are exact in float32 (an f16 mantissa times 6 bits), d*sc*q too
    (at most 22 bits), so both sides round once, on the same subtraction. Stacked experts keep their leading axis."""
    shape = (2, 6, 512)  # (experts, out, in)
    blocks = k_blocks(kind, 12, 512, seed=int(kind))
    with GGUFFile(write_one(tmp_path / "k.gguf", kind, blocks, shape)) as f:
        t = f.read("blk.0.ffn_down.weight")
        assert isinstance(t, QuantizedTensor)
        assert (t.bits, t.group_size, t.mode) == (BITS[kind], 32, "affine")
        assert t.weight.shape == (2, 6, 512 * BITS[kind] // 32) and t.scales.shape == t.biases.shape == (2, 6, 16)
        assert t.scales.dtype == t.biases.dtype == np.float32  # float16 would round d*sc
    got = mx.dequantize(mx.array(t.weight), mx.array(t.scales), mx.array(t.biases), group_size=32, bits=t.bits)
    expected = gguf.quants.dequantize(blocks.reshape(-1), kind).reshape(shape)
    np.testing.assert_array_equal(np.array(got), expected)


@pytest.mark.parametrize("kind", [Q5_0, Q5_1])
def test_legacy_5_bit_blocks_read_as_gguf_dequantizes_them_exactly(tmp_path, kind):
    """Q5_0 (w = d*(q - 16)) and Q5_1 (w = d*q + m) are MLX 5-bit group 32 with float16 d and m (or -16*d,
    exact): equal once widened to float32, as the gguf package computes (MLX computes in the scales' dtype)."""
    values = np.random.default_rng(int(kind)).standard_normal((6, 256)).astype(np.float32)
    blocks = gguf.quants.quantize(values, kind)
    with GGUFFile(write_one(tmp_path / "q5.gguf", kind, blocks, (6, 256))) as f:
        t = f.read("blk.0.ffn_down.weight")
    assert (t.bits, t.group_size, t.weight.shape, t.scales.dtype) == (5, 32, (6, 40), np.float16)
    scales, biases = (mx.array(a).astype(mx.float32) for a in (t.scales, t.biases))  # as the loader casts them
    got = mx.dequantize(mx.array(t.weight), scales, biases, group_size=32, bits=5)
    np.testing.assert_array_equal(np.array(got), gguf.quants.dequantize(blocks, kind).reshape(6, 256))


def _tiny(tmp_path, name, kinds, dequantized=False):
    """The tiny llama at width 256 with `kinds` (HF name -> type); `dequantized`: the same values as F32."""
    path = write_tiny_gguf(tmp_path / f"{name}.gguf", hidden=256, k_quants=kinds)
    if not dequantized:
        return path
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    floats = {}
    for hf, kind in kinds.items():
        stored = by_name[f"blk.0.{_short(hf)}.weight"]
        floats[hf] = gguf.quants.dequantize(stored.data, kind).reshape(tuple(reversed(stored.shape.tolist())))
    return write_tiny_gguf(tmp_path / f"{name}-f32.gguf", hidden=256, floats=floats)


def _short(hf: str) -> str:
    from tests.test_gguf import NAMES

    return NAMES[hf.removeprefix("model.layers.0.").removesuffix(".weight")]


def test_q4_k_model_runs_as_its_dequantized_twin_and_holds_4_bits(tmp_path):
    down = "model.layers.0.mlp.down_proj.weight"  # (256, 512)
    kinds = {down: Q4_K}
    quantized = mlxinfer.load(_tiny(tmp_path, "q", kinds), dtype="float32")
    dense = mlxinfer.load(_tiny(tmp_path, "d", kinds, dequantized=True), dtype="float32")
    layer = quantized._loaded.model.model.layers[0].mlp.down_proj
    assert (layer.bits, layer.group_size) == (4, 32)
    # Held: 4-bit codes (128 of the block's 144 bytes) and one float32 scale and bias per 32 values.
    assert layer.weight.nbytes == 256 * 512 // 2 == 256 * 512 // 256 * 128
    assert layer.scales.nbytes == layer.biases.nbytes == 256 * 512 // 32 * 4
    assert quantized._loaded.weights_bytes < dense._loaded.weights_bytes - 256 * 512 * 3
    with GGUFFile(quantized._loaded.path) as f:  # the size forecast counts what is held
        forecast = gguf_tensors(f, compute_size=4)[down].loaded_bytes
    assert forecast == layer.weight.nbytes + layer.scales.nbytes + layer.biases.nbytes
    ids = [1, 5, 9, 2, 7, 3]
    a, b = quantized.logits(ids), dense.logits(ids)
    # Same weights, different kernels (quantized matmul vs float matmul): float32 summation order only.
    assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(b).max())
    assert quantized.generate(ids, max_tokens=12).token_ids == dense.generate(ids, max_tokens=12).token_ids


def test_mixed_k_quant_model_loads_each_tensor_at_its_own_bits(tmp_path):
    """A Q4_K_M file mixes Q4_K, Q5_K, Q6_K and Q5_0 (Gemma 3 270M's has 81). The types of 32-value (sub-)blocks
    keep their codes, so the model answers as its dequantized twin; Q6_K is rounded once more onto 6-bit groups."""
    layers = "model.layers.0."
    kinds = {
        f"{layers}mlp.down_proj.weight": Q4_K,
        f"{layers}mlp.up_proj.weight": Q5_K,
        f"{layers}self_attn.q_proj.weight": Q5_0,
        f"{layers}self_attn.v_proj.weight": Q5_1,
    }
    quantized = mlxinfer.load(_tiny(tmp_path, "m", kinds), dtype="float32")
    dense = mlxinfer.load(_tiny(tmp_path, "md", kinds, dequantized=True), dtype="float32")
    mlp = quantized._loaded.model.model.layers[0].mlp
    attention = quantized._loaded.model.model.layers[0].self_attn
    assert (mlp.down_proj.bits, mlp.up_proj.bits, attention.q_proj.bits, attention.v_proj.bits) == (4, 5, 5, 5)
    assert mlp.up_proj.weight.nbytes == 512 * 256 * 5 // 8
    ids = [4, 8, 15, 16, 23, 42]
    a, b = quantized.logits(ids), dense.logits(ids)
    assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(b).max())
    with_q6 = mlxinfer.load(_tiny(tmp_path, "m6", {**kinds, f"{layers}mlp.gate_proj.weight": Q6_K}), dtype="float32")
    gate = with_q6._loaded.model.model.layers[0].mlp.gate_proj
    assert (gate.bits, gate.group_size, gate.weight.nbytes) == (6, 32, 512 * 256 * 6 // 8)


@pytest.mark.parametrize("method", ["rtn", pytest.param("dwq", marks=pytest.mark.slow)])  # dwq: never these codes
def test_convert_to_4_bits_keeps_each_k_quant_grid_it_can(tmp_path, method):
    """`convert --bits 4` of a K-quant file (group size 32 by default for block-quantized sources): Q4_K codes are
    copied, not rounded again; Q6_K (6 bits, once rounded at load) and Q5_0 stay on their finer grids with their
    codes; scales and biases take the output's dtype like every layer's."""
    layers = "model.layers.0."
    kinds = {f"{layers}mlp.down_proj.weight": Q4_K, f"{layers}mlp.gate_proj.weight": Q6_K}
    kinds[f"{layers}self_attn.v_proj.weight"] = Q5_0  # v: no rotary row order to undo
    path = _tiny(tmp_path, "c", kinds)
    convert(path, tmp_path / "out", bits=4, method=method, evaluate=False, progress=False)
    written = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    quantization = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    default = {"bits": quantization["bits"], "group_size": quantization["group_size"]}  # layers not listed
    for hf in kinds:
        with GGUFFile(path) as f:
            source = f.read(f"blk.0.{_short(hf)}.weight")  # what the loader holds
        path_key = hf.removesuffix(".weight")
        assert quantization.get(path_key, default) == {"bits": source.bits, "group_size": 32}, hf
        assert np.array_equal(np.array(written[hf]), source.weight), hf
        scales = written[hf.replace("weight", "scales")]
        expected = mx.array(source.scales).astype(scales.dtype)  # the one rounding: float32 d*sc -> output dtype
        assert mx.array_equal(scales, expected), hf


def any_blocks(kind: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random block bytes of any type, each below 0x78: every f16 in them (d, dmin, packed scales) is finite."""
    per, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 0x78, size=(rows, cols // per * size), dtype=np.uint8)


@pytest.mark.parametrize("kind", sorted(REQUANTIZED), ids=lambda k: gguf.GGMLQuantizationType(k).name)
def test_a_type_no_mlx_group_holds_is_rounded_once_no_worse_than_min_max_per_group(tmp_path, kind):
    """On the grid REQUANTIZED names, each group's squared error against what the gguf package dequantizes is at
    most plain min-max rounding's, and the tensor's below it under FINE_BITS bits (min-max's own from there); TQ
    groups ({-d, 0, d}) come out exact."""
    kind = gguf.GGMLQuantizationType(kind)
    bits, group = REQUANTIZED[kind]
    blocks = any_blocks(kind, 4, 512, seed=int(kind))
    with GGUFFile(write_one(tmp_path / "r.gguf", kind, blocks, (4, 512))) as f:
        t = f.read("blk.0.ffn_down.weight")
    assert (t.bits, t.group_size, t.weight.shape, t.scales.shape) == (
        bits,
        group,
        (4, 512 * bits // 32),
        (4, 512 // group),
    )
    got = np.array(mx.dequantize(*(mx.array(a) for a in (t.weight, t.scales, t.biases)), group_size=group, bits=bits))
    expected = gguf.quants.dequantize(blocks.reshape(-1), kind).reshape(4, -1, group)
    ours, theirs, min_max = against_min_max(got, expected, bits)
    if kind.name.startswith("TQ"):
        np.testing.assert_allclose(got, expected.reshape(4, 512), rtol=0, atol=1e-6 * np.abs(expected).max())
    elif bits >= FINE_BITS:
        np.testing.assert_allclose(got, min_max.reshape(4, 512), rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    else:
        assert ours.sum() < 0.95 * theirs.sum()


def against_min_max(got: np.ndarray, expected: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """Each group's squared error (ours, then plain min-max rounding's) and min-max's values, `expected` being
    (rows, groups, group); asserts ours is at most min-max's in every group."""
    low, high = expected.min(-1, keepdims=True), expected.max(-1, keepdims=True)
    step = np.where(high > low, (high - low) / ((1 << bits) - 1), 1)
    min_max = np.clip(np.rint((expected - low) / step), 0, (1 << bits) - 1) * step + low
    ours, theirs = (((x.reshape(expected.shape) - expected) ** 2).sum(-1) for x in (got, min_max))
    float_noise = 1e-9 * (expected**2).sum(-1)  # a group min-max holds exactly may refit a few ulps off
    assert np.isfinite(expected).all() and np.all(ours <= theirs * (1 + 1e-4) + float_noise)
    return ours, theirs, min_max


def test_the_load_line_says_what_was_rounded_once_more(tmp_path, caplog):
    kinds = {"model.layers.0.mlp.gate_proj.weight": Q6_K, "model.layers.0.mlp.down_proj.weight": Q4_K}
    path = _tiny(tmp_path, "line", kinds)
    with caplog.at_level("WARNING", logger="mlxinfer"):
        mlxinfer.load(path, dtype="float32")
    lines = [r.getMessage() for r in caplog.records if "rounded once more" in r.getMessage()]
    assert lines == ["line.gguf: 1 Q6_K tensors to MLX 6-bit group 32: rounded once more (no MLX group holds these "
                     "blocks as they are)"]  # fmt: skip
    with GGUFFile(path) as f:  # the forecast counts the grid the tensor is held on: 6 bits, a scale and bias per 32
        held = gguf_tensors(f, compute_size=4)["model.layers.0.mlp.gate_proj.weight"].loaded_bytes
    assert held == 512 * 256 * 6 // 8 + 2 * (512 * 256 // 32) * 4


def test_iq2_tensors_are_held_at_3_bits_and_the_load_line_says_so(tmp_path, caplog):
    """On MLX's 2-bit grid an IQ2 file answers nonsense (bench/README.md): its tensors are held at 3 bits, group 64,
    and the load line says why the model takes more memory than its file."""
    kind = gguf.GGMLQuantizationType.IQ2_XXS
    path = write_one(tmp_path / "iq2.gguf", kind, any_blocks(kind, 4, 512, seed=3), (4, 512))
    with GGUFFile(path) as f, caplog.at_level("WARNING", logger="mlxinfer"):
        note_requantized(f)
        t = f.read("blk.0.ffn_down.weight")
    assert (t.bits, t.group_size) == (3, 64)
    assert [r.getMessage() for r in caplog.records] == [
        "iq2.gguf: 1 IQ2_XXS tensors to MLX 3-bit group 64: rounded once more (no MLX group holds these blocks as "
        "they are); IQ1/IQ2 at 3 bits, more memory than the file: on MLX's 2-bit grid they answer nonsense"
    ]


def test_an_iq4_nl_row_of_96_values_is_held_in_groups_of_32(tmp_path):
    """IQ4_NL (blocks of 32) is what llama.cpp uses for rows no 256-value K block divides: a row of 96 values is
    held in groups of 32, one a block, no group further from its values than min-max rounding would put it."""
    kind = gguf.GGMLQuantizationType.IQ4_NL
    blocks = any_blocks(kind, 4, 96, seed=7)
    with GGUFFile(write_one(tmp_path / "nl.gguf", kind, blocks, (4, 96))) as f:
        t = f.read("blk.0.ffn_down.weight")
    assert (t.bits, t.group_size, t.scales.shape) == (4, 32, (4, 3))
    got = np.array(mx.dequantize(*(mx.array(a) for a in (t.weight, t.scales, t.biases)), group_size=32, bits=4))
    against_min_max(got, gguf.quants.dequantize(blocks.reshape(-1), kind).reshape(4, 3, 32), 4)
