"""GLM-4.5 (glm4_moe) and DeepSeek-V3 (deepseek_v3, Multi-head Latent Attention): conversion, config quirks,
and one-line refusals of malformed input.

Parity with transformers on the tiny fixtures is tests/test_parity.py; here each quirk we handle is pinned.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlxinfer.convert import convert

import mlxinfer
from mlxinfer.cache.layers import make_cache
from mlxinfer.errors import ConfigError, UnsupportedModelError, WeightMismatchError
from mlxinfer.models.config import normalize_config
from tests.conftest import TINY, golden
from tests.test_convert_hybrid import RELATIVE_RMS_8BIT, relative_rms, stored

FAMILIES = ["glm4_moe", "deepseek_v3", "deepseek_v3_plain"]
ROUTER = "model.layers.1.mlp.gate"  # the first MoE layer's router in glm4_moe and deepseek_v3


def config(name: str) -> dict:
    return json.loads((TINY / name / "config.json").read_text())


def max_diff(model: mlxinfer.Model, name: str) -> float:
    ref = golden(name)
    return float(np.abs(model.logits(ref["input_ids"].tolist()) - np.array(ref["logits"])).max())


def with_config(tmp_path: Path, name: str, change) -> Path:
    """A copy of fixture `name` whose config.json is `change(config)`."""
    folder = tmp_path / name
    shutil.copytree(TINY / name, folder)
    (folder / "config.json").write_text(json.dumps(change(config(name))))
    return folder


# Conversion (the pattern of tests/test_convert_hybrid.py).


@pytest.mark.parametrize("name", FAMILIES)
def test_8bit_output_is_the_float_model_with_its_weights_rounded(name, tmp_path):
    out = tmp_path / name
    convert(TINY / name, out, bits=8, dtype="float32", evaluate=False, progress=False)
    files = stored(out)
    reference = mlxinfer.load(TINY / name, dtype="float32")
    rounded, three_d = [], set()
    for path, value in tree_flatten(reference._loaded.model.parameters()):
        stem = path.removesuffix(".weight")
        if f"{stem}.scales" not in files:
            assert mx.array_equal(files[path], value), path  # norms, router weights and biases stay as they are
            continue
        scales = files[f"{stem}.scales"]
        group = value.shape[-1] // scales.shape[-1]
        weight = mx.dequantize(files[path], scales, files[f"{stem}.biases"], group_size=group, bits=8)
        error = np.abs(np.array(weight - value)).reshape(*scales.shape, group)
        assert (error <= np.abs(np.array(scales))[..., None] + 1e-6).all(), path
        rounded.append((path, weight))
        if value.ndim == 3:
            three_d.add(path.split(".")[-2])
    # Stacked experts (down_proj's 16 inputs fill no group of 64); MLA's per-head key and value maps (split
    # from kv_b_proj) where their inputs fill a group.
    mla = {"glm4_moe": set(), "deepseek_v3": {"unembed_out"}, "deepseek_v3_plain": {"embed_q", "unembed_out"}}
    expected = {"gate_proj", "up_proj"} | mla[name]
    assert three_d == expected
    assert not [k for k in files if k.endswith("mlp.gate.scales")]  # routers stay float, as in mlx-lm
    output = mlxinfer.load(out, dtype="float32")
    ids = golden(name)["input_ids"].tolist()
    logits = output.logits(ids)
    reference._loaded.model.load_weights(rounded, strict=False)
    assert np.abs(logits - reference.logits(ids)).max() < 1e-4
    assert relative_rms(logits, np.array(golden(name)["logits"])) < RELATIVE_RMS_8BIT


@pytest.mark.parametrize("name", FAMILIES)
def test_4bit_converts_loads_and_generates_with_routers_in_float(name, tmp_path):
    out = tmp_path / name
    result = convert(TINY / name, out, bits=4, eval_tokens=32, progress=False)
    assert result.quality is not None and result.quality.tokens == 32
    model = mlxinfer.load(out)
    modules = dict(model._loaded.model.named_modules())
    router = "model.layers.0.mlp.gate" if name == "deepseek_v3_plain" else ROUTER
    # mlx-lm quantizes no router of these families (its MoEGate is no Linear): ours stays float too.
    assert not hasattr(modules[router], "bits") and modules[router].weight.dtype != mx.uint32
    assert any(type(m).__name__ == "QuantizedSwitchLinear" and m.bits == 4 for m in modules.values())
    if name.startswith("deepseek"):
        assert any(type(m).__name__ == "QuantizedMultiLinear" and m.bits == 4 for m in modules.values())
    ids = golden(name)["input_ids"].tolist()
    assert np.isfinite(model.logits(ids)).all()
    assert model.generate(ids, max_tokens=4).stats.generated_tokens >= 1


# Config quirks.


def test_glm4_moe_classic_config_gives_the_same_logits_and_partial_rotary_defaults_to_half(tmp_path):
    def classic(cfg):
        rope = cfg.pop("rope_parameters")
        return {**cfg, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}

    ids = golden("glm4_moe")["input_ids"].tolist()
    tf5 = mlxinfer.load(TINY / "glm4_moe")
    classic_model = mlxinfer.load(with_config(tmp_path, "glm4_moe", classic))
    np.testing.assert_array_equal(classic_model.logits(ids), tf5.logits(ids))
    # Without the key, transformers' Glm4MoeConfig rotates half of each head (mlx-lm has no default).
    bare = {k: v for k, v in config("glm4_moe").items() if k != "rope_parameters"}
    assert normalize_config(bare).args["partial_rotary_factor"] == 0.5
    assert config("glm4_moe")["rope_parameters"]["partial_rotary_factor"] == 0.25  # so the fixture tells them apart


def test_deepseek_v3_tf5_config_gives_the_same_logits_with_yarn_mscale(tmp_path):
    def tf5(cfg):
        scaling = cfg.pop("rope_scaling")
        scaling["rope_type"], scaling["rope_theta"] = scaling.pop("type"), cfg.pop("rope_theta")
        return {**cfg, "rope_parameters": scaling}

    folder = with_config(tmp_path, "deepseek_v3", tf5)
    assert max_diff(mlxinfer.load(folder), "deepseek_v3") < 1e-3
    args = normalize_config(config("deepseek_v3")).args
    # The softmax scale reads mscale_all_dim again (transformers' yarn_apply_mscale), so it must survive.
    assert (args["rope_scaling"]["mscale"], args["rope_scaling"]["mscale_all_dim"]) == (1.0, 0.8)
    assert args["head_dim"] == args["qk_rope_head_dim"] == 16  # as DeepseekV3Config, whatever config.json says


def test_deepseek_v3_cache_holds_the_latent_and_rotated_key():
    model = mlxinfer.load(TINY / "deepseek_v3")
    lm = model._loaded.model
    cache = make_cache(lm.cache_kinds)
    lm(mx.array([golden("deepseek_v3")["input_ids"].tolist()]), cache)
    latent, rotated = cache[0].state
    assert latent.shape == (1, 1, 24, 64) and rotated.shape == (1, 1, 24, 16)  # kv_lora_rank, qk_rope_head_dim
    with pytest.raises(ConfigError, match="deepseek_v3 cannot use a quantized KV cache"):
        mlxinfer.load(TINY / "deepseek_v3", kv_bits=8)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_plain"])
def test_a_cached_latent_prefix_resumes_like_a_cold_run(name):
    model = mlxinfer.load(TINY / name)
    prompt = golden(name)["input_ids"].tolist()
    cold = model.generate(prompt, max_tokens=8, use_cache=False)
    model.generate(prompt[:20] + [1, 2, 3], max_tokens=4)  # the latent cache is cut back to the shared 20
    hit = model.generate(prompt, max_tokens=8)
    assert hit.stats.cached_tokens == 20 and hit.token_ids == cold.token_ids == golden(name)["greedy"].tolist()[:8]


@pytest.mark.parametrize("name", ["glm4_moe", "deepseek_v3"])
def test_multi_token_prediction_layers_are_ignored(name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(TINY / name, folder)
    tensors = mx.load(str(folder / "model.safetensors"))
    layers = config(name)["num_hidden_layers"]
    # The MTP module real checkpoints store after the decoder: a copy of the last layer plus its own tensors.
    extra = {k.replace(f"layers.{layers - 1}.", f"layers.{layers}."): v for k, v in tensors.items()
             if k.startswith(f"model.layers.{layers - 1}.")}  # fmt: skip
    extra[f"model.layers.{layers}.eh_proj.weight"] = mx.zeros((64, 128))
    mx.save_safetensors(str(folder / "model.safetensors"), {**tensors, **extra})
    assert max_diff(mlxinfer.load(folder), name) < 1e-3
    out = tmp_path / "out"
    convert(folder, out, bits=8, evaluate=False, progress=False)
    assert not [k for k in stored(out) if k.startswith(f"model.layers.{layers}.")]


def test_defaults_are_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    import dataclasses

    from mlxinfer.models.registry import ARCHITECTURES

    for model_type, name in (("glm4_moe", "Glm4MoeConfig"), ("deepseek_v3", "DeepseekV3Config")):
        cls = getattr(transformers, name)
        reference = {f.name: f.default for f in dataclasses.fields(cls)} | {"rope_theta": cls.default_theta}
        # GLM's partial_rotary_factor is a __post_init__ default, not a field.
        reference["partial_rotary_factor"] = cls().rope_parameters.get("partial_rotary_factor")
        for key, value in ARCHITECTURES[model_type].defaults.items():
            assert reference[key] == value, (model_type, key)


def test_router_matches_transformers_where_mlx_lm_does_not():
    """Kept experts with negative biased scores (mlx-lm zeroes dropped groups, so they would lose) and top-1
    with norm_topk_prob (mlx-lm skips renormalizing): both against transformers' router on the same weights."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from mlxinfer.families.deepseek_v3 import GroupedTopkRouter

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    for top_k, bias in ((3, -0.9), (1, 0.0)):
        cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=top_k,
                               norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
        theirs = DeepseekV3TopkRouter(cfg)
        weight = rng.normal(size=(8, 16)).astype(np.float32)
        correction = (bias + 0.1 * rng.normal(size=8)).astype(np.float32)
        with torch.no_grad():
            theirs.weight.copy_(torch.from_numpy(weight))
            theirs.e_score_correction_bias.copy_(torch.from_numpy(correction))
            _, their_weights, their_experts = theirs(torch.from_numpy(x))
        ours = GroupedTopkRouter(8, 16, top_k, 4, 2, True, 2.5)
        ours.weight, ours.e_score_correction_bias = mx.array(weight), mx.array(correction)
        experts, weights = ours(mx.array(x))
        # Both return each token's experts in no particular order: compare them sorted by expert.
        order, their_order = np.argsort(np.array(experts), -1), their_experts.argsort(-1).numpy()
        their_experts, their_weights = their_experts.numpy(), their_weights.numpy()
        np.testing.assert_array_equal(
            np.take_along_axis(np.array(experts), order, -1), np.take_along_axis(their_experts, their_order, -1)
        )
        np.testing.assert_allclose(
            np.take_along_axis(np.array(weights), order, -1),
            np.take_along_axis(their_weights, their_order, -1),
            rtol=1e-5,
        )


