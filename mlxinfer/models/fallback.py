"""Architectures mlxinfer has not verified, run through mlx-lm's own model class: the *unverified* fallback.

A verified family (models/registry.py) runs our forward pass, checked against transformers. Any other
model_type that mlx-lm ships runs mlx-lm's `Model.__call__` whole, on our caches: they speak mlx-lm's
cache protocol (`update_and_fetch`, `offset`, `make_mask`, numbered state slots), so generation, the
prefix cache and the converter work unchanged. What cannot: batching (mlx-lm's masks know no per-row
padding here), so the engine runs such a model one request at a time and says so; a quantized KV cache,
which the loader refuses. The model is labelled unverified wherever it is named.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError, UnsupportedModelError
from ..formats.safetensors_header import MAX_DIM
from ..untrusted import first_line, is_finite_number, is_int, shown
from .mlx_lm_modules import model_module

UNVERIFIED = "unverified (mlx-lm's model code, not checked against transformers)"
FULL, SLIDING, RECURRENT = "full_attention", "sliding_attention", "linear_attention"
_MODULE_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")
# mlx-lm cache classes -> the layer kind our engine keeps for it (a RotatingKVCache is a window).
_CACHE_KINDS = {"KVCache": FULL, "RotatingKVCache": SLIDING, "ArraysCache": RECURRENT, "MambaCache": RECURRENT}


def mlx_lm_module_name(model_type: Any) -> str | None:
    """The mlx-lm module that builds `model_type` (its own renames applied), or None when mlx-lm has none."""
    if not isinstance(model_type, str) or not _MODULE_NAME.fullmatch(model_type):
        return None
    name = _remapping().get(model_type, model_type)
    folder = _mlx_lm_folder()
    if folder is None or not (folder / "models" / f"{name}.py").is_file():
        return None
    module = model_module(name)
    return name if hasattr(module, "Model") and hasattr(module, "ModelArgs") else None


@functools.cache
def _mlx_lm_folder() -> Path | None:
    spec = importlib.util.find_spec("mlx_lm")
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


@functools.cache
def _remapping() -> dict[str, str]:
    """mlx-lm's MODEL_REMAPPING (mistral -> llama, kimi_k2 -> deepseek_v3, ...), read from its source:
    importing mlx_lm.utils would import transformers."""
    folder = _mlx_lm_folder()
    source = (folder / "utils.py").read_text() if folder and (folder / "utils.py").is_file() else ""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MODEL_REMAPPING" for t in node.targets):
            value = ast.literal_eval(node.value)
            return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}
    return {}


class Unverified:
    """Mixed into mlx-lm's model class: the interface the engine uses of a DecoderLM (models/decoder.py).

    The model keeps mlx-lm's class and parameter names, so its checkpoints load as they are."""

    verified = False
    batchable = False  # mlx-lm's masks have no per-row left padding in our batches

    def hidden(
        self, tokens: mx.array, cache: list[Any] | None = None, images: Any = None, shifts: Any = None
    ) -> mx.array:
        """The logits themselves: mlx-lm's head may scale or cap them in ways only its __call__ knows. (No vision
        tower loads for these families, so `images` and `shifts` are always None.)"""
        return super().__call__(tokens, cache=cache)

    def head(self, h: mx.array) -> mx.array:
        return h

    @property
    def cache_kinds(self) -> tuple[tuple[str, int | None], ...]:
        return self._mlxinfer_kinds

    def mlx_sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        sanitize = getattr(super(), "sanitize", None)
        return sanitize(weights) if sanitize is not None else weights


def build_fallback(module_name: str, args: dict[str, Any], source: str) -> nn.Module:
    """mlx-lm's model for `args` (parameters still lazy), taught the engine's interface."""
    module = model_module(module_name)
    _check_args(module.ModelArgs, args, source)
    try:
        model = module.Model(module.ModelArgs.from_dict(dict(args)))
    except (TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
        raise UnsupportedModelError(
            f"{source}: mlx-lm's {module_name} module cannot build this config ({type(e).__name__}: "
            f"{first_line(e)}); the model is not supported"
        ) from e
    kinds = _cache_kinds(model, source, module_name)
    model.__class__ = type(f"Unverified{type(model).__name__}", (Unverified, type(model)), {})
    object.__setattr__(model, "_mlxinfer_kinds", kinds)  # outside the module tree: not a parameter
    object.__setattr__(model, "vocab_size", int(args["vocab_size"]))
    return model


def _check_args(model_args: type, args: dict[str, Any], source: str) -> None:
    """Refuse, naming the key, a value the module's ModelArgs cannot take: a null or a wrong type where it
    declares a plain int, float or bool (a bad config would otherwise fail deep inside the module)."""
    for f in dataclasses.fields(model_args):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if f.name not in args or kind not in _CHECKS:
            continue
        value = args[f.name]
        if not _CHECKS[kind](value):
            raise ConfigError(f"{source}: {f.name} must be {_WORDS[kind]}, got {shown(value)}")


_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: is_int(v) and -1 <= v <= MAX_DIM,
    "float": lambda v: is_finite_number(v) or v in (math.inf, -math.inf),
    "bool": lambda v: isinstance(v, bool),
}
_WORDS = {"int": "an integer from -1 to 2**31 - 1", "float": "a number", "bool": "true or false"}


def _cache_kinds(model: nn.Module, source: str, module_name: str) -> tuple[tuple[str, int | None], ...]:
    caches = model.make_cache() if hasattr(model, "make_cache") else [None] * len(model.layers)
    kinds = []
    for cache in caches:
        name = "KVCache" if cache is None else type(cache).__name__
        kind = _CACHE_KINDS.get(name)
        if kind is None or (kind == SLIDING and getattr(cache, "keep", 0)):
            raise UnsupportedModelError(
                f"{source}: mlx-lm's {module_name} keeps a layer in a {name}"
                f"{' with kept sink positions' if kind else ''}, which mlxinfer's engine cannot hold yet"
            )
        kinds.append((kind, int(cache.max_size) if kind == SLIDING else None))
    if not kinds:
        raise UnsupportedModelError(f"{source}: mlx-lm's {module_name} has no layers: {shown(caches)}")
    return tuple(kinds)
