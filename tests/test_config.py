"""config.json normalization: both rope forms, layer types, and refusals."""

from __future__ import annotations

import json
import logging
import math

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
        ({"model_type": "bert"}, UnsupportedModelError, "model_type 'bert' is not supported (mlx-lm has no module"),
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


# Qwen3-Next / Qwen3.5: which layers are full attention, partial rotary, defaults.


def test_qwen3_next_layer_types_come_from_full_attention_interval_when_absent():
    raw = {**config("qwen3_next"), "num_hidden_layers": 6, "full_attention_interval": 3}
    del raw["layer_types"]
    cfg = normalize_config(raw)
    linear = "linear_attention"
    assert cfg.layer_types == (linear, linear, FULL, linear, linear, FULL)
    assert cfg.args["full_attention_interval"] == 3


def test_qwen3_next_interval_for_mlx_lm_is_rewritten_from_layer_types():
    # transformers ignores full_attention_interval once layer_types is given; mlx-lm reads only the interval.
    linear = "linear_attention"
    raw = {**config("qwen3_next"), "full_attention_interval": 4, "layer_types": [linear, FULL, linear, FULL]}
    assert normalize_config(raw).args["full_attention_interval"] == 2
    no_full = {**raw, "layer_types": [linear] * 4}
    assert normalize_config(no_full).args["full_attention_interval"] == 5  # past the last layer: none built


@pytest.mark.parametrize(
    "layer_types, words",
    [
        (["full_attention", "linear_attention", "linear_attention", "full_attention"], "every Nth layer"),
        (["linear_attention"] * 3, "4 entries"),
        (["linear_attention", "sliding_attention", "linear_attention", "full_attention"], "entries of"),
    ],
)
def test_qwen3_next_layouts_mlx_lm_cannot_build_are_refused(layer_types, words):
    with pytest.raises(UnsupportedModelError, match=words):
        normalize_config({**config("qwen3_next"), "layer_types": layer_types})


def test_qwen3_next_classic_and_rope_parameters_forms_normalize_the_same():
    tf5 = config("qwen3_next")
    classic = {k: v for k, v in tf5.items() if k not in ("rope_parameters", "layer_types")}
    classic.update(rope_theta=10000.0, partial_rotary_factor=0.25, full_attention_interval=4)
    a, b = normalize_config(tf5), normalize_config(classic)
    assert a.layer_types == b.layer_types
    for key in ("rope_theta", "partial_rotary_factor", "rope_scaling", "full_attention_interval"):
        assert a.args[key] == b.args[key], key


def test_qwen3_vl_hub_and_transformers_5_forms_keep_the_same_mrope_sections():
    # The Hub's Qwen3-VL configs (transformers 4.57) put the sections in rope_scaling, whose "default" type is no
    # scaling at all; transformers 5 writes rope_parameters. Both keep them for M-RoPE.
    tf5 = config("qwen3_vl")
    text = tf5["text_config"]
    rope = text["rope_parameters"]
    hub_text = {k: v for k, v in text.items() if k != "rope_parameters"}
    hub_text |= {"rope_theta": rope["rope_theta"], "rope_scaling": {"mrope_interleaved": True,
                 "mrope_section": rope["mrope_section"], "rope_type": "default"}}  # fmt: skip
    a, b = normalize_config(tf5), normalize_config({**tf5, "text_config": hub_text})
    assert a.args["mrope_section"] == b.args["mrope_section"] == [4, 2, 2]
    assert a.args["rope_theta"] == b.args["rope_theta"] == 10000.0 and a.args["rope_scaling"] is b.args["rope_scaling"]


