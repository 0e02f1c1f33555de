"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/version) over the same engine
(/api/embed is with the embeddings, routes/embeddings.py).

Each request is translated into an OpenAI-shaped body and checked by schema.py, so every limit is the
OpenAI routes'; answers go back in Ollama's shapes: NDJSON lines, durations in nanoseconds, errors as
{"error": message}. Reference: https://github.com/ollama/ollama/blob/main/docs/api.md
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlx.core as mx
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ... import __version__, library
from ...api import Model
from ...chat import MAX_TOOL_CALLS, output_format
from ...engine import GenerationStats
from ...errors import MlxInferError
from ...untrusted import is_int, shown
from ...vision import MAX_IMAGES
from ..core import API, read_body
from ..deltas import Answer, Done, Running
from ..errors import APIError, as_api_error
from ..schema import CompletionRequest, keep_alive_s, parse_chat, parse_completion, parse_json
from ..structured import Prepared, format_of, prepare_chat, prepare_completion

log = logging.getLogger("mlxinfer.server")
# Ollama's option: the OpenAI field schema.py checks. Ollama's other options (num_gpu, num_thread,
# mirostat, ...) tune llama.cpp; there is nothing here they could change, so they are ignored as Ollama does.
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",  # refused unless 0, as on /v1
    "frequency_penalty": "frequency_penalty",
}
OLLAMA_OPTION = {ours: theirs for theirs, ours in OPTIONS.items()}
OLLAMA_NAMES = {ours: f"options.{theirs}" for ours, theirs in OLLAMA_OPTION.items()}
RENAMED = {"reasoning_effort": "think"}  # Ollama's fields that are not options
NS = 1_000_000_000
FOREVER = "9999-12-31T23:59:59Z"  # expires_at of a model kept loaded forever (keep_alive < 0)


def routes(api: API) -> list[Route]:
    def route(path: str, name: str, handler: Callable[[API, Request], Any], method: str) -> Route:
        async def run(request: Request) -> Response:
            return await handler(api, request)

        return Route(path, api.counted(name, ollama_errors(run)), methods=[method])

    return [
        route("/api/chat", "ollama_chat", chat, "POST"),
        route("/api/generate", "ollama_generate", generate, "POST"),
        route("/api/tags", "ollama_tags", tags, "GET"),
        route("/api/ps", "ollama_ps", ps, "GET"),
        route("/api/show", "ollama_show", show, "POST"),
        route("/api/version", "ollama_version", version, "GET"),
    ]


# -- errors ---------------------------------------------------------------------------------------


def error_response(error: APIError) -> JSONResponse:
    """An APIError in Ollama's shape: the status and {"error": message}."""
    return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers())


