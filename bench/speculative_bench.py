"""Speculative decoding figures: decode tokens/s of mlxinfer with speculation off, lookup, auto and draft, and of
mlx-lm plain and with its draft model, on the same files, greedy, in one run; acceptance rates, tokens per target
step, and what one forward pass of the target costs by the positions it feeds (which decides whether speculation
can pay on a device).

Two tasks: an input-grounded one (a ~1,000-token document, `mlxinfer/data/prose.txt`, and an instruction to quote
or correct it: prompt lookup's home ground) and open chat (a short question, a free answer). The target is the 8-bit
SmolLM2-135M-Instruct and the draft model its 4-bit conversion, both made by `mlx_lm.convert` from the same
checkpoint (`bench/models.py`). `--quick` runs the tiny llama fixture drafting for itself.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .hybrid_models import TINY

INSTRUCTION = "Quote the first paragraph of the document above exactly, word for word."
QUESTION = "What are three good habits for staying healthy?"
TINY_DOCUMENT_CHARS = 100  # the tiny fixture reads bytes and holds 256 positions: prompt and answer must fit


@dataclass
class SpeculativeSettings:
    grounded_tokens: int = 96  # max_tokens of the input-grounded answer
    chat_tokens: int = 64  # max_tokens of the open chat answer
    runs: int = 2  # rounds; each runs every configuration of both engines once (interleaved), medians reported
    document_chars: int | None = None  # None: the whole document
    num_draft_tokens: int = 3  # mlx-lm's drafts per step: mlx_lm.generate's default (--num-draft-tokens)
    curve_context: int = 700  # context the cost curve's forward passes attend to
    curve_positions: tuple[int, ...] = (1, 2, 3, 5, 9)
    curve_repeats: int = 3  # per size, median reported
    tiny_case: bool = True  # the tiny fixture too: where a forward pass costs about the same for 1 or 9 positions

    @classmethod
    def quick(cls) -> SpeculativeSettings:
        return cls(8, 8, 1, TINY_DOCUMENT_CHARS, curve_context=32, curve_repeats=1, tiny_case=False)

    @classmethod
    def tiny(cls) -> SpeculativeSettings:
        """The tiny fixture's own case within a full run: its document fits its 256 positions."""
        return cls(48, 160, 5, TINY_DOCUMENT_CHARS, curve_context=150, curve_repeats=5, tiny_case=False)


def speculative_models(quick: bool) -> tuple[Path, Path, str]:
    """(target, draft model, where they come from)."""
    if quick:
        tiny = TINY / "llama_classic"
        return tiny, tiny, "tiny test fixture (tests/fixtures/tiny/llama_classic, random weights), drafting for itself"
    from .models import prepare_models

    paths = prepare_models(["8", "4"])
    source = (
        "SmolLM2-135M-Instruct: the 8-bit target and its 4-bit draft model, both made by mlx_lm.convert "
        "(group size 64) from the same bf16 checkpoint (bench/models.py)"
    )
    return paths["8"], paths["4"], source


def prompts(settings: SpeculativeSettings) -> dict[str, str]:
    """The two tasks' user messages."""
    from mlxinfer.data import prose_text

    document = prose_text()[: settings.document_chars].strip()
    return {"grounded": f"{document}\n\n{INSTRUCTION}", "chat": QUESTION}


