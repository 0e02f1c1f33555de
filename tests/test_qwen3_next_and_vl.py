"""Qwen3-Next / Qwen3.5 config forms and weight layouts, and vision-language checkpoints run as text models.

Expected logits are the fixtures' golden ones (transformers) or those of the unchanged fixture.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mlxinfer
from mlxinfer.cli import main
from mlxinfer.errors import CorruptFileError, UnsupportedModelError, WeightMismatchError
from mlxinfer.families.qwen3_next import to_mlx_layout
from mlxinfer.formats.safetensors_header import read_header
from mlxinfer.models.checkpoint import load_tensors, open_folder
from mlxinfer.models.config import normalize_config
from mlxinfer.models.decoder import build_model
from mlxinfer.models.multimodal import text_checkpoint
from tests.conftest import TINY, golden


def logits(path: Path, name: str) -> np.ndarray:
    return mlxinfer.load(path).logits(golden(name)["input_ids"].tolist())


def rewrite_config(folder: Path, change) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def test_qwen3_next_classic_config_gives_the_same_model(tiny_copy):
    # Real Qwen3-Next checkpoints: top-level rope_theta and partial_rotary_factor, no layer_types.
    def classic(raw):
        rope = raw.pop("rope_parameters")
        del raw["layer_types"]
        raw.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"])
        raw.update(full_attention_interval=4, rope_scaling=None)

    folder = tiny_copy("qwen3_next")
    rewrite_config(folder, classic)
    np.testing.assert_array_equal(logits(folder, "qwen3_next"), logits(TINY / "qwen3_next", "qwen3_next"))


def test_qwen3_5_without_rope_parameters_uses_transformers_defaults(tiny_copy):
    # transformers: theta 10000 and a quarter of each head rotated; mlx-lm's qwen3_5 would use theta 100000.
    folder = tiny_copy("qwen3_5")
    rewrite_config(folder, lambda raw: raw.pop("rope_parameters"))
    np.testing.assert_array_equal(logits(folder, "qwen3_5"), logits(TINY / "qwen3_5", "qwen3_5"))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_a_checkpoint_in_mlx_layout_loads_the_same(tiny_copy, name):
    folder = tiny_copy(name)
    weights = to_mlx_layout(dict(mx.load(str(folder / "model.safetensors"))), num_experts=4)
    assert "model.layers.0.linear_attn.conv1d.weight" in weights
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    np.testing.assert_array_equal(logits(folder, name), logits(TINY / name, name))


def test_the_mlx_layout_is_what_transformers_stores_converted():
    stored = dict(mx.load(str(TINY / "qwen3_next" / "model.safetensors")))
    ours = to_mlx_layout(dict(stored), num_experts=4)
    assert ours["model.layers.0.mlp.switch_mlp.up_proj.weight"].shape == (4, 24, 64)
    np.testing.assert_array_equal(ours["model.layers.0.mlp.switch_mlp.up_proj.weight"][2],
                                  stored["model.layers.0.mlp.experts.2.up_proj.weight"])  # fmt: skip
    assert ours["model.layers.0.linear_attn.conv1d.weight"].shape == (160, 4, 1)
    # Zero-centred norms are stored as w and used as 1 + w; the gated norm in linear attention is not.
    np.testing.assert_array_equal(ours["model.norm.weight"], stored["model.norm.weight"] + 1)
    np.testing.assert_array_equal(ours["model.layers.3.self_attn.q_norm.weight"],
                                  stored["model.layers.3.self_attn.q_norm.weight"] + 1)  # fmt: skip
    np.testing.assert_array_equal(ours["model.layers.0.linear_attn.norm.weight"],
                                  stored["model.layers.0.linear_attn.norm.weight"])  # fmt: skip


def test_a_missing_expert_is_named(tiny_copy):
    folder = tiny_copy("qwen3_next")
    weights = dict(mx.load(str(folder / "model.safetensors")))
    del weights["model.layers.1.mlp.experts.3.down_proj.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.1\.mlp\.experts\.\*\.down_proj \(3 of 4\)"):
        mlxinfer.load(folder)


def test_layers_built_otherwise_than_layer_types_say_are_refused():
    config = normalize_config(json.loads((TINY / "qwen3_next" / "config.json").read_text()))
    swapped = dataclasses.replace(config, layer_types=("full_attention",) + config.layer_types[1:])
    with pytest.raises(UnsupportedModelError, match="layer 0 was built as linear attention"):
        build_model(swapped)


# Vision-language checkpoints.

VL = {"qwen3_5_vl": ("model.language_model.", "lm_head."), "gemma3_vl": ("language_model.",)}


def vision_tensors(name: str) -> list[str]:
    """The fixture's tensors outside the text model (the fixture report lists them)."""
    header = read_header(TINY / name / "model.safetensors")
    return sorted(n for n in header if not n.startswith(VL[name]))


@pytest.mark.parametrize("name, count", [("qwen3_5_vl", 21), ("gemma3_vl", 23)])
def test_the_vision_tower_is_skipped_with_one_line_and_the_text_model_matches(caplog, name, count):
    assert len(vision_tensors(name)) == count
    with caplog.at_level(logging.INFO, logger="mlxinfer"):
        model = mlxinfer.load(TINY / name)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"{count} tensors" in lines[0] and "model.safetensors" in lines[0]
    assert "images are not supported" in lines[0]
    ref = golden(name)  # the full model's output on a text-only prompt
    assert np.abs(model.logits(ref["input_ids"].tolist()) - np.array(ref["logits"])).max() < 1e-3


@pytest.mark.parametrize("name", list(VL))
def test_vision_tensors_are_never_loaded(name):
    checkpoint = text_checkpoint(open_folder(TINY / name))
    weights = load_tensors(checkpoint)
    assert not set(vision_tensors(name)) & set(weights) and set(weights) == set(checkpoint.tensors)
    assert all(n.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")) for n in weights)


def test_gemma3_in_transformers_internal_layout_loads_the_same(tiny_copy):
    # Saved without transformers 5's mapping back: model.language_model.*, model.vision_tower.*, ...
    folder = tiny_copy("gemma3_vl")
    weights = dict(mx.load(str(folder / "model.safetensors")))
    text = "language_model.model."
    renamed = {(f"model.language_model.{k.removeprefix(text)}" if k.startswith(text) else f"model.{k}"): v
               for k, v in weights.items()}  # fmt: skip
    assert "model.language_model.layers.0.mlp.up_proj.weight" in renamed and "model.vision_tower." in str(renamed)
    mx.save_safetensors(str(folder / "model.safetensors"), renamed)
    np.testing.assert_array_equal(logits(folder, "gemma3_vl"), logits(TINY / "gemma3_vl", "gemma3_vl"))


def test_two_tensors_for_one_text_weight_are_refused(tiny_copy):
    folder = tiny_copy("gemma3_vl")
    weights = dict(mx.load(str(folder / "model.safetensors")))
    weights["model.language_model.norm.weight"] = weights["language_model.model.norm.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(CorruptFileError, match="both the text model's model.norm.weight"):
        mlxinfer.load(folder)


def test_a_text_checkpoint_is_left_as_it_is(caplog):
    checkpoint = open_folder(TINY / "qwen3_5")
    with caplog.at_level(logging.INFO):
        assert text_checkpoint(checkpoint) is checkpoint
    assert not caplog.records


@pytest.mark.parametrize("name", list(VL))
def test_plan_reads_a_nested_config(name):
    result = CliRunner().invoke(main, ["plan", str(TINY / name), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["max_context"] == 256
