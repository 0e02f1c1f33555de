"""`mlxinfer convert BASE --adapter PATH`: the source as it reads with the adapter merged into its float weights.

Merging before quantizing rounds the fine-tuned weights once; quantizing the base first and adding the adapter
later would keep the base's rounding error and add the adapter's on top. Every step reads the merged weights: the
tensors written (`AdaptedSource.read`), and the float model that calibration and the quality report load
(`fuse_loaded`). A GGUF block tensor the adapter changes is made float first (it cannot stay on its grid).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxinfer.adapters import Adapter, LowRank, fuse_into, fused, read_adapter
from mlxinfer.adapters.loading import named_as_in, text_name  # the adapter's names and the source's meet
from mlxinfer.errors import ConversionError
from mlxinfer.models.config import ModelConfig
from mlxinfer.untrusted import listed

from .sources import Quantized, Source, Tensor


class AdaptedSource:
    """`source` with `adapter` merged into the weights it adapts (and its whole saved modules in place)."""

    def __init__(self, source: Source, adapter_path: str | Path):
        self._source = source
        self.adapter = read_adapter(adapter_path)
        # mlx-lm's per-expert pairs name the runtime's stacked experts: merged as the output is written (`merged`)
        self._experts = {f"{p}.weight": pair for p, pair in self.adapter.modules.items() if pair.per_expert}
        self._pending = set(self._experts)
        self._pairs = {text_name(p): pair for p, pair in self.adapter.modules.items() if not pair.per_expert}
        self._saved = {text_name(name): value for name, value in self.adapter.replaced.items()}
        self.tensors = dict(source.tensors)
        self._merged: dict[str, LowRank] = {}
        for name, tensor in source.tensors.items():
            pair = self._pairs.get(text_name(name.removesuffix(".weight"))) if name.endswith(".weight") else None
            if pair is not None:
                _check_fits(self.adapter, name, tensor, pair)
                self._merged[name] = pair
                self.tensors[name] = Tensor(tensor.shape, "F32", 4 * math.prod(tensor.shape))
        found = {text_name(n.removesuffix(".weight")) for n in self._merged}
        missing = sorted(set(self._pairs) - found) + sorted(set(self._saved) - {text_name(n) for n in source.tensors})
        if missing:
            raise ConversionError(f"{self.adapter.path}: adapts {listed(missing)}, which {source.description} has no "
                                  "tensor for; it was trained for another base model")  # fmt: skip

    def __getattr__(self, name: str) -> Any:  # description, config, folder, mapped_bytes, ... are the source's
        return getattr(self._source, name)

    def read(self, name: str) -> mx.array | Quantized:
        saved = self._saved.get(text_name(name))
        if saved is not None:
            return saved
        value = self._source.read(name)
        pair = self._merged.get(name)
        if pair is None:
            return value
        weight = value.rows(0, math.prod(value.shape[:-1])) if isinstance(value, Quantized) else value
        return fused(weight, pair)

    def merged(self, name: str, value: mx.array | Quantized) -> mx.array | Quantized:
        """An output tensor (the runtime's layout) with the adapter's per-expert pairs for it merged in."""
        pair = self._experts.get(name)
        if pair is None:
            return value
        experts, rows = pair.a.shape[0], pair.b.shape[-1]
        weight = value.rows(0, experts * rows).reshape(experts, rows, -1) if isinstance(value, Quantized) else value
        if tuple(weight.shape) != (experts, rows, pair.a.shape[1]):
            raise ConversionError(f"{self.adapter.path}: {name} is {tuple(weight.shape)} in the model but "
                                  f"{(experts, rows, pair.a.shape[1])} in the adapter; it was trained for another "
                                  "base model")  # fmt: skip
        self._pending.discard(name)
        return fused(weight, pair)

    def check_merged(self) -> None:
        """Every per-expert pair found its tensor (the output is not the fine-tune otherwise)."""
        if self._pending:
            raise ConversionError(f"{self.adapter.path}: adapts {listed(sorted(self._pending))}, which this model "
                                  "has no experts for; it was trained for another base model")  # fmt: skip

    def identity(self) -> dict[str, Any]:
        """What the manifest records of the adapter merged in."""
        a = self.adapter
        return {"path": str(a.path), "sha256": a.digest, "kind": a.kind, "written_by": a.writer, "rank": a.rank,
                "modules": len(a.modules), "base_model": a.base_model}  # fmt: skip

    def close(self) -> None:
        self._source.close()


def fuse_loaded(model: nn.Module, source: Any, dtype: mx.Dtype, config: ModelConfig) -> None:
    """Merge the adapter of an AdaptedSource into `model` (the source loaded by the runtime), in place."""
    adapter: Adapter | None = getattr(source, "adapter", None)
    if adapter is not None:
        fuse_into(model, named_as_in(adapter, model, config.spec.fused_outputs), dtype)


def _check_fits(adapter: Adapter, name: str, tensor: Tensor, pair: LowRank) -> None:
    want = (pair.b.shape[1], pair.a.shape[0])
    if tuple(tensor.shape) != want:
        raise ConversionError(f"{adapter.path}: {name} is {tuple(tensor.shape)} in the source but {want} in the "
                              "adapter; it was trained for another base model")  # fmt: skip
