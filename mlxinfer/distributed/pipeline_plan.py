"""`mlxinfer plan MODEL --hosts ...`: the layer split by each host's memory, what each host holds, and the
expected speed over the links, as one object the CLI prints as a table or JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .estimate import (
    DEFAULT_HOP_LATENCY_S,
    DEFAULT_LINK_GBPS,
    DEFAULT_MEMORY_GBPS,
    PipelineEstimate,
    StageLoad,
    estimate_pipeline,
)
from .hosts import Host
from .layer_sizes import LayerSizes
from .split import binary_size, layer_ranges, split_layers


@dataclass(frozen=True)
class HostShare:
    """One host's run of layers and what it holds."""

    rank: int
    name: str
    start: int  # first layer
    end: int  # one past the last layer
    weights_bytes: int  # its layers' and the shared weights
    kv_bytes: int  # its layers' KV cache at the plan's context (a recurrent layer's: its state)
    working_bytes: int  # prefill activations and MLX's runtime
    usable_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.working_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.total_bytes

    @property
    def layers(self) -> str:
        return str(self.start) if self.end - self.start == 1 else f"{self.start}-{self.end - 1}"

    def to_dict(self) -> dict[str, Any]:
        fields = ("rank", "name", "start", "end", "weights_bytes", "kv_bytes", "working_bytes", "usable_bytes")
        return {
            **{f: getattr(self, f) for f in fields},
            "layers": self.end - self.start,
            "total_bytes": self.total_bytes,
            "headroom_bytes": self.headroom_bytes,
        }


@dataclass(frozen=True)
class PipelinePlan:
    sizes: LayerSizes
    shares: tuple[HostShare, ...]
    estimate: PipelineEstimate

    def to_dict(self) -> dict[str, Any]:
        s = self.sizes
        names = [share.name for share in self.shares]
        links = [{**vars(link), "from": names[link.source], "to": names[link.target]} for link in self.estimate.links]
        return {
            "model": s.source,
            "context": s.context,
            "dtype": s.dtype,
            "kv_bits": s.kv_bits,
            "layers": len(s.layer_weight_bytes),
            "checkpoint_weights_bytes": sum(s.layer_weight_bytes) + s.shared_weight_bytes,
            "shared_weights_bytes": s.shared_weight_bytes,
            "activation_bytes_per_token": s.activation_bytes,
            "hosts": [share.to_dict() for share in self.shares],
            "links": links,
            "decode_tps": self.estimate.decode_tps,
            "ttft_s": self.estimate.ttft_s,
            "prompt_tokens": self.estimate.prompt_tokens,
            "memory_gbps": self.estimate.memory_gbps,
            "hop_latency_s": self.estimate.latency_s,
            "estimate": True,
            "assumptions": list(self.estimate.assumptions) + list(s.notes),
        }

    def lines(self) -> list[str]:
        """The plan as the CLI prints it: a table of hosts, the links, the estimate and its assumptions."""
        s, e = self.sizes, self.estimate
        kv = f"{s.kv_bits}-bit" if s.kv_bits else s.dtype
        names = [h.name for h in self.shares]
        lines = [
            f"{s.source}: {len(s.layer_weight_bytes)} layers over {len(names)} hosts at {s.context} tokens "
            f"({s.dtype} weights, {kv} KV cache)",
            *_table(self.shares, s.context),
            f"every host holds the shared {binary_size(s.shared_weight_bytes)} (embeddings, final norm, head); "
            f"total adds {binary_size(s.working_bytes)} each for prefill activations and MLX's runtime",
        ]
        if e.links:
            lines.append(
                f"links (per token: a {s.activation_bytes:,}-byte hidden state to the next host, and a share of "
                "summing the last host's output into every host):"
            )
        for link in e.links:
            lines.append(
                f"  {names[link.source]} -> {names[link.target]}: {link.gbps:g} Gb/s, {link.bytes_per_token:,} "
                "bytes/token"
            )
        lines.append(
            f"estimate: {e.decode_tps:,.1f} tokens/s decoding, {_seconds(e.ttft_s)} to the first token of a "
            f"{e.prompt_tokens}-token prompt (estimates, not measurements)"
        )
        return lines + [f"  - {a}" for a in (*e.assumptions, *s.notes)]


def plan_pipeline(
    sizes: LayerSizes,
    hosts: Sequence[Host],
    link_gbps: float = DEFAULT_LINK_GBPS,
    memory_gbps: float = DEFAULT_MEMORY_GBPS,
    latency_s: float = DEFAULT_HOP_LATENCY_S,
) -> PipelinePlan:
    """Split `sizes`'s layers over `hosts` (each with its memory_bytes) and estimate the speed; a host's
    own link_gbps wins over `link_gbps`. SplitError when the layers do not fit."""
    names = [h.name for h in hosts]
    usable = [h.memory_bytes for h in hosts]
    if any(u is None for u in usable):
        missing = next(h.name for h in hosts if h.memory_bytes is None)
        raise ValueError(f"{missing} has no memory to plan with")  # parse_hosts never gives such a host
    counts = split_layers(sizes.layer_bytes, sizes.shared_bytes, usable, names)
    shares, loads = [], []
    for rank, (start, end) in enumerate(layer_ranges(counts)):
        weights = sum(sizes.layer_weight_bytes[start:end])
        kv = sum(sizes.layer_kv_bytes[start:end])
        shared = sizes.shared_weight_bytes
        shares.append(HostShare(rank, names[rank], start, end, weights + shared, kv, sizes.working_bytes, usable[rank]))
        loads.append(StageLoad(weights, sum(sizes.layer_parameters[start:end])))
    head = StageLoad(sizes.head_weight_bytes, sizes.head_parameters)
    links = [h.link_gbps or link_gbps for h in hosts]
    estimate = estimate_pipeline(loads, head, sizes.activation_bytes, links, memory_gbps, latency_s)
    return PipelinePlan(sizes, tuple(shares), estimate)


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1000:.1f} ms"


def _table(shares: Sequence[HostShare], context: int) -> list[str]:
    rows = [("rank", "host", "layers", "weights", f"KV@{context}", "total", "usable", "headroom")]
    for h in shares:
        sizes = (h.weights_bytes, h.kv_bytes, h.total_bytes, h.usable_bytes, h.headroom_bytes)
        rows.append((str(h.rank), h.name, h.layers, *(binary_size(n) for n in sizes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    # text columns to the left, sizes to the right
    return ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
