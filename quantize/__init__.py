"""mlxinfer.quantize: quantization methods and their quality measurement.

Installed as `mlxinfer.quantize` (the folder stays at the repository's top level).
The methods are tracked in the converter issue; today this package is empty.
"""