def run_speculative_bench(target: Path, draft: Path, source: str, settings: SpeculativeSettings) -> dict[str, Any]:
    import mlxinfer
    from mlxinfer.speed.conditions import conditions

    model = mlxinfer.load(target, draft_model=draft)
    figures: dict[str, Any] = {
        "conditions": conditions(),
        "load_average_at_start": os.getloadavg(),
        "settings": asdict(settings),
        "model": {"target": str(target), "draft": str(draft), "source": source, "compute_dtype": model.compute_dtype},
        "code": _code_version(),
    }
    # Warm-up once: both models' kernels and buffers, and a first timed verification for auto's step costs.
    for mode in ("off", "draft"):
        model.chat(QUESTION, max_tokens=8, speculate=mode)
    mlx_lm = MlxLmRuns(target, draft, model.compute_dtype, settings.num_draft_tokens)
    figures["tasks"] = {}
    for task, text in prompts(settings).items():
        ids = model.encode_prompt(text, chat=True)
        max_tokens = settings.grounded_tokens if task == "grounded" else settings.chat_tokens
        figures["tasks"][task] = _task(model, mlx_lm, ids, max_tokens, settings.runs)
    figures["step_costs"] = step_costs(model, settings)
    if settings.tiny_case:
        tiny, _, tiny_source = speculative_models(quick=True)
        figures["tiny"] = run_speculative_bench(tiny, tiny, tiny_source, SpeculativeSettings.tiny())
    figures["load_average_at_end"] = os.getloadavg()
    return figures


