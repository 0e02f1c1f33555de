"""Run benchmark configurations, each in a fresh process, with a progress bar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

from tqdm.auto import tqdm

from ..errors import MlxInferError
from .measure import Measurement, RunSpec, Spread
from .worker import RESULT_PREFIX


class BenchmarkError(MlxInferError):
    """A benchmark configuration failed to run."""


def run_all(specs: list[RunSpec], timeout_s: float = 1800.0, progress: bool = True) -> list[Measurement]:
    """Measure every spec in its own process; order is kept."""
    results = []
    bar = tqdm(specs, desc="benchmark", unit="config", disable=not progress)
    for spec in bar:
        bar.set_postfix_str(f"{spec.engine} {spec.label} {spec.mode}")
        results.append(run_one(spec, timeout_s))
    return results


def run_one(spec: RunSpec, timeout_s: float) -> Measurement:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "mlxinfer.speed.worker"],
            input=json.dumps(asdict(spec)),
            env={**os.environ, **spec.env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"{spec.engine} on {spec.model} ran past {timeout_s:.0f} s") from None
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_PREFIX)), None)
    if done.returncode != 0 or line is None:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchmarkError(f"{spec.engine} on {spec.model} failed: {last}")
    return measurement_from_dict(json.loads(line[len(RESULT_PREFIX) :]))


def measurement_from_dict(data: dict) -> Measurement:
    spreads = {k: Spread(**v) for k, v in data.items() if isinstance(v, dict) and set(v) == {"median", "min", "max"}}
    return Measurement(**{**data, **spreads})
