"""MoE figures: decode tokens/s of mlxinfer and mlx-lm on the same mixture-of-experts files, and the converter's
wall time and peak RSS against `mlx_lm.convert` on the same checkpoint, each conversion in its own process.

The checkpoint is a random-weight, realistically shaped MoE written by transformers (speed and memory figures,
never quality): Qwen3-MoE when the registry supports it, else gpt-oss. Both engines decode in float32, the fast
dtype of MLX's CPU backend, greedy, on the same prompt ids; mlx-lm reads the same weight files through a view
with a config it understands (bench/hybrid_models.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .convert_bench import _bits_per_weight, _timed_conversion
from .hybrid_bench import decode_row
from .hybrid_models import SHAPES, TINY, Shape, build_checkpoint, mlx_lm_view, shape_summary

PEAK_GOAL = 0.5  # mlxinfer's converter peak RSS at most this fraction of mlx_lm.convert's
MOE_SHAPES = {
    "qwen3_moe": Shape(
        "Qwen3-30B-A3B scaled down: head_dim 128, 16 query / 2 KV heads, 32 experts (top 4) of width 256 in every "
        "layer; 8 layers, hidden 1024, vocabulary 32768 (not Qwen's 151936, so the experts hold most weights)",
        dict(
            model_type="qwen3_moe",
            vocab_size=32768,
            hidden_size=1024,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=128,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            intermediate_size=3072,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
    ),
    # The hybrid bench's gpt-oss (its windows, YaRN and GQA), with the experts holding most of the weights.
    "gpt_oss": Shape(
        "gpt-oss-20b scaled down: head_dim 64, 8:1 GQA, 128-token windows, YaRN; 32 experts (top 4) of width 512; "
        "8 layers, hidden 1024, vocabulary 32768",
        SHAPES["gpt_oss"].config
        | {"vocab_size": 32768, "hidden_size": 1024, "num_local_experts": 32, "intermediate_size": 256},
    ),
}


@dataclass
class MoeSettings:
    prompt_tokens: int = 32
    decode_tokens: int = 32
    runs: int = 3  # per engine and file set, interleaved; medians reported
    bits: int = 4
    group_size: int = 64
    source_dtype: str = "bfloat16"  # as real MoE checkpoints ship
    warmup: str = "per engine: 2 tokens after an 8-token prompt, not counted"

    @classmethod
    def quick(cls) -> MoeSettings:
        """The tiny fixture (float32, its widths are multiples of 32 at most): seconds, not minutes."""
        return cls(prompt_tokens=24, decode_tokens=8, runs=1, group_size=32, source_dtype="float32")


def moe_family() -> str:
    """Qwen3-MoE once the registry supports it, else gpt-oss."""
    from mlxinfer.models.registry import ARCHITECTURES

    return "qwen3_moe" if "qwen3_moe" in ARCHITECTURES else "gpt_oss"


def prepare_moe_model(family: str, tiny: bool, root: Path | None = None) -> Path:
    """The bench's MoE checkpoint: the committed tiny fixture, or a shaped one built once (torch + transformers)."""
    if tiny:
        return TINY / family
    from mlxinfer.paths import cache_dir

    root = root or cache_dir() / "bench-models" / "moe"
    return build_checkpoint(MOE_SHAPES[family], root / f"{family}-shaped-bf16", dtype="bfloat16")


def run_moe_bench(source: Path, family: str, settings: MoeSettings) -> dict[str, Any]:
    """Converter rows first (nothing else running), then decode rows on the source and on mlx-lm's output."""
    from mlxinfer.speed.conditions import conditions

    with tempfile.TemporaryDirectory(prefix="mlxinfer-moe-bench-") as tmp:
        work = Path(tmp)
        figures: dict[str, Any] = {
            "conditions": conditions(),
            "load_average_at_start": os.getloadavg(),
            "settings": asdict(settings),
            "family": family,
            "model": {"path": str(source), "source": _source(source, family), **shape_summary(source)},
            "compute_dtype": "float32",
        }
        figures["convert"] = _convert_rows(source, work, settings)
        files = {f"source ({figures['model']['dtype_on_disk']})": source}
        files[f"{settings.bits}-bit g{settings.group_size} (mlx_lm.convert)"] = work / "mlx-lm"
        figures["decode"] = []
        for label, path in files.items():
            row = {"files": label, **decode_row(family, path, work / "decode", settings)}
            print(f"moe bench: {row}", file=sys.stderr, flush=True)
            figures["decode"].append(row)
        figures["ratios"] = ratios(figures)
        return figures


def _source(path: Path, family: str) -> str:
    is_tiny = path.resolve().parent == TINY.resolve()
    return "tiny test fixture (tests/fixtures/tiny)" if is_tiny else MOE_SHAPES[family].source