def ollama_errors(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Every refusal in Ollama's shape, naming Ollama's fields; also those core.API renders in OpenAI's shape
    (`API.whole`'s error events)."""

    async def run(request: Request) -> Response:
        try:
            response = await handler(request)
        except (APIError, MlxInferError, ClientDisconnect) as error:  # the request's fault, not a bug
            return error_response(_renamed(as_api_error(error)))
        except Exception as error:  # noqa: BLE001 - a bug answers 500 in Ollama's shape; the server goes on
            log.exception("%s failed", request.url.path)
            return error_response(as_api_error(error))
        if isinstance(response, JSONResponse) and response.status_code >= 400:
            body = json.loads(response.body)
            error = body.get("error") if isinstance(body, dict) else None
            if isinstance(error, dict):  # OpenAI's {"error": {"message", ...}}
                headers = {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "connection")}
                return JSONResponse({"error": error.get("message")}, response.status_code, headers)
        return response

    return run


def _effort(think: Any) -> Any:
    """Ollama's `think` (true, false, or gpt-oss's "low", "medium", "high") as OpenAI's reasoning_effort."""
    if isinstance(think, bool):
        return "medium" if think else "none"
    if think not in (None, "low", "medium", "high"):
        raise APIError(400, f'think must be true, false, "low", "medium" or "high", got {shown(think)}', "think")
    return think


def _renamed(error: APIError) -> APIError:
    """An error about an OpenAI field, renamed to the Ollama field the client sent (options.num_predict, format)."""
    old = error.param or ""
    new = OLLAMA_NAMES.get(old) or RENAMED.get(old) or ("format" if old.startswith("response_format") else None)
    if new is None:
        return error
    message = new + error.message[len(old) :] if error.message.startswith(old) else f"{new}: {error.message}"
    return APIError(error.status, message, new, error.code, error.retry_after_s, error.close)


# -- requests in: Ollama's bodies as OpenAI's ------------------------------------------------------


class LoadOnly(Exception):  # noqa: N818 - not an error: /api/generate with no prompt only loads or unloads
    def __init__(self, model: str | None, keep_alive: float | None):
        super().__init__(model)
        self.model, self.keep_alive = model, keep_alive


def parse_ollama_chat(raw: bytes) -> tuple[Any, Any]:
    """An /api/chat body, checked as the OpenAI chat request it becomes."""
    return parse_chat(to_openai_chat(parse_json(raw)))


def parse_ollama_generate(raw: bytes) -> tuple[Any, Any]:
    """An /api/generate body: a chat of system + user prompt, or with `raw` the prompt as it is."""
    body = parse_json(raw)
    prompt = body.get("prompt")
    if prompt is None or prompt == "":  # Ollama's way to load (or, with keep_alive 0, unload) a model
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "model must name the model to load or unload", "model")
        raise LoadOnly(model, keep_alive_s(body.get("keep_alive")))
    return _generate_request(body, prompt)


def _generate_request(body: dict[str, Any], prompt: Any) -> tuple[Any, Any]:
    for name, why in (
        ("suffix", "fill-in-the-middle is not supported"),
        ("template", "a template per request is not supported; the model's own chat template is used"),
        ("context", "context token ids are not supported; send the conversation to /api/chat instead"),
    ):
        if body.get(name) not in (None, "", []):
            raise APIError(400, f"{name}: {why}", name)
    system, raw = body.get("system"), body.get("raw", False)
    if not isinstance(prompt, str):
        raise APIError(400, f"prompt must be a string, got {shown(prompt)}", "prompt")
    if system is not None and not isinstance(system, str):
        raise APIError(400, f"system must be a string, got {shown(system)}", "system")
    if raw not in (True, False, None):
        raise APIError(400, f"raw must be true or false, got {shown(raw)}", "raw")
    if raw:
        if system:  # a raw prompt is sent as it is: there is no template to put a system prompt in
            raise APIError(400, "system cannot be combined with raw: put it in the prompt yourself", "system")
        if body.get("images") not in (None, []):
            raise APIError(400, "images cannot be combined with raw: send them without raw", "images")
        return parse_completion({**_common(body), "prompt": prompt})
    messages = [{"role": "system", "content": system}] if system else []
    if body.get("images") not in (None, []):
        prompt = with_images(prompt, body["images"], "images")
    return parse_chat({**_common(body), "messages": [*messages, {"role": "user", "content": prompt}]})


def with_images(content: Any, images: Any, where: str) -> Any:
    """A message's text with Ollama's `images` (base64 strings) before it, as OpenAI's content parts."""
    if not isinstance(images, list) or len(images) > MAX_IMAGES or not all(isinstance(b, str) for b in images):
        raise APIError(400, f"{where} must be a list of at most {MAX_IMAGES} base64 strings", where)
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": f"data:;base64,{b}"}} for b in images]
    return parts + ([{"type": "text", "text": content}] if isinstance(content, str) and content else [])