def test_partial_rotary_defaults_to_a_quarter_for_qwen3_next_and_stays_refused_elsewhere():
    raw = config("qwen3_5")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}  # transformers' default: 0.25
    assert normalize_config(raw).args["partial_rotary_factor"] == 0.25
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor is only supported for"):
        normalize_config({**minimal(), "partial_rotary_factor": 0.5})


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"linear_num_value_heads": 3}, ConfigError, "multiple of linear_num_key_heads"),
        ({"linear_conv_kernel_dim": 1}, ConfigError, "linear_conv_kernel_dim"),
        ({"num_experts": 10**9}, ConfigError, "num_experts"),
        ({"num_experts_per_tok": 5}, ConfigError, "num_experts_per_tok"),
        ({"mlp_only_layers": "0"}, ConfigError, "mlp_only_layers"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, UnsupportedModelError, "'linear'"),
    ],
)
def test_qwen3_next_bad_values_are_refused(change, error, words):
    with pytest.raises(error, match=words):
        normalize_config({**config("qwen3_next"), **change})


def test_qwen3_5_text_with_experts_is_refused():
    # Qwen3_5TextConfig has no experts; mlx-lm's qwen3_5 would build them from this key.
    with pytest.raises(UnsupportedModelError, match="num_experts"):
        normalize_config({**config("qwen3_5"), "num_experts": 4})


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_qwen_defaults_are_transformers_defaults(family):
    pytest.importorskip("transformers")
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from mlxinfer.models.registry import ARCHITECTURES

    reference = (Qwen3NextConfig if family == "qwen3_next" else Qwen3_5TextConfig)().to_dict()
    reference.update(reference.pop("rope_parameters"))
    for key, value in ARCHITECTURES[family].defaults.items():
        assert reference[key] == value, key


# Vision-language checkpoints: the text model of a nested config.


def test_gemma3_vl_config_is_its_text_config():
    cfg = normalize_config(config("gemma3_vl"))  # no top-level vocab_size; a stale _sliding_window_pattern of 6
    assert cfg.model_type == "gemma3_text" and cfg.vocab_size == 272 and cfg.tie_word_embeddings
    assert cfg.layer_types == (SLIDING, SLIDING, SLIDING, FULL) and cfg.sliding_window == 8
    assert cfg.eos_token_ids == (258,) and cfg.bos_token_id == 256


def test_qwen3_5_vl_config_is_its_text_config():
    cfg, text = normalize_config(config("qwen3_5_vl")), normalize_config(config("qwen3_5"))
    assert cfg.model_type == "qwen3_5_text" and not cfg.tie_word_embeddings
    assert cfg.layer_types == text.layer_types
    informative = ("architectures", "transformers_version")
    assert {k: v for k, v in cfg.args.items() if k not in informative} == {
        k: v for k, v in text.args.items() if k not in informative
    }


def test_a_sparse_gemma3_text_config_takes_transformers_defaults():
    pytest.importorskip("transformers")
    from transformers import Gemma3Config

    # google/gemma-3-4b-it names only what differs from Gemma3TextConfig's defaults.
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
            "final_logit_softcapping": 30.0}  # fmt: skip
    raw = {"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106], "vision_config": {}}
    cfg = normalize_config(raw)
    ref = Gemma3Config(text_config=dict(text)).text_config
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "query_pre_attn_scalar",
                "max_position_embeddings", "rms_norm_eps"):  # fmt: skip
        assert cfg.args[key] == getattr(ref, key), key
    assert list(cfg.layer_types) == ref.layer_types and cfg.sliding_window == ref.sliding_window
    assert cfg.args["rope_scaling"]["factor"] == 8.0 and cfg.args["rope_theta"] == 1e6
    # Gemma3ForConditionalGeneration never soft-caps its logits (only Gemma3ForCausalLM does).
    assert cfg.args.get("final_logit_softcapping") is None
    assert cfg.eos_token_ids == (1, 106)


