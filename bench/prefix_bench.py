"""Prefix-cache figures: TTFT with a shared prefix against cold and against mlx-lm's prompt-cache reuse,
TTFT by cached fraction, prefilled tokens over a chat, and what quantized KV costs.

Both engines run the same 4-bit model folder in float32 (the fast dtype on the
CPU backend; on Apple GPUs pass the folder you want). Each TTFT is one
measurement after a warm-up request; the ratios are the point, and they are
large enough that the noise of this machine does not decide them.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx


def run_prefix_bench(model_path: Path, prefix_tokens: int = 1000, quick: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mlxinfer-prefix-bench-") as store:
        # A private prefix store: the user's warmed prefixes (or an earlier run's) must not give free hits.
        os.environ["MLXINFER_CACHE_DIR"], saved = store, os.environ.get("MLXINFER_CACHE_DIR")
        try:
            return _run(model_path, prefix_tokens, quick)
        finally:
            if saved is None:
                os.environ.pop("MLXINFER_CACHE_DIR")
            else:
                os.environ["MLXINFER_CACHE_DIR"] = saved


def _run(model_path: Path, prefix_tokens: int, quick: bool) -> dict[str, Any]:
    import mlxinfer
    from mlxinfer.data import calibration_text, prose_text
    from mlxinfer.speed.conditions import conditions

    model = mlxinfer.load(model_path, dtype="float32")
    text_ids = model.tokenizer.encode((prose_text() + "\n\n" + calibration_text()) * 4, add_special_tokens=False)
    prefix_tokens = 64 if quick else prefix_tokens
    prefix, questions = text_ids[:prefix_tokens], [text_ids[-40:-24], text_ids[-24:-8]]
    model.generate(text_ids[:8], max_tokens=1, use_cache=False)  # warm-up: kernels, allocator
    figures = {
        "conditions": conditions(),
        "model": str(model_path),
        "compute_dtype": "float32",
        "prefix_tokens": len(prefix),
        "question_tokens": len(questions[0]),
        "shared_prefix": _shared_prefix(model, prefix, questions),
        "mlx_lm_shared_prefix": _mlx_lm_shared_prefix(model_path, prefix, questions),
        "by_cached_fraction": _by_fraction(model, text_ids[: 48 if quick else 400]),
        "chat": _chat_prefill(model, model_path, turns=3 if quick else 10),
        "kv_bits": _kv_bits(model_path, text_ids[: 32 if quick else 512]),
    }
    return figures


def _shared_prefix(model: Any, prefix: list[int], questions: list[list[int]]) -> dict[str, float]:
    model.prefix_cache.clear()
    cold = model.generate(prefix + questions[0], max_tokens=1).stats  # cold, and fills the cache
    hit = model.generate(prefix + questions[1], max_tokens=1).stats
    return {"cold_ttft_s": cold.ttft_s, "hit_ttft_s": hit.ttft_s, "cached_tokens": hit.cached_tokens}


def _mlx_lm_shared_prefix(model_path: Path, prefix: list[int], questions: list[list[int]]) -> dict[str, float]:
    """mlx-lm's own reuse, as its server does it: keep the prefix's cache, deep-copy it, feed the rest."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    lm, _ = load(str(model_path))
    lm.set_dtype(mx.float32)
    next(generate_step(mx.array(prefix[:8]), lm, max_tokens=1))  # warm-up

    def first_token(ids: list[int], cache: list[Any]) -> float:
        start = time.perf_counter()
        token, _ = next(generate_step(mx.array(ids), lm, prompt_cache=cache, max_tokens=1))
        mx.eval(token)
        return time.perf_counter() - start

    cache = make_prompt_cache(lm)
    cold = first_token(prefix + questions[0], cache)
    trim_prompt_cache(cache, cache[0].offset - len(prefix))
    start = time.perf_counter()
    reused = copy.deepcopy(cache)  # what mlx-lm's server does on every hit
    hit = (time.perf_counter() - start) + first_token(questions[1], reused)
    return {"cold_ttft_s": cold, "hit_ttft_s": hit}


def _by_fraction(model: Any, prompt: list[int]) -> list[dict[str, float]]:
    rows = []
    for fraction in (0.0, 0.25, 0.5, 0.75, 0.9, 0.98):
        model.prefix_cache.clear()
        cached = int(fraction * len(prompt))
        if cached:
            model.warm(prompt[:cached])
        stats = model.generate(prompt, max_tokens=1).stats
        rows.append({"cached_fraction": stats.cached_tokens / len(prompt), "ttft_s": stats.ttft_s})
    return rows


