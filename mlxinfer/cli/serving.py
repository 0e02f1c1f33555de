"""`mlxinfer serve` (the OpenAI-compatible server, on one machine or split over several) and `mlxinfer ps`."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import click

from ..adapters import MAX_ADAPTERS
from ..api import Model
from ..default_model import default_model_path
from ..defaults import DEFAULT_MAX_ADAPTERS, SERVER_PREFILL_CHUNK_TOKENS
from ..display import mib
from ..engine import SchedulerConfig
from ..errors import ServerConfigError
from ..library import record_use
from ..local_server import find_server, new_token, publish, server_identity, withdraw
from .common import errors_as_one_line, load_model, recorded_load
from .options import ADAPTER_HELP, adapter_pairs, dtype_option, speculation_options


@click.command()
@click.argument("model", required=False)
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless --allow-remote)."
)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0 picks a free port.")
@click.option("--allow-remote", is_flag=True, help="Allow a non-loopback --host; needs --api-key.")
@click.option(
    "--api-key",
    envvar="MLXINFER_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' [env: MLXINFER_API_KEY].",
)
@click.option(
    "--cors-origin", multiple=True, help="A browser origin allowed to call the API (repeatable; no wildcards)."
)
@click.option(
    "--max-batch", type=click.IntRange(1, 256), default=8, show_default=True, help="Requests decoding together."
)
@click.option(
    "--max-queue",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="Requests waiting beyond that; more get 429.",
)
@click.option(
    "--prefill-chunk",
    type=click.IntRange(1, 65536),
    default=SERVER_PREFILL_CHUNK_TOKENS,
    show_default=True,
    help="Prompt tokens per prefill step; running streams wait at most one step for a new prompt.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=1),
    default=600.0,
    show_default=True,
    help="Seconds per request, queueing included.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1),
    default=100,
    show_default=True,
    help="Open HTTP connections; past it the longest-idle one is closed (or 503).",
)
@click.option("--kv-bits", type=click.Choice(["4", "8"]), default=None, help="Store KV caches quantized.")
@dtype_option
@click.option(
    "--max-body-mb",
    type=click.IntRange(1, 1024),
    default=4,
    show_default=True,
    help="Largest request body in MiB. Images come as base64 data: URLs, a third larger than the file.",
)
@click.option(
    "--keep-alive",
    envvar="MLXINFER_KEEP_ALIVE",
    default="5m",
    show_default=True,
    help="How long a model stays loaded after its last request (seconds, 30s, 5m, 1h; -1: always) "
    "[env: MLXINFER_KEEP_ALIVE]. A request's keep_alive overrides it.",
)
@click.option(
    "--hostfile",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Split MODEL over the hosts of this JSON file (mlx.launch's format); this machine is rank 0.",
)
@click.option(
    "--parallel",
    type=click.Choice(["pipeline", "tensor"]),
    default="pipeline",
    show_default=True,
    help="With --hostfile: layers per host (pipeline) or every layer's heads split (tensor).",
)
@click.option(
    "--stall-timeout",
    type=click.FloatRange(min=1),
    default=120.0,
    show_default=True,
    help="With --hostfile: seconds a rank may take to answer before the server reports unhealthy.",
)
@click.option(
    "--image-urls",
    is_flag=True,
    help="Fetch images requests give as http(s) addresses (10 s, 3 redirects, 32 MiB each); else only data: URLs.",
)
@click.option(
    "--adapter",
    "adapters",
    multiple=True,
    metavar="[NAME=]PATH",
    help=ADAPTER_HELP + " Requests name it MODEL:NAME; repeat for more (they batch together). Adapter folders in "
    "the models folder load on the first request that names them.",
)
@click.option(
    "--max-adapters",
    type=click.IntRange(1, MAX_ADAPTERS),
    default=DEFAULT_MAX_ADAPTERS,
    show_default=True,
    help="Adapters a model keeps loaded; a new one unloads the least recently used idle one.",
)
@speculation_options
@errors_as_one_line
def serve(model: str | None, kv_bits: str | None, dtype: str | None, **options: Any) -> None:
    """Serve MODEL over an OpenAI-compatible API (chat and text completions, streaming, /metrics).

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Examples:
      mlxinfer serve                                   # the default model on http://127.0.0.1:8080
      mlxinfer serve ~/models/Qwen3-0.6B-4bit --port 9000
      mlxinfer serve ~/models/Qwen3-4B-4bit --draft-model ~/models/Qwen3-0.6B-4bit
      mlxinfer serve ~/models/Qwen3-4B-4bit --adapter sql=~/adapters/sql --adapter ~/adapters/poet
      mlxinfer serve ~/models/Llama-3.3-70B-4bit --hostfile hosts.json   # split over several Macs
      curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
           -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    from ..server import ServerSettings, listen
    from ..server import serve as run_server
    from ..server.settings import is_loopback

    o = options
    keep_alive = _keep_alive_option(o["keep_alive"])
    adapters = adapter_pairs(o["adapters"])
    if adapters and o["hostfile"] is not None:
        raise click.UsageError("--adapter is not supported with --hostfile yet")
    settings = ServerSettings(
        host=o["host"],
        port=o["port"],
        allow_remote=o["allow_remote"],
        api_key=o["api_key"],
        cors_origins=o["cors_origin"],
        request_timeout_s=o["request_timeout"],
        max_connections=o["max_connections"],
        max_body_bytes=o["max_body_mb"] << 20,
        scheduler=SchedulerConfig(max_batch=o["max_batch"], max_queue=o["max_queue"], prefill_chunk=o["prefill_chunk"]),
        speculate=o["speculate"],
        draft_model=o["draft_model"],
        image_urls=o["image_urls"],
        local_token=new_token(),
    )
    sockets = listen(settings)  # before the load: a taken port is one line now, not after the loading
    other = find_server()  # the user's resident server, if one runs already
    if o["hostfile"] is not None:
        models, llm = _distributed_models(model, settings, dtype, kv_bits, o)
    else:
        models = _resident_models(settings, keep_alive, dtype, kv_bits, o["max_adapters"])
        speculation = {"draft_model": settings.draft_model, "speculate": settings.speculate}
        llm = load_model(model, dtype, quiet=False, kv_bits=kv_bits, adapters=adapters, **speculation)
    record_use(llm.path)
    name = models.add(llm, settings.scheduler).id

    def ready(url: str) -> None:  # once connections are answered, with the real port (also for --port 0)
        click.echo(f"Serving {name} on {url}/v1 (Ctrl-C to stop)", err=True)
        if other is not None:
            click.echo(f"note: the mlxinfer server at {other.url} (pid {other.pid}) stays the one that "
                       "`mlxinfer chat` and mlxinfer.connect() use", err=True)  # fmt: skip
        elif is_loopback(settings.host):  # front ends find it; never a server reachable from elsewhere
            try:
                publish(url, settings.local_token)
            except (OSError, ServerConfigError) as e:  # serving goes on; front ends just will not find it
                click.echo(f"note: front ends will not find this server: {e}", err=True)

    try:
        run_server(models, settings, sockets=sockets, on_ready=ready)
    finally:
        withdraw(settings.local_token)


