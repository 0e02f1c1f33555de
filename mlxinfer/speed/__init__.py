"""Speed measurement shared by `mlxinfer bench` and the repository's bench/ harness.

Each configuration runs in its own process (`python -m mlxinfer.speed.worker`) so
peak memory and warm-up are measured per engine, not inherited from the last one.
"""

from .engines import ENGINES
from .measure import Measurement, RunSpec, Spread

__all__ = ["ENGINES", "Measurement", "RunSpec", "Spread"]
