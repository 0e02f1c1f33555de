"""Quantization quality on kinds of text no calibration or quality report saw: code, technical prose, chat.

Each recipe converts the float source (`--no-eval`, in a folder of its own). Both models are then scored on each
kind's first TOKENS tokens, against each other (mlxinfer.quantize.compare_models): the perplexity change from
source to output, and the mean KL(source || output). The texts are held out, and none is a data set:
- code: Python from this repository (mlxinfer/engine/runner.py, output.py, admission.py);
- technical prose: this repository's README.md, without its code blocks and tables;
- chat: bench/data/chat_turns.json, seven everyday exchanges written for this bench, in the model's chat template.
The calibration text (mlxinfer/data/calibration.txt) and the quality report's (prose.txt) are English literary
prose; neither is used here.

    python -m bench.heldout_bench [--source FOLDER] [--tokens 512] [--recipes rtn-g64,nvfp4,...]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import tempfile
import time
from pathlib import Path

from mlxinfer.convert import convert
from mlxinfer.quantize import compare_models

import mlxinfer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = Path.home() / ".cache" / "mlxinfer-tests" / "bench-models" / "SmolLM2-135M-Instruct-bf16"
RECIPES = {
    "default": {},  # what `mlxinfer convert SRC -o OUT` picks (convert/default_recipe.py)
    "rtn-g64": {"bits": 4, "group_size": 64},
    "rtn-g32": {"bits": 4, "group_size": 32},
    "mixed-4-8": {"bits": 4, "group_size": 64, "recipe": "mixed-4-8"},
    "gptq-g64": {"bits": 4, "group_size": 64, "method": "gptq"},
    "sensitivity-4.75": {"group_size": 64, "recipe": "sensitivity", "bpw": 4.75},
    "gptq-g64-mixed": {"bits": 4, "group_size": 64, "method": "gptq", "calibration": "mixed"},
    "sensitivity-4.75-mixed": {"group_size": 64, "recipe": "sensitivity", "bpw": 4.75, "calibration": "mixed"},
    "awq-g64": {"bits": 4, "group_size": 64, "method": "awq"},
    "awq-g64-mixed": {"bits": 4, "group_size": 64, "method": "awq", "calibration": "mixed"},
    "dwq-g64-mixed": {"bits": 4, "group_size": 64, "method": "dwq", "calibration": "mixed"},
    "sensitivity-4.75-dwq-mixed": {
        "group_size": 64,
        "recipe": "sensitivity",
        "bpw": 4.75,
        "method": "dwq",
        "calibration": "mixed",
    },
    "sensitivity-4.95-dwq-mixed": {
        "group_size": 64,
        "recipe": "sensitivity",
        "bpw": 4.95,
        "method": "dwq",
        "calibration": "mixed",
    },
    "nvfp4": {"mode": "nvfp4"},
    "mxfp4": {"mode": "mxfp4"},
    "mxfp8": {"mode": "mxfp8"},
    "rtn-8bit": {"bits": 8, "group_size": 64},
}


def texts(model: mlxinfer.Model) -> dict[str, list[int]]:
    """Token ids of each held-out kind, for `model`'s tokenizer (and chat template)."""
    code = "\n\n".join(
        (ROOT / "mlxinfer" / "engine" / n).read_text() for n in ("runner.py", "output.py", "admission.py")
    )
    readme = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    prose = "\n".join(line for line in readme.splitlines() if not line.lstrip().startswith("|"))
    chat = json.loads((ROOT / "bench" / "data" / "chat_turns.json").read_text())
    encode = model.tokenizer.encode
    return {
        "code": encode(code, add_special_tokens=False),
        "technical prose": encode(prose, add_special_tokens=False),
        "chat": model.encode_prompt(chat, chat=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="a float checkpoint folder")
    parser.add_argument("--tokens", type=int, default=512, help="tokens scored per kind of text")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, of: " + ", ".join(RECIPES))
    args = parser.parse_args()
    source = mlxinfer.load(args.source, cpu_weights="dense")
    kinds = {kind: ids[: args.tokens] for kind, ids in texts(source).items()}
    print(f"source {args.source.name}; {platform.node()} ({platform.machine()}); {time.strftime('%Y-%m-%d')}")
    print("tokens per kind: " + ", ".join(f"{kind} {len(ids)}" for kind, ids in kinds.items()))
    print("\n| recipe | bits/weight | convert s | " + " | ".join(f"{k}: ppl / KL" for k in kinds) + " | mean ppl |")
    print("|---|---|---|" + "---|" * (len(kinds) + 1))
    for name in args.recipes.split(","):
        folder = Path(tempfile.mkdtemp(prefix=f"heldout-{name}-"))
        try:
            started = time.perf_counter()
            result = convert(args.source, folder / "out", evaluate=False, progress=False, **RECIPES[name])
            took = time.perf_counter() - started
            output = mlxinfer.load(folder / "out", cpu_weights="dense")
            reports = {kind: compare_models(source, output, ids) for kind, ids in kinds.items()}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        cells = [f"{r.ppl_change_pct:+.1f}% / {r.mean_kl:.3f}" for r in reports.values()]
        mean = sum(r.ppl_change_pct for r in reports.values()) / len(reports)
        print(f"| {name} | {result.bits_per_weight:.2f} | {took:.0f} | " + " | ".join(cells) + f" | {mean:+.1f}% |")


if __name__ == "__main__":
    main()
