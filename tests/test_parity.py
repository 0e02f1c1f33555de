"""Every supported architecture matches transformers (fp32, eager) on tiny random checkpoints.

Golden outputs come from tests/fixtures/make_tiny_models.py (needs torch; CI does not).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from tests.conftest import ARCHITECTURES, TINY, golden


@pytest.fixture(scope="module", params=ARCHITECTURES)
def case(request):
    return request.param, mlxinfer.load(TINY / request.param), golden(request.param)


@pytest.mark.slow
def test_logits_match_transformers(case):
    name, model, ref = case
    logits = model.logits(ref["input_ids"].tolist())
    assert logits.shape == tuple(ref["logits"].shape)
    assert np.abs(logits - np.array(ref["logits"])).max() < 1e-3, name


@pytest.mark.slow
def test_greedy_continuation_matches_transformers(case):
    name, model, ref = case
    result = model.generate(ref["input_ids"].tolist(), max_tokens=16)
    assert result.token_ids == ref["greedy"].tolist(), name


@pytest.mark.slow
def test_cached_logits_equal_uncached(case):
    name, model, ref = case
    ids = ref["input_ids"].tolist()
    one_at_a_time = model.logits(ids, chunk_tokens=1)
    chunked = model.logits(ids, chunk_tokens=5)
    whole = model.logits(ids)
    # Float32 rounding only: a BLAS that blocks a product by its row count (OpenBLAS) sums in another order
    # for 1, 5 or 24 rows, and recurrent layers (Gated DeltaNet) carry that through every token: up to
    # ~4e-5 of the logits' scale here, against the 1e-3 absolute allowed from transformers above.
    tolerance = 1e-4 * max(1.0, float(np.abs(whole).max()))
    assert np.abs(one_at_a_time - whole).max() < tolerance, name
    assert np.abs(chunked - whole).max() < tolerance, name


def test_classic_and_transformers5_configs_give_the_same_model():
    classic = mlxinfer.load(TINY / "llama_classic")
    tf5 = mlxinfer.load(TINY / "llama_tf5")
    ids = golden("llama_classic")["input_ids"].tolist()
    assert classic.config.args["rope_theta"] == tf5.config.args["rope_theta"]
    np.testing.assert_array_equal(classic.logits(ids), tf5.logits(ids))


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_sliding_window_changes_the_output(name, monkeypatch):
    # Guards the parity tests above: with the window disabled the logits must move,
    # so matching transformers proves the window is applied.
    model = mlxinfer.load(TINY / name)
    ref = golden(name)
    layout = model._loaded.model.layout
    widened = type(layout)(layout.layer_types, 10_000, layout.embed_scale, layout.final_logit_softcapping)
    monkeypatch.setattr(model._loaded.model, "layout", widened)
    logits = model.logits(ref["input_ids"].tolist())
    assert np.abs(logits - np.array(ref["logits"])).max() > 0.1


def test_compute_dtype_is_float32_on_cpu():
    model = mlxinfer.load(TINY / "qwen2")
    expected = "float32" if mx.default_device().type == mx.DeviceType.cpu else model.compute_dtype
    assert model.compute_dtype == expected
    assert mlxinfer.load(TINY / "qwen2", dtype="bfloat16").compute_dtype == "bfloat16"