def test_vl_eos_ids_add_the_outer_ones_to_the_text_models():
    raw = config("gemma3_vl")
    raw["eos_token_id"] = [258, 106]
    assert normalize_config(raw).eos_token_ids == (258, 106)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"text_config": None}, ConfigError, "needs a text_config"),
        ({"text_config": {"model_type": "llama"}}, UnsupportedModelError, "text_config.model_type"),
        ({"quantization_config": {"quant_method": "awq"}}, UnsupportedModelError, "awq"),
    ],
)
def test_bad_vl_configs_are_refused(change, error, words):
    with pytest.raises(error, match=words):
        normalize_config({**config("gemma3_vl"), **change})


# --- gpt_oss and granitemoehybrid -------------------------------------------------------------------------------
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}  # fmt: skip


def test_gpt_oss_classic_tf5_and_default_rope_forms_normalize_the_same():
    tf5 = config("gpt_oss")
    classic = {k: v for k, v in tf5.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in tf5["rope_parameters"].items() if k != "rope_theta"}
    classic |= {"rope_theta": 150000.0, "rope_scaling": scaling}
    # GptOssConfig with no RoPE keys at all: YaRN factor 32 at theta 150000, the fixture's values.
    bare = {k: v for k, v in classic.items() if k not in ("rope_theta", "rope_scaling")}
    got = [normalize_config(raw).args for raw in (tf5, classic, bare)]
    for args in got:
        assert (args["rope_theta"], args["rope_scaling"]) == (got[0]["rope_theta"], got[0]["rope_scaling"])
    yarn = got[0]["rope_scaling"]
    assert yarn["truncate"] is False and yarn["original_max_position_embeddings"] == 4096
    assert yarn["attention_factor"] == pytest.approx(0.1 * math.log(32) + 1)


def test_gpt_oss_missing_keys_take_transformers_defaults():
    raw = {k: v for k, v in config("gpt_oss").items() if k not in ("sliding_window", "swiglu_limit", "layer_types")}
    cfg = normalize_config(raw)
    assert cfg.sliding_window == 128 and cfg.args["swiglu_limit"] == 7.0
    assert cfg.layer_types == (SLIDING, FULL, SLIDING, FULL)  # transformers: even layers slide


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"factor": None}, {"factor": 131072 / 4096}),  # transformers: max / original positions
        ({"beta_fast": None, "beta_slow": 0}, {"beta_fast": 32, "beta_slow": 1}),  # read with `or`
        ({"attention_factor": 0.5}, {"attention_factor": 0.5}),
        ({"mscale": 1, "mscale_all_dim": 0.5}, {"attention_factor": (1 + math.log(32) / 10) / (1 + math.log(32) / 20)}),
        ({"mscale": 2.0}, {"attention_factor": 0.1 * math.log(32) + 1}),  # mscale alone is ignored
        ({"truncate": True}, {"truncate": True}),
    ],
)
def test_yarn_settings_resolve_like_transformers(change, expected):
    raw = config("gpt_oss")
    raw["rope_parameters"] = {**raw["rope_parameters"], **change}
    yarn = normalize_config(raw).args["rope_scaling"]
    for key, value in expected.items():
        assert yarn[key] == pytest.approx(value), key


