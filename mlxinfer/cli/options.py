"""Options several commands share (model, sampling, speculation) and their checks, made before any load."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..defaults import DEFAULT_MAX_TOKENS
from ..engine import MODES, SamplingParams, check_max_tokens, check_startup_mode, check_stops
from ..errors import SamplingError

dtype_option = click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default=None,
    help="Compute dtype (default: float32 on CPU, half precision on Apple GPUs).",
)


def speculation_options(func: Callable[..., Any]) -> Callable[..., Any]:
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


def generation_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Model, sampling and speculation options shared by generate and chat."""
    decorators = [
        click.argument("model", required=False),
        click.option("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, show_default=True,
                     help="Most tokens to generate."),
        click.option("--temperature", "-t", type=float, default=None,
                     help="0 is greedy. Each sampling option left out takes the model's own (its "
                          "generation_config.json, see `mlxinfer show`), else greedy decoding's."),
        click.option("--top-p", type=float, default=None,
                     help="Sample from the likeliest tokens whose probabilities add up to this; 1 disables it."),
        click.option("--top-k", type=int, default=None,
                     help="Sample from the k likeliest tokens; 0 disables it."),
        click.option("--min-p", type=float, default=None,
                     help="Drop tokens less likely than this times the likeliest one's probability; 0 disables it."),
        click.option("--repetition-penalty", type=float, default=None,
                     help="Above 1, makes tokens already seen less likely; 1 disables it."),
        click.option("--seed", type=int, default=None, help="Same seed, same text."),
        click.option("--stop", multiple=True, help="Stop when this string appears (repeatable)."),
        click.option("--system", default=None, help="System message for chat prompts."),
        dtype_option,
        click.option("--kv-bits", type=click.Choice(["4", "8"]), default=None,
                     help="Store the KV cache quantized (less memory per token, slightly lower quality)."),
        speculation_options,
        click.option("--adapter", default=None, metavar="[NAME=]PATH",
                     help=ADAPTER_HELP + " Loads MODEL here, with it."),
        click.option("--local", is_flag=True,
                     help="Load the model in this process even when an mlxinfer server runs (else: use the server)."),
    ]  # fmt: skip
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


ADAPTER_HELP = ("A LoRA or DoRA adapter folder, as mlx-lm or PEFT save it, over MODEL; NAME defaults to the "
                "folder's name.")  # fmt: skip


def adapter_pairs(values: tuple[str, ...] | list[str]) -> dict[str, Path]:
    """--adapter values, [NAME=]PATH each, as load()'s {name: folder}; a name given twice is a usage error."""
    pairs: dict[str, Path] = {}
    for value in values:
        name, _, path = value.partition("=") if "=" in value and not Path(value).exists() else ("", "", value)
        folder = Path(path).expanduser()
        name = name or folder.resolve().name
        if name in pairs:
            raise click.BadParameter(f"two adapters are called {name!r}; name them: --adapter NAME=PATH",
                                     param_hint="--adapter")  # fmt: skip
        pairs[name] = folder
    return pairs


def take_speculation(options: dict[str, Any]) -> dict[str, Any]:
    """load()'s speculate and draft_model, taken out of `options`; --speculate draft without a draft model (or
    off / lookup with one) fails here by the engine's rule, before any load."""
    speculate, draft_model = options.pop("speculate"), options.pop("draft_model")
    _check_option("speculate", check_startup_mode, speculate, draft_model)
    return {"speculate": speculate, "draft_model": draft_model}


def checked_generation(options: dict[str, Any]) -> dict[str, Any]:
    """The sampling options for Model.stream, checked by the engine's own rules so a bad one fails before a load."""
    options = dict(options)
    options["stop"] = list(options.get("stop") or [])
    for field in dataclasses.fields(SamplingParams):  # one field at a time, so the error names its flag
        if options.get(field.name) is not None:  # a field left out is the model's, checked at its load
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
