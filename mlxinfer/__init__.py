"""mlxinfer: fast, lean, trustworthy LLM inference on Apple Silicon, built on MLX."""

# Importing leaves MLX as it is: OpenBLAS is routed in at the first model load on the CPU (blas.py).
from .api import GenerationResult, Model, load
from .engine import GenerationStats, SamplingParams

__version__ = "0.1.0"

from .resident_client import RemoteModel, connect  # noqa: E402 - after __version__, which the server reads

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "Model",
    "RemoteModel",
    "SamplingParams",
    "__version__",
    "connect",
    "load",
]
