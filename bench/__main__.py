"""python -m bench [--quick] [--model PATH] [--convert-only | --prefix-only | --server-only | --kv-memory-only |
--hybrid-only | --moe-only | --structured-only | --speculative-only]:
mlxinfer vs mlx-lm, side by side, one run."""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from datetime import date
from pathlib import Path

from mlxinfer.speed.report import markdown
from mlxinfer.speed.suite import Settings, run_suite
from mlxinfer.tokenizer import Tokenizer

from .convert_bench import MLX_LM, output_folder, run_convert_bench
from .convert_bench import markdown as convert_markdown
from .models import adopt_quantized, prepare_models
from .plots import bar_chart

RESULTS = Path(__file__).parent / "results"
LABELS = {"bf16": "bf16", "8": "8-bit", "4": "4-bit"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="4-bit only, tiny sizes, one run, mlx-lm in our dtype only (CI smoke test)"
    )
    parser.add_argument("--model", type=Path, help="a model folder instead of the SmolLM2 bf16/8/4-bit set")
    parser.add_argument("--bits", default=None, help="comma list of bf16,8,4 (default: all; --quick: 4)")
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--decode-tokens", type=int)
    parser.add_argument("--runs", type=int)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON, markdown and PNGs")
    parser.add_argument("--skip-convert", action="store_true", help="leave out the converter figures")
    parser.add_argument("--convert-only", action="store_true", help="only the converter figures")
    parser.add_argument("--prefix-only", action="store_true", help="only the prefix-cache and KV figures")
    parser.add_argument("--server-only", action="store_true", help="only the server figures (against mlx_lm.server)")
    parser.add_argument("--kv-memory-only", action="store_true", help="only the sliding-window KV memory figures")
    parser.add_argument(
        "--hybrid-only", action="store_true", help="only the hybrid-model figures (--quick: on the tiny fixtures)"
    )
    parser.add_argument(
        "--moe-only", action="store_true", help="only the MoE figures: decode and converter (--quick: tiny fixture)"
    )
    parser.add_argument(
        "--structured-only",
        action="store_true",
        help="only the structured-output figures: decode and TTFT with a JSON schema (--quick: tiny fixture)",
    )
    parser.add_argument(
        "--speculative-only",
        action="store_true",
        help="only the speculative-decoding figures: off/lookup/auto/draft vs mlx-lm's draft model (--quick: tiny)",
    )
    args = parser.parse_args()
    if args.speculative_only:
        write_speculative_outputs(args.out, args.quick)
        return
    if args.structured_only:
        write_structured_outputs(args.out, args.quick, args.model)
        return
    if args.moe_only:
        write_moe_outputs(args.out, args.quick)
        return
    if args.hybrid_only:
        write_hybrid_outputs(args.out, args.quick)
        return
    if args.kv_memory_only:
        from .kv_memory import markdown as kv_markdown
        from .kv_memory import run_kv_memory_bench

        figures = run_kv_memory_bench(contexts=(2048, 4096) if args.quick else (8192, 32768))
        write_figures(figures, kv_markdown(figures), args.out, args.quick, "-kv-memory")
        return
    if args.convert_only:
        write_outputs({"convert": convert_figures(args.quick)}, args.out, args.quick, suffix="-convert")
        return
    if args.prefix_only:
        write_prefix_outputs(args.model or prepare_models(["4"])["4"], args.out, args.quick)
        return
    if args.server_only:
        write_server_outputs(args.model or prepare_models(["4"])["4"], args.out, args.quick)
        return

    settings = Settings.for_backend(quick=args.quick)
    for field in ("prompt_tokens", "decode_tokens", "runs"):
        if getattr(args, field):
            setattr(settings, field, getattr(args, field))
    convert = None
    if args.quick and not args.skip_convert and not args.model:
        # Quick: the converter figures first, their mlx-lm conversion being the very call prepare_models makes
        # for the 4-bit model; its output becomes that model instead of the same checkpoint converted twice.
        convert = convert_figures(quick=True, keep_mlx_lm=True)
    if args.model:
        models = {args.model.name: args.model}
    else:
        bits = (args.bits or ("4" if args.quick else "bf16,8,4")).split(",")
        models = {LABELS[b]: path for b, path in prepare_models(bits).items()}
    tokenizers = {label: Tokenizer.from_folder(path) for label, path in models.items()}
    report = run_suite(models, tokenizers, settings, compare=True)
    if not args.skip_convert and not args.model:
        report["convert"] = convert or convert_figures(args.quick)
    write_outputs(report, args.out, quick=args.quick)


