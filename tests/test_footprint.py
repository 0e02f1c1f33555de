"""One footprint from a config: what `pull` estimates and the distributed split counts, against real caches."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import mlx.core as mx
import pytest
from safetensors import safe_open

from mlxinfer.cache import StateCache, make_cache
from mlxinfer.distributed.layer_sizes import read_layer_sizes
from mlxinfer.hub import estimated_plan
from mlxinfer.models.config import ATTENTION, normalize_config
from mlxinfer.models.footprint import config_footprint, footprint, layer_state_bytes
from mlxinfer.models.loader import load_model
from tests.conftest import TINY

# Each recurrent kind (short conv, Mamba-2 with one and two groups, Gated DeltaNet), an MoE model, latent
# attention (DeepSeek), sliding windows and a plain dense model.
FIXTURES = ["lfm2", "granitemoehybrid", "granitemoehybrid_nope", "qwen3_next", "qwen3_5", "deepseek_v3",
            "gpt_oss", "gemma3", "qwen2"]  # fmt: skip
MEASURED = ("weights_bytes", "expert_bytes", "active_expert_bytes")  # bytes only the loaded arrays show


def caches_after_prefill_and_decode(loaded) -> list:
    """The real caches of `loaded` after a 5-token prompt and one decoded token."""
    decoder = loaded.model
    caches = make_cache(decoder.cache_kinds)
    mx.eval(decoder.hidden(mx.array([[3, 4, 5, 6, 7]], dtype=mx.uint32), caches))
    mx.eval(decoder.hidden(mx.array([[8]], dtype=mx.uint32), caches))
    return caches


# bfloat16 where the CPU backend runs it (its GatherMM, which MoE layers use, is float32 only): the convolution's
# inputs follow the compute dtype, the recurrence's state stays float32.
STATE_CASES = [*((name, "float32") for name in FIXTURES), ("lfm2", "bfloat16"), ("qwen3_5", "bfloat16")]


@pytest.mark.parametrize(("name", "dtype"), STATE_CASES)
def test_each_layers_state_from_the_config_is_what_its_cache_holds(name, dtype):
    loaded = load_model(TINY / name, dtype=dtype)
    size = loaded.compute_dtype.size
    caches = caches_after_prefill_and_decode(loaded)
    for kind, cache in zip(loaded.config.layer_types, caches, strict=True):
        held = cache.nbytes if isinstance(cache, StateCache) else 0
        assert layer_state_bytes(loaded.config, kind, size) == held, kind


def test_an_unverified_models_state_is_probed_from_its_module():
    # lfm2_moe runs on mlx-lm's module: the config names no layer kinds, the probe through its layers finds them
    loaded = load_model(TINY / "lfm2_moe", dtype="float32")
    assert not loaded.config.verified
    held = sum(c.nbytes for c in caches_after_prefill_and_decode(loaded) if isinstance(c, StateCache))
    measured = footprint(loaded)
    assert (measured.recurrent_layers, measured.state_bytes) == (2, held) and held > 0
    assert config_footprint(loaded.config, 4).state_bytes == 0  # from the config alone: every layer full attention


@pytest.mark.parametrize("name", FIXTURES)
def test_the_config_footprint_is_the_loaded_models_but_for_measured_bytes(name):
    loaded = load_model(TINY / name, dtype="float32")
    estimate = config_footprint(loaded.config, loaded.compute_dtype.size)
    measured = footprint(loaded)
    assert dataclasses.replace(measured, **{k: getattr(estimate, k) for k in MEASURED}) == estimate


def test_the_split_counts_each_recurrent_layers_state_and_the_planner_agrees():
    sizes = read_layer_sizes(TINY / "qwen3_next", context=512, dtype="float32")
    loaded = load_model(TINY / "qwen3_next", dtype="float32")
    state = [c.nbytes for c in caches_after_prefill_and_decode(loaded) if isinstance(c, StateCache)]
    kinds = loaded.config.layer_types
    assert [kv for kv, kind in zip(sizes.layer_kv_bytes, kinds) if kind not in ATTENTION] == state
    # 2 KV heads x 32 dims x K and V x float32 x 512 positions in the one full-attention layer
    assert [kv for kv, kind in zip(sizes.layer_kv_bytes, kinds) if kind in ATTENTION] == [2 * 32 * 2 * 4 * 512]
    assert sum(sizes.layer_kv_bytes) == footprint(loaded).cache_bytes(512)
    assert not any("recurrent" in note for note in sizes.notes)


def parameters(folder) -> int:
    with safe_open(str(folder / "model.safetensors"), "numpy") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


@pytest.mark.parametrize("name", ["qwen3_next", "granitemoehybrid", "gpt_oss"])
def test_pull_estimates_the_experts_width_and_the_recurrent_state(name):
    # pull sees the config and the headers' parameter count: its plan counts what the loaded model's does
    config = normalize_config(json.loads((TINY / name / "config.json").read_text()))
    plan = estimated_plan(SimpleNamespace(config=config, parameters=parameters(TINY / name)))
    loaded = load_model(TINY / name)  # the compute dtype pull assumes: this device's
    measured = footprint(loaded)
    assert plan.footprint.weights_bytes == loaded.weights_bytes
    assert dataclasses.replace(plan.footprint, **{k: getattr(measured, k) for k in MEASURED}) == measured
    if name == "qwen3_next":  # no expert biases: the config's expert weights are every routed byte
        assert plan.footprint.expert_bytes == measured.expert_bytes
        assert plan.footprint.active_expert_bytes == measured.active_expert_bytes
