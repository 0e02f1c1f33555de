"""gpt-oss's MXFP4 experts kept as MLX mxfp4: from GGUF (llama.cpp's block_mxfp4), through the converter.

The GGUF's experts are the tiny fixture's, quantized by `mx.quantize(mode="mxfp4")` and written as GGML
type 39 blocks; the reference is transformers' model with those experts replaced by `mx.dequantize` of
the same arrays, so the only rounding is the one both sides share.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlxinfer.convert import convert

import mlxinfer
from mlxinfer.errors import MlxInferError
from tests.conftest import TINY, golden
from tests.test_gguf_families import write_family_gguf

MXFP4 = gguf.GGMLQuantizationType.MXFP4
# The fixture's down experts have 24 inputs, no whole block of 32: they stay F32, as llama.cpp would keep them.
EXPERTS = ("gate", "up")
LAYERS = json.loads((TINY / "gpt_oss" / "config.json").read_text())["num_hidden_layers"]
TYPES = {f"blk.{i}.ffn_{w}_exps.weight": MXFP4 for i in range(LAYERS) for w in EXPERTS}


def mxfp4(values: np.ndarray) -> tuple[mx.array, mx.array]:
    """MLX's mxfp4 of `values` (..., in): packed uint32 (..., in / 8) and uint8 exponents (..., in / 32)."""
    return mx.quantize(mx.array(values, dtype=mx.float32), group_size=32, bits=4, mode="mxfp4")


def dequantized(values: np.ndarray) -> np.ndarray:
    return np.array(mx.dequantize(*mxfp4(values), group_size=32, bits=4, mode="mxfp4", dtype=mx.float32))