# Malformed input: one line each, naming the file and the key.

rope_yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}


@pytest.mark.parametrize(
    ("name", "change", "error", "words"),
    [
        ("glm4_moe", {"n_group": 3}, ConfigError, "n_routed_experts=8 must split into n_group=3 equal groups"),
        ("glm4_moe", {"n_group": 8, "topk_group": 4}, ConfigError, "groups of at least 2 experts"),
        ("glm4_moe", {"topk_group": 5}, ConfigError, "topk_group must be a positive integer of at most 4"),
        ("glm4_moe", {"num_experts_per_tok": 5}, ConfigError, "num_experts_per_tok=5 is more than the 4 experts"),
        ("glm4_moe", {"num_experts_per_tok": 0}, ConfigError, "num_experts_per_tok must be a positive integer"),
        ("glm4_moe", {"n_routed_experts": None}, ConfigError, "n_routed_experts must be a positive integer"),
        ("glm4_moe", {"first_k_dense_replace": 4}, ConfigError, "first_k_dense_replace must be an integer from 0"),
        ("glm4_moe", {"routed_scaling_factor": 0}, ConfigError, "routed_scaling_factor must be a positive"),
        ("glm4_moe", {"norm_topk_prob": "yes"}, ConfigError, "norm_topk_prob must be true or false"),
        ("glm4_moe", {"topk_method": "greedy"}, UnsupportedModelError, "topk_method='greedy' is not supported"),
        ("glm4_moe", {"rope_parameters": {**rope_yarn}}, UnsupportedModelError, "rope type 'yarn' is not supported"),
        ("deepseek_v3", {"num_key_value_heads": 1}, ConfigError, "num_key_value_heads=1 must equal"),
        ("deepseek_v3", {"qk_rope_head_dim": 15}, ConfigError, "qk_rope_head_dim=15 must be even"),
        ("deepseek_v3", {"kv_lora_rank": None}, ConfigError, "kv_lora_rank must be a positive integer"),
        ("deepseek_v3", {"rope_interleave": 1}, ConfigError, "rope_interleave must be true or false"),
        ("deepseek_v3", {"moe_layer_freq": 2}, UnsupportedModelError, "moe_layer_freq=2 is not supported"),
        ("deepseek_v3", {"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func='softmax' is not supported"),
        ("deepseek_v3", {"num_nextn_predict_layers": -1}, ConfigError, "num_nextn_predict_layers must be an integer"),
    ],
)
def test_malformed_config_is_one_line_naming_the_key(name, change, error, words, tmp_path):
    folder = with_config(tmp_path, name, lambda cfg: {**cfg, **change})
    with pytest.raises(error) as caught:
        mlxinfer.load(folder)
    message = str(caught.value)
    assert "\n" not in message and words in message and str(folder / "config.json") in message, message


def without_router(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k: v for k, v in tensors.items() if not k.startswith(f"{ROUTER}.")}


@pytest.mark.parametrize(
    ("name", "config_change", "change", "words"),
    [
        # The config's expert count against the router's rows, before anything is built.
        ("glm4_moe", {"n_routed_experts": 16}, dict, "n_routed_experts is 16"),
        # A router that does not fit the experts it routes among, or none.
        ("deepseek_v3", {}, lambda w: {**w, f"{ROUTER}.e_score_correction_bias": mx.zeros((7,))},
         f"{ROUTER}.e_score_correction_bias (file (7,), model (8,))"),
        ("deepseek_v3", {}, without_router, "missing (2)"),
        # An expert missing from the stack.
        ("deepseek_v3_plain", {}, lambda w: {k: v for k, v in w.items() if ".experts.3.up_proj" not in k},
         "missing (2): model.layers.0.mlp.experts.3.up_proj.weight, model.layers.1.mlp.experts.3.up_proj.weight"),
    ],
)  # fmt: skip
def test_malformed_experts_are_one_line(name, config_change, change, words, tmp_path):
    folder = with_config(tmp_path, name, lambda cfg: {**cfg, **config_change})
    path = folder / "model.safetensors"
    mx.save_safetensors(str(path), change(mx.load(str(path))))
    with pytest.raises(WeightMismatchError) as caught:
        mlxinfer.load(folder)
    message = str(caught.value)
    assert "\n" not in message and words in message, message
