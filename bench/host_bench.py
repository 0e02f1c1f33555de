"""Host work per decoded token: mlxinfer against mlx-lm on a dispatch-bound model, in one run (issue 37 item 1).

On an Apple GPU a small model's decode step takes 2-8 ms, so the Python around each step decides speed there. A
model small enough that MLX's own work per step is a fraction of a millisecond shows that host work on any
machine: a llama of 4 layers, 256 wide, with the tiny fixtures' byte-level tokenizer padded to 512 ids (random
weights, float32, in transformers' layout). A real vocabulary would not do here: on this CPU reading a
49,152 x 256 float32 head alone takes ~6 ms a token. Every case decodes the same
prompt ids for the same number of tokens, greedily, and at temperature 1 among the 64 likeliest (a random
model's greedy answer repeats itself, so prompt lookup drafts it; sampled, nothing is drafted); the runs are
interleaved, case after case, and each case's best run is kept (the spread on a shared machine is one-sided:
other work only slows a run).

- "floor": a bare pipelined loop over mlx-lm's model (forward, sampler, `mx.async_eval` of the next step before
  reading this one: what mlx-lm's `generate_step` does without its detokenizer and bookkeeping).
- mlx-lm's `stream_generate`; mlxinfer's `Model.stream` with `speculate` off and auto, with a stop string that
  never matches, and under a grammar (a regular expression every token satisfies, so the answer is as long).

Host work per token is the main thread's CPU time per token (`time.thread_time`): building the step's graph,
MLX's dispatch of it (`mx.async_eval`), and each engine's own Python; the device's work and waiting for it are not
in it, nor is other load on the machine, so it separates far better than wall time on a shared machine. Its part
above the floor's is what an engine adds to a bare loop.

    python -m bench.host_bench [--tokens 200] [--runs 3] [--profile CASE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxinfer.paths import cache_dir
from mlxinfer.speed.conditions import conditions, described

from .hybrid_models import BOS_ID, EOS_ID, Shape, write_tokenizer

SHAPE = Shape(
    "a llama of 4 layers, hidden 256, 512 byte-level ids (random weights): dispatch-bound on any device",
    {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "rope_theta": 10000.0,
    },
)  # fmt: skip
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# A stop string no answer contains, so the stop matcher runs on every token and never ends the answer.
NEVER = "\x00never\x00"
# Every token the fixture can emit decodes to text this matches (a grammar that checks each token, cuts nothing).
ANYTHING = r"(.|\n)*"
RESULTS = Path(__file__).parent / "results"
# <|endoftext|>, <|im_start|>, <|im_end|>, and the vocabulary's last id, which both engines also end a sequence at
SPECIAL_IDS = [BOS_ID, BOS_ID + 1, EOS_ID, 511]
TOP_K = 64  # sampled cases: far above where a special token's logit of 0 ranks


def prepare_fixture(root: Path | None = None, shape: Shape = SHAPE, name: str = "host-bench-llama-256x4-v512") -> Path:
    """A random llama of `shape` (the dispatch-bound one by default), built once and cached as `name`, in
    transformers' layout, written with NumPy alone (so that a GPU machine runs the benches without torch). Its
    special tokens' embeddings are zero, so their logits are 0, the middle of a random model's: greedy and top-k
    sampling never pick them (an EOS would end a run early, and mlx-lm's streaming detokenizer has no text for the
    others)."""
    from safetensors.numpy import save_file

    out = (root or cache_dir() / "bench-models") / name
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {**shape.config, "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6}
    config.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=BOS_ID, torch_dtype="float32")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    weights = _random_llama(config)
    weights["model.embed_tokens.weight"][SPECIAL_IDS] = 0
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    write_tokenizer(tmp, config["vocab_size"], config["max_position_embeddings"])
    os.replace(tmp, out)
    return out


def _random_llama(c: dict[str, Any]) -> dict[str, np.ndarray]:
    """A llama's tensors, normal with transformers' initializer range (0.02), norms at 1."""
    rng = np.random.default_rng(0)
    hidden, inner, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {layer + "self_attn.q_proj.weight": (q, hidden), layer + "self_attn.k_proj.weight": (kv, hidden),
                   layer + "self_attn.v_proj.weight": (kv, hidden), layer + "self_attn.o_proj.weight": (hidden, q),
                   layer + "mlp.gate_proj.weight": (inner, hidden), layer + "mlp.up_proj.weight": (inner, hidden),
                   layer + "mlp.down_proj.weight": (hidden, inner)}  # fmt: skip
    weights = {name: (0.02 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}
    norms = ["model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight"
        for i in range(c["num_hidden_layers"])
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    return weights | {name: np.ones(hidden, np.float32) for name in norms}


Run = Callable[[], tuple[int, str]]  # a case's run: how many tokens it made, and what speculation did


def cases(folder: Path, tokens: int, temperature: float) -> dict[str, Run]:
    """Each case: a function decoding `tokens` tokens (greedy at temperature 0) from the same prompt ids."""
    import mlx_lm
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    import mlxinfer

    ours = mlxinfer.load(folder, dtype="float32")
    ids = ours.encode_prompt(PROMPT, chat=True)
    theirs, tokenizer = mlx_lm.load(str(folder))
    tokenizer.eos_token_ids = set(ours.eos_token_ids)  # mlx-lm also counts this vocabulary's last id (511) as one
    sampler = make_sampler(temp=temperature, top_k=TOP_K)

    def floor() -> tuple[int, str]:
        cache = make_prompt_cache(theirs)
        y = sampler(theirs(mx.array([ids]), cache=cache)[:, -1, :])
        mx.async_eval(y)
        for _ in range(tokens - 1):
            following = sampler(theirs(y[:, None], cache=cache)[:, -1, :])
            mx.async_eval(following)
            y.item()
            y = following
        y.item()
        return tokens, ""

    def mlx_lm_case() -> tuple[int, str]:
        return sum(1 for _ in stream_generate(theirs, tokenizer, ids, max_tokens=tokens, sampler=sampler)), ""

    def ours_case(**options: Any) -> Run:
        def run() -> tuple[int, str]:
            sampling = {"temperature": temperature, "top_k": TOP_K}
            stream = ours.stream(ids, max_tokens=tokens, use_cache=False, **sampling, **options)
            for _ in stream:
                pass
            return stream.stats.generated_tokens, stream.stats.speculation_summary()

        return run

    return {
        "floor (bare loop)": floor,
        "mlx-lm": mlx_lm_case,
        "mlxinfer, speculate off": ours_case(speculate="off"),
        "mlxinfer, speculate auto": ours_case(speculate="auto"),
        "mlxinfer, off + stop string": ours_case(speculate="off", stop=[NEVER]),
        "mlxinfer, auto + stop string": ours_case(speculate="auto", stop=[NEVER]),
        "mlxinfer, off + grammar": ours_case(speculate="off", regex=ANYTHING),
    }


def measure(runs: dict[str, Run], rounds: int) -> dict[str, dict[str, Any]]:
    """Each case's best tokens per second and least main-thread CPU time per token over `rounds` interleaved rounds
    (after one warm-up round). The main thread's CPU time is the host work: graph building, MLX's dispatch, the
    engine's Python; waiting for the device is not in it, nor is other work on the machine (unlike wall time)."""
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    made: dict[str, tuple[int, str]] = {}
    for round_ in range(rounds + 1):
        for name, run in runs.items():
            start, cpu = time.perf_counter(), time.thread_time()
            made[name] = run()
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            if round_:  # round 0 warms every case up (compiles, allocations, the first grammar)
                seen[name].append((made[name][0] / wall, 1e6 * cpu / made[name][0]))
    return {
        name: {
            "best_tps": max(tps for tps, _ in runs_),
            "all_tps": [tps for tps, _ in runs_],
            "host_us_per_token": min(us for _, us in runs_),
            "tokens": made[name][0],
            "speculation": made[name][1],
        }
        for name, runs_ in seen.items()
    }


