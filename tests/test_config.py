"""config.json normalization: both rope forms, layer types, and refusals."""

from __future__ import annotations

import json
import logging

import pytest

from mlxinfer.errors import ConfigError, UnsupportedModelError
from mlxinfer.models.config import FULL, SLIDING, normalize_config
from tests.conftest import TINY


def config(name: str) -> dict:
    return json.loads((TINY / name / "config.json").read_text())


def test_classic_and_rope_parameters_forms_normalize_the_same():
    classic, tf5 = normalize_config(config("llama_classic")), normalize_config(config("llama_tf5"))
    for key in ("rope_theta", "rope_scaling", "head_dim", "num_key_value_heads"):
        assert classic.args[key] == tf5.args[key]


def test_rope_parameters_with_scaling_are_read():
    cfg = normalize_config(config("llama_rope_llama3"))
    assert cfg.args["rope_theta"] == 500000.0
    assert cfg.args["rope_scaling"]["rope_type"] == "llama3"
    assert cfg.args["rope_scaling"]["factor"] == 8.0


def test_phi3_partial_rotary_is_read_from_rope_parameters():
    assert normalize_config(config("phi3")).args["partial_rotary_factor"] == 0.5


def test_gemma3_nested_rope_parameters():
    cfg = normalize_config(config("gemma3"))
    assert cfg.args["rope_theta"] == 1_000_000.0
    assert cfg.args["rope_local_base_freq"] == 10_000.0
    assert cfg.layer_types == (SLIDING,) * 5 + (FULL,)


@pytest.mark.parametrize(
    "model_type, extra, expected",
    [
        ("gemma2", {"sliding_window": 8}, (SLIDING, FULL, SLIDING, FULL)),
        ("gemma3_text", {"sliding_window": 8, "sliding_window_pattern": 2}, (SLIDING, FULL, SLIDING, FULL)),
        ("mistral", {"sliding_window": 8}, (SLIDING,) * 4),
        ("mistral", {"sliding_window": None}, (FULL,) * 4),
        (
            "qwen2",
            {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2},
            (FULL, FULL, SLIDING, SLIDING),
        ),
        ("qwen2", {"sliding_window": 8, "use_sliding_window": False}, (FULL,) * 4),
        ("llama", {}, (FULL,) * 4),
    ],
)
def test_layer_types_follow_transformers_rules(model_type, extra, expected):
    raw = {**minimal(model_type), "num_hidden_layers": 4, **extra}
    assert normalize_config(raw).layer_types == expected


def minimal(model_type: str = "llama") -> dict:
    return {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 272,
        "rms_norm_eps": 1e-6,
    }


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, UnsupportedModelError, "rope type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, UnsupportedModelError, "'yarn'"),
        ({"model_file": "modeling_evil.py"}, UnsupportedModelError, "model_file"),
        ({"model_type": "mamba"}, UnsupportedModelError, "model_type 'mamba'"),
        ({"hidden_act": "relu"}, UnsupportedModelError, "hidden_act='relu'"),
        ({"quantization_config": {"quant_method": "gptq"}}, UnsupportedModelError, "gptq"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, ConfigError, "not divisible"),
        ({"num_key_value_heads": 3}, ConfigError, "multiple of num_key_value_heads"),
        ({"vocab_size": 0}, ConfigError, "vocab_size"),
        ({"pretraining_tp": 2}, UnsupportedModelError, "pretraining_tp"),
        ({"partial_rotary_factor": 0.5}, UnsupportedModelError, "partial_rotary_factor"),
        ({"layer_types": ["full_attention"]}, UnsupportedModelError, "layer_types"),
        ({"layer_types": [SLIDING, SLIDING]}, ConfigError, "sliding_window"),
        ({"hidden_act": ["silu"]}, ConfigError, "hidden_act must be"),
        ({"head_dim": "16"}, ConfigError, "head_dim must be"),
        ({"layer_types": 5}, ConfigError, "layer_types must be"),
        ({"quantization": "yes"}, ConfigError, "quantization must be"),
        ({"rope_theta": float("nan")}, ConfigError, "rope_theta must be a finite"),
        ({"tie_word_embeddings": "false"}, ConfigError, "tie_word_embeddings must be"),
        ({"sliding_window": True}, ConfigError, "sliding_window must be"),
        ({"rms_norm_eps": True}, ConfigError, "rms_norm_eps must be"),
        ({"rope_parameters": "x"}, ConfigError, "rope_parameters must be"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, ConfigError, "llama3 rope scaling needs"),
    ],
)
def test_bad_or_unsupported_settings_are_refused(change, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        normalize_config({**minimal(), **change})


@pytest.mark.parametrize("model_type", ["phi3", "gemma2"])
def test_rope_scaling_is_refused_where_the_module_ignores_it(model_type):
    raw = {**minimal(model_type), "rope_scaling": {"type": "linear", "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match="rope type 'linear'"):
        normalize_config(raw)


def test_gemma3_defaults_follow_transformers():
    flat_rope = {"rope_theta": 1e6, "rope_type": "default"}
    raw = {**minimal("gemma3_text"), "head_dim": 16, "sliding_window": 8, "rope_parameters": flat_rope}
    cfg = normalize_config(raw)
    assert cfg.args["rope_theta"] == 1e6 and cfg.args["rope_local_base_freq"] == 10_000.0


@pytest.mark.parametrize(
    "model_type, change, words",
    [
        ("gemma2", {"attn_logit_softcapping": None}, "attn_logit_softcapping=null"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
)
def test_settings_the_module_cannot_honour_are_refused(model_type, change, words):
    with pytest.raises(UnsupportedModelError, match=words):
        normalize_config({**minimal(model_type), "head_dim": 16, **change})


def test_gemma3_softcapping_is_refused_not_dropped():
    raw = {**minimal("gemma3_text"), "head_dim": 16, "final_logit_softcapping": 30.0}
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping"):
        normalize_config(raw)


def test_auto_map_is_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = normalize_config({**minimal(), "auto_map": {"AutoModelForCausalLM": "x.Model"}})
    assert cfg.model_type == "llama"
    assert "auto_map" in caplog.text


def test_eos_ids_accept_int_and_list():
    assert normalize_config({**minimal(), "eos_token_id": [2, 7]}).eos_token_ids == (2, 7)
    assert normalize_config({**minimal(), "eos_token_id": 2}).eos_token_ids == (2,)