def _code_version() -> str:
    """The commit measured (speculation's policy is young and changes), "+ changes" when mlxinfer/ differs from it."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "mlxinfer"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + changes" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


# mlxinfer's configurations, in the order they run: auto before lookup and draft, so that in the first round it
# meets the long context having learned only the warm-up's verification and the plain row's steps.
CONFIGS = (
    ("off", "off", False),
    ("auto", "auto", False),  # no draft model given: auto drafts by prompt lookup
    ("auto + draft model", "auto", True),
    ("lookup", "lookup", False),
    ("draft", "draft", True),
)


def _task(model: Any, mlx_lm: MlxLmRuns, ids: list[int], max_tokens: int, runs: int) -> dict[str, Any]:
    """Every configuration of both engines, `runs` rounds, interleaved. mlxinfer's first run prefills the prompt
    and the rest resume from its prefix cache (one Model, one cache): decoding is the only work that differs."""
    ours: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in CONFIGS}
    theirs: dict[str, list[dict[str, Any]]] = {name: [] for name in MlxLmRuns.CONFIGS}
    caches = mlx_lm.prefill(ids)
    for _ in range(runs):
        for name, mode, with_draft in CONFIGS:
            with _draft_model(model, with_draft):
                ours[name].append(_ours_run(model, ids, max_tokens, mode))
            _log("mlxinfer", name, ours[name][-1])
        for name in theirs:
            theirs[name].append(mlx_lm.run(name, ids, max_tokens, model.eos_token_ids, caches))
            _log("mlx-lm", name, theirs[name][-1])
    rows = [_row("mlxinfer", name, r) for name, r in ours.items()] + [_row("mlx-lm", n, r) for n, r in theirs.items()]
    return {
        "prompt_tokens": len(ids),
        "max_tokens": max_tokens,
        "draft_read_s": draft_read_s(model, ids),
        **_compared(rows),
    }


@contextmanager
def _draft_model(model: Any, keep: bool) -> Iterator[None]:
    """The model with or without its draft model. Auto drafts with the draft model when there is one, so auto by
    lookup needs it gone; one Model keeps one prefix cache, so the long prompt is prefilled once for all."""
    draft, drafting = model._draft, model._drafting
    model._draft, model._drafting = (draft, drafting) if keep else (None, None)
    try:
        yield
    finally:
        model._draft, model._drafting = draft, drafting


def _ours_run(model: Any, ids: list[int], max_tokens: int, mode: str) -> dict[str, Any]:
    s = (result := model.generate(ids, max_tokens=max_tokens, speculate=mode)).stats
    return {
        "decode_tps": s.decode_tps,
        "generated_tokens": s.generated_tokens,
        "finish": s.finish_reason,
        "ttft_s": s.ttft_s,
        "cached_tokens": s.cached_tokens,
        "drafted": s.drafted_tokens,
        "accepted": s.accepted_tokens,
        "steps": s.target_steps,  # while speculating; each emitted its kept drafts + 1
        "speculation_off": s.speculation_off,
        "switched_off": s.speculation_switched_off,
        "draft_declined": s.draft_declined,
        "ids": result.token_ids,
    }


def draft_read_s(model: Any, ids: list[int]) -> float:
    """Seconds mlxinfer's draft model takes to read the prompt, timed apart. It reads it alongside the target's
    prefill (in the TTFT of a run that drafts with it) unless its own prefix cache has it, as in every run here
    after the first that drafts with it (mlx-lm prefills its draft model with the target, before the first token)."""
    from mlxinfer.defaults import PREFILL_CHUNK_TOKENS
    from mlxinfer.engine import DraftModel, SamplingParams

    drafter = DraftModel(model.draft.model, ids, SamplingParams(), model.config.vocab_size)
    began = time.perf_counter()
    while drafter.read(PREFILL_CHUNK_TOKENS):  # in the chunks a lone request's prefill runs
        pass
    return time.perf_counter() - began


class MlxLmRuns:
    """mlx-lm on the same folders, in mlxinfer's compute dtype (the matched mode of the main bench: mlx-lm's bf16
    default runs ~8x slower on MLX's CPU backend). Each task's prompt, but its last token, is prefilled once into
    both models' caches; every run starts from a deep copy, as mlx-lm's own prompt-cache reuse does."""

    CONFIGS = ("plain", "draft model")

    def __init__(self, target: Path, draft: Path, dtype: str, num_draft_tokens: int):
        import mlx.core as mx
        from mlx_lm import load

        from mlxinfer.models.dtype import parse_dtype

        self.model, _ = load(str(target))
        self.draft, _ = load(str(draft))
        for m in (self.model, self.draft):
            m.set_dtype(parse_dtype(dtype))  # floats only; packed weights stay
            mx.eval(m.parameters())
        self.num_draft_tokens = num_draft_tokens
        for config in self.CONFIGS:  # warm-up, as mlxinfer's
            self.run(config, [1, 2, 3], 4, (), None)

    def prefill(self, ids: list[int]) -> tuple[list[Any], list[Any]]:
        """Both models' caches holding `ids` but the last token."""
        return _prefilled(self.model, ids[:-1]), _prefilled(self.draft, ids[:-1])

    def run(
        self, config: str, ids: list[int], max_tokens: int, eos: tuple[int, ...], caches: tuple | None
    ) -> dict[str, Any]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step, speculative_generate_step

        drafting = config == "draft model"
        cache = None if caches is None else copy.deepcopy(caches[0] + (caches[1] if drafting else []))
        prompt = mx.array(ids[-1:] if cache else ids)
        if drafting:
            tokens = speculative_generate_step(
                prompt, self.model, self.draft, num_draft_tokens=self.num_draft_tokens, max_tokens=max_tokens,
                prompt_cache=cache,
            )  # fmt: skip
            steps = ((t, from_draft) for t, _, from_draft in tokens)
        else:
            steps = (
                (t, False) for t, _ in generate_step(prompt, self.model, max_tokens=max_tokens, prompt_cache=cache)
            )
        began, times, out, flags = time.perf_counter(), [], [], []
        for token, from_draft in steps:
            times.append(time.perf_counter() - began)
            flags.append(from_draft)
            if token in eos:
                break  # the EOS step is timed, as mlxinfer's is; the token is not part of the answer
            out.append(int(token))
        return {
            "decode_tps": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0,
            "generated_tokens": len(out),
            "finish": "stop" if len(out) < len(times) else "length",
            "ttft_s": times[0],
            **(draft_stats(flags, max_tokens, self.num_draft_tokens) if drafting else {}),
            "ids": out,
        }


