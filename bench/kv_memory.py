"""KV memory of a Gemma-3-shaped model with every layer holding the whole history (before) and with
bounded sliding windows (after), measured in the real caches and as the memory planner predicts it.

No weights are needed: random keys and values of the model's shape are written into the caches in
prefill chunks, and each cache's `nbytes` is read. Layers of one kind hold identical bytes, so one
cache of each kind is filled and counted once per layer of that kind (`every_layer=True` fills them
all: about 2 minutes at 32k on a 2-core CPU, where a full cache re-copies its history every chunk).

    python -m bench.kv_memory            # 8k and 32k, about 10 s here
    python -m bench --kv-memory-only     # the same, written to bench/results/
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxinfer.cache import make_cache
from mlxinfer.cache.layers import FULL, SLIDING
from mlxinfer.defaults import PREFILL_CHUNK_TOKENS
from mlxinfer.memory import ModelFootprint


@dataclass(frozen=True)
class AttentionShape:
    """The attention layout of a model: what its KV caches hold."""

    name: str
    layers: int
    sliding_every: int  # layer i slides unless (i + 1) % sliding_every == 0 (transformers' Gemma 3 rule)
    window: int
    kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    def kinds(self, windows: bool = True) -> list[tuple[str, int | None]]:
        """Each layer's (type, window); without `windows` every layer is full attention (the runtime until now)."""
        slides = [(i + 1) % self.sliding_every != 0 for i in range(self.layers)]
        return [(SLIDING, self.window) if windows and s else (FULL, None) for s in slides]


# google/gemma-3-4b-it config.json, text_config: num_hidden_layers 34, sliding_window 1024,
# sliding_window_pattern 6 (layers 5, 11, ..., 29 are global: 5 full, 29 sliding),
# num_key_value_heads 4, head_dim 256, torch_dtype bfloat16.
GEMMA3_4B = AttentionShape("Gemma 3 4B", 34, 6, 1024, 4, 256, mx.bfloat16)


def held_bytes(kinds: list[tuple[str, int | None]], shape: AttentionShape, context: int,
               chunk: int = PREFILL_CHUNK_TOKENS, every_layer: bool = False) -> dict[str, int]:  # fmt: skip
    """Bytes the caches built by `make_cache(kinds)` hold after `context` positions written `chunk` at a time,
    per layer type (all layers of that type together)."""
    caches = make_cache(kinds)
    counts = Counter(kinds)
    # One cache per distinct kind, unless every layer is filled.
    filled = list(range(len(kinds))) if every_layer else [kinds.index(kind) for kind in counts]
    part = mx.random.normal((1, shape.kv_heads, chunk, shape.head_dim)).astype(shape.dtype)  # (B, kv_heads, T, hd)
    mx.eval(part)
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        for i in filled:
            caches[i].update_and_fetch(part[:, :, :n], part[:, :, :n])
        mx.eval([caches[i].arrays for i in filled])
    held: Counter[str] = Counter()
    for i in filled:
        held[kinds[i][0]] += caches[i].nbytes * (1 if every_layer else counts[kinds[i]])
    return dict(held)


def planned(kinds: list[tuple[str, int | None]], shape: AttentionShape) -> ModelFootprint:
    """The memory planner's view of these layers (weights and activations left out)."""
    types = [kind for kind, _ in kinds]
    size = shape.dtype.size
    return ModelFootprint(
        weights_bytes=0, full_layers=types.count(FULL), kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        heads=0, hidden=0, intermediate=0, vocab=0, compute_bytes=size, kv_bytes=size,
        sliding_layers=types.count(SLIDING), window=shape.window,
    )  # fmt: skip


def run_kv_memory_bench(shape: AttentionShape = GEMMA3_4B, contexts: tuple[int, ...] = (8192, 32768),
                        chunk: int = PREFILL_CHUNK_TOKENS, every_layer: bool = False) -> dict[str, Any]:  # fmt: skip
    """Measured and planned KV bytes before and after sliding windows, at each context."""
    from mlxinfer.speed.conditions import conditions

    rows = []
    for context in contexts:
        for case, windows in (("before", False), ("after", True)):
            kinds = shape.kinds(windows)
            started = time.perf_counter()
            measured = held_bytes(kinds, shape, context, chunk, every_layer)
            footprint = planned(kinds, shape)
            rows.append({
                "context": context,
                "case": case,
                "full_layers": footprint.full_layers,
                "sliding_layers": footprint.sliding_layers,
                "measured_full_bytes": measured.get(FULL, 0),
                "measured_sliding_bytes": measured.get(SLIDING, 0),
                "measured_bytes": sum(measured.values()),
                "planned_bytes": footprint.kv_cache_bytes(context, chunk),
                "seconds": round(time.perf_counter() - started, 2),
            })  # fmt: skip
    return {
        "conditions": conditions(),
        "shape": {
            "name": shape.name,
            "layers": shape.layers,
            "sliding_every": shape.sliding_every,
            "window": shape.window,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "dtype": str(shape.dtype).removeprefix("mlx.core."),
        },  # fmt: skip
        "prefill_chunk": chunk,
        "every_layer": every_layer,
        "rows": rows,
        "ratios": {str(c): _ratio(rows, c) for c in contexts},
    }


def _ratio(rows: list[dict[str, Any]], context: int) -> float:
    """Measured KV before over after, at `context`."""
    by_case = {r["case"]: r["measured_bytes"] for r in rows if r["context"] == context}
    return by_case["before"] / by_case["after"]


def markdown(figures: dict[str, Any]) -> str:
    s, c = figures["shape"], figures["conditions"]
    versions = " · ".join(f"{k} {v}" for k, v in c["versions"].items() if v)
    lines = [
        f"KV memory of a {s['name']}-shaped model: {s['layers']} layers, 1 in {s['sliding_every']} full "
        f"attention, the rest sliding (window {s['window']}), {s['kv_heads']} KV heads x {s['head_dim']}, "
        f"{s['dtype']}; prefill chunks of {figures['prefill_chunk']}. Before: every layer a full cache "
        f"(KVCache(window=None)); after: make_cache with the windows. "
        + ("Every layer filled." if figures["every_layer"] else "One cache per kind filled, counted per layer."),
        f"{c['chip']} ({c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB) · {c['os']} · backend "
        f"{c['backend']} · {versions}",
        "",
        "| context | case | full layers | sliding layers | full MiB | sliding MiB | measured MiB | planned MiB "
        "| drift | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in figures["rows"]:
        drift = r["planned_bytes"] / r["measured_bytes"] - 1
        lines.append(
            f"| {r['context']} | {r['case']} | {r['full_layers']} | {r['sliding_layers']} "
            f"| {_mib(r['measured_full_bytes'])} | {_mib(r['measured_sliding_bytes'])} | {_mib(r['measured_bytes'])} "
            f"| {_mib(r['planned_bytes'])} | {drift:+.1%} | {r['seconds']} |"
        )
    lines.append("")
    lines += [f"At {context} tokens: {ratio:.2f}x less KV after" for context, ratio in figures["ratios"].items()]
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_memory", description=__doc__)
    parser.add_argument("--contexts", default="8192,32768", help="comma list of context lengths")
    parser.add_argument("--every-layer", action="store_true", help="fill every layer's cache (slow)")
    args = parser.parse_args()
    contexts = tuple(int(c) for c in args.contexts.split(","))
    print(markdown(run_kv_memory_bench(contexts=contexts, every_layer=args.every_layer)))


if __name__ == "__main__":
    main()
