"""One file per model family, named for its model_type (close variants share one, see models/registry.py's
SHARED_FILES). Top to bottom: transformers' defaults, the config checks, the layers over mlx-lm's blocks, the
weight renames, llama.cpp's GGUF conventions where we read them, and last `SPECS`, the registry row naming them.

models/registry.py imports a file by name when a config asks for its family; nothing in models/ imports one
statically. Pieces two families share live in models/ (shared_layers.py, config_rules.py, moe_weights.py).
"""
