"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the OpenAI chat path.

A request becomes an OpenAI-shaped chat body checked by schema.parse_chat, so both APIs share every check;
the answer's deltas come back as Anthropic's content blocks, whole or as its stream events.
Follows https://docs.anthropic.com/en/api/messages and .../en/docs/build-with-claude/streaming
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...chat import MAX_TOOLS
from ...errors import MlxInferError
from ...untrusted import shown
from ..core import API
from ..deltas import Done, Running
from ..errors import APIError, as_api_error
from ..schema import ChatRequest, GenerationParams, parse_chat, parse_json

MAX_ITEMS = 100_000  # Anthropic's limit on messages; content blocks per message are held to it too
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and {"type": "tool", "name"}: a named one
UNREADABLE = {"image": "images outside a user message", "document": "documents"}
DROPPED = ("thinking", "redacted_thinking")  # an earlier turn's reasoning: templates leave it out anyway
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # and "stop": end_turn or stop_sequence
TEXT_BLOCKS = {"content": ("text", "text_delta"), "reasoning_content": ("thinking", "thinking_delta")}
# Anthropic's thinking blocks carry a signature of its own making: there is none to give here.
EMPTY_BLOCKS = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# A stop string's characters, at most 4 UTF-8 bytes each, with byte-level tokens: every token it can span.


def routes(api: API) -> list[Route]:
    messages = Messages(api)
    return [
        Route("/v1/messages", api.counted("messages", messages.create), methods=["POST"]),
        Route("/v1/messages/count_tokens", api.counted("count_tokens", messages.count_tokens), methods=["POST"]),
    ]


# ---- the request: Anthropic's body as an OpenAI chat body ----


def to_openai(body: dict[str, Any], needs_max_tokens: bool = True) -> dict[str, Any]:
    """An Anthropic Messages body as the OpenAI chat body parse_chat checks; fields it does not use are dropped.

    Example:
        >>> to_openai({"max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]})
        {'model': None, 'max_tokens': 8, ..., 'messages': [{'role': 'system', ...}, {'role': 'user', ...}], ...}
    """
    if needs_max_tokens and body.get("max_tokens") is None:  # required by Anthropic: no server default
        raise APIError(400, "max_tokens is required: the most tokens the answer may have, e.g. 1024", "max_tokens")
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else thinking
    if kind not in (None, "enabled", "disabled"):
        raise APIError(400, f'thinking must be {{"type": "enabled"}} or {{"type": "disabled"}}, got {shown(thinking)}')
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise APIError(400, f"temperature must be a number in [0, 1], got {shown(temperature)}", "temperature")
    out = {name: body.get(name) for name in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream")}
    out["stop"] = body.get("stop_sequences")
    out["reasoning_effort"] = {"enabled": "medium", "disabled": "none"}.get(kind)  # a thinking budget: unused
    out["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    out["tools"] = _tools(body.get("tools"))
    return {**out, **_tool_choice(body.get("tool_choice")), **_output_format(body.get("output_config"))}


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages or len(messages) > MAX_ITEMS:
        raise APIError(400, f"messages must be a non-empty list of at most {MAX_ITEMS} {{role, content}}", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise APIError(400, f'messages[{i}].role must be "user" or "assistant", got {shown(role)}', "messages")
        turn = _user if role == "user" else _assistant
        out += turn(message.get("content"), f"messages[{i}].content")
    # Anthropic continues a final assistant message (a prefill); chat templates would close it and start
    # another turn: refused rather than answered differently.
    if messages[-1]["role"] != "user":
        raise APIError(400, "the last message must be the user's: continuing an assistant message is not supported")
    return out


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, parts = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind = _kind(block, f"{where}[{j}]", images=True)
        if kind == "tool_result":
            results.append(_tool_result(block, f"{where}[{j}]"))
        elif kind == "text":
            parts.append({"type": "text", "text": _text([block], f"{where}[{j}]")})
        elif kind == "image":
            parts.append(_image(block, f"{where}[{j}]"))
        elif kind not in DROPPED:
            raise APIError(400, f"{where}[{j}]: a user message cannot hold a {shown(kind)} block")
    # Results answer the calls of the turn before, so they come first (Anthropic puts them first too).
    if any(p["type"] == "image_url" for p in parts):
        return [*results, {"role": "user", "content": parts}]
    text = "".join(p["text"] for p in parts)
    return results + ([{"role": "user", "content": text}] if parts or not results else [])


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as OpenAI's image_url part: base64 data as a data: URL; a url source is fetched only by a
    server started with --image-urls."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise APIError(400, f'{where}.source must be {{"type": "base64", "media_type", "data"}}', where)
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise APIError(400, f"{where}.tool_use_id must be the id of the tool_use block it answers")
    content = block.get("content")
    text = "" if content is None else _text(content, f"{where}.content")
    if block.get("is_error") is True:  # OpenAI's tool messages have no such flag: the model reads it as text
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "assistant", "content": content}]
    texts, calls = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "text":
            texts.append(_text([block], f"{where}[{j}]"))
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{where}[{j}]"))
        elif kind not in DROPPED:
            raise APIError(400, f"{where}[{j}]: an assistant message cannot hold a {shown(kind)} block")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    return [{**message, "tool_calls": calls} if calls else message]


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name and isinstance(arguments, dict)):
        raise APIError(400, f'{where} must be {{"type": "tool_use", "id", "name", "input": {{...}}}}')
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined (as OpenAI's text parts are)."""
    if isinstance(content, str):
        return content
    blocks = _blocks(content, where)
    for j, block in enumerate(blocks):
        if _kind(block, f"{where}[{j}]") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where} must be a string or a list of text blocks {{type: text, text}}")
    return "".join(block["text"] for block in blocks)


