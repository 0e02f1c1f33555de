"""mlxinfer: fast, lean, trustworthy LLM inference on Apple Silicon, built on MLX."""

from . import blas

blas.activate()  # before any matmul: MLX's CPU GEMMs reach OpenBLAS on Linux (see blas.py)

from .api import GenerationResult, Model, load  # noqa: E402
from .engine import GenerationStats, SamplingParams  # noqa: E402

__version__ = "0.1.0"

from .remote import RemoteModel, connect  # noqa: E402 - after __version__, which the server reads

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
