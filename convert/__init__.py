"""mlxinfer.convert: Hugging Face and GGUF checkpoints to MLX model folders.

Installed as `mlxinfer.convert` (the folder stays at the repository's top level).
The converter itself is tracked in its own issue; today this package is empty.
"""
