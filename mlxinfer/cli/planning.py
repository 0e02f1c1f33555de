"""`mlxinfer plan`: what a model needs in memory on this machine, or how it splits over several (--hosts)."""

from __future__ import annotations

import json

import click

from ..default_model import default_model_path
from ..display import mib
from ..distributed.estimate import DEFAULT_LINK_GBPS, DEFAULT_MEMORY_GBPS
from .common import errors_as_one_line, load_model


@click.command()
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
@errors_as_one_line
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
    llm = load_model(model, dtype, quiet=True, kv_bits=kv_bits)
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
    from ..distributed.hosts import parse_hosts
    from ..distributed.layer_sizes import read_layer_sizes
    from ..distributed.pipeline_plan import plan_pipeline

    parsed = parse_hosts(hosts)  # a malformed --hosts fails before the model is looked at
    sizes = read_layer_sizes(model or default_model_path(), context, dtype, kv_bits)
    pipeline = plan_pipeline(sizes, parsed, link_gbps or DEFAULT_LINK_GBPS, memory_gbps or DEFAULT_MEMORY_GBPS)
    if as_json:
        click.echo(json.dumps(pipeline.to_dict(), indent=1))
        return
    for line in pipeline.lines():
        click.echo(line)
