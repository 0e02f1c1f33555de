"""`mlxinfer bench` (speed, TTFT, memory) and `mlxinfer eval` (perplexity): measurements of one model."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..api import MAX_CHARS_PER_TOKEN
from ..default_model import default_model_path
from ..library import located
from ..models import load_tokenizer
from .common import errors_as_one_line, load_model


@click.command()
@click.argument("model", required=False)
@click.option("--compare", is_flag=True, help="Also measure mlx-lm on the same files (default and matched dtype).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")
@click.option("--prompt-tokens", type=click.IntRange(1), default=None, help="Prompt length (default by backend).")
@click.option("--decode-tokens", type=click.IntRange(2), default=None, help="Tokens to decode (default by backend).")
@click.option("--runs", type=click.IntRange(1), default=None, help="Warm runs per configuration.")
@errors_as_one_line
def bench(model: str | None, compare: bool, as_json: bool, **sizes: int | None) -> None:
    """Measure decode and prefill speed, TTFT, memory and engine overhead of a model.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Examples:
      mlxinfer bench                              # the default model
      mlxinfer bench ~/models/Qwen3-0.6B-4bit --compare --json
    """
    from ..speed.report import markdown
    from ..speed.suite import Settings, run_suite

    path = located(model) if model else default_model_path()
    if compare and path.suffix == ".gguf":
        raise click.ClickException(f"{path.name}: mlx-lm cannot load GGUF files; compare on a model folder")
    settings = Settings.for_backend()
    for key, value in sizes.items():
        if value is not None:
            setattr(settings, key, value)
    report = run_suite({path.name: path}, {path.name: load_tokenizer(path)}, settings, compare, progress=not as_json)
    click.echo(json.dumps(report, indent=1) if as_json else markdown(report))


@click.command("eval")
@click.argument("model", required=False)
@click.option(
    "--text",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A UTF-8 text file [default: the shipped English prose].",
)
@click.option("--max-tokens", type=click.IntRange(2), default=512, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@errors_as_one_line
def evaluate(model: str | None, text_file: Path | None, max_tokens: int, dtype: str | None) -> None:
    """Perplexity of MODEL on a text (lower is better).

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.
    """
    import codecs

    from tqdm.auto import tqdm

    from ..data import prose_text
    from ..quantize import perplexity

    chars = max_tokens * MAX_CHARS_PER_TOKEN  # ample text for max_tokens tokens: a huge file is read no further
    if text_file is None:
        text = prose_text()
    else:
        try:
            with text_file.open("rb") as f:
                head = f.read(4 * chars)  # UTF-8 takes at most 4 bytes a character
            text = codecs.getincrementaldecoder("utf-8")().decode(head)  # a character cut at the end is dropped
        except UnicodeDecodeError as e:
            raise click.ClickException(f"{text_file}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        except OSError as e:
            raise click.ClickException(f"{text_file}: cannot read it ({e.strerror})") from None
    llm = load_model(model, dtype, quiet=False)
    ids = llm.tokenizer.encode(text[:chars])[:max_tokens]
    if len(ids) < 2:
        raise click.ClickException(f"{text_file}: needs at least 2 tokens of text")
    with tqdm(total=len(ids), unit="tok", desc="perplexity") as bar:
        ppl = perplexity(llm, ids, progress=bar.update)
    click.echo(f"perplexity {ppl:.4f} over {len(ids)} tokens")
