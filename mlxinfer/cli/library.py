"""`mlxinfer ls / rm / show / pull`: the models on this machine (mlxinfer.library) and from the Hub (mlxinfer.hub)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from ..display import mib, plural
from ..library import (
    ADDED,
    LocalModel,
    add_model,
    details,
    disk_bytes,
    find_model,
    list_models,
    local_adapters,
    models_dir,
    remove_model,
)
from ..untrusted import plain, shown_path
from .common import errors_as_one_line, load_model
from .planning import plan


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@click.option(
    "--add",
    "add_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Register a .gguf file or a model folder first (it stays where it is; `mlxinfer rm` unregisters it).",
)
@errors_as_one_line
def ls_models(as_json: bool, add_path: Path | None) -> None:
    """List the models on this machine: the models folder, mlxinfer's cache, the Hugging Face cache, added ones.

    \b
    Examples:
      mlxinfer ls
      mlxinfer ls --add ~/Downloads/Qwen3-0.6B-Q8_0.gguf
      mlxinfer ls --json
    """
    if add_path is not None:
        added = add_model(add_path)
        click.echo(f"added {added.name} ({added.path})", err=True)
    models, adapters = list_models(), local_adapters()
    if as_json:
        listed = [m.to_dict() for m in models] + [{"name": a.name, "adapter": True, "path": str(a)} for a in adapters]
        click.echo(json.dumps(listed, indent=1))
        return
    if not models and not adapters:
        click.echo("no models yet: `mlxinfer pull ORG/NAME` downloads one, `mlxinfer ls --add PATH` adds one", err=True)
        return
    rows = [("NAME", "FAMILY", "SUPPORT", "BITS", "SIZE", "LAST USED", "PATH")]
    rows += [_model_row(m) for m in models]
    rows += [(f"*:{a.name}", "adapter", "-", "-", mib(disk_bytes(a)[0]), "-", shown_path(a)) for a in adapters]
    widths = [min(48, max(len(row[i]) for row in rows)) for i in range(len(rows[0]) - 1)]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    if adapters:
        click.echo("*:NAME: an adapter a server loads over a model when a request names MODEL:NAME", err=True)


def _model_row(model: LocalModel) -> tuple[str, ...]:
    size = ("over " if not model.complete else "") + mib(model.size_bytes)
    used = time.strftime("%Y-%m-%d %H:%M", time.localtime(model.last_used)) if model.last_used else "never"
    bits = str(model.bits) if model.bits else "-"
    return (model.name, model.family or "?", model.support, bits, size, used, shown_path(model.path))


def _find(name: str) -> LocalModel:
    """The listed model called `name`, or a one-line error saying how to see the names."""
    model = find_model(name)
    if model is None:
        raise click.ClickException(f"no model called {plain(name)}; `mlxinfer ls` lists the names")
    return model


@click.command("rm")
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Do not ask first.")
@errors_as_one_line
def rm_model(name: str, yes: bool) -> None:
    """Delete a model listed by `mlxinfer ls` (asks first); an added one is only unregistered, its file stays.

    \b
    Examples:
      mlxinfer rm SmolLM2-4bit
      mlxinfer rm Qwen/Qwen3-0.6B --yes       # a Hugging Face cache entry, every revision
    """
    model = _find(name)
    action = "Unregister" if model.source == ADDED else "Delete"
    kept = " (the file stays)" if model.source == ADDED else ""
    question = f"{action} {model.name} ({mib(model.size_bytes)}) at {shown_path(model.path)}{kept}?"
    if not yes and not click.confirm(question, default=False):
        click.echo(f"kept {model.name}", err=True)
        return
    removed = remove_model(model)
    for path in removed:
        click.echo(f"deleted {shown_path(path)}")
    if not removed:
        click.echo(f"unregistered {model.name}; {shown_path(model.path)} is left as it was")


@click.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the summary and the memory plan as JSON.")
@click.pass_context
@errors_as_one_line
def show_model(ctx: click.Context, name: str, as_json: bool) -> None:
    """A model's config (family, layers, sizes, context, vocabulary), chat template, quantization and memory plan.

    NAME: a name `mlxinfer ls` lists.

    \b
    Examples:
      mlxinfer show SmolLM2-135M-Instruct.Q4_1
      mlxinfer show Qwen/Qwen3-0.6B --json
    """
    model = _find(name)
    info = details(model)
    if as_json:
        info["memory_plan"] = load_model(str(model.path), None, quiet=True).memory_plan().to_dict()
        click.echo(json.dumps(info, indent=1))
        return
    for key in ("name", "path", "family", "support", "layers", "hidden_size", "context", "vocab_size"):
        value = info[key]
        click.echo(f"{key.replace('_', ' '):<14}{'?' if value is None else value}")
    click.echo(f"{'size':<14}{mib(model.size_bytes)}")
    template = info["chat_template"]
    click.echo(f"{'chat template':<14}{'yes' if template['present'] else 'none (prompts are sent raw)'}")
    for line in template["first_lines"]:
        click.echo(f"{'':<16}{line}")
    quantization = info["quantization"]
    if quantization:
        q = quantization
        click.echo(f"{'quantization':<14}{q['bits']} bits, group size {q['group_size'] or '-'}, mode {q['mode']}")
    else:
        click.echo(f"{'quantization':<14}none ({model.bits or '?'}-bit floats)")
    click.echo(f"{'sampling':<14}{info['sampling']['text']}")
    click.echo()
    ctx.invoke(plan, model=str(model.path))


@click.command()
@click.argument("hub_id")
@click.option(
    "--bits",
    type=click.Choice(["4", "8"]),
    default=None,
    help="Convert to this many bits on the way (4: convert's learned default).",
)
@click.option("--revision", default="main", show_default=True, help="Branch, tag or commit to download.")
@click.option("--force", is_flag=True, help="Replace the model folder if it exists.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before downloading.")
@errors_as_one_line
def pull(hub_id: str, bits: str | None, revision: str, force: bool, yes: bool) -> None:
    """Download a Hugging Face checkpoint into the models folder, checked before its weights come.

    \b
    First the file list, config.json and each shard's header are read: a family
    mlxinfer cannot run, pickle-only weights (*.bin, never loaded) or a damaged
    header stop it there. Only safetensors, config, tokenizer and chat template
    files are downloaded, into $MLXINFER_CACHE_DIR/downloads/ORG--NAME as .part
    files; an interrupted pull resumes when run again. The finished folder moves to
    $MLXINFER_MODELS_DIR/NAME (default ~/models/NAME). With --bits, it is converted
    into NAME-4bit / NAME-8bit instead (no quality report: `mlxinfer eval` gives
    one) and the download folder is deleted. HF_ENDPOINT and HF_TOKEN are honoured;
    MLXINFER_HUB_STALL_S (default 60) is how long a download may bring under 1 KiB.

    \b
    Examples:
      mlxinfer pull HuggingFaceTB/SmolLM2-135M-Instruct
      mlxinfer pull Qwen/Qwen3-0.6B --bits 4 --yes
    """
    from ..hub import check_disk, download, estimated_plan, finish, plan_pull
    from ..models.footprint import quantized_bytes

    name = hub_id.rsplit("/", 1)[-1]
    target = models_dir() / (f"{name}-{bits}bit" if bits else name)
    pull_plan = plan_pull(hub_id, revision, target=target, force=force)
    quantized = quantized_bytes(pull_plan.parameters, int(bits)) if bits else 0
    _print_pull_plan(pull_plan, estimated_plan(pull_plan, int(bits) if bits else None))
    check_disk(pull_plan, extra_bytes=quantized)
    remaining = pull_plan.remaining_bytes()
    if not yes and not click.confirm(f"Download {mib(remaining)} into {pull_plan.folder}?", default=True):
        return
    try:
        folder = download(pull_plan)
    except KeyboardInterrupt:
        raise click.ClickException(
            f"interrupted; the partial files stay in {pull_plan.folder}: run the same pull to resume"
        ) from None
    path = finish(pull_plan) if bits is None else _convert_pulled(folder, target, int(bits), force)
    click.echo(f"pulled {hub_id} into {path}; `mlxinfer chat {path}` talks to it")


def _print_pull_plan(pull_plan: Any, memory: Any) -> None:
    total, remaining = pull_plan.download_bytes, pull_plan.remaining_bytes()
    resumed = f" ({mib(total - remaining)} already here)" if remaining < total else ""
    click.echo(f"{pull_plan.repo_id} at {pull_plan.listing.commit[:12]}: {pull_plan.family}", err=True)
    click.echo(f"  parameters  {pull_plan.parameters / 1e6:,.1f}M", err=True)
    click.echo(f"  download    {mib(total)} in {plural(len(pull_plan.files), 'file')}{resumed}", err=True)
    click.echo(
        f"  memory      {memory.verdict} at {memory.context} tokens (estimated: weights "
        f"{mib(memory.footprint.weights_bytes)}, needs {mib(memory.needed_bytes)} of {mib(memory.usable_bytes)} "
        "usable)",
        err=True,
    )
    click.echo(f"              {memory.context_limit()}", err=True)


def _convert_pulled(folder: Path, target: Path, bits: int, force: bool) -> Path:
    """Convert a finished download into `target` with `bits`, then delete the download (mlxinfer wrote it)."""
    import shutil

    from mlxinfer.convert import ConvertSettings, plan_conversion, run_conversion

    conversion = plan_conversion(folder, target, ConvertSettings(bits=bits, evaluate=False), force=force)
    click.echo(conversion.summary(), err=True)
    result = run_conversion(conversion)
    click.echo(result.summary(), err=True)
    shutil.rmtree(folder, ignore_errors=True)
    return target
