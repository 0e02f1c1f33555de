"""Activation-aware scaling (quantize/awq.py): folds that leave the float model as it was, the wrong fold refused,
and a converted model that computes its source's function (at 8 bits) and loads in mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlxinfer.convert import convert
from mlxinfer.quantize.awq import _fold, _groups, awq_model
from mlxinfer.quantize.recipes import LayerQuant

import mlxinfer
from mlxinfer.models.loader import load_model
from tests.conftest import TINY, golden
from tests.test_convert import mlx_lm_greedy


def tokens() -> mx.array:
    return mx.array(np.random.default_rng(0).integers(0, 200, (2, 64)))


def quantized_layers(model) -> dict[str, LayerQuant]:
    return {p: LayerQuant(4, 32) for p, m in model.named_modules() if type(m).__name__ == "Linear" and ".layers." in p}


# Plain RMSNorm weights, Gemma's (1 + w) norms and pre-feedforward norm, a fused qkv and gate_up (phi3).
@pytest.mark.parametrize("arch", ["llama_classic", "gemma3", "phi3"])
def test_scaling_leaves_the_float_model_computing_what_it_did(arch):
    model = load_model(TINY / arch).model
    before = model(tokens())
    weights = dict(tree_flatten(model.parameters()))
    changed = awq_model(model, tokens(), quantized_layers(model))
    after = model(tokens())
    assert (mx.abs(after - before).max() / mx.abs(before).max()).item() < 1e-4
    # Every group's layers and its norm took new values, and those are what the model now holds.
    expected = {"phi3": 4, "llama_classic": 8, "gemma3": 8}[arch] * len(model.layers)
    assert len(changed) == expected, sorted(changed)
    held = dict(tree_flatten(model.parameters()))
    assert all(held[name] is value and not mx.array_equal(weights[name], value) for name, value in changed.items())


def test_a_fold_that_would_change_the_block_is_undone():
    # Gemma 3's post_attention_layernorm scales the attention's output, not the MLP's input: dividing it by the
    # scales of gate/up would change what the block computes.
    model = load_model(TINY / "gemma3").model
    block, h = model.layers[0], model.embed(tokens())
    mask = model.mask(h.shape[1], 0, model.layout.layer_types[0])
    reference = block(h, mask, None)
    before = dict(tree_flatten(block.parameters()))
    scales = mx.linspace(0.5, 2.0, h.shape[-1])
    fed = ("mlp.gate_proj", "mlp.up_proj")
    assert not _fold(block, "post_attention_layernorm", fed, scales, lambda: block(h, mask, None), reference)
    after = dict(tree_flatten(block.parameters()))
    assert all(mx.array_equal(before[name], after[name]) for name in before)
    assert ("post_attention_layernorm", fed) not in _groups(block)  # the groups take pre_feedforward_layernorm


@pytest.mark.slow
def test_an_8bit_awq_conversion_computes_its_source_and_mlx_lm_runs_it(tmp_path):
    # At 8 bits rounding costs almost nothing: the folded norms and scaled layers as written must compute the
    # source's function, as closely as plain rounding's output does.
    common = dict(bits=8, group_size=32, dtype="float32", eval_tokens=64, progress=False)
    rtn = convert(TINY / "gemma3", tmp_path / "rtn", method="rtn", **common)
    awq = convert(TINY / "gemma3", tmp_path / "awq", method="awq", **common)
    assert awq.manifest["settings"]["method"] == "awq" and awq.bits_per_weight == rtn.bits_per_weight
    assert awq.quality.mean_kl < 2 * rtn.quality.mean_kl + 1e-4, (awq.quality, rtn.quality)
    ids = golden("gemma3")["input_ids"].tolist()
    ours = mlxinfer.load(tmp_path / "awq").generate(ids, max_tokens=6)
    assert mlx_lm_greedy(tmp_path / "awq", ids, len(ours.token_ids), eos=-1) == ours.token_ids
