"""The user's models: where they are (the models folder, the caches, files added by hand) and what each is."""

from .catalog import disk_bytes, local_models, models_dir
from .listing import (
    ADDED,
    CACHE,
    LocalModel,
    add_model,
    chat_template,
    describe,
    details,
    find_model,
    hf_cache_dir,
    list_models,
    record_use,
    remove_model,
)

__all__ = [
    "ADDED",
    "CACHE",
    "LocalModel",
    "add_model",
    "chat_template",
    "describe",
    "details",
    "disk_bytes",
    "find_model",
    "hf_cache_dir",
    "list_models",
    "local_models",
    "models_dir",
    "record_use",
    "remove_model",
]
