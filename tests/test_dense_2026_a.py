"""SmolLM3, Cohere2, Ministral 3 / Mistral 3, Gemma 4 (text and multimodal) config quirks and refusals, and
Phi-4-mini's config.

Expected logits are the fixtures' golden ones (transformers), scaled where the change's effect is exact, or
those of the unchanged fixture when only the config form changes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from mlxinfer.errors import ConfigError, UnsupportedModelError, WeightMismatchError
from mlxinfer.models.config import normalize_config
from mlxinfer.models.multimodal import text_config
from tests.conftest import TINY, golden

S, F = "sliding_attention", "full_attention"


def ids(name: str) -> list[int]:
    return golden(name)["input_ids"].tolist()


def logits(path: Path, name: str) -> np.ndarray:
    return mlxinfer.load(path).logits(ids(name))


def reference(name: str) -> np.ndarray:
    return np.array(golden(name)["logits"])


def rewrite_config(folder: Path, change) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def raw_config(name: str) -> dict:
    return json.loads((TINY / name / "config.json").read_text())


def refused(raw: dict, error: type[Exception]) -> str:
    with pytest.raises(error) as caught:
        normalize_config(raw)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("config.json: ")
    return message


# ---- SmolLM3 ----
def test_smollm3_transformers5_config_gives_the_classic_ones_logits(tiny_copy):
    folder = tiny_copy("smollm3")

    def to_tf5(raw):
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.pop("rope_theta")}
        raw.pop("rope_scaling")

    rewrite_config(folder, to_tf5)
    assert np.abs(logits(folder, "smollm3") - reference("smollm3")).max() < 1e-3


def test_smollm3_no_rope_layers_list_wins_over_the_interval(tiny_copy):
    # Guards the parity test: with the list gone, the interval puts NoPE on layer 3 instead of 1.
    folder = tiny_copy("smollm3")
    rewrite_config(folder, lambda raw: raw.pop("no_rope_layers"))
    assert normalize_config(json.loads((folder / "config.json").read_text())).args["no_rope_layers"] == [1, 1, 1, 0]
    assert np.abs(logits(folder, "smollm3") - reference("smollm3")).max() > 1e-2


def test_smollm3_slides_its_nope_layers_only_with_use_sliding_window():
    raw = {**raw_config("smollm3"), "sliding_window": 8}
    raw.pop("layer_types")  # as transformers 4 wrote it: derived from no_rope_layers
    assert normalize_config(raw).layer_types == (F,) * 4
    config = normalize_config({**raw, "use_sliding_window": True})
    assert config.layer_types == (F, S, F, F) and config.sliding_window == 8


def test_smollm3_refuses_a_malformed_no_rope_layers():
    message = refused({**raw_config("smollm3"), "no_rope_layers": [1, 0]}, ConfigError)
    assert "no_rope_layers" in message


# ---- Cohere2 ----
def test_cohere2_classic_config_gives_the_same_logits(tiny_copy):
    # Command R7B's config.json: sliding_window_pattern instead of layer_types, top-level rope_theta.
    folder = tiny_copy("cohere2")

    def to_classic(raw):
        raw.pop("layer_types")
        raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
        raw["sliding_window_pattern"] = 4

    rewrite_config(folder, to_classic)
    assert np.abs(logits(folder, "cohere2") - reference("cohere2")).max() < 1e-3


def test_cohere2_logit_scale_multiplies_the_logits(tiny_copy):
    folder = tiny_copy("cohere2")
    rewrite_config(folder, lambda raw: raw.update(logit_scale=1.0))  # 4x the fixture's 0.25
    assert np.abs(logits(folder, "cohere2") - 4 * reference("cohere2")).max() < 4e-3


def test_cohere2_refuses_rope_scaling():
    raw = {**raw_config("cohere2"), "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4}}
    assert "'linear'" in refused(raw, UnsupportedModelError)


# ---- Ministral 3 / Mistral 3 ----
def test_ministral3_classic_rope_scaling_gives_the_same_logits(tiny_copy):
    folder = tiny_copy("ministral3")

    def to_classic(raw):
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}

    rewrite_config(folder, to_classic)
    assert np.abs(logits(folder, "ministral3") - reference("ministral3")).max() < 1e-3


def test_ministral3_query_scale_changes_the_output(tiny_copy):
    # Guards the parity test: without the llama-4 scale (beta 0) the logits move.
    folder = tiny_copy("ministral3")
    rewrite_config(folder, lambda raw: raw["rope_parameters"].update(llama_4_scaling_beta=0.0))
    assert np.abs(logits(folder, "ministral3") - reference("ministral3")).max() > 1e-2


def test_ministral3_query_scale_is_finite_on_left_padding():
    model = mlxinfer.load(TINY / "ministral3")._loaded.model
    scale = model.layers[0].self_attn.query_scale(3, mx.array([-2, 30]))  # a padded row starts before 0
    expected = [[1, 1, 1], [1 + 0.3 * np.log(4), 1 + 0.3 * np.log(4), 1 + 0.3 * np.log(5)]]
    np.testing.assert_allclose(np.array(scale)[:, 0, :, 0], expected, rtol=1e-6)


def test_ministral3_slides_every_layer_and_ignores_layer_types():
    raw = {**raw_config("ministral3"), "sliding_window": 8, "layer_types": [F, F]}
    config = normalize_config(raw)
    assert config.layer_types == (S, S) and config.sliding_window == 8


def test_ministral3_needs_llama_4_scaling_beta():
    raw = raw_config("ministral3")
    raw["rope_parameters"].pop("llama_4_scaling_beta")
    assert "rope_parameters.llama_4_scaling_beta" in refused(raw, UnsupportedModelError)


def test_mistral3_holds_a_mistral_or_a_ministral3_text_model():
    raw = raw_config("mistral3_vl")
    assert text_config(raw, "config.json")["model_type"] == "ministral3"
    raw["text_config"]["model_type"] = "mistral"
    assert text_config(raw, "config.json")["model_type"] == "mistral"
    raw["text_config"]["model_type"] = "llama"
    message = refused(raw, UnsupportedModelError)
    assert "text_config.model_type is 'llama'" in message


# ---- Gemma 4 ----
@pytest.mark.parametrize("name, global_kv", [("gemma4", None), ("gemma4_vl", 1)])
def test_gemma4_global_head_dim_form_gives_the_per_layer_config_ones_logits(tiny_copy, name, global_kv):
    # Google's checkpoints say global_head_dim / num_global_key_value_heads; transformers 5 writes per_layer_config.
    folder = tiny_copy(name)

    def to_google_form(raw):
        text = raw.get("text_config", raw)
        text.pop("per_layer_config")
        text["global_head_dim"] = 32
        if global_kv:
            text["num_global_key_value_heads"] = global_kv

    rewrite_config(folder, to_google_form)
    assert np.abs(logits(folder, name) - reference(name)).max() < 1e-3


def test_gemma4_sizes_follow_transformers_defaults():
    raw = raw_config("gemma4")
    raw.pop("per_layer_config")
    raw.pop("layer_types")
    raw.update(num_hidden_layers=7, num_kv_shared_layers=0)
    config = normalize_config(raw)
    assert config.args["global_head_dim"] == 512  # transformers' default when config.json names none
    # 5 sliding, 1 full, then the last layer made full whatever the pattern says.
    assert config.layer_types == (S,) * 5 + (F, F)


def test_gemma4_kv_shared_layers_have_no_keys_of_their_own(tiny_copy):
    # transformers stores no k/v projections for the shared layers (and doubles their MLPs): read without
    # sharing, the checkpoint does not fit, and the error names what is missing.
    folder = tiny_copy("gemma4")
    rewrite_config(folder, lambda raw: raw.update(num_kv_shared_layers=0))
    with pytest.raises(WeightMismatchError, match=r"missing \(6\): model.layers.4.self_attn.k_norm.weight"):
        mlxinfer.load(folder)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"num_kv_shared_layers": 5}, ConfigError, "no earlier full_attention layer"),
        ({"use_bidirectional_attention": "all"}, UnsupportedModelError, "use_bidirectional_attention"),
        ({"per_layer_config": {"2": {"intermediate_size": 8}}}, UnsupportedModelError, "per_layer_config.2"),
        ({"per_layer_config": {"2": {"head_dim": 32}}}, UnsupportedModelError, "full_attention layers"),
        ({"attention_bias": True}, UnsupportedModelError, "attention_bias"),
        ({"vocab_size_per_layer_input": 100}, ConfigError, "vocab_size_per_layer_input"),
    ],
)
def test_gemma4_refuses_what_it_cannot_compute(change, error, words):
    assert words in refused({**raw_config("gemma4"), **change}, error)


def test_gemma4_refuses_other_rope_on_global_layers():
    raw = raw_config("gemma4")
    raw["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0}
    assert "rope_parameters.full_attention rope_type 'yarn'" in refused(raw, UnsupportedModelError)


@pytest.mark.parametrize("name, count", [("gemma4_vl", 16), ("mistral3_vl", 15)])
def test_the_vision_tower_is_skipped_with_one_line(caplog, name, count):
    with caplog.at_level(logging.INFO, logger="mlxinfer"):
        model = mlxinfer.load(TINY / name)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1 and f"skipped the vision tower ({count} tensors" in lines[0], lines
    assert np.abs(model.logits(ids(name)) - reference(name)).max() < 1e-3


# ---- Phi-4-mini ----
def phi4_mini_config() -> dict:
    """microsoft/Phi-4-mini-instruct's config.json (factors shortened to their real count, 48 = 0.75 * 128 / 2)."""
    return {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu", "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
        "vocab_size": 200064, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": 262144,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48},
        "tie_word_embeddings": True, "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999,
        "torch_dtype": "bfloat16",
    }  # fmt: skip


def test_phi4_mini_is_refused_for_its_longrope_scaling():
    # transformers switches Phi-4-mini between short_factor and long_factor by the sequence length
    # (past original_max_position_embeddings), which mlxinfer does not implement.
    message = refused(phi4_mini_config(), UnsupportedModelError)
    assert "'longrope'" in message


def test_phi4_mini_loads_as_phi3_without_its_rope_scaling():
    # Everything else in the config is phi3 as verified: partial rotary 0.75, tied embeddings.
    raw = {**phi4_mini_config(), "rope_scaling": None}
    config = normalize_config(raw)
    assert config.args["partial_rotary_factor"] == 0.75 and config.tie_word_embeddings
