"""OLMo 2/3, Granite 3.x, GLM-4-0414 and EXAONE 4.0 beyond the parity tests: each config form the real
checkpoints or transformers 5 write gives the same model, keys config.json leaves out take transformers'
defaults, the rules for which layers slide and rotate follow transformers, and what we cannot run is refused
in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import mlxinfer
from mlxinfer.errors import ConfigError, UnsupportedModelError
from mlxinfer.models.config import FULL, SLIDING, normalize_config
from mlxinfer.models.registry import ARCHITECTURES
from tests.conftest import TINY, golden


def rewritten(tmp_path: Path, name: str, edit) -> Path:
    folder = tmp_path / name
    shutil.copytree(TINY / name, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config)))
    return folder


def config(name: str) -> dict:
    return json.loads((TINY / name / "config.json").read_text())


def logits(folder: Path, name: str) -> np.ndarray:
    return np.array(mlxinfer.load(folder).logits(golden(name)["input_ids"].tolist()))


def transformers_logits(folder: Path, name: str) -> np.ndarray:
    """The reference: transformers' own model on `folder` (float32, eager attention)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32)
    ids = torch.tensor([golden(name)["input_ids"].tolist()])
    with torch.no_grad():
        return model.eval()(ids, use_cache=False).logits[0].numpy()


# Config forms. The fixtures use the real checkpoints' form (classic for OLMo 2, Granite and EXAONE 4.0);
# olmo3 and glm4 are written as transformers 5 writes them.


