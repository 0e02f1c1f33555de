"""Hybrid-model figures: TTFT of a request that shares a long prefix with an earlier one on a hybrid model
(cold, and resumed from a state snapshot), and decode tokens/s of each hybrid family against mlx-lm.

Both engines compute in float32 (the fast dtype on MLX's CPU backend) from the same float32 weight files,
greedy, on the same prompt ids. The checkpoints are random-weight, realistically shaped models
(bench/hybrid_models.py): these are speed figures, never quality ones.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from .hybrid_models import SHAPES, TINY, mlx_lm_view, shape_summary


@dataclass
class HybridSettings:
    prefix_tokens: int = 1000  # the shared prefix of the TTFT figure
    question_tokens: int = 16  # what differs after it
    snapshot_every: int = 256  # the TTFT figure's second row: denser snapshots than the default
    # MLX's CPU matmul runs at ~2.3 GFLOP/s here, so a 350M model prefills ~3 tokens/s: short decode prompts.
    prompt_tokens: int = 32  # the decode figure's prompt
    decode_tokens: int = 32
    runs: int = 3  # per engine, interleaved; medians reported
    ttft_family: str = "lfm2"

    @classmethod
    def quick(cls) -> HybridSettings:
        """Tiny sizes for the tiny fixtures (their context is 256 tokens)."""
        return cls(prefix_tokens=64, question_tokens=16, snapshot_every=32, prompt_tokens=24, decode_tokens=8, runs=1)


def run_hybrid_bench(models: dict[str, Path], settings: HybridSettings) -> dict[str, Any]:
    """Figures for `models` ({family: folder}); families that do not load are rows that say why."""
    from mlxinfer.speed.conditions import conditions

    with tempfile.TemporaryDirectory(prefix="mlxinfer-hybrid-bench-") as work:
        with _private_cache(Path(work) / "cache"):
            figures = {
                "conditions": conditions(),
                # Other work on this machine slows both engines; runs are interleaved so the ratios hold up better.
                "load_average_at_start": os.getloadavg(),
                "settings": asdict(settings),
                "compute_dtype": "float32",
                "models": {name: _described(name, path) for name, path in models.items()},
                "decode": [],
            }
            for name, path in models.items():
                figures["decode"].append(decode_row(name, path, Path(work) / name, settings))
                _progress(figures["decode"][-1])
            ttft_model = models.get(settings.ttft_family)
            figures["shared_prefix"] = _shared_prefix(ttft_model, settings) if ttft_model else None
            return figures


def _progress(row: dict[str, Any]) -> None:
    # A full run takes a while on a CPU: say what is done (stderr; the tables go to stdout at the end).
    print(f"hybrid bench: {row}", file=sys.stderr, flush=True)


@contextmanager
def _private_cache(folder: Path) -> Iterator[None]:
    # A private prefix store: the user's warmed prefixes (or an earlier run's) must not give free hits.
    os.environ["MLXINFER_CACHE_DIR"], saved = str(folder), os.environ.get("MLXINFER_CACHE_DIR")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MLXINFER_CACHE_DIR")
        else:
            os.environ["MLXINFER_CACHE_DIR"] = saved


def _described(name: str, path: Path) -> dict[str, Any]:
    is_tiny = path.resolve().parent == TINY.resolve()
    source = "tiny test fixture (tests/fixtures/tiny)" if is_tiny else SHAPES[name].source
    return {"path": str(path), "source": source, "weights": "random (transformers init)", **shape_summary(path)}


def _text_ids(model: Any, count: int) -> list[int]:
    from mlxinfer.data import calibration_text, prose_text

    ids = model.tokenizer.encode((prose_text() + "\n\n" + calibration_text()) * 2, add_special_tokens=False)
    return ids[:count]


def _shared_prefix(path: Path, s: HybridSettings) -> dict[str, Any]:
    """A prompt of prefix + question after an earlier one with the same prefix: cold, then the hit, three ways."""
    import mlxinfer

    model = mlxinfer.load(path, dtype="float32")
    p, q = s.prefix_tokens, s.question_tokens
    ids = _text_ids(model, p + 3 * q)
    prefix, questions = ids[:p], [ids[p + i * q : p + (i + 1) * q] for i in range(3)]
    model.generate(ids[:8], max_tokens=1, use_cache=False)  # warm-up: kernels, allocator
    rows = []
    for every in (None, s.snapshot_every):
        label = "after a request, default snapshots" if every is None else f"after a request, snapshot_every={every}"
        model.prefix_cache.clear()
        options = {"max_tokens": 1} if every is None else {"max_tokens": 1, "snapshot_every": every}
        cold = model.generate(prefix + questions[0], **options).stats  # cold, and fills the cache
        hit = model.generate(prefix + questions[1], **options).stats
        rows.append(_ttft_row(label, cold.ttft_s, hit))
        _progress(rows[-1])
    # Last: a warmed prefix stays on disk, so it would turn any later cold request into a hit.
    model.prefix_cache.clear()
    start = time.perf_counter()
    model.warm(prefix)
    warm_s = time.perf_counter() - start
    hit = model.generate(prefix + questions[2], max_tokens=1).stats
    # Its cold figure is the first row's: the same prompt length, run cold.
    rows.append({**_ttft_row("after model.warm(prefix)", rows[0]["cold_ttft_s"], hit), "warm_s": warm_s})
    return {"family": s.ttft_family, "prompt_tokens": p + q, "rows": rows}


def _ttft_row(label: str, cold_ttft_s: float, hit: Any) -> dict[str, Any]:
    return {
        "how": label,
        "cold_ttft_s": cold_ttft_s,
        "hit_ttft_s": hit.ttft_s,
        "speedup": cold_ttft_s / hit.ttft_s,
        "cached_tokens": hit.cached_tokens,
        "prefilled_tokens": hit.prefilled_tokens,
        "cache_note": hit.cache_note,
    }


def decode_row(name: str, path: Path, work: Path, s: Any) -> dict[str, Any]:
    """Both engines on `path` in float32, runs interleaved so drift on this machine hits both alike.

    `s` gives prompt_tokens, decode_tokens and runs (HybridSettings, MoeSettings). Each engine first
    decodes 2 tokens after an 8-token prompt (warm-up: kernels, allocator), not counted."""
    import mlxinfer

    row: dict[str, Any] = {"family": name}
    try:
        ours = mlxinfer.load(path, dtype="float32")
    except Exception as e:  # a family that does not load (yet) is a row that says why, not a failed bench
        return {**row, "skipped": _one_line(f"mlxinfer cannot load it: {type(e).__name__}: {e}")}
    # What one decoded token reads of the weights (an MoE model: its dense weights and active experts only).
    row["weights_bytes"] = ours.footprint.weights_bytes
    row["decode_weights_bytes"] = ours.footprint.decode_weights_bytes
    theirs = _mlx_lm(path, work / "mlx-lm-view")
    if isinstance(theirs, str):
        row["mlx_lm_skipped"] = theirs
    else:
        row["mlx_lm_decode_weights_bytes"] = _decode_weights_bytes(theirs[0], path)
    prompt = _text_ids(ours, s.prompt_tokens)
    runs: dict[str, list[dict[str, Any]]] = {"mlxinfer": [], "mlx-lm": []}
    _ours_run(ours, prompt[:8], 2)  # warm-up
    if not isinstance(theirs, str):
        _mlx_lm_run(*theirs, prompt[:8], 2)
    for _ in range(s.runs):
        runs["mlxinfer"].append(_ours_run(ours, prompt, s.decode_tokens))
        if not isinstance(theirs, str):
            runs["mlx-lm"].append(_mlx_lm_run(*theirs, prompt, s.decode_tokens))
    for engine, measured in runs.items():
        if measured:
            row[engine] = _summary(measured)
    if runs["mlx-lm"]:
        row["same_tokens"] = runs["mlxinfer"][0]["ids"] == runs["mlx-lm"][0]["ids"]
    del ours, theirs
    gc.collect()
    mx.clear_cache()
    return row


def _mlx_lm(path: Path, view: Path) -> tuple[Any, Any] | str:
    """mlx-lm's model and tokenizer on a view of the same files, or why it cannot load them."""
    from mlx.utils import tree_flatten
    from mlx_lm import load

    try:
        model, tokenizer = load(str(mlx_lm_view(path, view)))
    except Exception as e:  # mlx-lm's own limits are a finding to report
        return _one_line(f"mlx-lm cannot load it: {type(e).__name__}: {e}")
    model.set_dtype(mx.float32)  # floats only (bf16 files, quantization scales); packed weights stay
    mx.eval(model.parameters())
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    if dtypes != {mx.float32}:
        return f"mlx-lm would compute in {dtypes}, not float32"
    return model, tokenizer