def figures(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case: tok/s, ms per token, host work per token and its part above the floor's, the ratio to mlx-lm."""
    floor_us = results["floor (bare loop)"]["host_us_per_token"]
    mlx_lm_tps = results["mlx-lm"]["best_tps"]
    return {
        name: {
            **r,
            "ms_per_token": 1000 / r["best_tps"],
            "host_us_over_floor": r["host_us_per_token"] - floor_us,
            "vs_mlx_lm": r["best_tps"] / mlx_lm_tps,
        }
        for name, r in results.items()
    }


def markdown(report: dict[str, Any]) -> str:
    head = (
        f"{described(report['conditions'])}; {report['tokens']} tokens per run, best of {report['rounds']} "
        f"interleaved rounds; load average at start {report['load_average_at_start'][0]:.1f}"
    )
    parts = [head]
    for temperature, table in report["by_temperature"].items():
        rows = [f"Temperature {temperature}:", ""]
        rows.append("| case | tok/s (best) | all runs | ms/token | host us/token (vs floor) | vs mlx-lm | drafts |")
        rows.append("|---|---|---|---|---|---|---|")
        for name, f in table.items():
            spread = ", ".join(f"{t:.0f}" for t in f["all_tps"])
            host = f"{f['host_us_per_token']:.0f} ({f['host_us_over_floor']:+.0f})"
            rows.append(
                f"| {name} | {f['best_tps']:.0f} | {spread} | {f['ms_per_token']:.3f} | {host} | "
                f"{f['vs_mlx_lm']:.2f}x | {f['speculation'] or '-'} |"
            )
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


def profile(run: Run, out: Path) -> None:
    """cProfile of one run of a case (after a warm-up run), its top functions by own time printed."""
    run()
    profiler = cProfile.Profile()
    profiler.runcall(run)
    profiler.dump_stats(out)
    pstats.Stats(str(out)).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds after the warm-up round")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--profile", metavar="CASE", help="profile one case (a name from the table) instead")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_average = os.getloadavg()
    folder = prepare_fixture()
    if args.profile:
        profile(cases(folder, args.tokens, args.temperatures[0])[args.profile], args.out / "host-bench.prof")
        return
    by_temperature = {}
    for temperature in args.temperatures:
        results = measure(cases(folder, args.tokens, temperature), args.runs)
        short = [name for name, r in results.items() if r["tokens"] < args.tokens // 2]
        if short:
            raise SystemExit(f"host bench: {short} ended before {args.tokens // 2} tokens (an EOS): too few to time")
        by_temperature[temperature] = figures(results)
    report = {
        "conditions": conditions(),
        "load_average_at_start": load_average,
        "tokens": args.tokens,
        "rounds": args.runs,
        "model": SHAPE.source,
        "by_temperature": by_temperature,
    }
    save_report(args.out, "host", report, markdown(report))


def save_report(out: Path, name: str, report: dict[str, Any], text: str) -> None:
    """`report` as JSON and `text` as markdown in `out` (named by date, host and `name`); the markdown printed."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{date.today().isoformat()}-{os.uname().nodename}-{name}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
