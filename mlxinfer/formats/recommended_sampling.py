"""The sampling a model's authors recommend, read from generation_config.json's fields or a GGUF's metadata.

A request's own fields win; a field the model states fills one the request leaves out (vLLM's behaviour); a
field neither states takes mlxinfer's one default (`engine.sampling.SamplingParams`: greedy). transformers'
`do_sample: false` means greedy whatever else the file says, and `do_sample: true` with no temperature samples
at transformers' temperature 1. The values' ranges are checked where they are used, by SamplingParams.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..defaults import DEFAULT_SAMPLING
from ..errors import ConfigError
from ..untrusted import is_finite_number, shown

GENERATION_CONFIG = "generation_config.json"
FIELDS = tuple(DEFAULT_SAMPLING)
# llama.cpp's convert_hf_to_gguf.py writes generation_config.json's fields under these keys.
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
GGUF_SOURCE = "the GGUF's general.sampling keys"
TRANSFORMERS_TEMPERATURE = 1.0  # GenerationConfig's temperature when a file asks to sample and names none


@dataclass(frozen=True)
class SamplingDefaults:
    """The fields a model states (only those) and what states them ("" when nothing does)."""

    values: Mapping[str, float | int] = field(default_factory=dict)
    source: str = ""

    @property
    def in_force(self) -> dict[str, float | int]:
        """Every field a request that gives none samples with: the model's, else mlxinfer's default."""
        return {**DEFAULT_SAMPLING, **self.values}

    def describe(self) -> str:
        """One line for `show` and the load line: the fields in force that are not mlxinfer's default, and their
        source, e.g. "temperature 0.7, top_p 0.8 (from generation_config.json)"."""
        force = self.in_force
        shown_fields = [f"{name} {value:g}" for name, value in force.items() if value != DEFAULT_SAMPLING[name]]
        text = ", ".join(shown_fields if force["temperature"] else ["greedy", *shown_fields])
        return f"{text} (from {self.source})" if self.source else f"{text} (mlxinfer's default: the model names none)"


def from_generation_config(generation: Mapping[str, Any], source: str) -> SamplingDefaults:
    """The sampling fields of a parsed generation_config.json (`source` names it in errors).

    Example:
        >>> from_generation_config({"do_sample": True, "top_p": 0.9}, "generation_config.json").values
        {'temperature': 1.0, 'top_p': 0.9}
    """
    do_sample = generation.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ConfigError(f"{source}: do_sample must be true or false, got {shown(do_sample)}")
    if do_sample is False:  # transformers decodes greedily and ignores the rest
        return SamplingDefaults({"temperature": 0.0}, GENERATION_CONFIG)
    values = {name: _number(generation.get(name), name, source) for name in FIELDS}
    values = {name: value for name, value in values.items() if value is not None}
    if do_sample and "temperature" not in values:
        values["temperature"] = TRANSFORMERS_TEMPERATURE
    return SamplingDefaults(_normalized(values, source), GENERATION_CONFIG if values else "")


def from_gguf_metadata(metadata: Mapping[str, Any], source: str) -> SamplingDefaults:
    """The sampling fields llama.cpp's converter wrote into a GGUF's metadata."""
    values = {name: _number(metadata.get(key), key, source) for key, name in GGUF_KEYS.items()}
    values = {name: value for name, value in values.items() if value is not None}
    return SamplingDefaults(_normalized(values, source), GGUF_SOURCE if values else "")


def _number(value: Any, name: str, source: str) -> float | int | None:
    if value is None:
        return None
    if not is_finite_number(value) or isinstance(value, bool):
        raise ConfigError(f"{source}: {name} must be a finite number, got {shown(value)}")
    return value


def _normalized(values: dict[str, Any], source: str) -> dict[str, float | int]:
    out: dict[str, float | int] = {name: float(value) for name, value in values.items() if name != "top_k"}
    if "top_k" in values:
        top_k = values["top_k"]
        if top_k != int(top_k):
            raise ConfigError(f"{source}: top_k must be a whole number, got {shown(top_k)}")
        out["top_k"] = max(0, int(top_k))  # transformers' 0 and llama.cpp's -1 both mean "no top-k"
    return {name: out[name] for name in FIELDS if name in out}
