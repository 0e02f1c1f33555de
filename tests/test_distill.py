"""DWQ-style distillation (quantize/distill.py): MLX's packing read back, fixed codes, and scales that learn."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlxinfer.quantize.affine import quantize_rows
from mlxinfer.quantize.distill import _Codes, _loss, _unpack, distill_model, teacher_targets
from mlxinfer.quantize.recipes import LayerQuant

from mlxinfer.models.loader import load_model
from tests.conftest import TINY


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_unpack_reads_the_codes_mlx_packed(bits):
    weight = mx.array(np.random.default_rng(bits).standard_normal((3, 128)).astype(np.float32))
    packed, _, _ = mx.quantize(weight, group_size=64, bits=bits)
    ones, zeros = mx.ones((3, 2)), mx.zeros((3, 2))  # dequantizing with scale 1, bias 0 gives the codes
    expected = mx.dequantize(packed, ones, zeros, group_size=64, bits=bits)
    np.testing.assert_array_equal(np.array(_unpack(packed, bits, 128)), np.array(expected))


def test_a_held_layer_computes_what_mlx_quantized_linear_computes_on_its_triplet():
    rng = np.random.default_rng(0)
    linear = nn.Linear(64, 16, bias=True)
    linear.weight = mx.array(rng.standard_normal((16, 64)).astype(np.float32))
    held = _Codes(linear, LayerQuant(4, 32), None, mx.float32)
    held.scale_shift = mx.full(held.scale_shift.shape, 0.1)  # as training moves them, off the round-to-nearest grid
    held.bias_shift = mx.full(held.bias_shift.shape, -0.3)
    x = mx.array(rng.standard_normal((5, 64)).astype(np.float32))
    reference = nn.QuantizedLinear(64, 16, bias=True, group_size=32, bits=4)
    packed, scales, biases = held.triplet(mx.float32)
    reference.update({"weight": packed, "scales": scales, "biases": biases, "bias": linear.bias})
    np.testing.assert_allclose(np.array(held(x)), np.array(reference(x)), rtol=1e-5, atol=1e-5)
    assert set(dict(nn.utils.tree_flatten(held.trainable_parameters()))) == {"scale_shift", "bias_shift"}


def test_the_loss_is_the_kl_over_the_teachers_top_tokens_and_the_rest_as_one():
    rng = np.random.default_rng(3)
    teacher_logits, student_logits = rng.standard_normal((2, 2, 5, 40)) * 3
    k = 8

    def log_softmax(x):
        return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)

    p, q = np.exp(log_softmax(teacher_logits)), np.exp(log_softmax(student_logits))
    top = np.argsort(-p, axis=-1)[..., :k]
    p_top, q_top = np.take_along_axis(p, top, -1), np.take_along_axis(q, top, -1)
    p_bins = np.concatenate([p_top, 1 - p_top.sum(-1, keepdims=True)], -1)  # the k tokens, then the rest
    q_bins = np.concatenate([q_top, 1 - q_top.sum(-1, keepdims=True)], -1)
    expected = np.mean(np.sum(p_bins * np.log(p_bins / q_bins), -1))
    teacher = mx.array(np.log(p_top).astype(np.float32))
    loss = _loss(lambda tokens: mx.array(student_logits.astype(np.float32)), None, mx.array(top), teacher)
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-4)


@pytest.mark.slow
def test_distilled_scales_bring_the_quantized_model_closer_to_the_float_one():
    loaded = load_model(TINY / "qwen2")
    model = loaded.model
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(0)
    batches = [mx.array(rng.integers(0, vocab, size=(2, 32))) for _ in range(4)]
    targets = teacher_targets(model, batches)
    layers = {f"model.layers.{i}.mlp.down_proj": LayerQuant(3, 32) for i in range(len(model.model.layers))}
    originals = {path: model.model.layers[i].mlp.down_proj.weight for i, path in enumerate(layers)}
    start = {path: quantize_rows(originals[path], 3, 32, mx.float32) for path in layers}
    kl_start = _mean_loss(_with_triplets(load_model(TINY / "qwen2").model, start), batches, targets)
    distilled = distill_model(model, batches, targets, layers, mx.float32, start, epochs=16, learning_rate=3e-2)
    kl_end = _mean_loss(_with_triplets(load_model(TINY / "qwen2").model, distilled), batches, targets)
    assert kl_end < 0.8 * kl_start, (kl_start, kl_end)
    for path, (packed, _, _) in distilled.items():  # the codes stay as they started; only scales and biases move
        np.testing.assert_array_equal(np.array(packed), np.array(start[path][0]))
        assert not np.allclose(np.array(distilled[path][1]), np.array(start[path][1]))


def _with_triplets(model, triplets):
    """`model` with each path's weight replaced by MLX's own quantized linear layer on its triplet."""
    for path, (packed, scales, biases) in triplets.items():
        index = int(path.split(".")[2])
        mlp = model.model.layers[index].mlp
        out_features, in_features = mlp.down_proj.weight.shape
        layer = nn.QuantizedLinear(in_features, out_features, bias=False, group_size=32, bits=3)
        layer.update({"weight": packed, "scales": scales, "biases": biases})
        mlp.down_proj = layer
    return model


def _mean_loss(model, batches, targets) -> float:
    return float(np.mean([_loss(model, tokens, *target).item() for tokens, target in zip(batches, targets)]))


def test_dwq_with_every_layer_kept_as_the_source_holds_it_trains_nothing_and_loads_nothing():
    from mlxinfer.convert.calibration import dwq_tensors

    # A Q4_K_M file converted to 4 bits keeps every quantized layer's own codes: no layer is left to distill.
    assert dwq_tensors(source=None, layers={"model.layers.0.mlp.down_proj": None}, dtype=mx.float32) == {}


def test_calibration_loads_a_gguf_with_every_layer_float_whatever_the_weights_mode(tmp_path, monkeypatch):
    # GPTQ, AWQ, DWQ and the sensitivity search read and replace float weights. Loading for them once left what the
    # CPU chose (on a GPU, or with MLXINFER_CPU_WEIGHTS=quantized: every block packed; lately a tied head kept
    # packed), and GPTQ failed on a packed head.
    import gguf
    from mlxinfer.convert.calibration import _load
    from mlxinfer.convert.sources import open_source
    from mlxinfer.quantize.calibrate import child

    from mlxinfer.models.cpu_weights import quantized_layers
    from tests.test_gguf import write_tiny_gguf

    monkeypatch.setenv("MLXINFER_CPU_WEIGHTS", "quantized")
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"]
    path = write_tiny_gguf(tmp_path / "q8.gguf", k_quants=dict.fromkeys(names, gguf.GGMLQuantizationType.Q8_0))
    loaded = _load(open_source(path))
    assert quantized_layers(loaded.model) == {}
    held = load_model(path, cpu_weights="quantized").model.model
    for path_in_model in ("embed_tokens", "layers.0.mlp.down_proj"):
        dense, packed = (child(model, path_in_model) for model in (loaded.model.model, held))
        scales, biases = (a.astype(mx.float32) for a in (packed.scales, packed.biases))
        want = mx.dequantize(packed.weight, scales, biases, group_size=32, bits=8).astype(loaded.compute_dtype)
        assert dense.weight.dtype == loaded.compute_dtype and mx.array_equal(dense.weight, want), path_in_model