def _convert_rows(source: Path, work: Path, s: MoeSettings) -> list[dict[str, Any]]:
    """Each converter on the same weights, same bits and group size, in its own process (its own peak RSS).

    mlx-lm reads a view of the source: links to the same weight files, with a config it understands."""
    view = mlx_lm_view(source, work / "mlx-lm-source")
    converters = {
        "mlx-lm": (
            "from mlx_lm import convert; import sys; convert(sys.argv[1], mlx_path=sys.argv[2], quantize=True, "
            f"q_bits={s.bits}, q_group_size={s.group_size})",
            view,
        ),
        "mlxinfer": (
            "from mlxinfer.convert import convert; import sys; convert(sys.argv[1], sys.argv[2], "
            f"bits={s.bits}, group_size={s.group_size}, evaluate=False, progress=False)",
            source,
        ),
    }
    rows = []
    for name, (code, src) in converters.items():
        out = work / name
        wall, peak = _timed_conversion(code, src, out)
        rows.append(
            {"converter": name, "wall_s": wall, "peak_rss_bytes": peak, "bits_per_weight": _bits_per_weight(out)}
        )
        print(f"moe bench: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def ratios(figures: dict[str, Any]) -> dict[str, float]:
    """mlxinfer over mlx-lm: converter wall time and peak RSS, and decode tokens/s on each set of files."""
    theirs, ours = (next(r for r in figures["convert"] if r["converter"] == name) for name in ("mlx-lm", "mlxinfer"))
    found = {
        "convert_wall": ours["wall_s"] / theirs["wall_s"],
        "convert_peak_rss": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"],
    }
    for row in figures["decode"]:
        if "mlxinfer" in row and "mlx-lm" in row:
            found[f"decode {row['files']}"] = row["mlxinfer"]["decode_tps"] / row["mlx-lm"]["decode_tps"]
    return found


def markdown(f: dict[str, Any]) -> str:
    c, m = f["conditions"], f["model"]
    head = (
        f"{c['date']} · {c['chip']} ({c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB) · {c['os']} · backend "
        f"{c['backend']} · mlx {c['versions']['mlx']} · mlx-lm {c['versions']['mlx-lm']} · mlxinfer "
        f"{c['versions']['mlxinfer']}; load average at start {f['load_average_at_start'][0]:.1f}\n\n"
        f"Model: {m['model_type']}, {m['params'] / 1e6:.3g}M parameters ({m['dtype_on_disk']} on disk), hidden "
        f"{m['hidden_size']}, {m['layers']} layers, vocabulary {m['vocab_size']}; {m['source']}; random weights "
        "(speed and memory only)."
    )
    return "\n\n".join([head, _convert_table(f), _decode_table(f), _ratio_lines(f)])


def _convert_table(f: dict[str, Any]) -> str:
    s = f["settings"]
    lines = [
        f"Converter: the same {f['model']['dtype_on_disk']} checkpoint to {s['bits']}-bit, group size "
        f"{s['group_size']}, each in its own process (peak RSS of that process)",
        "",
        "| converter | wall s | x mlx-lm | peak RSS MiB | x mlx-lm | bits/weight |",
        "|---|---|---|---|---|---|",
    ]
    base = f["convert"][0]
    for r in f["convert"]:
        lines.append(
            f"| {r['converter']} | {r['wall_s']:.1f} | {r['wall_s'] / base['wall_s']:.2f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} | {r['peak_rss_bytes'] / base['peak_rss_bytes']:.2f} | "
            f"{r['bits_per_weight']:.2f} |"
        )
    return "\n".join(lines)


def _decode_table(f: dict[str, Any]) -> str:
    s = f["settings"]
    lines = [
        f"Decode, float32 compute, {s['prompt_tokens']}-token prompt, {s['decode_tokens']} greedy tokens, median of "
        f"{s['runs']} interleaved runs per engine (min-max); warm-up {s['warmup']}",
        "",
        "| files | mlxinfer tok/s | mlx-lm tok/s | mlxinfer / mlx-lm | same tokens | decode reads (of weights) |",
        "|---|---|---|---|---|---|",
    ]
    for r in f["decode"]:
        if "skipped" in r:
            lines.append(f"| {r['files']} | skipped: {r['skipped'][:160]} | | | | |")
            continue
        reads = f"{_size(r['decode_weights_bytes'])} ({_size(r['weights_bytes'])})"
        if "mlx-lm" not in r:
            lines.append(f"| {r['files']} | {_tps(r['mlxinfer'])} | {r['mlx_lm_skipped'][:160]} | | | {reads} |")
            continue
        ratio = r["mlxinfer"]["decode_tps"] / r["mlx-lm"]["decode_tps"]
        same = "yes" if r["same_tokens"] else "no"
        lines.append(
            f"| {r['files']} | {_tps(r['mlxinfer'])} | {_tps(r['mlx-lm'])} | {ratio:.2f}x | {same} | {reads} |"
        )
    return "\n".join(lines)


def _ratio_lines(f: dict[str, Any]) -> str:
    found = ratios(f)
    peak = found["convert_peak_rss"]
    verdict = "met" if peak <= PEAK_GOAL else "NOT met"
    lines = [
        f"- converter peak RSS, mlxinfer / mlx-lm: {peak:.2f}x (goal: at most {PEAK_GOAL}x: {verdict}); "
        f"wall time {found['convert_wall']:.2f}x",
    ]
    lines += [
        f"- {name}, mlxinfer / mlx-lm: {value:.2f}x" for name, value in found.items() if name.startswith("decode")
    ]
    return "\n".join(lines)


def _size(n: int) -> str:
    """Decimal units, as bandwidth is quoted (GB/s): the roofline is bandwidth over these bytes."""
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def _tps(engine: dict[str, Any]) -> str:
    return f"{engine['decode_tps']:.2f} ({engine['decode_tps_min']:.2f}-{engine['decode_tps_max']:.2f})"