def _decode_weights_bytes(model: Any, path: Path) -> int:
    """The same count on mlx-lm's model: its experts sit in the same SwitchLinear modules as ours."""
    from mlx.utils import tree_flatten

    from mlxinfer.models.footprint import resident_experts

    per_token = json.loads((path / "config.json").read_text()).get("num_experts_per_tok") or 0
    experts = resident_experts(model, int(per_token))
    return sum(v.nbytes for _, v in tree_flatten(model.parameters())) - experts.nbytes + experts.active_nbytes


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _ours_run(model: Any, prompt: list[int], n: int) -> dict[str, Any]:
    # No prefix cache: every run prefills the whole prompt, as mlx-lm does.
    result = model.generate(prompt, max_tokens=n, temperature=0.0, use_cache=False)
    stats = result.stats
    return {
        "decode_tps": stats.decode_tps,
        "ttft_s": stats.ttft_s,
        "tokens": stats.generated_tokens,
        "ids": result.token_ids,
    }


def _mlx_lm_run(model: Any, tokenizer: Any, prompt: list[int], n: int) -> dict[str, Any]:
    from mlx_lm import stream_generate

    start = time.perf_counter()
    times, ids = [], []
    for response in stream_generate(model, tokenizer, prompt, max_tokens=n):  # greedy: no sampler given
        times.append(time.perf_counter())
        ids.append(response.token)
    decode_tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {"decode_tps": decode_tps, "ttft_s": times[0] - start, "tokens": len(ids), "ids": ids}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tps = [r["decode_tps"] for r in runs]
    return {
        "decode_tps": statistics.median(tps),
        "decode_tps_min": min(tps),
        "decode_tps_max": max(tps),
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "generated_tokens": runs[0]["tokens"],
    }


