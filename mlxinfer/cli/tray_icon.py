"""`mlxinfer menubar`: the menubar (macOS) / tray (Linux) icon that serves a model and opens its chat page."""

from __future__ import annotations

from pathlib import Path

import click

from ..default_model import default_model_path
from ..errors import DefaultModelError
from .common import errors_as_one_line, recorded_load


@click.command()
@click.argument("model", required=False)
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port of the chat page and API."
)
@click.option(
    "--models-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder whose models Switch Model offers [default: $MLXINFER_MODELS_DIR or ~/models].",
)
@click.option("--kv-bits", type=click.Choice(["4", "8"]), default=None, help="Store KV caches quantized.")
@errors_as_one_line
def menubar(model: str | None, port: int, models_dir: Path | None, kv_bits: str | None) -> None:  # fmt: skip
    """A menubar (macOS) / tray (Linux) icon that serves MODEL and opens its chat page.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    The menu shows the model and its memory and the last answer's speed, and has
    Open Chat, Switch Model, Unload, Start/Stop Server and Quit.
    """
    from ..library import models_dir as default_models_dir
    from ..server import ServerSettings
    from ..ui import MenubarController
    from ..ui.desktop import instead, require_tray
    from ..ui.tray import run_tray

    settings = ServerSettings(port=port)
    path = Path(model).expanduser() if model else None
    advice = instead(str(path) if path else None, port, kv_bits)  # expanded: a quoted ~ would not expand
    require_tray(advice)  # before any download or load: no tray, no icon
    bits = int(kv_bits) if kv_bits else None
    if path is None:
        path = default = default_model_path()
    else:
        try:  # offered under Switch Model if it was fetched before
            default = default_model_path(download=False)
        except DefaultModelError:
            default = None
    controller = MenubarController(
        settings,
        models_dir=models_dir or default_models_dir(),
        loader=lambda path: recorded_load(path, kv_bits=bits),
        default_model=default,
    )
    controller.start(path, on_bound=lambda: click.echo(f"Loading {path.name}...", err=True))  # a taken port: 1 line
    click.echo(f"Serving on {controller.url} (chat page at {controller.url}/); Quit from the icon's menu", err=True)
    run_tray(controller, advice)
