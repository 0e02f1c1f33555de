"""A queued generation as the HTTP side sees it: its events carried onto the event loop, parsed into answer deltas.

Every front end (OpenAI, Ollama, Anthropic) starts a job the same way (core.API.start) and reads the same
`Running.deltas()`: generated text in, OpenAI answer fields out (content, reasoning_content, tool_calls);
only the shapes the routes write differ. Streamed and whole answers come from the same pieces in the same
order, so the streamed deltas, concatenated, are the whole answer: the same content, reasoning and calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..chat import Content, OutputParser, Piece, Reasoning, ToolCall
from ..engine import Delta, Event, Finished, GenerationStats, Job
from .errors import APIError, as_api_error
from .metrics import Metrics
from .model_pool import ServedModel
from .schema import GenerationParams

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class JobEvents:
    """A job's events, carried from the scheduler's thread onto this event loop."""

    def __init__(self, on_end: Callable[[Event], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._on_end = on_end

    def put(self, item: Event) -> None:  # called on the scheduler's thread
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody is listening
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        if not isinstance(item, Delta):  # here, not in the handler: a client that left no longer reads its events
            self._on_end(item)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            item = await self._queue.get()
            yield item
            if not isinstance(item, Delta):
                return


class TokenClock:
    """Feeds time-to-first-token and time-per-token histograms from a stream of deltas."""

    def __init__(self, metrics: Metrics, arrived: float):
        self.metrics, self.last, self.start = metrics, None, arrived

    def tick(self, tokens: int) -> None:
        if not tokens:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.token_latency.observe((now - self.last) / tokens)
        self.last = now


@dataclass(frozen=True)
class Done:
    """The end of a generation: its stats and the finish reason in OpenAI's terms ("tool_calls" included)."""

    stats: GenerationStats
    finish_reason: str


@dataclass
class Running:
    """A submitted job: read `deltas()` once; `cancel()` when the client is gone (a no-op once it finished)."""

    served: ServedModel
    job: Job
    events: JobEvents
    answer: Answer
    params: GenerationParams
    clock: TokenClock
    prompt_tokens: int
    _release: Callable[[], None]  # gives the model back (its keep-alive counts from then)
    _released: bool = field(default=False)

    async def deltas(self) -> AsyncIterator[dict[str, Any] | Done | APIError]:
        """Answer deltas ({"content": ...}, {"reasoning_content": ...}, {"tool_calls": [...]}), then one `Done`,
        or an APIError for a generation that failed."""
        try:
            async for item in self.events:
                if isinstance(item, Delta):
                    self.clock.tick(item.tokens)
                    for delta in self.answer.feed(item.text):
                        yield delta
                elif isinstance(item, Finished):
                    for delta in self.answer.finish():
                        yield delta
                    yield Done(item.stats, self.answer.finish_reason(item.stats.finish_reason))
                else:
                    yield as_api_error(item.error)
        finally:
            self._end()

    def cancel(self) -> None:
        self.served.scheduler.cancel(self.job)
        self._end()

    def streamed(self, body: AsyncIterator[str], media_type: str) -> Response:
        """`body` as a streaming response that cancels the job however the response ends, also when the client
        left before the first byte (the body's own `finally` would then never run)."""
        return _CancellingStream(self, body, media_type=media_type, headers=STREAM_HEADERS)

    def _end(self) -> None:
        if not self._released:  # the model's keep-alive counts from here
            self._released = True
            self._release()


class _CancellingStream(StreamingResponse):
    def __init__(self, running: Running, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._running = running

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._running.cancel()  # a no-op once the job finished


class Answer:
    """One answer being generated: `feed` each Delta's text, `finish` at the end; each returns the new deltas."""

    def __init__(self, parser: OutputParser | None):
        self._parser = parser
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._parser is None:
            return self._take([Content(text)] if text else [])
        return self._take(self._parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._take(self._parser.finish() if self._parser is not None else [])

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's "tool_calls" when the model called tools and stopped on its own; else the engine's reason."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def message(self) -> dict[str, Any]:
        """The whole chat message: content is None when the model only called tools, as OpenAI's is."""
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in self.calls]
        return message

    @property
    def text(self) -> str:
        return "".join(self.content)

    def _take(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        """Record the pieces; their deltas, adjacent text of one kind joined into one delta."""
        deltas: list[dict[str, Any]] = []
        for piece in pieces:
            delta = self._record(piece)
            if delta is None:
                continue
            key = next(iter(delta))
            if deltas and key != "tool_calls" and next(iter(deltas[-1])) == key:
                deltas[-1][key] += delta[key]
            else:
                deltas.append(delta)
        return deltas

    def _record(self, piece: Piece) -> dict[str, Any] | None:
        if isinstance(piece, ToolCall):
            call = {
                "index": piece.index,
                "id": piece.id,
                "type": "function",
                "function": {"name": piece.name, "arguments": piece.arguments},
            }
            self.calls.append(call)
            return {"tool_calls": [call]}
        if not piece.text:
            return None
        if isinstance(piece, Reasoning):
            self.reasoning.append(piece.text)
            return {"reasoning_content": piece.text}
        self.content.append(piece.text)
        return {"content": piece.text}
