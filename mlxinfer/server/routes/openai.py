"""OpenAI's /v1/chat/completions, /v1/completions and /v1/models, and their bodies in OpenAI's shapes.

Follows https://platform.openai.com/docs/api-reference/chat: whole completions, or server-sent-event
chunks ending in `data: [DONE]` (with a usage chunk when stream_options.include_usage asks for one).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...engine import GenerationStats
from ..core import API
from ..deltas import Answer, Done, Running
from ..errors import APIError
from ..schema import openai_chat, openai_completion
from ..structured import prepare_completion


def routes(api: API) -> list[Route]:
    async def chat_completions(request: Request) -> Response:
        running = await api.start(request, openai_chat)
        return await _answer(api, request, running, Reply(running.served.id, chat=True))

    async def completions(request: Request) -> Response:
        running = await api.start(request, openai_completion, encode=prepare_completion)
        return await _answer(api, request, running, Reply(running.served.id, chat=False))

    async def list_models(request: Request) -> Response:
        # `verified`: the family matches transformers; false for mlx-lm's model code run as it is (unverified).
        # `sampling_defaults`: what a request that names no sampling field gets (the model's generation config,
        # else greedy); read from the model's files, so off the event loop.
        # An adapter is listed as "model:adapter" with its base as `parent`, as vLLM lists LoRA modules.
        def model(name: str, parent: str | None = None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": api.started,
                "owned_by": "mlxinfer",
                "verified": api.models.verified(name),
                "sampling_defaults": api.models.sampling_defaults(name),
                **({"parent": parent} if parent else {}),
            }

        def listed() -> list[dict[str, Any]]:
            adapters = [model(name, parent) for name, parent, _ in api.models.adapter_ids]
            return [model(name) for name in api.models.ids] + adapters

        data = await run_in_threadpool(listed)
        return JSONResponse({"object": "list", "data": data})

    return [
        Route("/v1/chat/completions", api.counted("chat", chat_completions), methods=["POST"]),
        Route("/v1/completions", api.counted("completions", completions), methods=["POST"]),
        Route("/v1/models", api.counted("models", list_models), methods=["GET"]),
    ]


async def _answer(api: API, request: Request, running: Running, reply: Reply) -> Response:
    if running.params.stream:
        return running.streamed(_stream(running, reply), "text/event-stream")
    return await api.whole(request, running, lambda done: JSONResponse(reply.whole(running.answer, done.stats)))


async def _stream(running: Running, reply: Reply) -> AsyncIterator[str]:
    try:
        if reply.chat:
            yield event(reply.chunk({"content": ""}, role=True))
        async for item in running.deltas():
            if isinstance(item, Done):
                yield event(reply.chunk(finish_reason=item.finish_reason))
                if running.params.include_usage:
                    yield event(reply.usage_chunk(item.stats))
            elif isinstance(item, APIError):
                yield event(item.body())
            else:
                yield event(reply.chunk(item))
        yield event("[DONE]")
    finally:
        running.cancel()  # a no-op once it finished; frees the slot if the client left


def usage(stats: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def event(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class Reply:
    """The id, model and shape shared by every body of one answer; `chat` picks chat or text completions."""

    model: str
    chat: bool
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {
            "id": prefix + self.id,
            "object": kind + (".chunk" if chunk and self.chat else ""),
            "created": self.created,
            "model": self.model,
        }

    def whole(self, answer: Answer, stats: GenerationStats) -> dict[str, Any]:
        reason = answer.finish_reason(stats.finish_reason) if self.chat else stats.finish_reason
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["message"] = answer.message()
        else:
            choice["text"] = answer.text
        return {**self._head(chunk=False), "choices": [choice], "usage": usage(stats)}

    def chunk(
        self, delta: dict[str, Any] | None = None, finish_reason: str | None = None, role: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk; `delta` holds content, reasoning_content or tool_calls (text completions: content)."""
        delta = delta or {}
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = {"role": "assistant", **delta} if role else delta
        else:
            choice["text"] = delta.get("content", "")
        return {**self._head(chunk=True), "choices": [choice]}

    def usage_chunk(self, stats: GenerationStats) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": usage(stats)}
