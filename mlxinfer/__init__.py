"""mlxinfer: fast, lean, trustworthy LLM inference on Apple Silicon, built on MLX."""

from .api import GenerationResult, Model, load
from .engine import GenerationStats, SamplingParams

__version__ = "0.1.0"

__all__ = ["GenerationResult", "GenerationStats", "Model", "SamplingParams", "__version__", "load"]
