"""Request bodies in, validated parameters out; every refusal is a 400 naming the field.

Follows OpenAI's chat and completions APIs with n=1. Fields the engine cannot
honour (logprobs, tools, non-zero presence/frequency penalties) are refused
rather than ignored, so a client never gets an answer it did not ask for.
Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import operator
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from ..engine import SamplingParams
from ..engine.sampling import is_finite_number, is_int
from ..engine.text import check_stops
from ..errors import SamplingError
from ..untrusted import shown
from .errors import APIError, as_api_error

ROLES = frozenset({"system", "developer", "user", "assistant"})
UNSUPPORTED = (  # refused when set to anything but their default
    "echo",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "logit_bias",
    "response_format",
    "suffix",
)
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
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool


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


def parse_chat(body: dict[str, Any]) -> tuple[list[dict[str, str]], GenerationParams]:
    return _messages(body.get("messages")), _params(body)


def parse_completion(body: dict[str, Any]) -> tuple[str | list[int], GenerationParams]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return prompt, _params(body)
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [int(t) for t in prompt], _params(body)
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:  # a list or object role is not hashable: check first
            raise APIError(400, f"messages[{i}] needs a role among {sorted(ROLES)}", f"messages[{i}].role")
        out.append({"role": role, "content": _content(message.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text can be read by a text model
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


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
    )


def _sampling(body: dict[str, Any]) -> SamplingParams:
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature  # OpenAI's default
    # OpenAI's range; SamplingParams itself allows more for library callers.
    if not is_finite_number(temperature) or not 0 <= temperature <= 2:
        raise APIError(400, f"temperature must be a number in [0, 2], got {shown(temperature)}", "temperature")
    fields = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": None}
    values = {name: body.get(name, default) for name, default in fields.items()}
    values = {name: fields[name] if value is None and name != "seed" else value for name, value in values.items()}
    for name, value in values.items():
        if value is not None and not is_finite_number(value):
            raise APIError(400, f"{name} must be a number, got {shown(value)}", name)
    try:
        return SamplingParams(temperature=temperature, **values)
    except SamplingError as e:
        raise as_api_error(e) from None


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


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {shown(value)}", name)
    return value
