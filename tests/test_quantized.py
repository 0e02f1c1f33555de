"""MLX-quantized folders: as mlx-lm writes them, and mixed bits per layer."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from tests.conftest import TINY, golden


def test_folder_written_by_mlx_lm_convert_loads(tmp_path):
    from mlx_lm import convert

    out = tmp_path / "qwen3-8bit"
    convert(str(TINY / "qwen3"), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=8)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    model = mlxinfer.load(out)
    ref = golden("qwen3")
    logits = model.logits(ref["input_ids"].tolist())
    assert model._loaded.quantized_layers == 2 * 7 + 2  # 7 linears per layer, embedding, head
    # 8-bit weights move logits a little, not a lot.
    assert np.abs(logits - np.array(ref["logits"])).max() < 0.25


@pytest.mark.parametrize("group_size", [32, 64])
def test_mixed_bits_match_their_dequantized_weights(tiny_copy, group_size):
    folder = tiny_copy("llama_classic")
    weights = mx.load(str(folder / "model.safetensors"))
    quantized, dequantized = {}, dict(weights)
    for name, value in weights.items():
        if value.ndim != 2:
            quantized[name] = value
            continue
        bits = 8 if "embed" in name else 4
        w, s, b = mx.quantize(value, group_size=group_size, bits=bits)
        stem = name.removesuffix(".weight")
        quantized.update({name: w, f"{stem}.scales": s, f"{stem}.biases": b})
        dequantized[name] = mx.dequantize(w, s, b, group_size=group_size, bits=bits)
    mx.save_safetensors(str(folder / "model.safetensors"), quantized)
    q_model = mlxinfer.load(folder)
    mx.save_safetensors(str(folder / "model.safetensors"), dequantized)
    d_model = mlxinfer.load(folder)

    layers = q_model._loaded.model.model
    assert (layers.embed_tokens.bits, layers.layers[0].mlp.up_proj.bits) == (8, 4)
    assert layers.layers[0].mlp.up_proj.group_size == group_size
    ids = golden("llama_classic")["input_ids"].tolist()
    assert np.abs(q_model.logits(ids) - d_model.logits(ids)).max() < 1e-3
