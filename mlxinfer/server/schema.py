"""Request bodies in, validated parameters out; every refusal is a 400 naming the field.

Follows OpenAI's chat and completions APIs with n=1. Fields the engine cannot
honour (logprobs, legacy functions, non-zero presence/frequency penalties) are
refused rather than ignored, so a client never gets an answer it did not ask for.
Unknown fields are ignored, as OpenAI-compatible servers do. Tools and
response_format are checked here (cheap, bounded by the body); compiling them
is structured.py's.
"""

from __future__ import annotations

import json
import operator
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from ..chat import Tool, ToolChoice, check_effort, check_messages, check_tool_choice, check_tools
from ..defaults import SAMPLING_FIELDS
from ..engine import RequestSources, SamplingParams, check_stops
from ..errors import GrammarError, SamplingError
from ..grammar import any_json_object, check_schema
from ..untrusted import is_finite_number, is_int, shown
from .errors import APIError, as_api_error

UNSUPPORTED = (  # refused when set to anything but their default
    "echo",
    "logprobs",
    "top_logprobs",
    "functions",  # the legacy form of tools
    "function_call",
    "logit_bias",
    "suffix",
)
FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for response_format.json_schema.name
MAX_DEPTH = 64  # a chat request nests about 5 levels; json.loads recurses once per level
MAX_INT_DIGITS = 20  # seeds reach 2**63 (19 digits); no field takes a longer integer
_STRING = re.compile(rb'"[^"]*"')  # once escaped quotes are gone, a string runs to the next quote
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # 2 opens, 0 closes; minus 1 each: +1 / -1


@dataclass(frozen=True)
class GenerationParams:
    """What a chat or completion request asks of the engine."""

    model: str | None
    max_tokens: int | None  # None: the server's default, at most the context left
    sampling: dict[str, Any]  # the fields the request gives; the others are the model's (engine.with_defaults)
    stop: list[str]
    stream: bool
    include_usage: bool
    keep_alive: float | None = None  # seconds the model stays loaded after this request; None: the server's default


@dataclass(frozen=True)
class ResponseFormat:
    """`response_format` checked: `kind` "json_object" or "json_schema" (with its schema); "text" is None."""

    kind: str
    schema: dict[str, Any]  # grammar.any_json_object() for json_object
    where: str  # the field named in errors about the schema


@dataclass(frozen=True)
class ChatRequest:
    """A chat request's conversation, tools and output format (GenerationParams hold the rest)."""

    messages: list[dict[str, Any]]
    tools: list[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    response_format: ResponseFormat | None
    image_sources: RequestSources = RequestSources()  # set by the server: its --image-urls, the caller's token
    reasoning_effort: str | None = None  # None: the template's default; "none" turns reasoning off (chat/thinking.py)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    response_format: ResponseFormat | None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; NaN and Infinity literals are refused (they are not JSON).

    The nesting depth is bounded before parsing (json.loads recurses once per level and a deep
    enough body overflows a thread's stack); an integer literal longer than any field takes
    becomes a float, as in JavaScript, instead of a slow exact conversion: 1e999 and a
    5000-digit integer both arrive as inf, which every numeric field then refuses by name."""
    try:
        text = raw.decode("utf-8")  # JSON travels as UTF-8 (RFC 8259); the depth check relies on it
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 text: {e}") from None
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise APIError(400, f"the request body nests {depth} levels deep; at most {MAX_DEPTH} are accepted")
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_int=_int_or_float)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def nesting_depth(raw: bytes) -> int:
    """How deep UTF-8 JSON text nests arrays and objects (outside strings), in linear time and C loops.

    When that cannot exceed MAX_DEPTH (no more brackets than that), the bracket count instead."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")  # escaped backslashes, then escaped quotes
    brackets = _STRING.sub(b"", text).translate(None, _NOT_BRACKETS)
    opening = brackets.count(b"[") + brackets.count(b"{")
    if opening <= MAX_DEPTH:  # the common case: nothing more to count
        return opening
    return max(map(operator.sub, accumulate(brackets.translate(_BRACKET_STEPS)), range(1, len(brackets) + 1)))


def _int_or_float(digits: str) -> int | float:
    return int(digits) if len(digits.lstrip("-")) <= MAX_INT_DIGITS else float(digits)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a valid JSON number")


def openai_chat(raw: bytes) -> tuple[ChatRequest, GenerationParams]:
    """A /v1/chat/completions body."""
    return parse_chat(parse_json(raw))


def openai_completion(raw: bytes) -> tuple[CompletionRequest, GenerationParams]:
    """A /v1/completions body."""
    return parse_completion(parse_json(raw))


def parse_chat(body: dict[str, Any]) -> tuple[ChatRequest, GenerationParams]:
    messages, params = check_messages(body.get("messages")), _params(body)
    tools = check_tools(body.get("tools"))
    request = ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=check_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=_flag(body, "parallel_tool_calls", default=True),
        response_format=response_format(body.get("response_format")),
        reasoning_effort=check_effort(body.get("reasoning_effort")),
    )
    if request.response_format is not None and request.tool_choice.mode in ("required", "named"):
        raise APIError(
            400,
            "response_format cannot be combined with a forced tool_choice: the answer is a tool call; "
            "leave one of them out",
            "response_format",
        )
    return request, params


