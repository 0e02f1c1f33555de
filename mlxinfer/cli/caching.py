"""`mlxinfer cache warm / ls / clear`: warmed prompt prefixes kept on disk, and the models beside them."""

from __future__ import annotations

from pathlib import Path

import click

from ..api import MAX_CHARS_PER_TOKEN
from ..cache import clear_prefixes, list_prefixes
from ..display import mib, plural
from ..library import disk_bytes, local_models, model_name, models_dir
from ..paths import cache_dir
from ..untrusted import shown_path
from .common import errors_as_one_line, load_model


@click.group()
def cache() -> None:
    """Models and warmed prompt prefixes (a system prompt, a document) kept on disk."""


@cache.command("warm")
@click.argument("model", required=False)
@click.option(
    "--prefix-file",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="UTF-8 text to warm.",
)
@click.option("--raw", is_flag=True, help="Warm the text as a raw prompt instead of a chat's system message.")
@click.option("--kv-bits", type=click.Choice(["4", "8"]), default=None, help="For runs that use --kv-bits.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@errors_as_one_line
def cache_warm(model: str | None, prefix_file: Path, raw: bool, kv_bits: str | None, dtype: str | None) -> None:
    """Prefill a prefix once and keep its KV on disk for every later prompt that starts with it.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Examples:
      mlxinfer cache warm --prefix-file system_prompt.txt      # as the chat's system message
      mlxinfer cache warm ~/models/m-4bit --prefix-file doc.txt --raw
    """
    llm = load_model(model, dtype, quiet=True, kv_bits=kv_bits)
    if llm.prefix_cache.store is None:  # warming in memory would be lost at exit: the point is the file
        where = shown_path(llm.path)
        raise click.ClickException(f"{where}: warmed prefixes cannot be kept on disk for this model (see the warning)")
    text = _read_prefix_file(prefix_file, llm.context_tokens * MAX_CHARS_PER_TOKEN * 4)  # UTF-8: <= 4 bytes a char
    tokens = llm.warm(text if raw else [{"role": "system", "content": text}])
    click.echo(f"warmed {plural(tokens, 'token')} of {prefix_file} for {llm.path.name}")


def _read_prefix_file(path: Path, max_bytes: int) -> str:
    """The text to warm, reading no more than a prefix that fits the context could take."""
    try:
        with path.open("rb") as f:
            raw = f.read(max_bytes + 1)
        text = raw.decode("utf-8")
    except OSError as e:
        raise click.ClickException(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise click.ClickException(f"{path}: is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    if len(raw) > max_bytes:
        raise click.ClickException(f"{path}: is longer than the model's context could hold; warm a shorter text")
    if not text.strip():
        raise click.ClickException(f"{path}: is empty; give the text to warm")
    return text


@cache.command("ls")
@errors_as_one_line
def cache_ls() -> None:
    """List the models (downloaded, in $MLXINFER_MODELS_DIR or ~/models) and the warmed prefixes, with sizes."""
    root = cache_dir() / "prefixes"
    rows = list_prefixes(root)  # first: an unreadable cache is then one line of error, not half a listing
    _list_models()
    for row in rows:
        click.echo(f"{row['model']:<40} {row['tokens']:>8} tokens {mib(int(row['bytes']), 0):>10}  {row['path']}")
    if not rows:
        click.echo(f"no warmed prefixes in {root}: `mlxinfer cache warm --prefix-file FILE` adds one", err=True)
        return
    size = mib(sum(int(row["bytes"]) for row in rows), 0)
    click.echo(f"{plural(len(rows), 'warmed prefix', 'warmed prefixes')} ({size}) in {root}", err=True)


def _list_models() -> None:
    """Print each model mlxinfer can find with its size on disk, then a summary (or how to get one)."""
    folders = [cache_dir() / "models", models_dir()]
    bench_models = cache_dir() / "bench-models"  # checkpoints the checkout's `python -m bench.models` made
    folders += [bench_models] if bench_models.is_dir() else []
    folders = list(dict.fromkeys(folders))  # MLXINFER_MODELS_DIR may be the cache's own folder
    where = ", ".join(str(folder) for folder in folders)
    models = [path for folder in folders for path in local_models(folder)]
    total = 0
    for path in models:
        size, complete = disk_bytes(path)
        total += size
        click.echo(
            f"{model_name(path):<40} {('' if complete else 'over ') + mib(size):>19}  {path}"
        )  # as `ls` names it
    if not models:
        click.echo(
            f"no models yet in {where}: `mlxinfer chat` fetches the default one; "
            f"`mlxinfer convert SRC -o {models_dir() / 'NAME'}` adds one",
            err=True,
        )
        return
    click.echo(f"{plural(len(models), 'model')} ({mib(total)}) in {where}", err=True)


@cache.command("clear")
@errors_as_one_line
def cache_clear() -> None:
    """Delete every warmed prefix (and quarantined ones); models and files mlxinfer did not write are left alone."""
    root = cache_dir() / "prefixes"
    removed = clear_prefixes(root)
    for path in removed:
        click.echo(f"removed {path}", err=True)
    prefixes = sum(1 for path in removed if path.parent.name != "quarantine" and not path.name.startswith("."))
    files = plural(len(removed), "file")
    click.echo(f"removed {plural(prefixes, 'warmed prefix', 'warmed prefixes')} ({files}) from {root}")