def _resident_models(
    settings: Any, keep_alive: float, dtype: str | None, kv_bits: str | None, max_adapters: int = DEFAULT_MAX_ADAPTERS
) -> Any:
    """The server's models: more load by name on request (the list `mlxinfer ls` shows), within the memory
    the planner sees now, and each unloads `keep_alive` seconds after its last request; adapters in the models
    folder load over a model when a request names MODEL:ADAPTER, `max_adapters` a model."""
    from ..library import find_adapter
    from ..memory import machine_memory
    from ..server import ModelSet
    from ..server.model_pool import local_catalog

    bits = int(kv_bits) if kv_bits else None
    return ModelSet(
        catalog=local_catalog,
        loader=functools.partial(recorded_load, dtype=dtype, kv_bits=bits),
        keep_alive_s=keep_alive,
        budget_bytes=machine_memory().usable_bytes(),
        config=settings.scheduler,
        adapter_catalog=find_adapter,
        max_adapters=max_adapters,
    )


def _distributed_models(
    model: str | None, settings: Any, dtype: str | None, kv_bits: str | None, options: dict[str, Any]
) -> tuple[Any, Model]:
    """One model split over the hostfile's hosts, this process rank 0; it stays loaded and no other loads."""
    from ..distributed import Launch, read_hostfile, start_cluster
    from ..errors import ConfigError
    from ..server import ModelSet

    if settings.draft_model is not None or settings.speculate not in ("auto", "off"):
        raise ConfigError("--draft-model and --speculate do not run across ranks; leave them out with --hostfile")
    hosts = read_hostfile(options["hostfile"])
    path = str(Path(model).expanduser().resolve()) if model else str(default_model_path())
    launch = Launch(path, options["parallel"], dtype, int(kv_bits) if kv_bits else None)
    click.echo(f"Loading {path} over {len(hosts)} ranks ({launch.parallel} parallel)...", err=True)
    cluster = start_cluster(hosts, launch, settings.scheduler, stall_s=options["stall_timeout"])

    def refuse(_: Path) -> Model:
        raise ConfigError("this server runs one model split over its ranks; it loads no other")

    models = ModelSet(loader=refuse, keep_alive_s=math.inf, scheduler=cluster.scheduler)
    return models, cluster.rank.model


def _keep_alive_option(value: str) -> float:
    from ..server.errors import APIError
    from ..server.model_pool import DEFAULT_KEEP_ALIVE_S
    from ..server.schema import keep_alive_s

    try:
        seconds = keep_alive_s(value)
    except APIError:
        raise click.BadParameter(f"{value!r}: give seconds or a duration like 5m, 1h, -1 (never)") from None
    return DEFAULT_KEEP_ALIVE_S if seconds is None else seconds


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the loaded models as JSON.")
@errors_as_one_line
def ps(as_json: bool) -> None:
    """Show the models the running mlxinfer server has loaded, their memory, and when each unloads."""
    server = find_server()
    if server is None:
        raise click.ClickException("no mlxinfer server is running; start one with `mlxinfer serve`")
    rows = server_identity(server).get("loaded", [])
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(f"{'NAME':<40} {'MEMORY':>10} {'ANSWERING':>9}  {'UNLOADS':<14} PATH")
    for row in rows:
        click.echo(f"{row['name']:<40} {mib(row['memory_bytes'], 0):>10} {row['in_flight']:>9}  "
                   f"{_unloads(row):<14} {row['path']}")  # fmt: skip
        if row.get("adapters"):  # an older server's rows have none
            click.echo(f"  adapters ({len(row['adapters'])} of {row['max_adapters']}): {', '.join(row['adapters'])}")
    if not rows:
        click.echo(f"no models loaded (the server at {server.url} loads one on its first request)", err=True)


def _unloads(row: dict[str, Any]) -> str:
    if row.get("keep_alive_forever"):
        return "never"
    seconds = row.get("expires_in_s")
    if seconds is None:
        return "after answering"
    minutes, rest = divmod(int(seconds), 60)
    return f"in {minutes} min {rest} s" if minutes else f"in {rest} s"
