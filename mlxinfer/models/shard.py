"""One model split across the ranks of an `mx.distributed` group.

Pipeline (`Stage`): each rank holds a contiguous run of layers. Rank 0 embeds the
tokens, each rank runs its layers and sends the hidden states to the next, and the
last rank's output is summed into every rank (the others add zeros), so every rank
computes the same logits and samples the same tokens: the engine runs unchanged on
each rank. Only the owned layers' tensors are ever read from the checkpoint.

Tensor (`shard_tensor`): every rank holds every layer with 1/N of the attention heads
and of the MLP's columns; mlx.nn's sharded linears sum the partial products
across the group after the output and down projections.

Parameter paths stay the checkpoint's: a rank's local layer i is checkpoint layer
`start + i`, renamed on the way in.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from ..errors import UnsupportedModelError

_LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


@dataclass
class Stage:
    """This rank's place in a pipeline: layers [start, end) of `total`, and the traffic it has sent."""

    rank: int
    size: int
    start: int
    end: int
    total: int
    group: Any = None  # mx.distributed.Group; None in the unit tests that only slice
    # Whether every layer of the whole model can be cut at any position: the loop's choices (state snapshots)
    # must follow the whole model on every rank, not the kinds of layers one rank happens to hold.
    cuttable: bool = True
    sent_bytes: int = field(default=0, compare=False)  # hidden states sent and summed, for the bench

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def owns(self, name: str) -> str | None:
        """`name` as this rank stores it, or None for another rank's layer."""
        match = _LAYER.match(name)
        if match is None:
            return name  # embeddings, final norm, head: every rank keeps them
        index = int(match.group(2))
        if not self.start <= index < self.end:
            return None
        return f"{match.group(1)}{index - self.start}{match.group(3)}"

    def receive(self, template: mx.array) -> mx.array:
        """The previous rank's hidden states, shaped like `template` (rank 0: `template` itself)."""
        if self.first:
            return template
        return mx.distributed.recv_like(template, self.rank - 1, group=self.group)

    def finish(self, h: mx.array) -> mx.array:
        """Send `h` on, then give every rank the last rank's hidden states."""
        if not self.last:
            sent = mx.distributed.send(h, self.rank + 1, group=self.group)
            h = mx.depends(mx.zeros_like(h), sent)  # zeros that wait for the send
        self.sent_bytes += h.nbytes * (1 + (not self.last))  # the send, and this rank's part of the sum
        return mx.distributed.all_sum(h, group=self.group)


def select_weights(weights: dict[str, mx.array], stage: Stage) -> dict[str, mx.array]:
    """The tensors this rank holds, renamed to its local layer numbers (the rest are never read)."""
    kept = {}
    for name, value in weights.items():
        local = stage.owns(name)
        if local is not None:
            kept[local] = value
    return kept


def keep_layers(model: nn.Module, stage: Stage) -> None:
    """Cut a freshly built DecoderLM down to this rank's layers (still unevaluated: nothing is allocated)."""
    layers = model.model.layers
    if getattr(model, "pass_state", None) is not None:
        raise UnsupportedModelError(
            "its layers share one pass's state (Gemma 4's per-layer inputs and shared keys and values), which "
            "pipeline ranks cannot split: run it on one machine"
        )
    if len(layers) != stage.total:
        raise UnsupportedModelError(f"the pipeline plan has {stage.total} layers but the model has {len(layers)}")
    model.model.layers = layers[stage.start : stage.end]
    model.layout = replace(model.layout, layer_types=model.layout.layer_types[stage.start : stage.end])
    model.stage, model.sharded = stage, True


# Per family: the attention and MLP projections that split by output columns and the ones that sum back.
_COLUMNS = ("q_proj", "k_proj", "v_proj")
_ROWS = ("o_proj",)
_MLP_COLUMNS = ("gate_proj", "up_proj")
_MLP_ROWS = ("down_proj",)
_HEAD_COUNTS = ("n_heads", "n_kv_heads", "num_heads", "num_key_value_heads", "num_kv_heads")


def tensor_parallel_check(model: nn.Module, size: int) -> str | None:
    """Why `model` cannot split its heads over `size` ranks, or None when it can."""
    if getattr(model, "pass_state", None) is not None:
        return "its layers share one pass's state (Gemma 4's shared keys and values): run it on one machine"
    for index, layer in enumerate(model.model.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in (*_COLUMNS, *_ROWS)):
            return f"layer {index} is not plain attention + MLP (use pipeline parallelism for this model)"
        if not all(hasattr(mlp, n) for n in (*_MLP_COLUMNS, *_MLP_ROWS)):
            return f"layer {index}'s MLP is not gate/up/down (MoE or other): use pipeline parallelism"
        for count in _HEAD_COUNTS:
            value = getattr(attn, count, None)
            if isinstance(value, int) and value % size:
                return f"layer {index} has {value} {count.replace('_', ' ')}, not divisible by {size} ranks"
    return None


def shard_tensor(model: nn.Module, group: Any, sent: Callable[[int], None] | None = None) -> None:
    """Split every layer's heads and MLP columns over `group` (check `tensor_parallel_check` first)."""
    size = group.size()
    why = tensor_parallel_check(model, size)
    if why:
        raise UnsupportedModelError(f"tensor parallelism over {size} ranks: {why}")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in _COLUMNS:
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        for name in _ROWS:
            setattr(attn, name, shard_linear(getattr(attn, name), "sharded-to-all", group=group))
        for name in _MLP_COLUMNS:
            setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group))
        for name in _MLP_ROWS:
            setattr(mlp, name, shard_linear(getattr(mlp, name), "sharded-to-all", group=group))
        for count in _HEAD_COUNTS:
            if isinstance(getattr(attn, count, None), int):
                setattr(attn, count, getattr(attn, count) // size)
    model.sharded = True
