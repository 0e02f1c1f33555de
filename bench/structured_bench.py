"""Structured-output figures: decode tokens/s with and without a JSON schema (same prompt, same max_tokens,
greedy), the time to the first token with a new schema (compile included) and with the same schema again
(cached), grammar compile times, and the grammar's own cost per token.

Everything runs through the Python API (`model.stream(..., schema=...)`) on the real default model
(SmolLM2-135M-Instruct, the GGUF file, whose tokenizer llguidance builds from the GGUF's vocabulary); `--quick`
uses the tiny llama fixture. The prefix cache is off (`use_cache=False`): every request prefills its whole
prompt, so TTFT rows differ only by the grammar. Runs are interleaved, medians reported.

Where llama-cpp-python is installed (optional, never a dependency; --quick skips it), llama.cpp runs the same GGUF
file, the same prompt and schema (as GBNF, `LlamaGrammar.from_json_schema`), between mlxinfer's runs.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .hybrid_models import TINY

PROMPT = "Describe a fictional person as JSON with their name, age, occupation, skills, address and a long biography."
# A realistic response_format: nested object, bounded integer, enum, array, and a long free-text field so that
# both runs of the decode figure go on to max_tokens rather than stopping at different lengths.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "occupation": {"type": "string", "enum": ["engineer", "teacher", "doctor", "artist", "farmer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 2, "maxItems": 6},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string"}},
            "required": ["city", "country"],
        },
        "biography": {"type": "string", "minLength": 1000},
    },
    "required": ["name", "age", "occupation", "skills", "address", "biography"],
}
SMALL = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def large_schema(fields: int = 60) -> dict[str, Any]:
    """An API-sized schema: `fields` properties of mixed kinds, a third of them nested objects."""
    kinds = [
        {"type": "string", "maxLength": 64},
        {"type": "integer", "minimum": -1000, "maximum": 1000},
        {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["a", "b", "c"]}}},
        {"type": "boolean"},
        {"type": "string", "format": "date"},
    ]
    properties = {f"field_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": properties, "required": list(properties)[: fields // 2]}


@dataclass
class StructuredSettings:
    max_tokens: int = 64  # the decode figure's tokens per run (both runs reach it: see PERSON)
    runs: int = 5  # per row, interleaved; medians reported
    compile_runs: int = 5  # fresh compiles per grammar for the compile figure
    llama_cpp: bool = True  # run llama.cpp's GBNF rows too, where llama-cpp-python imports

    @classmethod
    def quick(cls) -> StructuredSettings:
        return cls(max_tokens=16, runs=1, compile_runs=2, llama_cpp=False)


def structured_model(quick: bool) -> tuple[Path, str]:
    """The bench's model and where it comes from: the default model, or the tiny fixture with --quick."""
    if quick:
        return TINY / "llama_classic", "tiny test fixture (tests/fixtures/tiny, random weights)"
    from mlxinfer.default_model import default_model_path

    return default_model_path(), "the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)"


def run_structured_bench(path: Path, source: str, settings: StructuredSettings) -> dict[str, Any]:
    import mlxinfer
    from mlxinfer.speed.conditions import conditions

    model = mlxinfer.load(path, prefix_cache_bytes=0)
    prompt = [{"role": "user", "content": PROMPT}]
    figures: dict[str, Any] = {
        "conditions": conditions(),
        # Other work on this machine slows every row; runs are interleaved so the ratios hold up better.
        "load_average_at_start": os.getloadavg(),
        "settings": asdict(settings),
        "model": {"path": str(path), "source": source, "compute_dtype": model.compute_dtype},
        "prompt_tokens": len(model.encode_prompt(prompt, chat=True)),
        "vocabulary_build_s": _vocabulary_build_s(model),
    }
    model.generate(prompt, max_tokens=2, use_cache=False)  # warm-up: kernels, allocator
    llama, figures["llama_cpp"] = _llama_cpp_runner(path, model, prompt, settings)
    if llama is not None:
        figures["conditions"]["versions"]["llama-cpp-python"] = llama.version
    figures["decode"] = _decode(model, prompt, settings, llama)
    figures["mask_us_per_token"] = _mask_cost(model, figures["decode"]["json_schema"]["ids"])
    figures["ttft"] = _ttft(model, prompt, settings)
    figures["compile"] = _compile_rows(model, settings)
    if llama is not None:
        figures["llama_cpp"] = llama.figures()
    return figures


