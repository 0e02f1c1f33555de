"""Data files shipped with mlxinfer.

prose.txt: the opening of Jane Austen's *Pride and Prejudice* (1813, public domain),
used as the benchmark prompt and as evaluation text for quantization.
calibration.txt: openings of other public-domain works (Dickens, Melville, Lincoln,
Conan Doyle, Carroll, the Declaration of Independence, Thoreau, Wells; typed from memory,
so wording may differ slightly from any edition), the text quantization is fitted on,
kept apart from the text it is judged on.
"""

from importlib import resources


def prose_text() -> str:
    """A few KB of real English prose that anyone may redistribute."""
    return resources.files(__name__).joinpath("prose.txt").read_text(encoding="utf-8")


def calibration_text() -> str:
    """Public-domain prose for fitting quantization, distinct from prose_text()."""
    return resources.files(__name__).joinpath("calibration.txt").read_text(encoding="utf-8")
