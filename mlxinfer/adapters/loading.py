"""Adapters put on a loaded model: read, checked against the base, installed, and counted in what it holds."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import mlx.core as mx
import mlx.nn as nn

from ..errors import AdapterError
from ..models.loader import LoadedModel
from ..models.multimodal import WRAPPERS
from ..untrusted import shown
from .adapter_set import MAX_ADAPTERS, AdapterSet, install
from .reading import Adapter, LowRank, read_adapter

log = logging.getLogger(__name__)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # what a request names it by (`base:NAME` on the server)


def with_adapters(loaded: LoadedModel, paths: Mapping[str, str | Path]) -> LoadedModel:
    """`loaded` with the adapters in `paths` ({name: folder}) installed over it; its weights_bytes counts them."""
    if not isinstance(paths, Mapping):
        raise AdapterError(f"adapters must map names to folders, e.g. {{'sql': 'adapters/sql'}}; got {shown(paths)}")
    adapters = [_read(loaded, name, path) for name, path in paths.items()]
    installed = install(loaded.model, adapters, loaded.compute_dtype)
    installed.counted = installed.nbytes  # in the weights_bytes below: the planner and the server's budget count it
    log.info("%s: %d adapter(s) installed (%s), %.1f MB", loaded.path, len(adapters),
             ", ".join(f"{a.name}: {a.kind} rank {a.rank}, {len(a.modules)} modules" for a in adapters),
             installed.nbytes / 1e6)  # fmt: skip
    return replace(loaded, weights_bytes=loaded.weights_bytes + installed.nbytes)


def add_adapter(loaded: LoadedModel, name: str, path: str | Path, limit: int = MAX_ADAPTERS) -> Adapter:
    """One more adapter over `loaded` (which may have none yet), removing the least recently used idle one past
    `limit`; BusyError when all of `limit` are running requests."""
    adapter = _read(loaded, name, path)
    adapters = getattr(loaded.model, "adapters", None)
    if adapters is None:  # the first: a set of one (two threads never get here at once: the device thread loads)
        loaded.model.adapters = adapters = AdapterSet(loaded.model, loaded.compute_dtype)
    adapters.add(adapter, limit)
    log.info("%s: adapter %s loaded (%s rank %d, %d modules)", loaded.path, name, adapter.kind, adapter.rank,
             len(adapter.modules))  # fmt: skip
    return adapter


def _read(loaded: LoadedModel, name: str, path: str | Path) -> Adapter:
    if getattr(loaded.model, "sharded", False):
        raise AdapterError("adapters over a model split across ranks are not supported yet; serve it on one machine")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise AdapterError(f"adapter name {shown(name)}: use letters, digits, '_', '.' and '-' (at most 64)")
    adapter = named_as_in(read_adapter(path, name), loaded.model, loaded.config.spec.fused_outputs)
    _say_base(adapter, loaded)
    return adapter


# A vision-language model's text layers, under the names its checkpoint gives them -> the names they have here.
TEXT_PREFIXES = sorted(
    {pair for wrapper in WRAPPERS.values() for pair in wrapper.text_prefixes}, key=lambda p: -len(p[0])
)


def text_name(name: str) -> str:
    """A tensor or module name with a vision-language checkpoint's text prefix turned into this loader's."""
    return next((new + name[len(old) :] for old, new in TEXT_PREFIXES if name.startswith(old)), name)


def named_as_in(
    adapter: Adapter, model: nn.Module, fused_outputs: Mapping[str, tuple[str, ...]] = MappingProxyType({})
) -> Adapter:
    """`adapter` with its modules under this model's names: a vision-language checkpoint's adapter names the text
    layers as its checkpoint does ("language_model.model.layers.0..."), which this loader renames; a fused layer
    the runtime splits by output rows (the family's `fused_outputs`) splits its pair the same way."""
    here = {name for name, _ in model.named_modules()}

    def renamed(path: str) -> str:
        return path if path in here else text_name(path)

    modules: dict[str, LowRank] = {}
    for path, pair in adapter.modules.items():
        path = renamed(path)
        fused = next((k for k in fused_outputs if path.endswith("." + k)), None) if path not in here else None
        parts = [path[: -len(fused)] + p for p in fused_outputs[fused]] if fused is not None else []
        if parts and all(p in here for p in parts):
            modules.update(zip(parts, _split_outputs(pair, len(parts))))
        else:
            modules[path] = pair
    saved = {f"{renamed(k.rsplit('.', 1)[0])}.{k.rsplit('.', 1)[1]}": v for k, v in adapter.replaced.items()}
    return replace(adapter, modules=modules, replaced=saved)


def _split_outputs(pair: LowRank, parts: int) -> list[LowRank]:
    """`pair` on a fused layer as one pair per equal block of its output rows (DoRA's magnitudes per row too)."""
    bs = mx.split(pair.b, parts, axis=-1)
    ms = mx.split(pair.magnitude, parts) if pair.magnitude is not None else [None] * parts
    return [LowRank(pair.a, b, m) for b, m in zip(bs, ms)]


def _say_base(adapter: Adapter, loaded: LoadedModel) -> None:
    """A warning where the adapter names a base model that is not this one's (shapes that fit may still differ in
    what the weights mean: a 4-bit copy of the right base fits, and so does another fine-tune of it)."""
    named = adapter.base_model
    if not named:
        return
    stem = Path(named.rstrip("/")).name.lower()
    ours = loaded.path.stem.lower()
    if stem and stem not in ours and ours not in stem:
        log.warning("%s: trained on %s, loaded over %s; its shapes fit, so it runs", adapter.path, named, loaded.path)