def convert_figures(quick: bool, keep_mlx_lm: bool = False) -> dict:
    """The converter figures; with `keep_mlx_lm`, mlx-lm's output is kept as the 4-bit model if none is cached."""
    with tempfile.TemporaryDirectory(prefix="mlxinfer-convert-bench-") as work:
        source = prepare_models(["bf16"])["bf16"]
        figures = run_convert_bench(source, Path(work), eval_tokens=8 if quick else 512, quick=quick)
        if keep_mlx_lm:
            adopt_quantized(output_folder(Path(work), MLX_LM), "4")
        return figures


def write_prefix_outputs(model: Path, out: Path, quick: bool) -> None:
    from .prefix_bench import markdown as prefix_markdown
    from .prefix_bench import run_prefix_bench, ttft_plot

    figures = run_prefix_bench(model, quick=quick)
    stem = write_figures(figures, prefix_markdown(figures), out, quick, "-prefix")
    ttft_plot(figures, out / f"{stem}-ttft.png")
    print(f"and {stem}-ttft.png")


def write_server_outputs(model: Path, out: Path, quick: bool) -> None:
    from .server_bench import markdown as server_markdown
    from .server_bench import run_server_bench

    figures = run_server_bench(model, quick=quick)
    write_figures(figures, server_markdown(figures), out, quick, "-server")


def write_hybrid_outputs(out: Path, quick: bool) -> None:
    from .hybrid_bench import HybridSettings, run_hybrid_bench
    from .hybrid_bench import markdown as hybrid_markdown
    from .hybrid_models import prepare_hybrid_models

    settings = HybridSettings.quick() if quick else HybridSettings()
    figures = run_hybrid_bench(prepare_hybrid_models(tiny=quick), settings)
    write_figures(figures, hybrid_markdown(figures), out, quick, "-hybrid")


def write_moe_outputs(out: Path, quick: bool) -> None:
    from .moe_bench import MoeSettings, moe_family, prepare_moe_model, run_moe_bench
    from .moe_bench import markdown as moe_markdown

    family = moe_family()
    settings = MoeSettings.quick() if quick else MoeSettings()
    figures = run_moe_bench(prepare_moe_model(family, tiny=quick), family, settings)
    write_figures(figures, moe_markdown(figures), out, quick, "-moe")


def write_structured_outputs(out: Path, quick: bool, model: Path | None) -> None:
    from .structured_bench import StructuredSettings, run_structured_bench, structured_model
    from .structured_bench import markdown as structured_markdown

    path, source = (model, str(model)) if model else structured_model(quick)
    settings = StructuredSettings.quick() if quick else StructuredSettings()
    figures = run_structured_bench(path, source, settings)
    write_figures(figures, structured_markdown(figures), out, quick, "-structured")


def write_speculative_outputs(out: Path, quick: bool) -> None:
    from .speculative_bench import SpeculativeSettings, run_speculative_bench, speculative_models
    from .speculative_bench import markdown as speculative_markdown

    target, draft, source = speculative_models(quick)
    settings = SpeculativeSettings.quick() if quick else SpeculativeSettings()
    figures = run_speculative_bench(target, draft, source, settings)
    write_figures(figures, speculative_markdown(figures), out, quick, "-speculative")


def write_figures(figures: dict, table: str, out: Path, quick: bool, suffix: str) -> str:
    """Write figures as JSON and their table as markdown; returns the file stem."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{date.today().isoformat()}-{platform.node() or 'host'}" + ("-quick" if quick else "") + suffix
    (out / f"{stem}.json").write_text(json.dumps(figures, indent=1) + "\n")
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out / stem}: .json, .md")
    return stem


def write_outputs(report: dict, out: Path, quick: bool, suffix: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{date.today().isoformat()}-{platform.node() or 'host'}" + ("-quick" if quick else "") + suffix
    tables = [markdown(report)] if "results" in report else []
    if "convert" in report:
        tables.append(convert_markdown(report["convert"]))
    table = "\n\n".join(tables)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(table + "\n")
    written = [".json", ".md"]
    if "results" in report:
        bar_chart(report, "decode_tps", "Decode tokens/s (higher is better)", out / f"{stem}-decode.png")
        bar_chart(report, "prefill_tps", "Prefill tokens/s (higher is better)", out / f"{stem}-prefill.png")
        written += ["-decode.png", "-prefill.png"]
    print(table)
    print(f"\nwrote {out / stem}: {', '.join(written)}")


if __name__ == "__main__":
    main()