def _vocabulary_build_s(model: Any) -> float:
    """llguidance's view of the tokenizer, built once per model (the first structured request pays it)."""
    from mlxinfer.grammar import vocabulary

    start = time.perf_counter()
    vocabulary(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
    return time.perf_counter() - start


def _decode(model: Any, prompt: list[dict[str, str]], s: StructuredSettings, llama: Any = None) -> dict[str, Any]:
    """Decode tok/s of the same prompt, greedy, unconstrained and under PERSON, runs interleaved (with
    llama.cpp's pair of runs after each of mlxinfer's, where `llama` is given)."""
    runs: dict[str, list[Any]] = {"unconstrained": [], "json_schema": []}
    for _ in range(s.runs):
        for row, options in (("unconstrained", {}), ("json_schema", {"schema": PERSON})):
            result = model.generate(prompt, max_tokens=s.max_tokens, use_cache=False, **options)
            runs[row].append(result)
            print(f"structured bench: {row}: {result.stats.summary()}", file=sys.stderr, flush=True)
        if llama is not None:
            llama.run_pair()
    rows: dict[str, Any] = {row: _decode_summary(results) for row, results in runs.items()}
    tps = {row: [r.stats.decode_tps for r in results] for row, results in runs.items()}
    return rows | _paired(tps["unconstrained"], tps["json_schema"])


def _paired(plain_tps: list[float], constrained_tps: list[float]) -> dict[str, float]:
    """Constrained / unconstrained decode tok/s. Each pair ran back to back: the ratio within a pair is less
    exposed to this machine's drift. Also as time added per token: what a device with shorter steps would feel."""
    ratios = [c / u for u, c in zip(plain_tps, constrained_tps)]
    added = [1e3 / c - 1e3 / u for u, c in zip(plain_tps, constrained_tps)]
    return {
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "added_ms_per_token": statistics.median(added),
    }


def _decode_summary(results: list[Any]) -> dict[str, Any]:
    tps = [r.stats.decode_tps for r in results]
    return {
        "decode_tps": statistics.median(tps),
        "decode_tps_min": min(tps),
        "decode_tps_max": max(tps),
        "generated_tokens": [r.stats.generated_tokens for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "text_head": results[0].text[:160],
        "ids": results[0].token_ids,
    }


def _mask_cost(model: Any, ids: list[int]) -> dict[str, float]:
    """The grammar's host work per token, replayed on the constrained answer: the mask (llguidance's bitmask,
    unpacked into a device array) and advancing the matcher. The engine overlaps the mask with the device step."""
    import mlx.core as mx

    from mlxinfer.engine import structure_of
    from mlxinfer.grammar import allowed_tokens

    constraint = structure_of(schema=PERSON).constraint(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
    times = []
    for token in ids:
        start = time.perf_counter()
        mx.eval(allowed_tokens([constraint], model.config.vocab_size))
        constraint.advance(token)
        times.append((time.perf_counter() - start) * 1e6)
    rest = sorted(times[1:])  # the first mask builds the lexer states the rest reuse: reported apart
    return {
        "first_us": times[0],
        "median_us": statistics.median(rest),
        "p90_us": rest[int(0.9 * (len(rest) - 1))],
        "max_us": rest[-1],
        "tokens": len(times),
    }


def _ttft(model: Any, prompt: list[dict[str, str]], s: StructuredSettings) -> dict[str, Any]:
    """Wall time from the call to the end of a 1-token answer: compile (when new) + prefill + first token."""
    rows: dict[str, list[float]] = {"unconstrained": [], "new schema": [], "same schema again": []}
    for run in range(s.runs):
        schema = _variant(PERSON, f"bench_run_{run}_{time.time_ns()}")  # never seen before: compiled now
        rows["unconstrained"].append(_one_token_s(model, prompt))
        for row in ("new schema", "same schema again"):
            rows[row].append(_one_token_s(model, prompt, schema=schema))
    return {row: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)} for row, t in rows.items()}


def _one_token_s(model: Any, prompt: list[dict[str, str]], **structure: Any) -> float:
    began = time.perf_counter()
    for _ in model.stream(prompt, max_tokens=1, use_cache=False, **structure):  # the grammar compiles in stream()
        pass
    return time.perf_counter() - began


def _compile_rows(model: Any, s: StructuredSettings) -> list[dict[str, Any]]:
    """Compile time of fresh grammars of each kind (a unique property or option each time, so never cached),
    and the lookup when the same grammar comes again."""
    from mlxinfer.engine import structure_of
    from mlxinfer.grammar import vocabulary

    vocab = vocabulary(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
    kinds: dict[str, Callable[[str], dict[str, Any]]] = {
        "small schema (1 property)": lambda tag: {"schema": _variant(SMALL, tag)},
        "person schema (the decode figure's)": lambda tag: {"schema": _variant(PERSON, tag)},
        "large schema (60 properties)": lambda tag: {"schema": _variant(large_schema(), tag)},
        "regex (ISO date-time)": lambda tag: {"regex": r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z " + tag},
        "choices (20 options)": lambda tag: {"choices": [f"{tag}-option-{i}" for i in range(20)]},
    }
    rows = []
    for name, make in kinds.items():
        fresh, cached = [], []
        for run in range(s.compile_runs):
            structure = structure_of(**make(f"c{run}_{time.time_ns()}"))
            compiled_before = vocab.compiled_now
            fresh.append(_constraint_s(model, structure))
            assert vocab.compiled_now == compiled_before + 1, "a fresh grammar was found in the cache"
            cached.append(_constraint_s(model, structure))
        rows.append(
            {
                "grammar": name,
                "grammar_chars": len(structure.grammar.text),
                "compile_ms": statistics.median(fresh) * 1e3,
                "compile_ms_max": max(fresh) * 1e3,
                "cached_us": statistics.median(cached) * 1e6,
            }
        )
    return rows


def _constraint_s(model: Any, structure: Any) -> float:
    start = time.perf_counter()
    structure.constraint(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
    return time.perf_counter() - start


def _variant(schema: dict[str, Any], tag: str) -> dict[str, Any]:
    """`schema` with one more optional property named after `tag`: a different grammar, the same answers."""
    changed = copy.deepcopy(schema)
    changed["properties"][f"x_{tag}"] = {"type": "boolean"}
    return changed


def _llama_cpp_runner(
    path: Path, model: Any, prompt: list[dict[str, str]], s: StructuredSettings
) -> tuple[LlamaCppRuns | None, str]:
    """llama.cpp's runs where they can happen, else None and the reason the figures will show."""
    if not s.llama_cpp:
        return None, "not measured: --quick runs the tiny fixture only"
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "not measured here: llama-cpp-python is not installed"
    if path.suffix != ".gguf":
        return None, f"not measured: llama.cpp reads GGUF files, and {path.name} is not one"
    return LlamaCppRuns(path, model, prompt, s.max_tokens), "measured"


class LlamaCppRuns:
    """llama.cpp (llama-cpp-python) on the same GGUF file, prompt, schema, greedy and max_tokens as mlxinfer,
    each request from an empty context (as mlxinfer's prefix cache is off), timed with streaming completion."""

    def __init__(self, path: Path, model: Any, prompt: list[dict[str, str]], max_tokens: int) -> None:
        import llama_cpp
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        self.version = llama_cpp.__version__
        self.max_tokens = max_tokens
        self.n_threads = 2  # the cores of the machine these figures were measured on
        ids = model.encode_prompt(prompt, chat=True)
        # mlxinfer's rendered chat prompt as a raw completion prompt: llama.cpp tokenizes it (special tokens on,
        # no BOS for this model); `same_prompt_tokens` says whether it saw mlxinfer's ids.
        self.text = model.tokenizer.apply_chat_template(prompt)
        self.n_ctx = 2 * (len(ids) + max_tokens)
        began = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=self.n_threads, n_ctx=self.n_ctx, verbose=False)
        self.load_s = time.perf_counter() - began
        self.prompt_tokens = 0
        self._complete(None, max_tokens=1)  # warm-up; with one token nothing past the prompt is evaluated
        self.prompt_tokens = self.llm.n_tokens
        self.same_prompt_tokens = self.llm._input_ids.tolist() == ids
        self.gbnf_chars = len(json_schema_to_gbnf(json.dumps(PERSON)))
        self.runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "gbnf": []}
        self.build_s: list[float] = []

    def run_pair(self) -> None:
        """One run without a grammar, then one with a grammar built fresh from PERSON."""
        import llama_cpp

        self.runs["unconstrained"].append(self._complete(None, self.max_tokens))
        began = time.perf_counter()
        grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(PERSON), verbose=False)
        self.build_s.append(time.perf_counter() - began)
        self.runs["gbnf"].append(self._complete(grammar, self.max_tokens))
        for row, runs in self.runs.items():
            r = runs[-1]
            print(
                f"structured bench: llama.cpp {row}: {r['tokens']} tokens ({r['finish']}), TTFT {r['ttft_s']:.3f} s, "
                f"decode {r['decode_tps']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )

    def _complete(self, grammar: Any, max_tokens: int) -> dict[str, Any]:
        self.llm.reset()  # no prefix reuse from the previous request: the whole prompt is evaluated again
        began = time.perf_counter()
        first = end = 0.0
        texts, finish = [], None
        stream = self.llm.create_completion(
            self.text, max_tokens=max_tokens, temperature=0.0, stream=True, grammar=grammar
        )
        for chunk in stream:
            end = time.perf_counter() - began
            first = first or end
            texts.append(chunk["choices"][0]["text"])
            finish = chunk["choices"][0]["finish_reason"] or finish
        # The last sampled token is evaluated only if another follows: at max_tokens it was not, and an EOS
        # (finish "stop") is sampled but neither evaluated nor counted as a token of the answer.
        tokens = self.llm.n_tokens - self.prompt_tokens + (finish == "length")
        steps_after_first = tokens - 1 + (finish == "stop")  # the EOS step took a decode step too
        return {
            "ttft_s": first,
            "decode_tps": steps_after_first / max(end - first, 1e-9),
            "tokens": tokens,
            "finish": finish,
            "text": "".join(texts),
        }

    def figures(self) -> dict[str, Any]:
        rows: dict[str, Any] = {row: _llama_summary(runs) for row, runs in self.runs.items()}
        tps = {row: [r["decode_tps"] for r in runs] for row, runs in self.runs.items()}
        return {
            "llama_cpp_python": self.version,
            "n_threads": self.n_threads,
            "n_ctx": self.n_ctx,
            "load_s": self.load_s,
            "prompt": "mlxinfer's rendered chat prompt text, passed as a raw completion prompt",
            "prompt_tokens": self.prompt_tokens,
            "same_prompt_tokens": self.same_prompt_tokens,
            "gbnf_chars": self.gbnf_chars,
            "grammar_build_ms": statistics.median(self.build_s) * 1e3,
            "grammar_build_ms_max": max(self.build_s) * 1e3,
            **rows,
            **_paired(tps["unconstrained"], tps["gbnf"]),
        }


def _llama_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tps, ttft = [r["decode_tps"] for r in runs], [r["ttft_s"] for r in runs]
    return {
        "decode_tps": statistics.median(tps),
        "decode_tps_min": min(tps),
        "decode_tps_max": max(tps),
        "ttft_s": statistics.median(ttft),
        "ttft_s_min": min(ttft),
        "ttft_s_max": max(ttft),
        "generated_tokens": [r["tokens"] for r in runs],
        "finish_reasons": [r["finish"] for r in runs],
        "text_head": runs[0]["text"][:160],
    }


def markdown(f: dict[str, Any]) -> str:
    c, s = f["conditions"], f["settings"]
    head = (
        f"{c['date']} · {c['chip']} ({c['cores']} cores, {c['memory_bytes'] / 2**30:.0f} GiB) · {c['os']} · backend "
        f"{c['backend']} · mlx {c['versions']['mlx']} · mlxinfer {c['versions']['mlxinfer']}"
        + (f" · llama-cpp-python {c['versions']['llama-cpp-python']}" if "llama-cpp-python" in c["versions"] else "")
        + f"; load average at start "
        f"{f['load_average_at_start'][0]:.1f}\n\n"
        f"Model: {f['model']['source']}, compute {f['model']['compute_dtype']}; chat prompt of {f['prompt_tokens']} "
        f"tokens; greedy; prefix cache off; median of {s['runs']} interleaved runs (min-max). llguidance's view of "
        f"the tokenizer took {f['vocabulary_build_s'] * 1e3:.0f} ms to build (once per model)."
    )
    return "\n\n".join([head, _decode_table(f), _ttft_table(f), _compile_table(f), _llama_cpp_table(f)])


def _decode_table(f: dict[str, Any]) -> str:
    d, mask = f["decode"], f["mask_us_per_token"]
    lines = [
        f"Decode, {f['settings']['max_tokens']} tokens max",
        "",
        "| run | decode tok/s | tokens | finish |",
        "|---|---|---|---|",
    ]
    for row in ("unconstrained", "json_schema"):
        r = d[row]
        lines.append(
            f"| {row.replace('_', ' ')} | {r['decode_tps']:.2f} ({r['decode_tps_min']:.2f}-{r['decode_tps_max']:.2f})"
            f" | {', '.join(map(str, r['generated_tokens']))} | {', '.join(r['finish_reasons'])} |"
        )
    lines += [
        "",
        f"- with a schema / without, median of the back-to-back pairs: {d['ratio']:.3f}x ({d['ratio_min']:.3f}-"
        f"{d['ratio_max']:.3f}; goal: at least 0.9x); time added per token: {d['added_ms_per_token']:.2f} ms",
        f"- the grammar's host work per token (mask + advance, replayed on the constrained answer's "
        f"{mask['tokens']} tokens): first token {mask['first_us'] / 1e3:.1f} ms, then median "
        f"{mask['median_us']:.0f} µs, p90 {mask['p90_us']:.0f} µs, max {mask['max_us']:.0f} µs",
    ]
    return "\n".join(lines)


def _ttft_table(f: dict[str, Any]) -> str:
    lines = [
        "Time to the first token, from the call (compile + prefill + one token)",
        "",
        "| request | seconds |",
        "|---|---|",
    ]
    for row, t in f["ttft"].items():
        lines.append(f"| {row} | {t['median_s']:.3f} ({t['min_s']:.3f}-{t['max_s']:.3f}) |")
    return "\n".join(lines)


def _compile_table(f: dict[str, Any]) -> str:
    lines = [
        f"Grammar compile (fresh grammar each time, median of {f['settings']['compile_runs']}) and cached lookup",
        "",
        "| grammar | grammar chars | compile ms (max) | cached µs |",
        "|---|---|---|---|",
    ]
    for r in f["compile"]:
        lines.append(
            f"| {r['grammar']} | {r['grammar_chars']:,} | {r['compile_ms']:.2f} ({r['compile_ms_max']:.2f}) | "
            f"{r['cached_us']:.0f} |"
        )
    return "\n".join(lines)


def _llama_cpp_table(f: dict[str, Any]) -> str:
    g = f["llama_cpp"]
    if isinstance(g, str):
        return f"llama.cpp GBNF: {g}"
    prompt = "the same" if g["same_prompt_tokens"] else "NOT the same"
    lines = [
        f"llama.cpp GBNF: llama-cpp-python {g['llama_cpp_python']}, the same GGUF file, n_threads {g['n_threads']}, "
        f"n_ctx {g['n_ctx']}, greedy, {f['settings']['max_tokens']} tokens max, a fresh context per request; "
        f"mlxinfer's rendered chat prompt as raw text ({g['prompt_tokens']} tokens, {prompt} ids as mlxinfer's); "
        f"grammar `LlamaGrammar.from_json_schema` of the same schema ({g['gbnf_chars']:,} chars of GBNF); "
        "streaming completion, runs interleaved with mlxinfer's",
        "",
        "| run | decode tok/s | tokens | finish | time to first token, s |",
        "|---|---|---|---|---|",
    ]
    for row, name in (("unconstrained", "unconstrained"), ("gbnf", "GBNF (json schema)")):
        r = g[row]
        lines.append(
            f"| {name} | {r['decode_tps']:.2f} ({r['decode_tps_min']:.2f}-{r['decode_tps_max']:.2f}) | "
            f"{', '.join(map(str, r['generated_tokens']))} | {', '.join(r['finish_reasons'])} | "
            f"{r['ttft_s']:.3f} ({r['ttft_s_min']:.3f}-{r['ttft_s_max']:.3f}) |"
        )
    d = f["decode"]
    lines += [
        "",
        f"- with the grammar / without, median of the back-to-back pairs: llama.cpp {g['ratio']:.3f}x "
        f"({g['ratio_min']:.3f}-{g['ratio_max']:.3f}), time added per token {g['added_ms_per_token']:.2f} ms; "
        f"mlxinfer {d['ratio']:.3f}x ({d['ratio_min']:.3f}-{d['ratio_max']:.3f}), "
        f"{d['added_ms_per_token']:.2f} ms",
        f"- grammar build (`from_json_schema`, fresh each run, median of {len(g['gbnf']['generated_tokens'])}): "
        f"{g['grammar_build_ms']:.2f} ms (max {g['grammar_build_ms_max']:.2f}); llama.cpp parses the GBNF in "
        "every request (inside the time to first token): llama-cpp-python keeps no compiled grammar",
    ]
    return "\n".join(lines)
