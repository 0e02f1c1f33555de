"""The adapters over one model: their slots, placing one (at load, or later while the model serves), removing the
least recently used idle one when a server's limit is reached, and which are running requests now.

Placing checks the whole adapter against the model first, so a misfit changes nothing. The stacks are swapped
under `lock`, which every forward pass with adapter rows holds while it is built (rows.selected).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import AdapterError, BusyError
from ..models.quantized import dense_weight, unpacked_columns
from ..untrusted import listed, shown
from .experts import PROJECTIONS, ExpertRows, expert_dims
from .latent import KEYS, SPLIT, VALUES, LatentRows, split_dims
from .reading import Adapter, LowRank
from .rows import BASE, KEY_SPACE, NO_ADAPTER, Chosen, LowRankRows, ReplacedRows, Selection, linear_dims

MAX_ADAPTERS = 64  # over one base; each adds a slot to every adapted module
RETRY_S = 1  # what a request refused while every adapter slot runs others is told to wait
LINEAR = (nn.Linear, nn.QuantizedLinear)
WHOLE = (*LINEAR, nn.Embedding, nn.QuantizedEmbedding)  # what PEFT's modules_to_save may replace here
WRAPPERS = (LowRankRows, ReplacedRows, ExpertRows, LatentRows)


class AdapterSet:
    """The adapters installed in one model: slot i + 1 holds `adapters[i]` (None: free)."""

    def __init__(self, model: nn.Module, dtype: mx.Dtype):
        self._model, self.dtype = model, dtype
        self.adapters: list[Adapter | None] = []
        self.selection = Selection()
        self.lock = threading.RLock()  # held while a pass with adapter rows is built, and while stacks are set
        self._placing = threading.Lock()  # one adapter placed or removed at a time
        self._running: Counter[int] = Counter()  # requests running with each slot
        self._used_at: dict[int, float] = {}
        self.nbytes = 0  # what the slots hold: the stacked pairs (padded ranks, the base's zero slot) and copies
        self.counted = 0  # of it, what the model's footprint counts (the adapters it was loaded with)

    @property
    def loaded(self) -> list[Adapter]:
        return [a for a in self.adapters if a is not None]

    @property
    def uncounted(self) -> int:
        """Bytes the adapters loaded since the model's footprint was taken hold beyond it."""
        return max(0, self.nbytes - self.counted)

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (None: the bare base)."""
        if name is None:
            return BASE
        for i, adapter in enumerate(self.adapters):
            if adapter is not None and adapter.name == name:
                return i + 1
        names = listed([a.name for a in self.loaded])
        raise AdapterError(f"no adapter named {shown(name)} is loaded; loaded: {names}")

    def choose(self, name: str | None) -> Chosen:
        """What a request for adapter `name` runs with (None: the bare base)."""
        slot = self.slot(name)
        adapter = self.adapters[slot - 1] if slot != BASE else None
        return Chosen(slot, int(adapter.digest[:15], 16) % KEY_SPACE or 1) if adapter is not None else NO_ADAPTER

    def take(self, name: str | None) -> Chosen:
        """`choose`, and the adapter counted as running a request (never removed) until `give_back`."""
        with self.lock:
            chosen = self.choose(name)
            self._running[chosen.slot] += 1
            self._used_at[chosen.slot] = time.monotonic()
            return chosen

    def give_back(self, chosen: Chosen) -> None:
        with self.lock:
            self._running[chosen.slot] -= 1
            self._used_at[chosen.slot] = time.monotonic()

    def add(self, adapter: Adapter, limit: int = MAX_ADAPTERS) -> int:
        """Place `adapter` in a free slot (removing the least recently used idle adapter past `limit`); its slot.
        BusyError when every one of `limit` adapters is running a request."""
        with self._placing:
            if any(a.name == adapter.name for a in self.loaded):
                raise AdapterError(f"an adapter named {shown(adapter.name)} is loaded already")
            self._check(adapter)
            self._make_room(min(limit, MAX_ADAPTERS))
            slot = next((i + 1 for i, a in enumerate(self.adapters) if a is None), len(self.adapters) + 1)
            self._place(slot, adapter)
            with self.lock:
                self.adapters[slot - 1 : slot] = [adapter]
                self._used_at[slot] = time.monotonic()
            return slot

    def remove(self, name: str) -> None:
        """Free adapter `name`'s slot (it must not be running a request)."""
        with self._placing:
            self._remove(name)

    def _remove(self, name: str) -> None:
        with self.lock:  # a request taking it now would find it gone, never half-removed
            slot = self.slot(name)
            if self._running[slot]:
                raise BusyError(f"adapter {shown(name)} is running a request; remove it once it is idle", RETRY_S)
            self.adapters[slot - 1] = None
        self._place(slot, None)

    def _make_room(self, limit: int) -> None:
        while len(self.loaded) >= limit:
            idle = [s for s, a in enumerate(self.adapters, start=1) if a is not None and not self._running[s]]
            if not idle:
                raise BusyError(f"all {limit} adapters this model keeps loaded are running requests; retry shortly",
                                RETRY_S)  # fmt: skip
            self._remove(self.adapters[min(idle, key=lambda s: self._used_at.get(s, 0.0)) - 1].name)

    def _place(self, slot: int, adapter: Adapter | None) -> None:
        """Write `adapter`'s pairs and copies into `slot` of every wrapper (None: empty the slot), wrapping the
        modules it is the first to adapt. The new stacks are made and evaluated first; only setting them, between
        two passes, holds `lock` (a pass being built waits that long, not for the adapter's loading)."""
        modules = dict(self._model.named_modules())
        pairs = adapter.modules if adapter is not None else {}
        # MLA's kv_b_proj, which this model holds as its two halves: by the attention layer
        latent = {p.rsplit(".", 1)[0]: pair for p, pair in pairs.items() if p.endswith(SPLIT) and p not in modules}
        low = {path: pair for path, pair in pairs.items() if not pair.per_expert and path in modules}
        experts: dict[str, dict[str, LowRank]] = {}  # an MoE layer -> its projections' per-expert pairs
        for path, pair in pairs.items():
            if pair.per_expert:
                layer, name = path.rsplit(".", 1)
                experts.setdefault(layer, {})[name] = pair
        saved = {k.rsplit(".", 1)[0] for k in adapter.replaced} if adapter is not None else set()
        wraps = {p: LowRankRows(modules[p], self.selection, self.dtype) for p in low if type(modules[p]) in LINEAR}
        wraps |= {p: ExpertRows(modules[p], self.selection, self.dtype) for p in experts if _is_glu(modules[p])}
        wraps |= {p: ReplacedRows(modules[p], self.selection) for p in saved if type(modules[p]) in WHOLE}
        for attention in latent:
            for role in (KEYS, VALUES):
                path = f"{attention}.{role}"
                if not isinstance(modules[path], LatentRows):
                    wraps[path] = LatentRows(modules[path], role, self.selection, self.dtype)
        slots = max(slot, len(self.adapters)) + 1  # every slot a running row may index
        staged = []
        for path, module in {**modules, **wraps}.items():
            if isinstance(module, LowRankRows):
                weight = lambda m=module: dense_weight(m.base)  # noqa: E731 - DoRA's, read only where needed
                staged.append((module, module.staged(slot, slots, low.get(path), self.dtype, weight)))
            elif isinstance(module, ExpertRows):
                staged.append((module, module.staged(slot, slots, experts.get(path, {}), self.dtype)))
            elif isinstance(module, LatentRows):
                staged.append((module, module.staged(slot, slots, latent.get(path.rsplit(".", 1)[0]), self.dtype)))
            elif isinstance(module, ReplacedRows):
                copy = _copy(module.base, path, adapter, self.dtype) if adapter is not None else None
                staged.append((module, module.staged(slot, copy)))
        with self.lock:
            for module, values in staged:
                for key, value in values.items():
                    setattr(module, key, value)
            if wraps:
                self._model.update_modules(tree_unflatten(list(wraps.items())))
        wrappers = [m for _, m in self._model.named_modules() if isinstance(m, WRAPPERS)]
        self.nbytes = sum(
            v.nbytes for w in wrappers for k, v in tree_flatten(w.parameters()) if not k.startswith("base.")
        )

    def _check(self, adapter: Adapter) -> None:
        """Every module the adapter names is one this model has, of the shape the adapter's tensors say."""
        modules = dict(self._model.named_modules())
        for path, pair in sorted(adapter.modules.items()):  # the first layer that differs is named
            if pair.per_expert:
                out_dims, in_dims = _check_experts(adapter, path, pair, modules)
            elif path.endswith(SPLIT) and path not in modules and split_dims(modules.get(path.rsplit(".", 1)[0])):
                if pair.magnitude is not None:
                    raise AdapterError(f"{adapter.path}: DoRA on {path} (split here into per-head halves) is not "
                                       "applied yet")  # fmt: skip
                in_dims, out_dims = split_dims(modules[path.rsplit(".", 1)[0]])
            else:
                module = _unwrapped(modules.get(path))
                if type(module) not in LINEAR:
                    _misfit(adapter, path, module, modules)
                out_dims, in_dims = linear_dims(module)
            if pair.a.shape[-2] != in_dims or pair.b.shape[-1] != out_dims:
                raise AdapterError(f"{adapter.path}: {path} maps {pair.a.shape[-2]} -> {pair.b.shape[-1]} features in "
                                   f"the adapter but {in_dims} -> {out_dims} in the model; it was trained for "
                                   "another base model")  # fmt: skip
        for name, value in adapter.replaced.items():
            path, param = name.rsplit(".", 1)
            module = _unwrapped(modules.get(path))
            if type(module) not in WHOLE:
                what = f"a {type(module).__name__}" if module is not None else "which this model does not have"
                raise AdapterError(f"{adapter.path}: replaces {path}, {what} (a tied head?); only linear layers and "
                                   "embeddings can be")  # fmt: skip
            shape = _whole_shape(module)
            if param not in ("weight", "bias") or (param == "weight" and tuple(value.shape) != shape):
                raise AdapterError(f"{adapter.path}: its {name} is {tuple(value.shape)}; the model's {path} is {shape}")


