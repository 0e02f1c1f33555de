"""The user's models: where they are (the models folder, the caches, files added by hand) and what each is.

catalog: models in a folder and their size · hf_cache: the Hugging Face hub cache · state: the added models and
last uses (two small JSON files) · local_model: what one model is · listing: ls, find, add, rm · copying: cp ·
show: details, chat template and sampling."""

from .catalog import disk_bytes, find_adapter, local_adapters, local_models, model_name, models_dir
from .copying import copy_model
from .hf_cache import hf_cache_dir
from .listing import add_model, find_model, list_models, located, remove_model
from .local_model import ADDED, CACHE, HF_CACHE, LocalModel, describe
from .show import chat_template, details, sampling_of
from .state import record_use

__all__ = [
    "ADDED",
    "CACHE",
    "HF_CACHE",
    "LocalModel",
    "add_model",
    "chat_template",
    "copy_model",
    "describe",
    "details",
    "disk_bytes",
    "find_adapter",
    "local_adapters",
    "find_model",
    "hf_cache_dir",
    "list_models",
    "local_models",
    "located",
    "model_name",
    "models_dir",
    "record_use",
    "remove_model",
    "sampling_of",
]
