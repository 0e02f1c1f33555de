"""Granite 4.0 hybrid beyond the parity tests: the config forms of transformers 4 (the real checkpoints)
and 5 give the same model, and every layer mlx-lm builds is the kind our caches and masks assume."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

import mlxinfer
from mlxinfer.cache import StateCache, make_cache
from tests.conftest import TINY, golden

LEGACY = {"linear_attention": "mamba", "full_attention": "attention"}


def rewritten(tmp_path: Path, name: str, edit) -> Path:
    folder = tmp_path / name
    shutil.copytree(TINY / name, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config)))  # json writes math.inf as a bare Infinity
    return folder


def as_granite4(config: dict) -> dict:
    """The form the Granite 4.0-H checkpoints on the Hub use (written by transformers 4)."""
    config["layer_types"] = [LEGACY[t] for t in config["layer_types"]]
    config["time_step_limit"] = [0.0, math.inf]
    return config


def as_transformers5(config: dict) -> dict:
    """The form transformers 5 writes: new layer names, tagged infinity, an explicit null position type."""
    config["layer_types"] = [{v: k for k, v in LEGACY.items()}[t] for t in config["layer_types"]]
    config["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    return config | {"position_embedding_type": None}


@pytest.mark.parametrize("name, edit", [("granitemoehybrid", as_granite4), ("granitemoehybrid_nope", as_transformers5)])
def test_both_config_forms_give_the_same_model(tmp_path, name, edit):
    ids = golden(name)["input_ids"].tolist()
    other = mlxinfer.load(rewritten(tmp_path, name, edit))
    np.testing.assert_array_equal(other.logits(ids), mlxinfer.load(TINY / name).logits(ids))


@pytest.mark.parametrize("name", ["granitemoehybrid", "granitemoehybrid_nope"])
def test_every_layer_is_built_as_the_kind_its_cache_and_mask_assume(name):
    lm = mlxinfer.load(TINY / name)._loaded.model
    kinds = lm.layout.layer_types
    assert "mamba" in kinds and "full_attention" in kinds
    for layer, kind, cache in zip(lm.layers, kinds, make_cache(lm.cache_kinds)):
        assert hasattr(layer, "mamba") == (kind == "mamba") and hasattr(layer, "self_attn") == (kind != "mamba")
        assert isinstance(cache, StateCache) == (kind == "mamba")