def block_mxfp4(values: np.ndarray) -> np.ndarray:
    """llama.cpp's block_mxfp4 bytes of mxfp4(values): per 32 elements an E8M0 byte, then 16 bytes whose
    low nibble is element j and high nibble element j + 16 (ggml-common.h)."""
    packed, scales = (np.array(a) for a in mxfp4(values))
    codes = (packed[..., None] >> (np.arange(8, dtype=np.uint32) * 4)) & 0xF  # element k at bits 4k
    codes = codes.astype(np.uint8).reshape(*values.shape[:-1], -1, 32)
    blocks = np.concatenate([scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
    return blocks.reshape(*values.shape[:-1], -1)


def write_mxfp4_gguf(path: Path, monkeypatch, edit=None) -> Path:
    """The gpt_oss fixture as GGUF, every layer's gate and up experts as MXFP4 blocks of `mx.quantize`'s rounding."""

    def quantize(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
        assert kind == MXFP4
        return block_mxfp4(values)

    with monkeypatch.context() as m:
        m.setattr(gguf.quants, "quantize", quantize)
        return write_family_gguf(path, "gpt_oss", types=TYPES, edit=edit)


def reference_logits(ids: list[int]) -> np.ndarray:
    """transformers' gpt-oss with its gate and up experts replaced by their mxfp4 rounding (as the GGUF holds it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY / "gpt_oss", dtype=torch.float32).eval()
    for layer in model.model.layers:
        experts = layer.mlp.experts
        gate_up = experts.gate_up_proj.detach().numpy()  # (E, H, 2I), gate and up interleaved
        rounded = np.empty_like(gate_up)
        for k in (0, 1):  # the GGUF holds gate and up as (E, I, H): rounded along H
            rounded[..., k::2] = dequantized(gate_up[..., k::2].swapaxes(1, 2)).swapaxes(1, 2)
        with torch.no_grad():
            experts.gate_up_proj.copy_(torch.from_numpy(rounded))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def oss_gguf(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as m:
        return write_mxfp4_gguf(tmp_path_factory.mktemp("mxfp4") / "oss-mxfp4.gguf", m)


def experts_of(model: mlxinfer.Model, index: int) -> list:
    experts = model._loaded.model.layers[index].mlp.experts
    return [getattr(experts, f"{w}_proj") for w in EXPERTS]


def test_block_mxfp4_reads_as_the_gguf_package_dequantizes_it():
    values = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32)
    expected = gguf.quants.dequantize(block_mxfp4(values), MXFP4)
    assert np.array_equal(dequantized(values), expected)  # kvalues_mxfp4 * e8m0 / 2 is E2M1 * e8m0


def test_mxfp4_experts_match_transformers_with_the_same_rounding(oss_gguf, caplog):
    ids = golden("gpt_oss")["input_ids"].tolist()
    with caplog.at_level("INFO"):
        model = mlxinfer.load(oss_gguf, dtype="float32")
    assert any("kept as MLX mxfp4" in r.getMessage() for r in caplog.records)
    logits = np.array(model.logits(ids))
    assert np.abs(logits - reference_logits(ids)).max() < 1e-4


def test_mxfp4_experts_stay_packed_exactly_as_stored(oss_gguf):
    model = mlxinfer.load(oss_gguf, dtype="float32")
    reader = gguf.GGUFReader(str(oss_gguf))
    for index in range(LAYERS):
        for name, module in zip(EXPERTS, experts_of(model, index), strict=True):
            assert isinstance(module, QuantizedSwitchLinear) and module.mode == "mxfp4"
            assert module.scales.dtype == mx.uint8 and "biases" not in module
            assert module.bias.dtype == mx.float32  # the experts' biases stay float
            stored = next(t for t in reader.tensors if t.name == f"blk.{index}.ffn_{name}_exps.weight")
            expected = gguf.quants.dequantize(stored.data, MXFP4).reshape(module.scales.shape[:-1] + (-1,))
            got = mx.dequantize(module.weight, module.scales, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
            assert np.array_equal(np.array(got), expected)


def test_convert_keeps_mxfp4_experts_and_mlx_lm_loads_the_output(oss_gguf, tmp_path):
    out = tmp_path / "oss-out"
    convert(oss_gguf, out, bits=4, dtype="float32", evaluate=False, progress=False)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["model.layers.0.mlp.experts.up_proj"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    direct, converted = mlxinfer.load(oss_gguf, dtype="float32"), mlxinfer.load(out, dtype="float32")
    for a, b in zip(experts_of(direct, 1), experts_of(converted, 1), strict=True):
        assert b.mode == "mxfp4" and mx.array_equal(a.weight, b.weight) and mx.array_equal(a.scales, b.scales)
    ids = golden("gpt_oss")["input_ids"].tolist()
    ours = converted.generate(ids, max_tokens=12).token_ids
    theirs, _ = mlx_lm_load(str(out))
    assert all(m.mode == "mxfp4" for m in experts_of_mlx_lm(theirs))
    tokens, greedy = list(ids), []
    for _ in range(12):  # mlx-lm's model, greedy, no cache: the whole sequence each step
        greedy.append(int(mx.argmax(theirs(mx.array([tokens]))[0, -1])))
        tokens.append(greedy[-1])
    assert greedy == ours


def experts_of_mlx_lm(model) -> list:
    return [getattr(layer.mlp.experts, f"{w}_proj") for layer in model.layers for w in EXPERTS]


def test_an_mxfp4_tensor_of_the_wrong_byte_count_is_one_line(tmp_path, monkeypatch):
    def halve(kv, tensors):  # one layer's up experts with half the inputs: 17-byte blocks, but too few of them
        name = "blk.1.ffn_up_exps.weight"
        tensors[name] = tensors[name][..., : tensors[name].shape[-1] // 2]

    with pytest.raises(MlxInferError) as e:
        mlxinfer.load(write_mxfp4_gguf(tmp_path / "bad.gguf", monkeypatch, edit=halve))
    message = str(e.value)
    assert "\n" not in message and "model.layers.1.mlp.experts.up_proj" in message
    assert "rows of 64 inputs need 8 packed words and 2 scales (mxfp4)" in message
    assert message.endswith("but the file has 4 and 1: damaged, or not this model's")


def hub_mxfp4_folder(folder: Path):
    """A random gpt-oss in the Hub checkpoints' layout (openai/gpt-oss-*): experts as `*_blocks` (E, out, in/32,
    16 bytes) and `*_scales` (E, out, in/32) of mx.quantize's mxfp4. Returns the folder and transformers'
    model with those experts read by transformers' own MXFP4 reader (intermediate 32: whole blocks for down)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(TINY / "gpt_oss", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text()) | {"intermediate_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).eval()
    stored = {}
    for name, value in model.state_dict().items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            stored[name] = mx.array(value.numpy())
            continue
        packed, scales = mxfp4(value.numpy().swapaxes(1, 2))  # transformers' (E, in, out) -> (E, out, in)
        blocks = np.array(packed.view(mx.uint8)).reshape(*scales.shape, 16)
        stored[f"{name}_blocks"], stored[f"{name}_scales"] = mx.array(blocks), scales
        with torch.no_grad():  # (E, in, out), as transformers dequantizes a Hub checkpoint
            value.copy_(convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(np.array(scales)),
                                                   dtype=torch.float32))  # fmt: skip
    mx.save_safetensors(str(folder / "model.safetensors"), stored)
    # As the Hub's config.json says it (written after transformers built its float model from the config).
    hub = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                               "model.embed_tokens", "lm_head"]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": hub}))
    return folder, model


def test_hub_mxfp4_experts_load_as_mxfp4_and_match_transformers(tmp_path):
    folder, reference = hub_mxfp4_folder(tmp_path / "hub")
    ids = golden("gpt_oss")["input_ids"].tolist()
    model = mlxinfer.load(folder, dtype="float32")
    for index in range(LAYERS):
        for module in (*experts_of(model, index), model._loaded.model.layers[index].mlp.experts.down_proj):
            assert isinstance(module, QuantizedSwitchLinear) and module.mode == "mxfp4"
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(np.array(model.logits(ids)) - expected).max() < 1e-4


def test_converting_a_hub_mxfp4_folder_is_one_line_naming_the_way_out(tmp_path):
    from mlxinfer.errors import ConversionError

    folder, _ = hub_mxfp4_folder(tmp_path / "hub")
    with pytest.raises(ConversionError, match=r"MXFP4 experts: convert a bf16 copy or the GGUF.* and \d+ more") as e:
        convert(folder, tmp_path / "out", bits=4, evaluate=False, progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
