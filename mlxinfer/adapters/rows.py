"""Many adapters over one copy of the base model, chosen per row of each forward pass.

`install` wraps every module an adapter targets: the base module stays as loaded (quantized or not, held once),
and beside it the adapters' low-rank pairs are stacked by slot (slot 0 is the bare base, all zeros), ranks padded
with zeros to the largest. A forward pass run inside `selected(model, slots)` gives row i adapter `slots[i]`:
when every row has the same one (a prefill, a batch of one adapter) each wrapper does two small matmuls; when
rows differ, `mx.gather_mm` takes each row's pair in the same two calls, so requests for different adapters and
for the bare base decode in one batch. Outside `selected`, every row is the base.

DoRA rescales each output row by m / ||W + BA|| (mlx-lm's DoRALinear and PEFT alike): the factor depends only on
the weights, so it is computed once here, per slot.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import AdapterError
from ..untrusted import listed, shown
from .fused import dense_weight, dora_factor
from .reading import Adapter, LowRank

BASE = 0  # the slot of the bare base model
MAX_ADAPTERS = 64  # installed over one base; each adds a slot to every adapted module
KEY_SPACE = 1 << 62  # an adapter's prefix-cache keys are negative, as image tokens' are: never a real token id


@dataclass(frozen=True)
class Chosen:
    """The adapter a request runs with: its slot in the model, and what the prefix cache keys its tokens by."""

    slot: int = BASE
    key: int = 0  # from the adapter's digest (0: the bare base, whose keys are its token ids)

    def keyed(self, ids: list[int]) -> list[int]:
        """`ids` as the prefix cache keys them under this adapter: KV computed under one adapter is never
        resumed under another or the base (the key is the adapter's content, not its name or slot)."""
        if not self.key:
            return ids
        return [-1 - ((self.key + t) % KEY_SPACE) for t in ids]


NO_ADAPTER = Chosen()


class Selection:
    """Which adapter each row of the forward pass being built uses (read while the graph is built)."""

    def __init__(self) -> None:
        self.uniform: int | None = BASE  # every row's slot, when they share one
        self.slots: mx.array | None = None  # (rows,) int32, when they do not


class LowRankRows(nn.Module):
    """A linear layer plus, per row, its adapter's x @ a @ b (and DoRA's rescaling)."""

    def __init__(self, base: nn.Module, a: mx.array, b: mx.array, factor: mx.array | None, selection: Selection):
        super().__init__()
        self.base, self.a, self.b = base, a, b  # a: (slots, in, rank); b: (slots, rank, out)
        if factor is not None:
            self.factor = factor  # (slots, out)
        self._selection = selection

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        selection = self._selection
        if selection.uniform == BASE:
            return y
        z, factor = self._update(x, y.shape, selection)
        if factor is None:
            return y + z.astype(y.dtype)
        bias = self.base.get("bias")
        plain = y - bias if bias is not None else y
        out = ((plain + z) * factor).astype(y.dtype)
        return out + bias if bias is not None else out

    def _update(self, x: mx.array, shape: tuple[int, ...], selection: Selection) -> tuple[mx.array, mx.array | None]:
        """Each row's x @ a @ b and its DoRA factor (None: no adapter here is DoRA)."""
        dora = "factor" in self
        slot = selection.uniform
        if slot is not None:
            return (x @ self.a[slot]) @ self.b[slot], self.factor[slot] if dora else None
        slots = selection.slots
        rows = x if x.ndim == 3 else x[:, None]  # gather_mm takes (rows, positions, in)
        z = mx.gather_mm(mx.gather_mm(rows, self.a, rhs_indices=slots), self.b, rhs_indices=slots).reshape(shape)
        return z, self.factor[slots].reshape(-1, *([1] * (x.ndim - 2)), shape[-1]) if dora else None


class ReplacedRows(nn.Module):
    """A module some adapters replace whole (PEFT's modules_to_save): each row runs its own adapter's copy."""

    def __init__(self, base: nn.Module, copies: dict[int, nn.Module], selection: Selection):
        super().__init__()
        self.base = base
        self.copies = {str(slot): module for slot, module in copies.items()}
        self._selection = selection

    @property
    def weight(self) -> mx.array:  # what callers read a module's shape from (the vocabulary, say)
        return self.base.weight

    def __call__(self, x: mx.array) -> mx.array:
        return self._per_row(lambda module: module(x), x)

    def as_linear(self, x: mx.array) -> mx.array:
        return self._per_row(lambda module: module.as_linear(x), x)

    def _per_row(self, run, x: mx.array) -> mx.array:
        selection = self._selection
        if selection.uniform is not None:
            return run(self.copies.get(str(selection.uniform), self.base))
        out = run(self.base)
        for slot, module in self.copies.items():
            rows = (selection.slots == int(slot)).reshape(-1, *([1] * (out.ndim - 1)))
            out = mx.where(rows, run(module), out)
        return out


@dataclass
class AdapterSet:
    """The adapters installed in one model: slot i + 1 is `adapters[i]`."""

    adapters: tuple[Adapter, ...]
    selection: Selection
    nbytes: int  # what the installed slots hold (padded ranks and whole-module copies included)

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (None: the bare base)."""
        if name is None:
            return BASE
        for i, adapter in enumerate(self.adapters):
            if adapter.name == name:
                return i + 1
        names = listed([a.name for a in self.adapters])
        raise AdapterError(f"no adapter named {shown(name)} is loaded; loaded: {names}")

    def choose(self, name: str | None) -> Chosen:
        """What a request for adapter `name` runs with (None: the bare base)."""
        slot = self.slot(name)
        return Chosen(slot, int(self.adapters[slot - 1].digest[:15], 16) or 1) if slot != BASE else NO_ADAPTER


def install(model: nn.Module, adapters: Sequence[Adapter], dtype: mx.Dtype) -> AdapterSet:
    """Wrap the modules `adapters` target in `model` (in place); their pairs are held in `dtype`."""
    names = [a.name for a in adapters]
    if len(set(names)) != len(names) or not 0 < len(names) <= MAX_ADAPTERS:
        raise AdapterError(f"adapters need 1 to {MAX_ADAPTERS} distinct names, got {listed(names)}")
    if getattr(model, "adapters", None) is not None:
        raise AdapterError("this model already has adapters installed; load the base again for another set")
    modules = dict(model.named_modules())
    selection = Selection()
    wrapped, held = [], 0
    for path in sorted({p for a in adapters for p in a.modules}):
        module = _target(modules, path, adapters)
        pairs = [a.modules.get(path) for a in adapters]
        a, b, factor = _stacked(module, path, pairs, adapters, dtype)
        wrapped.append((path, LowRankRows(module, a, b, factor, selection)))
        held += a.nbytes + b.nbytes + (factor.nbytes if factor is not None else 0)
    for path in sorted({p.rsplit(".", 1)[0] for a in adapters for p in a.replaced}):
        copies = _copies(modules, path, adapters, dtype)
        wrapped.append((path, ReplacedRows(modules[path], copies, selection)))
        held += sum(v.nbytes for c in copies.values() for v in c.parameters().values())
    model.update_modules(tree_unflatten(wrapped))
    mx.eval(model.parameters())
    model.adapters = AdapterSet(tuple(adapters), selection, held)
    return model.adapters


@contextmanager
def selected(model: nn.Module, slots: Sequence[int]) -> Iterator[None]:
    """Forward passes built inside run row i with adapter `slots[i]` (one slot: every row); then the base again."""
    adapters: AdapterSet | None = getattr(model, "adapters", None)
    if adapters is None or not any(slots):
        yield
        return
    selection = adapters.selection
    same = all(s == slots[0] for s in slots)
    selection.uniform, selection.slots = (slots[0], None) if same else (None, mx.array(slots, dtype=mx.int32))
    try:
        yield
    finally:
        selection.uniform, selection.slots = BASE, None


def _target(modules: dict[str, nn.Module], path: str, adapters: Sequence[Adapter]) -> nn.Module:
    owner = next(a for a in adapters if path in a.modules)
    module = modules.get(path)
    if module is None:
        linear = [n for n, m in modules.items() if isinstance(m, nn.Linear | nn.QuantizedLinear)]
        like = next((n for n in linear if n.endswith("q_proj")), linear[0] if linear else "none")
        raise AdapterError(f"{owner.path}: adapts {path}, which this model has no linear layer for (its layers are "
                           f"named like {like}): trained for another architecture, or a layer it splits")  # fmt: skip
    if type(module) not in (nn.Linear, nn.QuantizedLinear):
        raise AdapterError(f"{owner.path}: adapts {path}, a {type(module).__name__}; adapters apply to linear "
                           "layers only yet")  # fmt: skip
    return module


def _stacked(
    module: nn.Module, path: str, pairs: list[LowRank | None], adapters: Sequence[Adapter], dtype: mx.Dtype
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Slot-stacked (slots, in, rank) and (slots, rank, out) pairs, slot 0 and unadapting adapters zero; DoRA's
    factors (slots, out), 1 where a slot rescales nothing (None if no adapter here is DoRA)."""
    out_dims, in_dims = _dims(module)
    rank = max(p.rank for p in pairs if p is not None)
    a = mx.zeros((len(pairs) + 1, in_dims, rank), dtype)
    b = mx.zeros((len(pairs) + 1, rank, out_dims), dtype)
    factors = [mx.ones((out_dims,), mx.float32)] * (len(pairs) + 1)
    weight = None
    for slot, (pair, adapter) in enumerate(zip(pairs, adapters), start=1):
        if pair is None:
            continue
        if pair.a.shape[0] != in_dims or pair.b.shape[1] != out_dims:
            raise AdapterError(f"{adapter.path}: {path} maps {pair.a.shape[0]} -> {pair.b.shape[1]} features in the "
                               f"adapter but {in_dims} -> {out_dims} in the model; it was trained for another "
                               "base model")  # fmt: skip
        a[slot, :, : pair.rank] = pair.a.astype(dtype)
        b[slot, : pair.rank] = pair.b.astype(dtype)
        if pair.magnitude is not None:
            weight = dense_weight(module) if weight is None else weight
            factors[slot] = dora_factor(weight, pair)
    dora = any(p is not None and p.magnitude is not None for p in pairs)
    return a, b, mx.stack(factors).astype(dtype) if dora else None


def _dims(module: nn.Module) -> tuple[int, int]:
    out_dims, columns = module.weight.shape
    return out_dims, columns * 32 // module.bits if isinstance(module, nn.QuantizedLinear) else columns


def _copies(modules: dict[str, nn.Module], path: str, adapters: Sequence[Adapter], dtype: mx.Dtype) -> dict:
    """Each replacing adapter's own copy of module `path`, by slot."""
    base = modules.get(path)
    copies = {}
    for slot, adapter in enumerate(adapters, start=1):
        params = {k.rsplit(".", 1)[1]: v for k, v in adapter.replaced.items() if k.rsplit(".", 1)[0] == path}
        if not params:
            continue
        if base is None or type(base) not in (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding):
            what = "which this model does not have (a tied head?)" if base is None else f"a {type(base).__name__}"
            raise AdapterError(f"{adapter.path}: replaces {path}, {what}; only linear layers and embeddings can be")
        embedding = isinstance(base, nn.Embedding | nn.QuantizedEmbedding)
        shape = params.get("weight", mx.zeros((0,))).shape
        rows, columns = _dims(base) if not embedding else (base.weight.shape[0], _embedding_dims(base))
        if tuple(shape) != (rows, columns) or set(params) - {"weight", "bias"}:
            raise AdapterError(f"{adapter.path}: its {path} holds {listed(sorted(params))} of shape {tuple(shape)}; "
                               f"the model's is ({rows}, {columns})")  # fmt: skip
        copy = nn.Embedding(rows, columns) if embedding else nn.Linear(columns, rows, bias="bias" in params)
        copy.update({k: v.astype(dtype) for k, v in params.items()})
        copies[slot] = copy
    return copies


def _embedding_dims(module: nn.Module) -> int:
    columns = module.weight.shape[1]
    return columns * 32 // module.bits if isinstance(module, nn.QuantizedEmbedding) else columns
