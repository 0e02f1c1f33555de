"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}.

A request runs as a chat request (responses_input.py reads it); the answer's deltas come back as output
items (message, function_call, reasoning), whole or as the API's semantic stream events, each numbered.
A stored response (`store`, the default) keeps its conversation, so `previous_response_id` continues it;
the prefix cache then finds the KV of everything before the new input.
Follows https://platform.openai.com/docs/api-reference/responses and .../responses-streaming
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...errors import MlxInferError
from ..core import API
from ..deltas import Done, Running
from ..errors import APIError, as_api_error
from ..response_store import ResponseStore
from ..schema import ChatRequest, GenerationParams, parse_chat, parse_json
from .responses_input import Turn, read_turn

# The chat body's fields that come from a Responses field of another name, for errors about them.
CHAT_FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def routes(api: API) -> list[Route]:
    responses = Responses(api)
    stored = api.counted("stored_responses", responses.stored)
    return [
        Route("/v1/responses", api.counted("responses", responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"]),
    ]


class Responses:
    """The endpoints, over the API's models and gate, with the stored responses."""

    def __init__(self, api: API) -> None:
        self.api, self.store = api, ResponseStore()

    async def create(self, request: Request) -> Response:
        turn = Turn()
        running = await self.api.start(request, partial(self._parse, turn))
        output = Output(turn, running)
        if running.params.stream:
            return running.streamed(self._stream(running, output), "text/event-stream")

        def render(done: Done) -> Response:
            return JSONResponse(self._finished(output, done))

        return await self.api.whole(request, running, render, on_delta=output.feed)

    def _parse(self, turn: Turn, raw: bytes) -> tuple[ChatRequest, GenerationParams]:
        read = read_turn(parse_json(raw), self.store)
        turn.chat, turn.history, turn.echo, turn.store = read.chat, read.history, read.echo, read.store
        try:
            return parse_chat(turn.chat)
        except (APIError, MlxInferError) as error:  # named by the Responses field the client sent
            raise _renamed(as_api_error(error)) from None

    async def _stream(self, running: Running, output: Output) -> AsyncIterator[str]:
        numbered = Numbered()
        try:
            yield numbered.event({"type": "response.created", "response": output.response("in_progress")})
            yield numbered.event({"type": "response.in_progress", "response": output.response("in_progress")})
            async for item in running.deltas():
                if isinstance(item, Done):
                    for event in output.finish():
                        yield numbered.event(event)
                    response = self._finished(output, item)
                    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                    yield numbered.event({"type": kind, "response": response})
                elif isinstance(item, APIError):
                    failed = output.response(
                        "failed", error={"code": item.code or "server_error", "message": item.message}
                    )
                    yield numbered.event({"type": "response.failed", "response": failed})
                else:
                    for event in output.feed(item):
                        yield numbered.event(event)
        finally:
            running.cancel()  # a no-op once it finished; frees the slot if the client left

    def _finished(self, output: Output, done: Done) -> dict[str, Any]:
        output.finish()  # a whole answer: its last item closed (the stream has sent its events already)
        response = output.response(*_status(done), usage=_usage(done))
        if output.turn.store:
            self.store.put(response, [*output.turn.history, output.message()])
        return response

    async def stored(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            if not await run_in_threadpool(self.store.delete, response_id):
                raise _not_found(response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
        entry = await run_in_threadpool(self.store.get, response_id)
        if entry is None:
            raise _not_found(response_id)
        return JSONResponse(entry.response)


class Output:
    """Answer deltas in, output items out: the stream's item events as they come, and the whole output.

    A message or reasoning item runs until a delta of another kind; each tool call is an item of its own."""

    def __init__(self, turn: Turn, running: Running) -> None:
        self.turn, self.running = turn, running
        self.id, self.created = f"resp_{secrets.token_hex(24)}", int(time.time())
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # "message" or "reasoning": the item still taking text

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for call in delta.get("tool_calls", ()):
            events += self.finish() + self._call(call)
        if "reasoning_content" in delta:
            events += self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            events += self._text("message", delta["content"])
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Close the open item, if any: its done events."""
        if self._open is None:
            return []
        item, index, self._open = self.items[-1], len(self.items) - 1, None
        item["status"] = "completed"
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        part = item["content"][0]
        if item["type"] == "reasoning":
            done = [{"type": "response.reasoning_text.done", **at, "text": part["text"]}]
        else:
            done = [
                {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", **at, "part": copy.deepcopy(part)},
            ]
        return [*done, {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != kind:
            events += self.finish() + self._start(kind)
        item, index = self.items[-1], len(self.items) - 1
        item["content"][0]["text"] += text
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            return [*events, {"type": "response.reasoning_text.delta", **at, "delta": text}]
        return [*events, {"type": "response.output_text.delta", **at, "delta": text, "logprobs": []}]

    def _start(self, kind: str) -> list[dict[str, Any]]:
        self._open, index = kind, len(self.items)
        if kind == "reasoning":  # no summary is made: the model's own reasoning text is the content
            item = {"type": "reasoning", "id": f"rs_{secrets.token_hex(24)}", "summary": [], "status": "in_progress"}
            self.items.append({**item, "content": [{"type": "reasoning_text", "text": ""}]})
            return [{"type": "response.output_item.added", "output_index": index, "item": {**item, "content": []}}]
        item = {"type": "message", "id": f"msg_{secrets.token_hex(24)}", "status": "in_progress", "role": "assistant"}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append({**item, "content": [dict(part)]})
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            {"type": "response.output_item.added", "output_index": index, "item": {**item, "content": []}},
            {"type": "response.content_part.added", **at, "part": part},
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        name, arguments, index = call["function"]["name"], call["function"]["arguments"], len(self.items)
        item = {"type": "function_call", "id": f"fc_{secrets.token_hex(24)}", "call_id": call["id"], "name": name}
        self.items.append({**item, "arguments": arguments, "status": "completed"})
        at = {"item_id": item["id"], "output_index": index}
        return [
            {"type": "response.output_item.added", "output_index": index,
             "item": {**item, "arguments": "", "status": "in_progress"}},
            {"type": "response.function_call_arguments.delta", **at, "delta": arguments},
            {"type": "response.function_call_arguments.done", **at, "name": name, "arguments": arguments},
            {"type": "response.output_item.done", "output_index": index, "item": dict(self.items[-1])},
        ]  # fmt: skip

    def message(self) -> dict[str, Any]:
        """The answer as the chat message a continued response puts in its conversation."""
        message = self.running.answer.message()
        message.pop("reasoning_content", None)  # chat templates drop an earlier turn's reasoning
        return message

    def response(self, status: str, incomplete: str | None = None, usage: Any = None, error: Any = None) -> dict:
        """The response object: this answer's items, and the request's settings as they were applied."""
        sampling = self.running.job.sampling
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.running.served.id,
            "output": copy.deepcopy(self.items) if status != "in_progress" else [],
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "usage": usage,
            **self.turn.echo,
        }


class Numbered:
    """Server-sent events named by their type, each with the stream's next sequence_number."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, data: dict[str, Any]) -> str:
        data = {**data, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _status(done: Done) -> tuple[str, str | None]:
    """ "incomplete" when max_output_tokens cut the answer; else "completed" (a stop or a call ends it)."""
    return ("incomplete", "max_output_tokens") if done.finish_reason == "length" else ("completed", None)


def _usage(done: Done) -> dict[str, Any]:
    stats = done.stats
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.cached_tokens},
        "output_tokens": stats.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},  # not counted apart: they are in output_tokens
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def _renamed(error: APIError) -> APIError:
    """A chat field in an error, as the Responses field it came from (max_tokens -> max_output_tokens, ...)."""
    old = error.param or ""
    new = next((theirs for ours, theirs in CHAT_FIELDS.items() if old.startswith(ours)), None)
    if new is None:
        return error
    message = error.message.replace(old, new, 1) if old in error.message else f"{new}: {error.message}"
    return APIError(error.status, message, new, error.code, error.retry_after_s, error.close)


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r}: it was never stored, deleted, or let go", "response_id")