def to_openai_chat(body: dict[str, Any]) -> dict[str, Any]:
    """An /api/chat body as the /v1/chat/completions body schema.py checks.

    Example:
        >>> to_openai_chat({"model": "m", "messages": [], "options": {"num_predict": 8}})["max_tokens"]
        8
    """
    return {**_common(body), "messages": to_openai_messages(body.get("messages")), "tools": body.get("tools")}


def _common(body: dict[str, Any]) -> dict[str, Any]:
    """The fields /api/chat and /api/generate share: model, stream (true unless said), format, options."""
    stream = body.get("stream")
    return {
        "model": untagged(body.get("model")),
        "stream": True if stream is None else stream,  # Ollama streams unless told not to
        "keep_alive": body.get("keep_alive"),
        "reasoning_effort": _effort(body.get("think")),
        "response_format": _response_format(body.get("format")),
        "logprobs": body.get("logprobs"),  # refused by schema.py, as on /v1
        "top_logprobs": body.get("top_logprobs"),
        **_options(body.get("options")),
    }


def untagged(model: Any) -> Any:
    """A model name without Ollama's default tag: clients send "name:latest" for "name"."""
    return model[: -len(":latest")] if isinstance(model, str) and model.endswith(":latest") else model


def _options(options: Any) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise APIError(400, f"options must be an object, got {shown(options)}", "options")
    out = {ours: options[theirs] for theirs, ours in OPTIONS.items() if options.get(theirs) is not None}
    if is_int(out.get("max_tokens")) and out["max_tokens"] < 0:  # -1: no limit, -2: fill the context
        del out["max_tokens"]  # both are the server's default: as much as the context leaves, up to its cap
    return out


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise APIError(400, f'format must be "json" or a JSON schema object, got {shown(fmt)}', "format")


def to_openai_messages(messages: Any) -> Any:
    """Ollama's messages as OpenAI's: tool calls get ids (Ollama's have none) that the tool messages
    answering them name; `thinking` becomes reasoning_content. Anything malformed passes through
    untouched for check_messages to refuse by name."""
    if not isinstance(messages, list):
        return messages
    out, pending = [], []  # pending: ids of the latest assistant calls, each answered by one tool message
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        images = message.get("images")
        message = {k: v for k, v in message.items() if k not in ("images", "thinking", "tool_name")}
        if images not in (None, []):
            message["content"] = with_images(message.get("content"), images, f"messages[{i}].images")
        if isinstance(messages[i].get("thinking"), str):
            message["reasoning_content"] = messages[i]["thinking"]
        calls = message.get("tool_calls")
        if isinstance(calls, list) and len(calls) <= MAX_TOOL_CALLS:
            message["tool_calls"] = [_with_id(call, f"call_{i}_{j}") for j, call in enumerate(calls)]
            pending = [(c.get("id"), _call_name(c)) for c in message["tool_calls"] if isinstance(c, dict)]
        if message.get("role") == "tool":
            message.update(_answered(messages[i], pending, f"call_{i}"))
        out.append(message)
    return out


def _with_id(call: Any, default: str) -> Any:
    return {**call, "id": call.get("id") or default} if isinstance(call, dict) else call


def _call_name(call: dict[str, Any]) -> Any:
    function = call.get("function")
    return function.get("name") if isinstance(function, dict) else None


def _answered(message: dict[str, Any], pending: list[tuple[Any, Any]], default: str) -> dict[str, Any]:
    """A tool message's tool_call_id (the call it answers: by tool_name, else the next one) and name."""
    name = message.get("tool_name") or message.get("name")
    found = message.get("tool_call_id")
    if not found and pending:
        index = next((k for k, (_, called) in enumerate(pending) if called == name), 0)
        found = pending.pop(index)[0]
    return {"tool_call_id": found or default, **({"name": name} if isinstance(name, str) and name else {})}


def _encode(model: Model, request: Any) -> Prepared:
    if isinstance(request, CompletionRequest):
        return prepare_completion(model, request)
    return prepare_chat(model, request)


# -- answers out ----------------------------------------------------------------------------------


