"""Model loading: config normalization, checkpoint files, architectures."""

from .catalog import disk_bytes, local_models, models_dir
from .config import ModelConfig, normalize_config
from .loader import LoadedModel, load_model, load_tokenizer

__all__ = [
    "LoadedModel",
    "ModelConfig",
    "disk_bytes",
    "load_model",
    "load_tokenizer",
    "local_models",
    "models_dir",
    "normalize_config",
]
