"""Run benchmark configurations, each in a fresh process, with a progress bar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict

import mlx.core as mx
from tqdm.auto import tqdm

from ..errors import MlxInferError
from .measure import Measurement, RunSpec, Spread
from .worker import PROGRESS_PREFIX, RESULT_PREFIX


class BenchmarkError(MlxInferError):
    """A benchmark configuration failed to run."""


def run_all(specs: list[RunSpec], timeout_s: float = 1800.0, progress: bool = True) -> list[Measurement]:
    """Measure every spec in its own process; order is kept. The bar shows each configuration's progress and an
    estimate of its time left as its worker reports them."""
    results = []
    bar = tqdm(specs, desc="benchmark", unit="config", disable=not progress)
    for spec in bar:
        name = f"{spec.engine} {spec.label} {spec.mode}"
        bar.set_postfix_str(f"{name}: loading{slow_note(spec)}")
        results.append(run_one(spec, timeout_s, lambda line, name=name: bar.set_postfix_str(f"{name}: {line}")))
    return results


def slow_note(spec: RunSpec) -> str:
    """Why a configuration may take minutes here: mlx-lm's own dtype choice keeps quantized weights, which MLX's
    CPU backend multiplies without BLAS (mlxinfer's default dequantizes them on a CPU where that is faster)."""
    if spec.engine == "mlx-lm" and spec.mode == "default" and mx.default_device() == mx.cpu:
        return " (mlx-lm's quantized layers run without BLAS on a CPU: minutes per configuration here)"
    return ""


def run_one(spec: RunSpec, timeout_s: float, report: Callable[[str], None] = lambda line: None) -> Measurement:
    """One spec in a worker process: its progress lines to `report` as they come, its result parsed."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "mlxinfer.speed.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **spec.env},
        text=True,
    )
    errors: list[str] = []
    drain = threading.Thread(target=lambda: errors.extend(worker.stderr), daemon=True)  # never blocks the worker
    drain.start()
    timed_out = threading.Event()
    timer = threading.Timer(timeout_s, lambda: (timed_out.set(), worker.kill()))
    timer.start()
    line = None
    try:
        worker.stdin.write(json.dumps(asdict(spec)))
        worker.stdin.close()
        for out in worker.stdout:
            if out.startswith(PROGRESS_PREFIX):
                report(out[len(PROGRESS_PREFIX) :].strip())
            elif out.startswith(RESULT_PREFIX):
                line = out
        worker.wait()
    finally:
        timer.cancel()
        if worker.poll() is None:  # the caller was interrupted: the worker does not outlive it
            worker.kill()
        drain.join(timeout=5)
    if timed_out.is_set():
        raise BenchmarkError(f"{spec.engine} on {spec.model} ran past {timeout_s:.0f} s")
    if worker.returncode != 0 or line is None:
        last = ("".join(errors).strip().splitlines() or ["no output"])[-1]
        raise BenchmarkError(f"{spec.engine} on {spec.model} failed: {last}")
    return measurement_from_dict(json.loads(line[len(RESULT_PREFIX) :]))


def measurement_from_dict(data: dict) -> Measurement:
    spreads = {k: Spread(**v) for k, v in data.items() if isinstance(v, dict) and set(v) == {"median", "min", "max"}}
    return Measurement(**{**data, **spreads})