async def chat(api: API, request: Request) -> Response:
    return await _answer(api, request, await api.start(request, parse_ollama_chat), chat=True)


async def generate(api: API, request: Request) -> Response:
    try:
        running = await api.start(request, parse_ollama_generate, encode=_encode)
    except LoadOnly as only:
        return await _load_or_unload(api, request, only)
    return await _answer(api, request, running, chat=False)


async def _answer(api: API, request: Request, running: Running, chat: bool) -> Response:
    model = running.served.id
    if running.params.stream:
        return running.streamed(_lines(running, model, chat), "application/x-ndjson")
    return await api.whole(request, running, lambda done: JSONResponse(_whole(model, running.answer, done, chat)))


async def _lines(running: Running, model: str, chat: bool) -> AsyncIterator[str]:
    try:
        async for item in running.deltas():
            if isinstance(item, Done):
                line = {**_piece(model, {}, chat), **_done(item)}
            elif isinstance(item, APIError):
                line = {"error": item.message}  # Ollama's clients raise it as a ResponseError
            else:
                line = _piece(model, item, chat)
            yield json.dumps(line, ensure_ascii=False) + "\n"
    finally:
        running.cancel()  # a no-op once it finished; frees the slot if the client left


def _whole(model: str, answer: Answer, done: Done, chat: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": answer.text}
    if answer.reasoning:
        delta["reasoning_content"] = "".join(answer.reasoning)
    if answer.calls:
        delta["tool_calls"] = answer.calls
    return {**_piece(model, delta, chat), **_done(done)}


def _piece(model: str, delta: dict[str, Any], chat: bool) -> dict[str, Any]:
    """One line: a chat's {"message": {...}} or a generation's {"response": text}, "done": false."""
    fields: dict[str, Any] = {"role": "assistant", "content": delta.get("content", "")}
    if "reasoning_content" in delta:
        fields["thinking"] = delta["reasoning_content"]
    if delta.get("tool_calls"):
        fields["tool_calls"] = [_ollama_call(call) for call in delta["tool_calls"]]
    if chat:
        body: dict[str, Any] = {"message": fields}
    else:  # a generation has no tools: content and thinking only
        body = {"response": fields["content"], **({"thinking": fields["thinking"]} if "thinking" in fields else {})}
    return {"model": model, "created_at": _rfc3339(time.time()), **body, "done": False}


def _ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as Ollama's: the arguments an object, not JSON text."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"] or "{}")
    except ValueError:  # the parser's output is JSON; anything else is passed on as it came
        arguments = {"_raw": function["arguments"]}
    return {"function": {"name": function["name"], "arguments": arguments}}


def _done(done: Done) -> dict[str, Any]:
    """The last line's fields: the reason and Ollama's counters (durations in nanoseconds).

    load_duration is 0: a model loaded for the request is not timed apart from it."""
    stats: GenerationStats = done.stats
    prefill_s = stats.prefilled_tokens / stats.prefill_tps if stats.prefill_tps else 0.0
    return {
        "done": True,
        "done_reason": "length" if done.finish_reason == "length" else "stop",  # tool_calls: Ollama says stop
        "total_duration": int(stats.total_s * NS),
        "load_duration": 0,
        "prompt_eval_count": stats.prompt_tokens,
        "prompt_eval_duration": int(prefill_s * NS),
        "eval_count": stats.generated_tokens,
        "eval_duration": int(max(0.0, stats.total_s - stats.ttft_s) * NS),
    }


async def _load_or_unload(api: API, request: Request, only: LoadOnly) -> Response:
    """/api/generate without a prompt: keep_alive 0 unloads the model, anything else loads it."""
    if only.keep_alive == 0:
        name = await run_in_threadpool(_unload, api, only.model)
        reason = "unload"
    else:
        served = await run_in_threadpool(api.models.get, only.model, api.trusted(request))
        # The keep_alive (Ollama: the server's default when none is given) counts from now.
        keep_alive = api.models.keep_alive_s if only.keep_alive is None else only.keep_alive
        api.models.keep_alive(served.id, keep_alive)
        name, reason = served.id, "load"
    return JSONResponse(
        {"model": name, "created_at": _rfc3339(time.time()), "response": "", "done": True, "done_reason": reason}
    )


def _unload(api: API, name: str) -> str:
    served = api.models.loaded(name)
    if served is None:
        if name not in api.models.ids and library.find_model(name) is None:
            raise APIError(404, f"model {shown(name)} not found", "model", "model_not_found")
        return name  # not loaded: nothing to do
    # Idle: unloaded at once, so /api/ps no longer lists it when this answers. Busy: keep_alive 0 from now,
    # so the requests still answering end first, then the reaper unloads it.
    if not api.models.unload(served.id, if_idle=True):
        api.models.keep_alive(served.id, 0.0)
    return served.id


# -- the model list, the loaded models, one model's facts ------------------------------------------


async def tags(api: API, request: Request) -> Response:
    return JSONResponse({"models": await run_in_threadpool(_tags, api)})  # list_models walks the disk


def _tags(api: API) -> list[dict[str, Any]]:
    """The local models (`mlxinfer ls`), then those this server serves that are not among them."""
    local = library.list_models()  # bounded by the library's own caps (MAX_HF_REPOS, MAX_ADDED)
    names, paths = {m.name for m in local}, {m.path.resolve() for m in local}
    for name in api.models.ids:
        path = api.models.path_of(name)
        if name not in names and path is not None and path.resolve() not in paths:
            local.append(library.describe(name, path, "served"))
    models = [
        {
            "name": m.name,
            "model": m.name,
            "modified_at": _rfc3339(_mtime(m.path)),
            "size": m.size_bytes,
            "digest": _digest(m.path),
            "details": _details(m.path, m.family, _quantization_level(m.bits)),
        }
        for m in local
    ]
    return models + [_adapter_tag(*adapter) for adapter in api.models.adapter_ids]


def _adapter_tag(name: str, parent: str, path: Path) -> dict[str, Any]:
    """A served adapter as Ollama lists a model built FROM another (its `parent_model`)."""
    details = {**_details(path, "", ""), "parent_model": parent}
    size = library.disk_bytes(path)[0]
    return {"name": name, "model": name, "modified_at": _rfc3339(_mtime(path)), "size": size,
            "digest": _digest(path), "details": details}  # fmt: skip


async def ps(api: API, request: Request) -> Response:
    """The loaded models. size_vram equals size where MLX computes on a GPU (Apple silicon's unified
    memory, or an NVIDIA card's), and is 0 on the CPU backend."""
    loaded = {served.id: served.model for served in api.models}
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    rows = []
    for row in api.models.ps():
        model = loaded.get(row["name"])
        if model is None:  # unloaded between the two looks
            continue
        rows.append(
            {
                "name": row["name"],
                "model": row["name"],
                "size": row["memory_bytes"],
                "size_vram": row["memory_bytes"] if on_gpu else 0,
                "digest": _digest(Path(row["path"])),
                "details": _details(model.path, model.config.model_type, _model_quantization(model)),
                "expires_at": _expires_at(row, api.models.keep_alive_s),
                "context_length": model.context_tokens,
                "mlxinfer": {key: row[key] for key in ("path", "in_flight", "expires_in_s", "keep_alive_forever")},
            }
        )
    return JSONResponse({"models": rows})


def _expires_at(row: dict[str, Any], default_keep_alive_s: float) -> str:
    if row["keep_alive_forever"]:
        return FOREVER
    # expires_in_s is None while requests are in flight: then at the earliest a keep-alive after now.
    left = row["expires_in_s"] if row["expires_in_s"] is not None else default_keep_alive_s
    return FOREVER if math.isinf(left) else _rfc3339(time.time() + left)


async def show(api: API, request: Request) -> Response:

    body = await api.preparing.run(parse_json, await read_body(request, api.settings))
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, "model must name a model (see GET /api/tags)", "model")
    served = api.models.loaded(name)
    if served is not None:
        return JSONResponse(_show_loaded(served.model))
    return JSONResponse(await run_in_threadpool(_show_local, api, name))