def to_tf5(config: dict) -> dict:
    theta, scaling = config.pop("rope_theta"), config.pop("rope_scaling")
    assert scaling is None
    return config | {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


def olmo3_classic(config: dict) -> dict:
    """The real OLMo 3 form: top-level rope_theta, and a rope_scaling transformers gives the full layers."""
    params = config.pop("rope_parameters")
    full = dict(params[FULL])
    return config | {"rope_theta": full.pop("rope_theta"), "rope_scaling": full}


def glm4_classic(config: dict) -> dict:
    """The GLM-4-0414 form: top-level rope_theta and partial_rotary_factor."""
    params = config.pop("rope_parameters")
    return config | {"rope_theta": params["rope_theta"], "partial_rotary_factor": params["partial_rotary_factor"]}


def exaone4_pattern_only(config: dict) -> dict:
    """The EXAONE 4.0 32B form before transformers: the string pattern "LLLG" names the sliding layers."""
    del config["layer_types"]
    return config


def exaone4_number_pattern(config: dict) -> dict:
    del config["layer_types"]
    return config | {"sliding_window_pattern": 4}  # transformers' rule: every 4th layer is global


@pytest.mark.parametrize(
    "name, edit",
    [
        ("olmo2", to_tf5),
        ("granite", to_tf5),
        ("exaone4", to_tf5),
        ("olmo3", olmo3_classic),
        ("glm4", glm4_classic),
        ("exaone4", exaone4_pattern_only),
        ("exaone4", exaone4_number_pattern),
    ],
)
def test_each_config_form_gives_the_same_model(tmp_path, name, edit):
    np.testing.assert_array_equal(logits(rewritten(tmp_path, name, edit), name), logits(TINY / name, name))


# Which layers slide and which rotate: transformers' rules, checked against transformers itself.


def test_olmo3_without_layer_types_slides_like_transformers(tmp_path):
    def default_layers(config: dict) -> dict:  # transformers: every 4th layer full (the fixture: only the 2nd)
        del config["layer_types"]
        return config

    folder = rewritten(tmp_path, "olmo3", default_layers)
    assert normalize_config(json.loads((folder / "config.json").read_text())).layer_types == (
        SLIDING, SLIDING, SLIDING, FULL
    )  # fmt: skip
    np.testing.assert_allclose(logits(folder, "olmo3"), transformers_logits(folder, "olmo3"), atol=1e-3)


def test_exaone4_without_a_window_rotates_every_layer_like_transformers(tmp_path):
    """The all-global form (sliding_window null): every layer rotates, as transformers does then."""

    def all_global(config: dict) -> dict:
        return config | {"sliding_window": None, "sliding_window_pattern": None, "layer_types": [FULL] * 4}

    folder = rewritten(tmp_path, "exaone4", all_global)
    ours = mlxinfer.load(folder)
    assert all(layer.self_attn.use_rope for layer in ours._loaded.model.layers)
    np.testing.assert_allclose(logits(folder, "exaone4"), transformers_logits(folder, "exaone4"), atol=1e-3)


def test_exaone4_rotates_only_its_sliding_layers():
    lm = mlxinfer.load(TINY / "exaone4")._loaded.model
    assert [layer.self_attn.use_rope for layer in lm.layers] == [True, True, True, False]


# Defaults: keys config.json may leave out take the values transformers' config classes give them.


@pytest.mark.parametrize(
    "family, cls",
    [("olmo2", "Olmo2Config"), ("olmo3", "Olmo3Config"), ("granite", "GraniteConfig"), ("glm4", "Glm4Config"),
     ("exaone4", "Exaone4Config")],
)  # fmt: skip
def test_defaults_are_transformers_defaults(family, cls):
    transformers = pytest.importorskip("transformers")
    reference = getattr(transformers, cls)().to_dict()
    params = reference.pop("rope_parameters")
    reference.update(params.get(FULL, params))  # olmo3 nests them per layer type
    for key, value in ARCHITECTURES[family].defaults.items():
        assert reference[key] == value, key


def test_glm4_without_partial_rotary_factor_rotates_half_of_each_head():
    raw = config("glm4")
    del raw["rope_parameters"]["partial_rotary_factor"]
    assert normalize_config(raw).args["partial_rotary_factor"] == 0.5  # Glm4Config's default


# Refusals: one line naming the file and the key.


def refused(raw: dict, error: type[Exception], *words: str) -> None:
    with pytest.raises(error) as caught:
        normalize_config(raw, source="m/config.json")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("m/config.json: "), message
    for word in words:
        assert word in message, message


def test_olmo3_refuses_rope_scaling_on_sliding_layers():
    raw = config("olmo3")
    raw["rope_parameters"][SLIDING] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    refused(raw, UnsupportedModelError, "rope_parameters.sliding_attention.rope_type")


def test_olmo3_refuses_two_rope_bases():
    raw = config("olmo3")
    raw["rope_parameters"][SLIDING]["rope_theta"] = 10000.0
    refused(raw, UnsupportedModelError, "rope_theta", "10000.0")


def test_olmo3_refuses_fewer_layers_than_its_module_builds():
    refused({**config("olmo3"), "num_hidden_layers": 2, "layer_types": [SLIDING, FULL]}, UnsupportedModelError,
            "num_hidden_layers=2")  # fmt: skip


@pytest.mark.parametrize("pattern", ["LLXG", "", 0, True])
def test_exaone4_refuses_a_pattern_it_cannot_read(pattern):
    raw = exaone4_pattern_only(config("exaone4")) | {"sliding_window_pattern": pattern}
    refused(raw, ConfigError, "sliding_window_pattern")


def test_exaone4_refuses_a_window_no_layer_uses():
    # transformers would run every layer without RoPE: almost surely a broken config, not a model.
    refused({**config("exaone4"), "layer_types": [FULL] * 4}, UnsupportedModelError, "sliding_window=6")


@pytest.mark.parametrize("key", ["logits_scaling", "embedding_multiplier", "attention_multiplier"])
def test_granite_refuses_a_multiplier_that_is_not_positive(key):
    refused({**config("granite"), key: 0}, ConfigError, key)


def test_glm4_refuses_rope_scaling_its_module_ignores():
    raw = config("glm4")
    raw["rope_parameters"] |= {"rope_type": "linear", "factor": 2.0}
    refused(raw, UnsupportedModelError, "linear")


def test_olmo2_refuses_per_head_norms_as_weights_that_do_not_fit(tmp_path):
    """OLMo's q/k norms span the whole projection; a checkpoint whose norms are narrower is not OLMo's."""
    from safetensors.numpy import load_file, save_file

    from mlxinfer.errors import WeightMismatchError

    folder = tmp_path / "olmo2"
    shutil.copytree(TINY / "olmo2", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = tensors["model.layers.0.self_attn.q_norm.weight"][:16]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightMismatchError, match="q_norm"):
        mlxinfer.load(folder)


def test_olmo2_ignores_mlp_bias_as_transformers_does(tiny_copy):
    folder = tiny_copy("olmo2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    ids = golden("olmo2")["input_ids"].tolist()
    assert np.abs(mlxinfer.load(folder).logits(ids) - np.array(golden("olmo2")["logits"])).max() < 1e-3