def markdown(f: dict[str, Any]) -> str:
    from mlxinfer.speed.conditions import described

    head = (
        f"{described(f['conditions'])}; {f['compute_dtype']} compute, random weights (speed only); load average at "
        f"start {f['load_average_at_start'][0]:.1f}"
    )
    return "\n\n".join([head, _shared_prefix_table(f), _decode_table(f), _models_table(f)])


def _shared_prefix_table(f: dict[str, Any]) -> str:
    shared = f["shared_prefix"]
    if shared is None:
        return "(no TTFT figure: its family was not benchmarked)"
    s = f["settings"]
    lines = [
        f"TTFT, {shared['family']}: {s['prefix_tokens']}-token shared prefix + {s['question_tokens']}-token question, "
        "max_tokens=1, one warm-up request first",
        "",
        "| second request | cold TTFT s | hit TTFT s | speed-up | cached tokens | cache note |",
        "|---|---|---|---|---|---|",
    ]
    for r in shared["rows"]:
        lines.append(
            f"| {r['how']} | {r['cold_ttft_s']:.3f} | {r['hit_ttft_s']:.3f} | {r['speedup']:.1f}x | "
            f"{r['cached_tokens']} | {r['cache_note'] or '-'} |"
        )
    return "\n".join(lines)


def _decode_table(f: dict[str, Any]) -> str:
    s = f["settings"]
    lines = [
        f"Decode, {s['prompt_tokens']}-token prompt, {s['decode_tokens']} greedy tokens, median of {s['runs']} "
        "runs per engine (min-max), runs interleaved",
        "",
        "| family | mlxinfer tok/s | mlx-lm tok/s | mlxinfer / mlx-lm | same tokens | TTFT s (ours / mlx-lm) |",
        "|---|---|---|---|---|---|",
    ]
    for r in f["decode"]:
        if "skipped" in r:
            lines.append(f"| {r['family']} | skipped: {r['skipped'][:160]} | | | | |")
            continue
        ours = r["mlxinfer"]
        if "mlx-lm" not in r:
            lines.append(
                f"| {r['family']} | {_tps(ours)} | {r['mlx_lm_skipped'][:160]} | | | {ours['ttft_s']:.2f} / - |"
            )
            continue
        theirs = r["mlx-lm"]
        ratio = ours["decode_tps"] / theirs["decode_tps"]
        lines.append(
            f"| {r['family']} | {_tps(ours)} | {_tps(theirs)} | {ratio:.2f}x | {'yes' if r['same_tokens'] else 'no'} | "
            f"{ours['ttft_s']:.2f} / {theirs['ttft_s']:.2f} |"
        )
    return "\n".join(lines)


def _tps(engine: dict[str, Any]) -> str:
    return f"{engine['decode_tps']:.2f} ({engine['decode_tps_min']:.2f}-{engine['decode_tps_max']:.2f})"


def _models_table(f: dict[str, Any]) -> str:
    lines = ["| family | params | hidden | layers | vocab | on disk | shape from |", "|---|---|---|---|---|---|---|"]
    for name, m in f["models"].items():
        kinds = ", ".join(f"{n} {k}" for k, n in m["layer_types"].items())
        lines.append(
            f"| {name} | {_millions(m['params'])} | {m['hidden_size']} | {m['layers']} ({kinds}) | {m['vocab_size']} | "
            f"{m['dtype_on_disk']} | {m['source']} |"
        )
    return "\n".join(lines)


def _millions(count: int) -> str:
    return f"{count / 1e6:.0f}M" if count >= 10**7 else f"{count / 1e6:.2f}M"
