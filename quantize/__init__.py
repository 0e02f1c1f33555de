"""mlxinfer.quantize: quantization methods and their quality measurement.

Installed as `mlxinfer.quantize` (the folder stays at the repository's top level).
"""

from .affine import quantize_rows
from .quality import QualityReport, compare_models, perplexity
from .recipes import RECIPES, LayerQuant, Recipe, make_recipe

__all__ = [
    "RECIPES",
    "LayerQuant",
    "QualityReport",
    "Recipe",
    "compare_models",
    "make_recipe",
    "perplexity",
    "quantize_rows",
]
