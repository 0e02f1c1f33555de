"""A family outside the verified list runs through mlx-lm's own model class, labelled unverified everywhere.

The fixtures are written by transformers (tests/fixtures/make_tiny_models.py) for families mlxinfer has no
registry row for and mlx-lm has a module: Starcoder2 (dense), AFMoE (sliding windows, experts), LFM2-MoE
(short-convolution state, experts).
"""

from __future__ import annotations

import json
import logging

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from mlxinfer.convert import convert

import mlxinfer
from mlxinfer.cli import main
from mlxinfer.engine import Finished, SchedulerConfig
from mlxinfer.engine.serving import ServingThread
from mlxinfer.errors import ConfigError, UnsupportedModelError
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import ARCHITECTURES, TINY, golden
from tests.test_mlx_lm_roundtrip import mlx_lm_greedy
from tests.test_scheduler import batch_sizes, run_jobs

NAME = "starcoder2"
UNVERIFIED = [NAME, "afmoe", "lfm2_moe"]
# Transformers computes GELU-tanh in float32 through torch's kernel, mlx-lm through its own formula:
# measured 1.5e-3 at most on this fixture. A wrong RoPE base (mlx-lm's own default, when it reads a
# transformers-5 config as it is) measures 2.8.
TOLERANCE = 5e-3


@pytest.fixture(scope="module")
def model():
    return mlxinfer.load(TINY / NAME)


@pytest.mark.parametrize("name", UNVERIFIED)
def test_it_matches_transformers_and_is_labelled_on_the_load_line(name, caplog):
    with caplog.at_level(logging.WARNING):
        model = mlxinfer.load(TINY / name)
    assert f"model_type {name} is unverified" in caplog.text
    assert not model.verified and "(unverified)" in repr(model) and "(unverified)" in model._repr_html_()
    ref = golden(name)
    ids = ref["input_ids"].tolist()
    logits = model.logits(ids)
    assert np.abs(logits - np.array(ref["logits"])).max() < TOLERANCE
    assert np.abs(model.logits(ids, chunk_tokens=5) - logits).max() < 1e-4  # our caches, mlx-lm's masks
    assert model.generate(ids, max_tokens=16).token_ids == ref["greedy"].tolist()


def test_its_layers_keep_the_caches_mlx_lm_gives_them():
    kinds = {name: [k for k, _ in mlxinfer.load(TINY / name)._loaded.model.cache_kinds] for name in UNVERIFIED}
    assert kinds == {
        NAME: ["full_attention"] * 2,
        "afmoe": ["sliding_attention", "full_attention"] * 2,
        "lfm2_moe": ["linear_attention", "full_attention"] * 2,
    }


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_verified_family_never_takes_the_fallback(name):
    assert mlxinfer.load(TINY / name).verified


def test_a_model_type_mlx_lm_lacks_too_is_one_line(tiny_copy):
    folder = tiny_copy(NAME)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model"}))
    with pytest.raises(UnsupportedModelError, match="no_such_model.*mlx-lm has no module for it either") as e:
        mlxinfer.load(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", ["../../etc/passwd", "base", "cache", "x" * 200])
def test_hostile_model_types_import_nothing(tiny_copy, model_type):
    folder = tiny_copy(NAME)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(UnsupportedModelError, match="not supported"):
        mlxinfer.load(folder)


def test_a_quantized_kv_cache_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="unverified.*kv_bits=None"):
        mlxinfer.load(TINY / NAME, kv_bits=8)


@pytest.mark.parametrize("name", UNVERIFIED)
def test_the_prefix_cache_resumes_it(name):
    # The window of afmoe (8) and the state of lfm2_moe cannot be cut: the resume comes from a snapshot.
    ids = golden(name)["input_ids"].tolist()
    probe = ids[:20] + [7, 8, 9]
    cold = mlxinfer.load(TINY / name, prefix_cache_bytes=0).generate(probe, max_tokens=6)
    model = mlxinfer.load(TINY / name)
    model.generate(ids, max_tokens=2, snapshot_every=4)
    warm = model.generate(probe, max_tokens=6)
    assert warm.stats.cached_tokens == 20 and warm.token_ids == cold.token_ids


def test_a_scheduler_runs_its_requests_one_at_a_time_and_says_so(model, caplog):
    ids = golden(NAME)["input_ids"].tolist()
    prompts = [ids, ids[:12], ids[5:]]
    alone = [model.generate(p, max_tokens=6).text for p in prompts]
    with caplog.at_level(logging.WARNING):
        scheduler = ServingThread(model.runtime, SchedulerConfig(max_batch=8))
    assert "one request at a time" in caplog.text
    try:
        sizes = batch_sizes(scheduler)
        runs = run_jobs(scheduler, prompts, max_tokens=6)
    finally:
        scheduler.stop()
    assert [isinstance(r.end, Finished) for r in runs] == [True] * 3
    assert [r.text for r in runs] == alone and max(sizes) == 1


def test_json_stats_and_the_models_endpoint_say_unverified(model):
    result = CliRunner().invoke(main, ["generate", str(TINY / NAME), "-p", "hello", "--max-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.splitlines()[-1])
    assert payload["verified"] is False and payload["architecture"] == f"{NAME} (unverified)"
    models = ModelSet()
    models.add(model, SchedulerConfig(max_batch=2))
    models.add(mlxinfer.load(TINY / "qwen2"), SchedulerConfig(max_batch=2))
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        listed = {m["id"]: m["verified"] for m in httpx.get(running.url + "/v1/models").json()["data"]}
    assert listed == {NAME: False, "qwen2": True}


@pytest.mark.parametrize("bits", [8, 4])
def test_it_converts_to_a_folder_both_runtimes_agree_on(bits, tmp_path):
    out = tmp_path / f"{NAME}-{bits}bit"
    convert(TINY / NAME, out, bits=bits, dtype="float32", evaluate=False, progress=False)
    ours = mlxinfer.load(out)
    assert not ours.verified and ours._loaded.quantized_layers > 0
    ids = golden(NAME)["input_ids"].tolist()
    assert mlx_lm_greedy(out, ids, 8) == ours.generate(ids, max_tokens=8).token_ids


def test_calibrated_recipes_are_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(main, ["convert", str(TINY / NAME), "-o", str(tmp_path / "out"), "--method", "gptq"])
    assert result.exit_code != 0 and "unverified" in result.output and not (tmp_path / "out").exists()