def install(model: nn.Module, adapters: Sequence[Adapter], dtype: mx.Dtype) -> AdapterSet:
    """Wrap the modules `adapters` target in `model` (in place), their pairs held in `dtype`; `model.adapters`."""
    names = [a.name for a in adapters]
    if len(set(names)) != len(names) or not 0 < len(names) <= MAX_ADAPTERS:
        raise AdapterError(f"adapters need 1 to {MAX_ADAPTERS} distinct names, got {listed(names)}")
    if getattr(model, "adapters", None) is not None:
        raise AdapterError("this model already has adapters installed; load the base again for another set")
    installed = AdapterSet(model, dtype)
    for adapter in adapters:
        installed.add(adapter)
    model.adapters = installed
    return installed


def _unwrapped(module: nn.Module | None) -> nn.Module | None:
    return module.base if isinstance(module, WRAPPERS) else module


def _is_glu(module: nn.Module | None) -> bool:
    """mlx-lm's SwitchGLU: an MoE layer's experts, stacked per projection (SwitchLinear or its quantized kind)."""
    return (
        module is not None
        and all(getattr(module, name, None) is not None for name in PROJECTIONS)
        and hasattr(module, "activation")
    )


def _check_experts(adapter: Adapter, path: str, pair: LowRank, modules: dict[str, nn.Module]) -> tuple[int, int]:
    """(out, in) of one expert of the projection `path` names, which must be an MoE layer's with as many experts."""
    layer, name = path.rsplit(".", 1)
    glu = _unwrapped(modules.get(layer))
    if not _is_glu(glu) or name not in PROJECTIONS:
        raise AdapterError(f"{adapter.path}: has per-expert pairs for {path}, which is not an MoE layer's "
                           "projection in this model; it was trained for another architecture")  # fmt: skip
    experts = getattr(glu, name).weight.shape[0]
    if pair.a.shape[0] != experts:
        raise AdapterError(f"{adapter.path}: {path} has pairs for {pair.a.shape[0]} experts; the model's layer has "
                           f"{experts}: it was trained for another base model")  # fmt: skip
    return expert_dims(glu, name)


