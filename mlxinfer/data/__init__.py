"""Data files shipped with mlxinfer.

prose.txt: the opening of Jane Austen's *Pride and Prejudice* (1813, public domain),
used as the benchmark prompt and as calibration and evaluation text for quantization.
"""

from importlib import resources


def prose_text() -> str:
    """A few KB of real English prose that anyone may redistribute."""
    return resources.files(__name__).joinpath("prose.txt").read_text(encoding="utf-8")