def _chat_prefill(model: Any, model_path: Path, turns: int) -> dict[str, list[int]]:
    """Prompt tokens each engine runs per turn of the same chat.

    mlx-lm's `mlx_lm.chat` keeps one prompt cache and templates only the new user
    message each turn; ours templates the whole history and reuses what matches.
    """
    from mlx_lm import load

    _, lm_tokenizer = load(str(model_path))
    history: list[dict[str, str]] = []
    ours, theirs = [], []
    model.prefix_cache.clear()
    for turn in range(turns):
        history.append({"role": "user", "content": f"Turn {turn + 1}: name a color and a fruit."})
        result = model.chat(history, max_tokens=12)
        ours.append(result.stats.prefilled_tokens)
        new_message = lm_tokenizer.apply_chat_template(history[-1:], add_generation_prompt=True)
        theirs.append(len(new_message))
        history.append({"role": "assistant", "content": result.text})
    return {"mlxinfer": ours, "mlx_lm_chat": theirs}


def _kv_bits(model_path: Path, ids: list[int]) -> list[dict[str, float]]:
    from mlxinfer.quantize import perplexity

    import mlxinfer

    rows = []
    for bits in (None, 8, 4):
        model = mlxinfer.load(model_path, dtype="float32", kv_bits=bits, prefix_cache_bytes=0)
        rows.append(
            {
                "kv_bits": bits or 32,
                "kv_bytes_per_token": model.footprint.kv_bytes_per_token,
                "perplexity": perplexity(model, ids),
            }
        )
    return rows


def markdown(f: dict[str, Any]) -> str:
    c, shared, lm = f["conditions"], f["shared_prefix"], f["mlx_lm_shared_prefix"]
    base_kv = f["kv_bits"][0]
    ours, theirs = f["chat"]["mlxinfer"], f["chat"]["mlx_lm_chat"]
    lines = [
        f"Prefix cache: {Path(f['model']).name}, {f['compute_dtype']}, {f['prefix_tokens']}-token shared prefix + "
        f"{f['question_tokens']}-token question; {c['chip']} ({c['cores']} cores) · mlx {c['versions']['mlx']} · "
        f"mlx-lm {c['versions']['mlx-lm']}",
        "",
        "| engine | cold TTFT s | TTFT with shared prefix s | speed-up |",
        "|---|---|---|---|",
        f"| mlxinfer (prefix cache) | {shared['cold_ttft_s']:.2f} | {shared['hit_ttft_s']:.3f} | "
        f"{shared['cold_ttft_s'] / shared['hit_ttft_s']:.0f}x |",
        f"| mlx-lm (prompt cache, deep copy) | {lm['cold_ttft_s']:.2f} | {lm['hit_ttft_s']:.3f} | "
        f"{lm['cold_ttft_s'] / lm['hit_ttft_s']:.0f}x |",
        "",
        "| cached fraction | " + " | ".join(f"{r['cached_fraction']:.0%}" for r in f["by_cached_fraction"]) + " |",
        "|---|" + "---|" * len(f["by_cached_fraction"]),
        "| TTFT s | " + " | ".join(f"{r['ttft_s']:.2f}" for r in f["by_cached_fraction"]) + " |",
        "",
        f"Prompt tokens prefilled per chat turn: mlxinfer {ours} (total {sum(ours)}); "
        f"mlx_lm.chat {theirs} (total {sum(theirs)})",
        "",
        "| KV cache | bytes per token | x float | perplexity |",
        "|---|---|---|---|",
    ]
    for r in f["kv_bits"]:
        name = "float32" if r["kv_bits"] == 32 else f"{r['kv_bits']}-bit"
        lines.append(
            f"| {name} | {r['kv_bytes_per_token']:,} | {r['kv_bytes_per_token'] / base_kv['kv_bytes_per_token']:.2f} | "
            f"{r['perplexity']:.3f} |"
        )
    return "\n".join(lines)


def ttft_plot(f: dict[str, Any], path: Path) -> Path:
    from .plots import plt

    rows = f["by_cached_fraction"]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.plot([100 * r["cached_fraction"] for r in rows], [r["ttft_s"] for r in rows], marker="o")
    ax.set_xlabel("cached share of the prompt (%)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"TTFT by cached fraction · {Path(f['model']).name} · {f['conditions']['chip']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