def parse_completion(body: dict[str, Any]) -> tuple[CompletionRequest, GenerationParams]:
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, [], {}):
            raise APIError(400, f"{name} is for /v1/chat/completions; a text completion cannot call tools", name)
    params, formats = _params(body), response_format(body.get("response_format"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return CompletionRequest(prompt, formats), params
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return CompletionRequest([int(t) for t in prompt], formats), params
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def response_format(value: Any) -> ResponseFormat | None:
    """OpenAI's `response_format`: text (None), json_object, or json_schema {name, schema, strict?, description?}.

    A strict false schema is enforced all the same: an answer that may not match helps nobody."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(kind, any_json_object(), "response_format")
    if kind != "json_schema":
        where = "response_format.type" if isinstance(value, dict) else "response_format"
        raise APIError(400, f"{where} must be text, json_object or json_schema, got {shown(kind or value)}", where)
    return _json_schema_format(value.get("json_schema"))


def _json_schema_format(spec: Any) -> ResponseFormat:
    if not isinstance(spec, dict):
        raise APIError(
            400, "response_format.json_schema must be an object {name, schema}", "response_format.json_schema"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not FORMAT_NAME.fullmatch(name):
        raise APIError(
            400,
            f"response_format.json_schema.name must be 1 to 64 letters, digits, _ or -, got {shown(name)}",
            "response_format.json_schema.name",
        )
    for field, expected, what in (("strict", bool, "true or false"), ("description", str, "a string")):
        if spec.get(field) is not None and not isinstance(spec[field], expected):
            where = f"response_format.json_schema.{field}"
            raise APIError(400, f"{where} must be {what}, got {shown(spec[field])}", where)
    schema, where = spec.get("schema"), "response_format.json_schema.schema"
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{where} must be a JSON schema object, got {shown(schema)}", where)
    if schema is False:  # a valid schema that admits nothing: no answer could ever be given
        raise APIError(400, f"{where} is false: it admits no answer at all", where)
    if isinstance(schema, dict):
        try:
            check_schema(schema, where)
        except GrammarError as e:
            raise APIError(400, str(e), where) from None
    return ResponseFormat("json_schema", {} if schema is True else schema, where)


def _params(body: dict[str, Any]) -> GenerationParams:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise APIError(400, f"{name} is not supported by this server; leave it out", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported; use repetition_penalty (e.g. 1.1) instead", name)
    for name in ("n", "best_of"):
        if body.get(name) is not None and (body[name] != 1 or isinstance(body[name], bool)):
            raise APIError(400, f"{name} must be 1: one choice per request", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "model must be a string naming a loaded model (see GET /v1/models)", "model")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise APIError(400, f"max_tokens must be a positive integer, got {shown(max_tokens)}", "max_tokens")
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    return GenerationParams(
        model=model,
        max_tokens=max_tokens,
        sampling=_sampling(body),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=stream and _flag(options, "include_usage"),
        keep_alive=keep_alive_s(body.get("keep_alive")),
    )


MAX_KEEP_ALIVE_S = 366 * 86400
_DURATION = re.compile(r"(-?[0-9]{1,9}(?:\.[0-9]{1,9})?)(ms|s|m|h)?")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def keep_alive_s(value: Any) -> float | None:
    """Ollama's `keep_alive`: seconds as a number, or a duration string ("5m", "30s", "1h", "1.5h");
    0 unloads right after the request, a negative value keeps the model loaded (inf). None: not given."""
    if value is None:
        return None
    seconds: float | None = None
    if is_finite_number(value) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and len(value) <= 24 and (match := _DURATION.fullmatch(value.strip())):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds is None:
        raise APIError(400, f'keep_alive must be seconds or a duration like "5m", got {shown(value)}', "keep_alive")
    return float("inf") if seconds < 0 else min(seconds, MAX_KEEP_ALIVE_S)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields the request gives, checked; those it leaves out (or sends as null) take the model's
    own when the job is queued (engine.with_defaults), so the answer does not depend on the route."""
    given = {name: body.get(name) for name in SAMPLING_FIELDS if body.get(name) is not None}
    temperature = given.get("temperature", 0)
    # OpenAI's range; SamplingParams itself allows more for library callers.
    if not is_finite_number(temperature) or not 0 <= temperature <= 2:
        raise APIError(400, f"temperature must be a number in [0, 2], got {shown(temperature)}", "temperature")
    for name, value in given.items():
        if not is_finite_number(value):
            raise APIError(400, f"{name} must be a number, got {shown(value)}", name)
    try:
        SamplingParams(**given)  # every field's own range, here, where the request is answered 400
    except SamplingError as e:
        raise as_api_error(e) from None
    return given


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    try:
        return check_stops(stops)
    except SamplingError as e:
        raise as_api_error(e) from None


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {shown(value)}", name)
    return value
