"""One benchmark configuration: load an engine, time cold and warm runs, summarize."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..memory import peak_rss_bytes
from .engines import ENGINES


@dataclass(frozen=True)
class Spread:
    """Median, min and max of repeated measurements."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))


@dataclass
class RunSpec:
    """What to measure: an engine on a model, with a dtype and sizes."""

    engine: str  # "mlxinfer" or "mlx-lm"
    model: str
    label: str  # e.g. "4-bit"
    mode: str  # "default" (the engine's own dtype choice) or "matched"
    dtype: str | None
    prompt_ids: list[int]
    decode_tokens: int
    runs: int = 3
    budget_s: float = 120.0  # warm runs stop once this much time is spent
    overhead_steps: int = 8
    env: dict[str, str] = field(default_factory=dict)  # for the worker process, e.g. MLXINFER_CPU_WEIGHTS


@dataclass
class Measurement:
    """Results of one RunSpec; rates in tokens per second."""

    engine: str
    model: str
    label: str
    mode: str
    compute_dtype: str
    prompt_tokens: int
    decode_tokens: int
    warm_runs: int
    load_s: float
    ttft_cold_s: float
    prefill_tps: Spread
    decode_tps: Spread
    decode_step_s: Spread
    model_step_s: float
    engine_overhead: float  # decode step / bare model step
    weights_bytes: int
    decode_weights_bytes: int  # read per decoded token (MoE: the routed experts only)
    peak_memory_bytes: int  # MLX allocator peak
    peak_rss_bytes: int  # whole process
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(spec: RunSpec, report: Callable[[str], None] = lambda line: None) -> Measurement:
    """Run `spec` in this process (use a fresh process per spec for honest memory figures); `report` hears where
    it is and how long the rest should take, after the load and after each run."""
    start = time.perf_counter()
    engine = ENGINES[spec.engine](Path(spec.model), spec.dtype)
    load_s = time.perf_counter() - start
    report(f"loaded in {load_s:.0f} s; a first run of {spec.decode_tokens} tokens")
    mx.reset_peak_memory()
    cold = _one_run(engine, spec)
    warm = []
    spent = 0.0
    while len(warm) < spec.runs and (not warm or spent + warm[-1]["total_s"] <= spec.budget_s):
        last = warm[-1] if warm else cold
        left = min(spec.runs - len(warm), max(1, int(spec.budget_s // max(last["total_s"], 1e-9))))
        report(f"run {len(warm) + 1} of {spec.runs}: {spec.decode_tokens / last['total_s']:.1f} tok/s, "
               f"about {left * last['total_s']:.0f} s left")  # fmt: skip
        warm.append(_one_run(engine, spec))
        spent += warm[-1]["total_s"]
    model_step = engine.model_step_s(spec.prompt_ids, spec.overhead_steps)
    step = Spread.of([r["step_s"] for r in warm])
    return Measurement(
        engine=spec.engine,
        model=spec.model,
        label=spec.label,
        mode=spec.mode,
        compute_dtype=engine.compute_dtype,
        prompt_tokens=len(spec.prompt_ids),
        decode_tokens=spec.decode_tokens,
        warm_runs=len(warm),
        load_s=load_s,
        ttft_cold_s=cold["ttft_s"],
        prefill_tps=Spread.of([len(spec.prompt_ids) / r["ttft_s"] for r in warm]),
        decode_tps=Spread.of([1.0 / r["step_s"] for r in warm]),
        decode_step_s=step,
        model_step_s=model_step,
        engine_overhead=step.median / model_step,
        weights_bytes=engine.weights_bytes,
        decode_weights_bytes=engine.decode_weights_bytes,
        peak_memory_bytes=mx.get_peak_memory(),
        peak_rss_bytes=peak_rss_bytes(),
    )


def _one_run(engine: Any, spec: RunSpec) -> dict[str, float]:
    start, times = engine.token_times(spec.prompt_ids, spec.decode_tokens)
    steps = [b - a for a, b in zip(times, times[1:])]
    return {
        "ttft_s": times[0] - start,
        "step_s": statistics.median(steps) if steps else float("nan"),
        "total_s": times[-1] - start,
    }
