"""A benchmark suite: which configurations to run, and the figures derived from them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..data import prose_text
from ..models.dtype import choose_compute_dtype, dtype_name
from ..tokenizer import Tokenizer
from .bandwidth import ceiling_tps, kv_bytes_per_token, measure_bandwidth
from .conditions import conditions
from .measure import Measurement, RunSpec
from .runner import run_all


@dataclass
class Settings:
    """Sizes and repetitions; defaults follow the backend (the CPU backend is ~100x slower)."""

    prompt_tokens: int
    decode_tokens: int
    runs: int = 3
    budget_s: float = 120.0
    overhead_steps: int = 8  # bare model steps timed for the engine-overhead figure
    mlx_lm_modes: tuple[str, ...] = ("default", "matched")  # with compare: mlx-lm in its own dtype, in ours
    warmup: str = "one cold run per configuration, excluded from the medians"

    @classmethod
    def for_backend(cls, quick: bool = False) -> Settings:
        if quick:
            # A smoke run of the harness, hardly a measurement: a 2-token prefill and 4 tokens (mlxinfer's first
            # two arrive together, the first decode step queued behind the prefill, so only from the third on is
            # a step a real one). mlx-lm only in our dtype: its default on a 4-bit model, bf16, computes about a
            # token a second on the CPU backend and would be most of the run; `mlxinfer bench --compare` runs it.
            return cls(
                prompt_tokens=2, decode_tokens=4, runs=1, budget_s=30.0, overhead_steps=1, mlx_lm_modes=("matched",)
            )
        if mx.default_device().type == mx.DeviceType.gpu:
            return cls(prompt_tokens=512, decode_tokens=128)
        return cls(prompt_tokens=128, decode_tokens=32)


def prompt_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    """The first `n` tokens of the shipped English prose (repeated if the tokenizer is frugal)."""
    ids = tokenizer.encode(prose_text(), add_special_tokens=False)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def build_specs(models: dict[str, Path], tokenizers: dict[str, Tokenizer], settings: Settings, compare: bool):
    """Ours with its default dtype; with `compare`, mlx-lm with its default and with ours (settings.mlx_lm_modes)."""
    ours = dtype_name(choose_compute_dtype())
    specs = []
    for label, path in models.items():
        ids = prompt_ids(tokenizers[label], settings.prompt_tokens)
        common = dict(model=str(path), label=label, prompt_ids=ids, decode_tokens=settings.decode_tokens)
        common.update(runs=settings.runs, budget_s=settings.budget_s, overhead_steps=settings.overhead_steps)
        specs.append(RunSpec(engine="mlxinfer", mode="default", dtype=None, **common))
        if compare:
            if "default" in settings.mlx_lm_modes:
                specs.append(RunSpec(engine="mlx-lm", mode="default", dtype=None, **common))
            if "matched" in settings.mlx_lm_modes:
                specs.append(RunSpec(engine="mlx-lm", mode="matched", dtype=ours, **common))
    return specs


def run_suite(
    models: dict[str, Path], tokenizers: dict[str, Tokenizer], settings: Settings, compare: bool, progress: bool = True
) -> dict[str, Any]:
    """Run everything and return the JSON-able report: conditions, settings, bandwidth, results."""
    recorded = conditions()  # first: it routes MLX's CPU GEMMs (blas.py), so every engine below runs on one BLAS
    bandwidth = measure_bandwidth()
    results = run_all(build_specs(models, tokenizers, settings, compare), progress=progress)
    return {
        "conditions": recorded,
        "settings": asdict(settings),
        "bandwidth": {**asdict(bandwidth), "best_gbps": bandwidth.best_gbps},
        "results": [_with_ceiling(m, bandwidth.best_gbps, settings) for m in results],
    }


def _with_ceiling(m: Measurement, gbps: float, settings: Settings) -> dict[str, Any]:
    dtype_bytes = 4 if m.compute_dtype == "float32" else 2
    kv = kv_bytes_per_token(Path(m.model), dtype_bytes)
    # Mean context while decoding: the prompt plus half the generated tokens.
    context = settings.prompt_tokens + settings.decode_tokens / 2
    ceiling = ceiling_tps(gbps, m.decode_weights_bytes, kv, context)
    derived = {"kv_bytes_per_token": kv, "ceiling_tps": ceiling, "ceiling_fraction": m.decode_tps.median / ceiling}
    return {**m.to_dict(), **derived, "quantization": _quantization(Path(m.model))}


def _quantization(model: Path) -> dict[str, Any] | None:
    """The model's quantization block (bits, group size, per-layer overrides), None if unquantized."""
    config = model / "config.json"
    if not config.is_file():
        return {"source": "gguf"} if model.suffix == ".gguf" else None
    return json.loads(config.read_text()).get("quantization")