def test_yarn_takes_a_top_level_original_max_position_embeddings_first():
    raw = config("gpt_oss") | {"original_max_position_embeddings": 2048}
    assert normalize_config(raw).args["rope_scaling"]["original_max_position_embeddings"] == 2048


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"truncate": "no"}, ConfigError, "truncate must be true or false"),
        ({"beta_fast": -1.0}, ConfigError, "beta_fast must be a positive number"),
        ({"original_max_position_embeddings": 0}, ConfigError, "original_max_position_embeddings must be a positive"),
        ({"factor": "big"}, ConfigError, "factor must be a positive number"),
        ({"attention_factor": 0}, ConfigError, "attention_factor must be a positive number"),
        ({"mscale": 1.0, "mscale_all_dim": -10.0 / math.log(32)}, ConfigError, "mscale_all_dim"),
        ({"low_freq_factor": 1.0}, UnsupportedModelError, "'low_freq_factor' is not supported"),
        ({"rope_type": "longrope"}, UnsupportedModelError, "'longrope'"),
    ],
)
def test_bad_yarn_settings_are_refused(change, error, words):
    raw = config("gpt_oss")
    raw["rope_parameters"] = {**raw["rope_parameters"], **change}
    with pytest.raises(error, match=words):
        normalize_config(raw)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"num_experts_per_tok": 5}, ConfigError, "num_experts_per_tok must be from 1 to num_local_experts=4"),
        ({"num_local_experts": 0}, ConfigError, "num_local_experts must be an integer from 1"),
        ({"swiglu_limit": None}, ConfigError, "swiglu_limit must be a positive finite number"),
        ({"attention_bias": False}, UnsupportedModelError, "attention_bias=False"),
        ({"sliding_window": None}, ConfigError, "sliding layers need a positive sliding_window"),
        ({"quantization_config": {"quant_method": "gptq"}}, UnsupportedModelError, "gptq"),
    ],
)
def test_bad_gpt_oss_settings_are_refused(change, error, words):
    with pytest.raises(error, match=words):
        normalize_config({**config("gpt_oss"), **change})


def test_granite_layer_names_of_transformers_4_and_5_normalize_the_same():
    tf5 = config("granitemoehybrid")
    assert tf5["layer_types"] == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert tf5["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    legacy = tf5 | {"layer_types": ["mamba", "mamba", "attention", "mamba"], "time_step_limit": [0.0, math.inf]}
    older = {k: v for k, v in legacy.items() if k not in ("layer_types", "time_step_limit")}
    older["layers_block_type"] = legacy["layer_types"]  # the key transformers maps onto layer_types
    for raw in (tf5, legacy, older):
        cfg = normalize_config(raw)
        assert cfg.layer_types == ("mamba", "mamba", FULL, "mamba")
        assert cfg.args["layer_types"] == ["mamba", "mamba", "attention", "mamba"]  # mlx-lm's names
        assert cfg.args["time_step_limit"] == (0.0, math.inf)
    everything_mamba = {k: v for k, v in older.items() if k != "layers_block_type"}
    assert normalize_config(everything_mamba).layer_types == ("mamba",) * 4  # transformers' default


@pytest.mark.parametrize("given, expected", [("rope", "rope"), ("nope", "nope"), (None, "nope"), ("absent", "nope")])
def test_granite_rotates_only_when_transformers_does(given, expected):
    raw = config("granitemoehybrid") | {"position_embedding_type": given}
    if given == "absent":
        del raw["position_embedding_type"]
    assert normalize_config(raw).args["position_embedding_type"] == expected  # mlx-lm rotates unless "nope"


def test_granite_without_experts_runs_the_shared_mlp():
    cfg = normalize_config(config("granitemoehybrid") | {"num_local_experts": 0, "mlp_bias": True})
    assert cfg.args["intermediate_size"] == 40 and cfg.args["mlp_bias"] is False  # mlx-lm's `mlp` is that MLP


def test_granite_mamba_head_size_auto_and_defaults_follow_transformers():
    raw = config("granitemoehybrid") | {"mamba_d_head": "auto"}
    for key in ("time_step_limit", "mamba_conv_bias", "residual_multiplier"):
        del raw[key]
    args = normalize_config(raw).args
    assert args["mamba_d_head"] == 2 * 64 // 8
    assert args["time_step_limit"] == (0.0, math.inf) and args["mamba_conv_bias"] is True
    assert args["residual_multiplier"] == 1.0


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"time_step_limit": None}, ConfigError, "time_step_limit must be a list"),
        ({"time_step_limit": [1.0, 0.5]}, ConfigError, "0 <= low < high"),
        ({"time_step_limit": [{"__float__": "NaN"}, 1.0]}, ConfigError, "0 <= low < high"),
        ({"time_step_limit": [0.0, {"__float__": "Infinity", "x": 1}]}, ConfigError, "0 <= low < high"),
        ({"layer_types": ["mamba", "conv", "attention", "mamba"]}, UnsupportedModelError, "layer type 'conv'"),
        ({"layer_types": ["mamba", "sliding_attention", "mamba", "mamba"]}, UnsupportedModelError, "not supported"),
        ({"layer_types": ["mamba", {"kind": "mamba"}, "mamba", "mamba"]}, UnsupportedModelError, "layer type"),
        ({"layer_types": ["mamba"] * 3}, UnsupportedModelError, "layer_types must list num_hidden_layers=4"),
        ({"position_embedding_type": "alibi"}, UnsupportedModelError, "position_embedding_type 'alibi'"),
        ({"mamba_d_head": 15}, ConfigError, "mamba_n_heads \\* mamba_d_head"),
        ({"mamba_n_groups": 3}, ConfigError, "not a multiple of mamba_n_groups=3"),
        ({"mamba_d_conv": 10_000}, ConfigError, "mamba_d_conv must be a positive integer of at most 64"),
        ({"mamba_proj_bias": None}, ConfigError, "mamba_proj_bias must be true or false"),
        ({"logits_scaling": 0}, ConfigError, "logits_scaling must be a positive finite number"),
        ({"num_experts_per_tok": 0}, ConfigError, "num_experts_per_tok must be from 1"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, UnsupportedModelError, "rope type 'yarn'"),
        ({"head_dim": 32}, UnsupportedModelError, "head_dim=32 differs"),
    ],
)
def test_bad_granite_settings_are_refused(change, error, words):
    with pytest.raises(error, match=words):
        normalize_config({**config("granitemoehybrid"), **change})


