"""mlxinfer.convert: Hugging Face checkpoints, Hub ids and GGUF files to MLX model folders.

Installed as `mlxinfer.convert` (the folder stays at the repository's top level).
Streams tensor by tensor, writes atomically, and reports what quantization cost.
"""

from .pipeline import ConversionPlan, ConversionResult, ConvertSettings, convert, plan_conversion, run_conversion

__all__ = ["ConversionPlan", "ConversionResult", "ConvertSettings", "convert", "plan_conversion", "run_conversion"]
