"""`mlxinfer convert`: a Hugging Face folder, Hub id or GGUF file into an MLX model folder (mlxinfer.convert)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .common import errors_as_one_line


@click.command()
@click.argument("src")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="Output model folder.")
@click.option(
    "--bits",
    type=click.Choice(["4", "8", "16"]),
    default=None,
    help="Bits per quantized weight; 16 keeps the weights unquantized (in --dtype) [default: 4; a --mode's own]. "
    "4 with no --recipe, --bpw, --method or --group-size is the learned default: a measured mix of 4 and more bits "
    "(1.06x plain 4-bit's size), GPTQ-rounded and distilled, where the source allows it, else round-to-nearest; "
    "the plan line says which, why, and the time it takes.",
)
@click.option(
    "--mode",
    type=click.Choice(["affine", "mxfp4", "nvfp4", "mxfp8"]),
    default="affine",
    show_default=True,
    help="affine: a scale and bias per group; mxfp4 (4-bit, groups of 32), nvfp4 (4-bit, groups of 16) and mxfp8 "
    "(8-bit, groups of 32) are MLX's float formats, rounded to nearest with one 8-bit scale per group.",
)
@click.option(
    "--group-size",
    type=click.Choice(["32", "64", "128"]),
    default=None,
    help="Quantization group size [default: 64; 32 for GGUF Q4/Q8 sources, reused without rounding]",
)
@click.option(
    "--recipe",
    type=click.Choice(["uniform", "mixed-4-8", "sensitivity"]),
    default=None,
    help="mixed-4-8: 4-bit body, 8-bit embeddings and head; sensitivity: measured, needs --bpw.",
)
@click.option("--bpw", type=float, default=None, help="Bits-per-weight budget for --recipe sensitivity.")
@click.option(
    "--method",
    type=click.Choice(["rtn", "gptq", "awq", "dwq"]),
    default=None,
    help="Rounding: rtn (nearest, streaming), gptq (error-compensating, fitted on calibration text), awq (inputs "
    "scaled by their activations, then nearest) or dwq (gptq, then scales distilled toward the source's outputs) "
    "[default: dwq for the learned default (see --bits), gptq with --recipe sensitivity, else rtn].",
)
@click.option(
    "--calibration",
    type=click.Choice(["prose", "mixed"]),
    default=None,
    help="What GPTQ, AWQ, DWQ and --recipe sensitivity run the source on: shipped English prose, or half of it "
    "beside the model's own samples from chat, code, arithmetic and French/Spanish/German seeds [default: mixed for "
    "the learned default, else prose].",
)
@click.option(
    "--dtype",
    type=click.Choice(["float16", "bfloat16", "float32"]),
    default=None,
    help="Float type of unquantized tensors and scales [default: the source's 16-bit type].",
)
@click.option(
    "--adapter",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="A LoRA or DoRA adapter folder (mlx-lm's or PEFT's) merged into the weights before they are quantized; "
    "the manifest records its digest.",
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--no-eval", is_flag=True, help="Skip the perplexity / KL quality report.")
@click.option("--eval-tokens", type=click.IntRange(16), default=512, show_default=True)
@errors_as_one_line
def convert(
    src: str, out: Path, bits: str | None, group_size: str | None, no_eval: bool, force: bool, **options: Any
) -> None:
    """Convert a Hugging Face folder, Hub id or GGUF file into an MLX model folder.

    \b
    Examples:
      mlxinfer convert ~/hf/SmolLM2-135M-Instruct -o ~/models/SmolLM2-4bit   # the learned 4-bit default
      mlxinfer convert ~/hf/SmolLM2-135M-Instruct -o ~/models/SmolLM2-8bit --bits 8
      mlxinfer convert Qwen/Qwen3-0.6B -o ~/models/Qwen3-0.6B-8bit --bits 8
      mlxinfer convert model.Q4_1.gguf -o ~/models/m-4bit     # Q4_1 blocks reused as-is
      mlxinfer convert ~/hf/model -o out --recipe sensitivity --bpw 4.75
      mlxinfer convert ~/hf/model -o out --method rtn        # round-to-nearest 4-bit, streaming, in seconds
      mlxinfer convert ~/hf/model -o out --mode nvfp4        # 4-bit floats, an FP8 scale per 16
      mlxinfer convert ~/hf/model --adapter ~/adapters/sql -o sql-4bit   # the fine-tune, merged, then 4-bit
    """
    from mlxinfer.convert import ConvertSettings, plan_conversion, run_conversion

    adapter = options.pop("adapter")
    settings = ConvertSettings(
        bits=int(bits) if bits else None, group_size=int(group_size) if group_size else None, evaluate=not no_eval,
        adapter=str(adapter) if adapter is not None else None, **options,
    )  # fmt: skip
    plan = plan_conversion(src, out, settings, force=force)
    click.echo(plan.summary(), err=True)
    result = run_conversion(plan)  # logs the quality warning, if any, on stderr
    click.echo(result.summary())
