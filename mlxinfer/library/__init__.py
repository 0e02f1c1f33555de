"""The user's models: where they are (the models folder, the caches, files added by hand) and what each is."""

from .catalog import disk_bytes, local_models, models_dir

__all__ = ["disk_bytes", "local_models", "models_dir"]