def _blocks(content: Any, where: str) -> list[Any]:
    if not isinstance(content, list) or len(content) > MAX_ITEMS:
        raise APIError(400, f"{where} must be a string or a list of at most {MAX_ITEMS} content blocks")
    return content


def _kind(block: Any, where: str, images: bool = False) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise APIError(400, f"{where} must be a content block: an object with a type")
    if kind in UNREADABLE and not (images and kind == "image"):
        raise APIError(400, f"{where}: {UNREADABLE[kind]} are not supported")
    return kind


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise APIError(
                400, f"tools[{i}] is {shown(kind)}: only custom tools {{name, description, input_schema}} run here"
            )
        function = {"name": tool.get("name"), "description": tool.get("description")}
        out.append({"type": "function", "function": {**function, "parameters": tool.get("input_schema")}})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        out: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice.get("name")}}}
    elif isinstance(kind, str) and kind in TOOL_CHOICES:
        out = {"tool_choice": TOOL_CHOICES[kind]}
    else:
        raise APIError(400, f'tool_choice must be {{"type": "auto", "any", "tool" or "none"}}, got {shown(choice)}')
    serial = choice.get("disable_parallel_tool_use")
    if serial is not None and not isinstance(serial, bool):
        raise APIError(400, f"tool_choice.disable_parallel_tool_use must be true or false, got {shown(serial)}")
    return out if serial is None else {**out, "parallel_tool_calls": not serial}


def _output_format(config: Any) -> dict[str, Any]:
    """Structured outputs: output_config.format {type: json_schema, schema} is OpenAI's json_schema format.
    `effort` is a hint for Anthropic's own models: left unused."""
    if config is None:
        return {}
    spec = config.get("format") if isinstance(config, dict) else config
    if spec is None:
        return {}
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        raise APIError(400, f'output_config.format must be {{"type": "json_schema", "schema"}}, got {shown(spec)}')
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": spec.get("schema")}}}


def parse(raw: bytes) -> tuple[ChatRequest, GenerationParams]:
    """A /v1/messages body (run by API.start on a preparing thread)."""
    return parse_chat(to_openai(parse_json(raw)))


def parse_count(raw: bytes) -> tuple[ChatRequest, GenerationParams]:
    """A /v1/messages/count_tokens body: a Messages body without max_tokens."""
    return parse_chat(to_openai(parse_json(raw), needs_max_tokens=False))


# ---- the answer: deltas as content blocks ----