def _show_loaded(model: Model) -> dict[str, Any]:
    args = model.config.args
    sizes = {
        "context_length": model.context_tokens,
        "embedding_length": args.get("hidden_size"),
        "block_count": args.get("num_hidden_layers"),
        "vocab_size": args.get("vocab_size"),
    }
    template = model.tokenizer.chat_template or ""
    fmt = format_of(model.tokenizer)
    details = _details(model.path, model.config.model_type, _model_quantization(model))
    thinking = fmt.reasoning is not None
    return _shown(details, sizes, template, fmt.tools is not None, thinking, model.sampling_defaults.in_force)


def _show_local(api: API, name: str) -> dict[str, Any]:
    """A model that is not loaded, from its side files: config.json (or the GGUF header) and its template."""
    path = api.models.path_of(name)
    local = library.describe(name, path, "served") if path is not None else library.find_model(name)
    if local is None:
        raise APIError(404, f"model {shown(name)} not found; GET /api/tags lists the models", "model")
    facts = library.details(local)
    sizes = {
        "context_length": facts["context"],
        "embedding_length": facts["hidden_size"],
        "block_count": facts["layers"],
        "vocab_size": facts["vocab_size"],
    }
    template = library.chat_template(local.path) or ""
    fmt = output_format(template)
    details = _details(local.path, local.family, _quantization_level(local.bits))
    # Every model takes tools: its template's syntax, or the default one (chat/default_tools.py).
    return _shown(details, sizes, template, True, fmt.reasoning is not None, facts["sampling"]["defaults"])