def _prefilled(model: Any, ids: list[int], chunk: int = 512) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for start in range(0, len(ids), chunk):
        model(mx.array(ids[start : start + chunk])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def draft_stats(from_draft: list[bool], max_tokens: int, k: int) -> dict[str, int]:
    """mlx-lm's drafting, read from its tokens' `from_draft` flags. Each step drafts min(k, tokens left), yields
    the drafts the target kept (flag True), then the target's own token (False) unless max_tokens came first."""
    steps = drafted = at = 0
    while at < len(from_draft):
        drafts = min(k, max_tokens - at)
        steps, drafted = steps + 1, drafted + drafts
        kept = 0
        while kept < drafts and at < len(from_draft) and from_draft[at]:
            kept, at = kept + 1, at + 1
        if at < len(from_draft) and not from_draft[at]:
            at += 1  # the target's own token ends the step
    return {"drafted": drafted, "accepted": sum(from_draft), "steps": steps, "emitted": len(from_draft)}


def _row(engine: str, config: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs: median decode tok/s (min-max); acceptance and tokens per target step over all."""
    tps = [r["decode_tps"] for r in runs]
    drafted, accepted, steps = (sum(r.get(k, 0) for r in runs) for k in ("drafted", "accepted", "steps"))
    emitted = sum(r.get("emitted", r.get("accepted", 0) + r.get("steps", 0)) for r in runs)
    return {
        "engine": engine,
        "config": config,
        "decode_tps": statistics.median(tps),
        "decode_tps_min": min(tps),
        "decode_tps_max": max(tps),
        "runs": len(runs),
        "generated_tokens": [r["generated_tokens"] for r in runs],
        "finish": [r["finish"] for r in runs],
        "ttft_s": [r["ttft_s"] for r in runs],
        "cached_tokens": [r.get("cached_tokens") for r in runs],
        "drafted_tokens": drafted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": emitted / steps if steps else None,
        "speculation_off": runs[-1].get("speculation_off", ""),
        "draft_declined": runs[-1].get("draft_declined", ""),
        "switched_off": [r.get("switched_off", 0) for r in runs],
        "same_tokens_every_run": all(r["ids"] == runs[0]["ids"] for r in runs),
        "ids": runs[0]["ids"],
    }


def _compared(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each row's decode tok/s over its engine's plain row, and whether it chose the plain row's tokens."""
    plain = {r["engine"]: r for r in rows if r["config"] in ("off", "plain")}
    for r in rows:
        base = plain[r["engine"]]
        r["ratio"] = r["decode_tps"] / base["decode_tps"] if base["decode_tps"] else None
        r["same_tokens_as_plain"] = r["ids"] == base["ids"] and r["same_tokens_every_run"]
    return {"rows": rows, "same_tokens_across_engines": plain["mlxinfer"]["ids"] == plain["mlx-lm"]["ids"]}


def step_costs(model: Any, settings: SpeculativeSettings) -> dict[str, Any]:
    """Seconds of one forward pass of the target feeding 1, 2, 3, ... positions after `curve_context` tokens of the
    document, each pass cut back afterwards (as a rejected verification is): the price of verifying k drafts."""
    import mlx.core as mx

    from mlxinfer.cache import make_cache
    from mlxinfer.cache.rewind import mark, rewind
    from mlxinfer.engine import Prefill

    decoder = model._loaded.model
    ids = model.encode_prompt(prompts(settings)["grounded"], chat=True)[: settings.curve_context]
    cache = make_cache(decoder.cache_kinds)
    mx.eval(Prefill.start(decoder, cache, mx.array(ids, dtype=mx.uint32), 512).run())
    seconds: dict[int, list[float]] = {n: [] for n in settings.curve_positions}
    for _ in range(settings.curve_repeats + 1):  # the first round warms each shape and is not kept
        for n in settings.curve_positions:
            at = mark(cache)
            began = time.perf_counter()
            mx.eval(decoder(mx.array(ids[-n:], dtype=mx.uint32)[None], cache))
            seconds[n].append(time.perf_counter() - began)
            rewind(cache, at, at.length)
    one = statistics.median(seconds[settings.curve_positions[0]][1:])
    return {
        "context_tokens": len(ids),
        "rows": [
            {"positions": n, "seconds": statistics.median(t[1:]), "x_one": statistics.median(t[1:]) / one}
            for n, t in seconds.items()
        ],
    }


def _log(engine: str, config: str, run: dict[str, Any]) -> None:
    kept = f", {run['accepted']} of {run['drafted']} drafts kept" if run.get("drafted") else ""
    print(
        f"speculative bench: {engine} {config}: {run['decode_tps']:.2f} tok/s, "
        f"{run['generated_tokens']} tokens ({run['finish']}){kept}",
        file=sys.stderr,
        flush=True,
    )


def markdown(f: dict[str, Any]) -> str:
    c, s = f["conditions"], f["settings"]
    head = (
        f"{c['date']} · {c['chip']} ({c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB) · {c['os']} · backend "
        f"{c['backend']} · mlx {c['versions']['mlx']} · mlx-lm {c['versions']['mlx-lm']} · mlxinfer "
        f"{c['versions']['mlxinfer']} (commit {f['code']}); load average {f['load_average_at_start'][0]:.1f} at start, "
        f"{f['load_average_at_end'][0]:.1f} at the end\n\n"
        f"Model: {f['model']['source']}; both engines compute in {f['model']['compute_dtype']}. Greedy; one warm-up "
        f"per engine, then {s['runs']} round{'s' * (s['runs'] != 1)}, each running every row once (interleaved); "
        "median (min-max). "
        "mlxinfer's rows share its prefix cache (only its first run prefills the prompt), mlx-lm's start from a copy "
        f"of a cache prefilled once per task. mlx-lm drafts {s['num_draft_tokens']} tokens per step; mlxinfer "
        "adapts (starts at 4)."
    )
    parts = [head] + [_task_table(name, t) for name, t in f["tasks"].items()] + [_costs_table(f["step_costs"])]
    if "tiny" in f:
        parts += ["Tiny fixture (random weights), same bench:", markdown(f["tiny"])]
    return "\n\n".join(parts)


def _task_table(name: str, t: dict[str, Any]) -> str:
    lines = [
        f"{name}: {t['prompt_tokens']}-token prompt, {t['max_tokens']} tokens max",
        "",
        "| engine | config | decode tok/s | x plain | tokens | acceptance | tokens/step | TTFT s, first run | same |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in t["rows"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%} of {r['drafted_tokens']}"
        per_step = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
        off = f" (off: {r['speculation_off']})" if r["speculation_off"] else ""
        off += " (draft model not used: known slower here)" if r.get("draft_declined") else ""
        lines.append(
            f"| {r['engine']} | {r['config']}{off} | {r['decode_tps']:.2f} ({r['decode_tps_min']:.2f}-"
            f"{r['decode_tps_max']:.2f}) | {r['ratio']:.2f}x | {', '.join(map(str, r['generated_tokens']))} "
            f"({r['finish'][0]}) | {rate} | {per_step} | {r['ttft_s'][0]:.2f} | "
            f"{'yes' if r['same_tokens_as_plain'] else 'NO'} |"
        )
    same = "the same" if t["same_tokens_across_engines"] else "NOT the same"
    lines += ["", f"- mlxinfer and mlx-lm decoded {same} greedy tokens"]
    lines.append(f"- mlxinfer's draft model reads the prompt in {t['draft_read_s']:.2f} s (timed apart): in the TTFT "
                 "of its first run that drafts with it, then from its own prefix cache")  # fmt: skip
    return "\n".join(lines)


def _costs_table(costs: dict[str, Any]) -> str:
    lines = [
        f"One forward pass of the target after {costs['context_tokens']} tokens, by positions fed (median)",
        "",
        "| positions | seconds | x one |",
        "|---|---|---|",
    ]
    lines += [f"| {r['positions']} | {r['seconds']:.4f} | {r['x_one']:.2f} |" for r in costs["rows"]]
    return "\n".join(lines)
