"""Many adapters over one copy of the base model, chosen per row of each forward pass.

Each module an adapter targets is wrapped: the base module stays as loaded (quantized or not, held once), and
beside it the adapters' low-rank pairs are stacked by slot (slot 0 is the bare base, all zeros), ranks padded with
zeros to the largest. A forward pass built inside `selected(model, slots)` gives row i adapter `slots[i]`: when
every row has the same one (a prefill, a batch of one adapter) each wrapper does two small matmuls; when rows
differ, `mx.gather_mm` takes each row's pair in the same two calls, so requests for different adapters and for the
bare base decode in one batch. Outside `selected`, every row is the base.

DoRA rescales each output row by m / ||W + BA|| (mlx-lm's DoRALinear and PEFT alike): the factor depends only on
the weights, so it is computed once, when the adapter is placed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..models.quantized import unpacked_columns
from .fused import dora_factor
from .reading import LowRank

BASE = 0  # the slot of the bare base model
# An adapter's prefix-cache keys are negative int32s, as image tokens' are (prefix files store int32 ids): never a
# real token id. Each adapter shifts the ids by its own salt, so within one adapter no two tokens share a key, and
# the same prompt under two adapters differs unless their salts do not (1 in 2**31). Two adapters' keys meet only
# where one's prompt is the other's with every id shifted by their salts' difference, which must be under the
# vocabulary's size (1 in about 10**4 pairs for a 128k vocabulary): a prompt of shifted ids, not one anybody sends.
KEY_SPACE = (1 << 31) - 1


@dataclass(frozen=True)
class Chosen:
    """The adapter a request runs with: its slot in the model, and what the prefix cache keys its tokens by."""

    slot: int = BASE
    key: int = 0  # its salt, from the adapter's digest (0: the bare base, whose keys are its token ids)

    def keyed(self, ids: list[int]) -> list[int]:
        """`ids` as the prefix cache keys them under this adapter: KV computed under one adapter is never
        resumed under another or the base (the key is the adapter's content, not its name or slot)."""
        if not self.key:
            return ids
        return [-1 - ((self.key + t) % KEY_SPACE) for t in ids]


NO_ADAPTER = Chosen()


class Selection(threading.local):
    """Which adapter each row of the forward pass being built uses (read while the graph is built). Each thread
    has its own: a server's embeddings pass, built on another thread while the scheduler builds a step with
    adapter rows, runs the base."""

    def __init__(self) -> None:
        self.uniform: int | None = BASE  # every row's slot, when they share one
        self.slots: mx.array | None = None  # (rows,) int32, when they do not


class LowRankRows(nn.Module):
    """A linear layer plus, per row, its adapter's x @ a @ b (and DoRA's rescaling)."""

    def __init__(self, base: nn.Module, selection: Selection, dtype: mx.Dtype):
        super().__init__()
        out_dims, in_dims = linear_dims(base)
        self.base = base
        self.a, self.b = mx.zeros((1, in_dims, 1), dtype), mx.zeros((1, 1, out_dims), dtype)  # slot 0: the base
        self._selection = selection  # DoRA adds `factor`, (slots, out): m / ||W + BA||, 1 where none rescales

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

    def staged(self, slot: int, slots: int, pair: LowRank | None, dtype: mx.Dtype,
               weight: Callable[[], mx.array]) -> dict[str, mx.array]:  # fmt: skip
        """New stacks (evaluated) with `pair` (None: nothing) in `slot` and room for `slots` slots: set them on the
        module between passes (`setattr`), never written in place, so passes already built keep what they read.
        `weight`: the base's float weight, for DoRA's factor."""
        slots = max(self.a.shape[0], slots)
        a, b = (pair.a.astype(dtype), pair.b.astype(dtype)) if pair is not None else (None, None)
        out = {"a": with_row_padded(self.a, slot, slots, 2, a), "b": with_row_padded(self.b, slot, slots, 1, b)}
        dora = pair is not None and pair.magnitude is not None
        if "factor" in self or dora:
            width = out["b"].shape[2]
            factor = _padded(self.factor if "factor" in self else mx.ones((1, width), dtype), slots, 1, 0, 1.0)
            row = dora_factor(weight(), pair).astype(dtype) if dora else mx.ones((width,), dtype)
            out["factor"] = _with_row(factor, slot, row)
        mx.eval(out)
        return out


class ReplacedRows(nn.Module):
    """A module some adapters replace whole (PEFT's modules_to_save): each row runs its own adapter's copy."""

    def __init__(self, base: nn.Module, selection: Selection):
        super().__init__()
        self.base = base
        self.copies: dict[str, nn.Module] = {}  # by slot
        self._selection = selection

    @property
    def weight(self) -> mx.array:  # what callers read a module's shape from (the vocabulary, say)
        return self.base.weight

    def staged(self, slot: int, copy: nn.Module | None) -> dict[str, dict[str, nn.Module]]:
        """The copies with slot `slot` running `copy` (None: the base's own module), to set between passes."""
        copies = {k: v for k, v in self.copies.items() if k != str(slot)}
        return {"copies": {**copies, **({str(slot): copy} if copy is not None else {})}}

    def __call__(self, x: mx.array) -> mx.array:
        return self._per_row(lambda module: module(x))

    def as_linear(self, x: mx.array) -> mx.array:
        return self._per_row(lambda module: module.as_linear(x))

    def _per_row(self, run: Callable[[nn.Module], mx.array]) -> mx.array:
        selection = self._selection
        if selection.uniform is not None:
            return run(self.copies.get(str(selection.uniform), self.base))
        out = run(self.base)
        for slot, module in self.copies.items():
            rows = (selection.slots == int(slot)).reshape(-1, *([1] * (out.ndim - 1)))
            out = mx.where(rows, run(module), out)
        return out


@contextmanager
def selected(model: nn.Module, slots: Sequence[int]) -> Iterator[None]:
    """Forward passes built inside run row i with adapter `slots[i]` (one slot: every row); then the base again."""
    adapters = getattr(model, "adapters", None)
    if adapters is None or not any(slots):
        yield
        return
    selection = adapters.selection
    same = all(s == slots[0] for s in slots)
    with adapters.lock:  # an adapter placed from another thread swaps the stacks between passes, never inside one
        selection.uniform, selection.slots = (slots[0], None) if same else (None, mx.array(slots, dtype=mx.int32))
        try:
            yield
        finally:
            selection.uniform, selection.slots = BASE, None


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(out, in) features of a linear layer, quantized or not."""
    return module.weight.shape[0], unpacked_columns(module)


def _padded(x: mx.array, slots: int, axis: int, width: int, fill: float = 0.0) -> mx.array:
    """`x` with slots added (filled with `fill`) up to `slots`, and axis `axis` widened with zeros to `width`."""
    pads = [(0, slots - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    x = mx.pad(x, pads, constant_values=fill) if slots > x.shape[0] else x
    if width > x.shape[axis]:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, width - x.shape[axis])
        x = mx.pad(x, widths)
    return x


def with_row_padded(x: mx.array, slot: int, slots: int, axis: int, row: mx.array | None) -> mx.array:
    """`x` (slots first) grown to `slots` slots and, along its rank axis `axis`, to `row`'s rank, with slot `slot`
    holding `row` zero-padded (None: zeros). A new array: `x` itself is never written."""
    x = _padded(x, slots, axis, row.shape[axis - 1] if row is not None else 0)
    new = mx.zeros(x.shape[1:], x.dtype)
    if row is not None:
        span = [slice(None)] * new.ndim
        span[axis - 1] = slice(0, row.shape[axis - 1])
        new[tuple(span)] = row
    return _with_row(x, slot, new)


def _with_row(x: mx.array, slot: int, row: mx.array) -> mx.array:
    return mx.concatenate([x[:slot], row[None], x[slot + 1 :]])
