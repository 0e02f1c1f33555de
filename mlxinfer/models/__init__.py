"""Model loading: config normalization, checkpoint files, architectures."""

from .config import ModelConfig, normalize_config
from .loader import LoadedModel, load_model, load_tokenizer

__all__ = [
    "LoadedModel",
    "ModelConfig",
    "load_model",
    "load_tokenizer",
    "normalize_config",
]
