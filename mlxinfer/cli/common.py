"""What every command shares: library errors as one line, and loading a model with a note on stderr."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..api import Model, load
from ..errors import MlxInferError
from ..library import record_use


def errors_as_one_line(func: Callable[..., Any]) -> Callable[..., Any]:
    """A command whose library errors (MlxInferError) end it with one line on stderr and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MlxInferError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def load_model(
    model: str | None,
    dtype: str | None,
    quiet: bool,
    kv_bits: str | None = None,
    draft_model: Path | None = None,
    speculate: str = "auto",
    adapters: dict[str, Path] | None = None,
) -> Model:
    """`load` with the CLI's string flags, saying on stderr what loads (unless `quiet`: --json output)."""
    if not quiet:
        drafter = f" with the draft model {draft_model}" if draft_model else ""
        drafter += f" and the adapters {', '.join(adapters)}" if adapters else ""
        click.echo(f"Loading {model or 'the default model (SmolLM2-135M-Instruct)'}{drafter}...", err=True)
    bits = int(kv_bits) if kv_bits else None
    return load(model, dtype=dtype, kv_bits=bits, draft_model=draft_model, speculate=speculate, adapters=adapters)


def recorded_load(path: str | Path | None, **options: Any) -> Model:
    """`load`, noting the time for `mlxinfer ls` (the front ends' loads: `mlxinfer.load` itself writes nothing)."""
    llm = load(path, **options)
    record_use(llm.path)
    return llm