def _shown(
    details: dict[str, Any], sizes: dict[str, Any], template: str, tools: bool, thinking: bool, sampling: dict
) -> dict:
    family = details["family"] or "unknown"
    info = {"general.architecture": family, **{f"{family}.{k}": v for k, v in sizes.items() if v is not None}}
    capabilities = ["completion", *(["tools"] if tools else []), *(["thinking"] if thinking else [])]
    return {
        "modelfile": "",
        # Ollama's Modelfile PARAMETER lines, in its option names: the sampling a request that sets none gets.
        "parameters": "\n".join(f"{OLLAMA_OPTION[name]:<30} {value:g}" for name, value in sampling.items()),
        "template": template,
        "details": details,
        "model_info": info,
        "capabilities": capabilities,
    }


async def version(api: API, request: Request) -> Response:
    return JSONResponse({"version": __version__})


# -- shared pieces --------------------------------------------------------------------------------


def _details(path: Path, family: str | None, quantization: str) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf" if path.suffix == ".gguf" else "safetensors",
        "family": family or "",
        "families": [family] if family else None,
        "parameter_size": "",  # not known without counting the weights
        "quantization_level": quantization,
    }


def _quantization_level(bits: int | None) -> str:
    """Ollama's words for the bits: Q4, Q8, F16 (bf16 too), F32; "" when nothing says."""
    if bits is None:
        return ""
    return f"F{bits}" if bits >= 16 else f"Q{bits}"


def _model_quantization(model: Model) -> str:
    quantization = model.config.quantization or {}
    if is_int(quantization.get("bits")):
        return _quantization_level(quantization["bits"])
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(model.compute_dtype, "")


def _digest(path: Path) -> str:
    """A stable stand-in for Ollama's content digest: the SHA-256 of the model's path (not of its files,
    which would mean reading gigabytes)."""
    return hashlib.sha256(str(path).encode(errors="replace")).hexdigest()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _rfc3339(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
