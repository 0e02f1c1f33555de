"""gpt-oss beyond the parity tests: YaRN as transformers computes it, both config forms, the expert
weight layouts we accept or refuse, and attention sinks with a quantized KV cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxinfer
from mlxinfer.errors import WeightMismatchError
from mlxinfer.families.gpt_oss import convert_gpt_oss_weights, quantized_attention_with_sinks
from mlxinfer.models.config import normalize_config
from mlxinfer.models.decoder import build_model
from mlxinfer.models.footprint import KV_GROUP_SIZE
from tests.conftest import TINY, golden

# transformers 5.24 `ROPE_INIT_FUNCTIONS["yarn"]` on the fixture's config (head_dim 16, theta 1.5e5, factor 32,
# original 4096, beta 32/1): inverse frequencies and attention factor, with truncate false and true.
UNTRUNCATED = [1.0, 0.22541800141334534, 0.05081327259540558, 0.006794959306716919, 0.0004564839182421565,
               1.818833698052913e-05, 4.099978468730114e-06, 9.242089618055616e-07]  # fmt: skip
TRUNCATED = UNTRUNCATED[:3] + [0.007755465339869261, 0.0009144543437287211] + UNTRUNCATED[5:]
ATTENTION_FACTOR = 1.3465735902799727


def copy_with(tmp_path: Path, name: str, edit_config=None, edit_weights=None) -> Path:
    folder = tmp_path / name
    shutil.copytree(TINY / name, folder)
    (folder / "golden.safetensors").unlink()
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(edit_config(config)))
    if edit_weights is not None:
        weights = mx.load(str(folder / "model.safetensors"))
        mx.save_safetensors(str(folder / "model.safetensors"), edit_weights(weights))
    return folder


def ids() -> list[int]:
    return golden("gpt_oss")["input_ids"].tolist()


@pytest.mark.parametrize("truncate, expected", [(False, UNTRUNCATED), (True, TRUNCATED)])
def test_rope_frequencies_are_transformers_yarn(tmp_path, truncate, expected):
    def edit(config):
        config["rope_parameters"]["truncate"] = truncate
        return config

    model = mlxinfer.load(copy_with(tmp_path, "gpt_oss", edit))
    for layer in model._loaded.model.layers:
        rope = layer.self_attn.rope
        np.testing.assert_allclose(1 / np.array(rope._freqs), expected, rtol=1e-6)
        assert rope.scale == pytest.approx(ATTENTION_FACTOR, rel=1e-12)


def test_the_classic_config_form_gives_the_same_model(tmp_path):
    def classic(config):
        params = config.pop("rope_parameters")
        return config | {"rope_theta": params.pop("rope_theta"), "rope_scaling": params}

    np.testing.assert_array_equal(
        mlxinfer.load(copy_with(tmp_path, "gpt_oss", classic)).logits(ids()),
        mlxinfer.load(TINY / "gpt_oss").logits(ids()),
    )


def test_a_checkpoint_already_in_mlx_lm_layout_loads_as_it_is(tmp_path):
    config = normalize_config(json.loads((TINY / "gpt_oss" / "config.json").read_text()))
    folder = copy_with(tmp_path, "gpt_oss", edit_weights=lambda w: convert_gpt_oss_weights(w, config))
    saved = mx.load(str(folder / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_proj.weight" in saved and not any("gate_up" in k for k in saved)
    np.testing.assert_array_equal(mlxinfer.load(folder).logits(ids()), mlxinfer.load(TINY / "gpt_oss").logits(ids()))


def test_experts_stored_the_other_way_round_are_refused_not_cut_wrongly(tmp_path):
    def swapped(weights):
        name = "model.layers.1.mlp.experts.gate_up_proj"
        weights[name] = weights[name].swapaxes(1, 2)  # (E, 2I, H): gate/up would come from the wrong axis
        return weights

    with pytest.raises(WeightMismatchError, match=r"layers\.1\.mlp\.experts\.gate_up_proj: shape \(4, 48, 64\)"):
        mlxinfer.load(copy_with(tmp_path, "gpt_oss", edit_weights=swapped))


def test_the_experts_use_the_configs_swiglu_settings(tmp_path):
    model = mlxinfer.load(copy_with(tmp_path, "gpt_oss", lambda c: c | {"swiglu_alpha": 1.5, "swiglu_limit": 5.0}))
    for layer in model._loaded.model.layers:
        activation = layer.mlp.experts.activation
        assert (activation._alpha, activation._limit) == (1.5, 5.0)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "rows"])
def test_quantized_attention_with_sinks_matches_attention_over_the_dequantized_cache(mask_kind):
    rng = np.random.default_rng(0)
    B, heads, kv_heads, L, T, D = 2, 4, 2, 3, 7, KV_GROUP_SIZE
    shapes = ((B, heads, L, D), (B, kv_heads, T, D), (B, kv_heads, T, D))
    q, k, v = (mx.array(rng.normal(0, 1, shape).astype(np.float32)) for shape in shapes)
    sinks = mx.array(rng.normal(0, 1, (heads,)).astype(np.float32))
    qk, qv = mx.quantize(k, group_size=D, bits=8), mx.quantize(v, group_size=D, bits=8)
    mask = {
        "none": None,
        "causal": mx.arange(T - L, T)[:, None] >= mx.arange(T)[None],  # (L, T)
        "rows": mx.array(rng.random((B, 1, L, T)) > 0.3) | (mx.arange(T) == T - 1),  # per row, one key always seen
    }[mask_kind]
    got = quantized_attention_with_sinks(q, qk, qv, 0.125, mask, sinks, group_size=D, bits=8)
    dk, dv = mx.dequantize(*qk, group_size=D, bits=8), mx.dequantize(*qv, group_size=D, bits=8)
    want = mx.fast.scaled_dot_product_attention(q, dk, dv, scale=0.125, mask=mask, sinks=sinks)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_a_quantized_kv_cache_runs_with_sinks(tmp_path):
    """gpt-oss with head_dim 64 (what a quantized cache needs) and random weights: 8-bit keys and values
    stay close to the float cache, where mlx-lm's attention refuses sinks."""
    config = json.loads((TINY / "gpt_oss" / "config.json").read_text()) | {"head_dim": KV_GROUP_SIZE}
    folder = tmp_path / "gpt_oss_64"
    shutil.copytree(TINY / "gpt_oss", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(1)
    params = tree_flatten(build_model(normalize_config(config)).parameters())  # mlx-lm's layout, which loads as is
    weights = {k: mx.array(rng.normal(0, 0.2, p.shape).astype(np.float32)) for k, p in params}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    plain, quantized = mlxinfer.load(folder), mlxinfer.load(folder, kv_bits=8)
    assert np.abs(quantized.logits(ids()) - plain.logits(ids())).max() < 0.05