@pytest.mark.parametrize(
    "name, outer, inner, tied",
    [  # what transformers 5's Qwen3_5/Gemma3ForConditionalGeneration tie (checked with torch, not needed here)
        ("qwen3_5_vl", True, False, True),
        ("qwen3_5_vl", False, True, False),
        ("qwen3_5_vl", None, True, False),
        ("gemma3_vl", False, True, False),
        ("gemma3_vl", None, False, True),
    ],
)
def test_the_vl_wrapper_decides_whether_lm_head_is_tied(name, outer, inner, tied):
    raw = config(name)
    raw["text_config"]["tie_word_embeddings"] = inner
    raw.pop("tie_word_embeddings")
    if outer is not None:
        raw["tie_word_embeddings"] = outer
    assert normalize_config(raw).tie_word_embeddings is tied


def test_gemma3_text_defaults_are_transformers_defaults():
    pytest.importorskip("transformers")
    from transformers import Gemma3TextConfig

    from mlxinfer.models.multimodal import WRAPPERS

    reference = Gemma3TextConfig()
    for key, value in WRAPPERS["gemma3"].text_defaults.items():
        assert getattr(reference, key) == value, key


@pytest.mark.parametrize(
    "model_type, config_class", [("gpt_oss", "GptOssConfig"), ("granitemoehybrid", "GraniteMoeHybridConfig")]
)
def test_gpt_oss_and_granite_defaults_are_transformers_defaults(model_type, config_class):
    transformers = pytest.importorskip("transformers")
    import dataclasses

    from mlxinfer.families.gpt_oss import GPT_OSS_YARN
    from mlxinfer.models.registry import ARCHITECTURES

    cls = getattr(transformers, config_class)
    reference = {f.name: f.default for f in dataclasses.fields(cls)} | {"rope_theta": cls.default_theta}
    for key, value in ARCHITECTURES[model_type].defaults.items():
        expected = reference[key]
        assert (list(expected) if isinstance(expected, tuple) else expected) == value, key
    if model_type == "gpt_oss":
        assert {k: v for k, v in cls().rope_parameters.items() if k != "rope_theta"} == GPT_OSS_YARN
