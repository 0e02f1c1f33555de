"""Model loading: config normalization, checkpoint files, architectures."""

from .config import ModelConfig, normalize_config
from .loader import LoadedModel, load_model

__all__ = ["LoadedModel", "ModelConfig", "load_model", "normalize_config"]
