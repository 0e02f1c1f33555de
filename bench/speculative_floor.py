"""Auto's floor, with more rounds: mlxinfer's decode tok/s with `speculate` off, auto (prompt lookup) and auto with
the draft model loaded, on the speculative bench's two tasks and files, interleaved round by round.

The full speculative bench (`python -m bench --speculative-only`) spends most of its time on prefills and on
mlx-lm; two rounds of it cannot resolve 5% on a noisy machine. This runs only the rows the goal "never below 0.95x
with auto" is about, for many rounds, and reports each round's ratio to the off run beside it as well as the
medians. Usage: `python -m bench.speculative_floor [--rounds 8] [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from .speculative_bench import QUESTION, SpeculativeSettings, _draft_model, _ours_run, prompts, speculative_models

ROWS = (("off", "off", False), ("auto", "auto", False), ("auto + draft model", "auto", True))


def run_floor(rounds: int, quick: bool) -> dict[str, Any]:
    import mlxinfer
    from mlxinfer.speed.conditions import conditions

    target, draft, source = speculative_models(quick)
    settings = SpeculativeSettings.quick() if quick else SpeculativeSettings()
    model = mlxinfer.load(target, draft_model=draft)
    figures: dict[str, Any] = {"conditions": conditions(), "load_average_at_start": os.getloadavg()}
    figures |= {"model": source, "compute_dtype": model.compute_dtype, "rounds": rounds}
    for mode in ("off", "draft"):  # warm-up, as the speculative bench's: kernels, and the draft model timed once
        model.chat(QUESTION, max_tokens=8, speculate=mode)
    figures["tasks"] = {}
    for task, text in prompts(settings).items():
        ids = model.encode_prompt(text, chat=True)
        tokens = settings.grounded_tokens if task == "grounded" else settings.chat_tokens
        model.generate(ids, max_tokens=1, speculate="off")  # the prompt into the prefix cache, outside the rounds
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in ROWS}
        for _ in range(rounds):
            for name, mode, with_draft in ROWS:
                with _draft_model(model, with_draft):
                    run = _ours_run(model, ids, tokens, mode)
                runs[name].append({k: v for k, v in run.items() if k != "ids"} | {"same": run["ids"]})
        figures["tasks"][task] = _summary(ids, tokens, runs)
    figures["load_average_at_end"] = os.getloadavg()
    return figures


def _summary(ids: list[int], tokens: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    off = [r["decode_tps"] for r in runs["off"]]
    rows = {}
    for name, got in runs.items():
        tps = [r["decode_tps"] for r in got]
        paired = [t / o for t, o in zip(tps, off)]  # each round's ratio to the off run beside it
        rows[name] = {
            "decode_tps": tps,
            "median_ratio": statistics.median(tps) / statistics.median(off),
            "paired_ratios": paired,
            "median_paired_ratio": statistics.median(paired),
            "drafted": sum(r["drafted"] for r in got),
            "accepted": sum(r["accepted"] for r in got),
            "draft_declined": sorted({r["draft_declined"] for r in got} - {""}),
            "same_tokens_as_off": all(r["same"] == runs["off"][0]["same"] for r in got),
        }
    return {"prompt_tokens": len(ids), "max_tokens": tokens, "rows": rows}


def markdown(f: dict[str, Any]) -> str:
    c = f["conditions"]
    lines = [
        f"{c['date']} · {c['chip']} ({c['cores']} cores) · {c['os']} · backend {c['backend']} · mlx "
        f"{c['versions']['mlx']} · mlx-lm {c['versions']['mlx-lm']}; load average {f['load_average_at_start'][0]:.1f}"
        f" at start, {f['load_average_at_end'][0]:.1f} at the end. {f['model']}; compute {f['compute_dtype']}; "
        f"greedy; {f['rounds']} rounds, interleaved; every run resumes the prompt from the prefix cache.",
    ]
    for task, t in f["tasks"].items():
        lines += ["", f"{task}: {t['prompt_tokens']}-token prompt, {t['max_tokens']} tokens", ""]
        lines += ["| config | decode tok/s, median (min-max) | x off, medians | x off, median of rounds | drafts "
                  "kept | same tokens |", "|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in t["rows"].items():
            tps, kept = r["decode_tps"], f"{r['accepted']} of {r['drafted']}" if r["drafted"] else "-"
            declined = f" ({'; '.join(r['draft_declined'])})" if r["draft_declined"] else ""
            lines.append(
                f"| {name}{declined} | {statistics.median(tps):.2f} ({min(tps):.2f}-{max(tps):.2f}) | "
                f"{r['median_ratio']:.2f}x | {r['median_paired_ratio']:.2f}x | {kept} | "
                f"{'yes' if r['same_tokens_as_off'] else 'NO'} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="the tiny fixture, 2 rounds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    from .__main__ import write_figures

    figures = run_floor(2 if args.quick else args.rounds, args.quick)
    write_figures(figures, markdown(figures), args.out, args.quick, "-speculative-floor")


if __name__ == "__main__":
    main()