class Blocks:
    """Answer deltas in, content blocks out: the stream's block events as they come, and the whole content.

    A text or thinking block runs until a delta of another kind; a tool call is a block of its own."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the block still open

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        for call in delta.get("tool_calls", ()):
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            events += self.finish() + self._start({"type": "tool_use", "id": call["id"], "name": name, "input": {}})
            self.content[-1]["input"] = json.loads(arguments) if arguments else {}  # the parser checked it parses
            events += [self._delta({"type": "input_json_delta", "partial_json": arguments}), *self.finish()]
        for key, (kind, delta_type) in TEXT_BLOCKS.items():
            if key in delta:
                if self._open != kind:
                    events += self.finish() + self._start(EMPTY_BLOCKS[kind])
                self.content[-1][kind] += delta[key]
                events.append(self._delta({"type": delta_type, kind: delta[key]}))
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Close the open block, if any."""
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.content.append(dict(block))
        self._open = block["type"]
        return [{"type": "content_block_start", "index": len(self.content) - 1, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}


def stop_reason(done: Done) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence (the engine says which stop string it stopped at)."""
    if done.stats.stop_sequence:
        return "stop_sequence", done.stats.stop_sequence
    return STOP_REASONS.get(done.finish_reason, "end_turn"), None


def usage(done: Done) -> dict[str, int]:
    # Anthropic counts input read from the cache apart from input_tokens; OpenAI's prompt_tokens holds both.
    stats = done.stats
    return {
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,
        "output_tokens": stats.generated_tokens,
        "cache_read_input_tokens": stats.cached_tokens,
    }


def error_body(error: APIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers())


def sse(data: dict[str, Any]) -> str:
    """One server-sent event named, as Anthropic's are, by its type."""
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def answered_in_anthropic_shape(
    handler: Callable[[Messages, Request], Awaitable[Response]],
) -> Callable[[Messages, Request], Awaitable[Response]]:
    """Refusals as Anthropic's error objects (API.counted, outside, would write OpenAI's); bugs go on to it."""

    async def run(self: Messages, request: Request) -> Response:
        try:
            return await handler(self, request)
        except (APIError, MlxInferError, ClientDisconnect) as error:
            return error_response(as_api_error(error))

    return run


class Messages:
    """The endpoints, over the API's models and gate."""

    def __init__(self, api: API) -> None:
        self.api = api

    @answered_in_anthropic_shape
    async def create(self, request: Request) -> Response:
        running = await self.api.start(request, parse)
        head = {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant"}
        head["model"] = running.served.id
        if running.params.stream:
            return running.streamed(self._stream(running, head), "text/event-stream")
        blocks = Blocks()

        def render(done: Done) -> Response:
            reason, sequence = stop_reason(done)
            body = {**head, "content": blocks.content, "stop_reason": reason, "stop_sequence": sequence}
            return JSONResponse({**body, "usage": usage(done)})

        return await self.api.whole(request, running, render, on_delta=blocks.feed, error=error_response)

    async def _stream(self, running: Running, head: dict[str, Any]) -> AsyncIterator[str]:
        blocks, start_usage = Blocks(), {"input_tokens": running.prompt_tokens, "output_tokens": 0}
        message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}
        try:
            yield sse({"type": "message_start", "message": message})
            async for item in running.deltas():
                if isinstance(item, Done):
                    reason, sequence = stop_reason(item)
                    for event in blocks.finish():
                        yield sse(event)
                    delta = {"stop_reason": reason, "stop_sequence": sequence}
                    yield sse({"type": "message_delta", "delta": delta, "usage": usage(item)})
                    yield sse({"type": "message_stop"})
                elif isinstance(item, APIError):
                    yield sse(error_body(item))
                else:
                    for event in blocks.feed(item):
                        yield sse(event)
        finally:
            running.cancel()  # a no-op once it finished; frees the slot if the client left

    @answered_in_anthropic_shape
    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens as the model would read them (template, tools), without generating."""
        prepared = await self.api.encode_only(request, parse_count)
        return JSONResponse({"input_tokens": len(prepared.ids)})