def _misfit(adapter: Adapter, path: str, module: nn.Module | None, modules: dict[str, nn.Module]) -> None:
    if module is None:
        linear = [n for n, m in modules.items() if type(m) in LINEAR]
        like = next((n for n in linear if n.endswith("q_proj")), linear[0] if linear else "none")
        raise AdapterError(f"{adapter.path}: adapts {path}, which this model has no linear layer for (its "
                           f"layers are named like {like}): trained for another architecture, or a layer it "
                           "splits")  # fmt: skip
    raise AdapterError(f"{adapter.path}: adapts {path}, a {type(module).__name__}; adapters apply to linear layers "
                       "only yet")  # fmt: skip


def _whole_shape(module: nn.Module) -> tuple[int, int]:
    if type(module) in LINEAR:
        return linear_dims(module)
    return module.weight.shape[0], unpacked_columns(module)


def _copy(base: nn.Module, path: str, adapter: Adapter, dtype: mx.Dtype) -> nn.Module | None:
    """The adapter's own float copy of module `path` (PEFT's modules_to_save), or None if it keeps the base's."""
    params = {k.rsplit(".", 1)[1]: v.astype(dtype) for k, v in adapter.replaced.items() if k.rsplit(".", 1)[0] == path}
    if not params:
        return None
    rows, columns = _whole_shape(base)
    embedding = type(base) in (nn.Embedding, nn.QuantizedEmbedding)
    copy = nn.Embedding(rows, columns) if embedding else nn.Linear(columns, rows, bias="bias" in params)
    copy.update(params)
    return copy
