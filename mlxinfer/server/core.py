"""What every route shares: the loaded models, the settings, the metrics, and a request's way to a Job and back.

A request's body is read within a deadline (read_body), then parsed, validated and tokenized
on worker threads (a bounded number at once: limits.py), and queued on
its model's ServingThread as a Job. The scheduler's thread reports each event with
`call_soon_threadsafe` (deltas.py); a route streams them as server-sent events or
gathers them into one body (API.whole). A client that goes away cancels its job.
The routes (routes/) import this module; it imports none of them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..defaults import MAX_TOKENS  # above it, the engine's own check answers (max_tokens out of range)
from ..engine import Event, Finished, GenerationStats, Job, RequestSources, with_defaults
from ..errors import MlxInferError
from ..grammar import cancelled_by
from ..local_server import ANSWER_HEADER
from .deltas import Answer, Done, JobEvents, Running, TokenClock
from .errors import APIError, as_api_error
from .guard import shows_token
from .limits import WorkGate
from .metrics import Metrics
from .model_pool import ModelSet, ServedModel
from .schema import ChatRequest, GenerationParams
from .settings import ServerSettings
from .structured import Prepared, prepare_chat

log = logging.getLogger("mlxinfer.server")


class API:
    """What the routes share: the loaded models, the settings, the metrics and the preparing gate, and the
    request path every front end takes (`start`, `whole`); each route module takes one in its `routes(api)`."""

    def __init__(
        self, models: ModelSet, settings: ServerSettings, on_finished: Callable[[GenerationStats], None] | None = None
    ):
        self.models, self.settings = models, settings
        self.metrics = Metrics(models)
        self.preparing = WorkGate(settings.prepare_workers, settings.prepare_queue)
        self._on_finished = on_finished
        self.started = int(time.time())
        self._named: dict[str, Running] = {}  # answers a user's own front end may stop (local_server.STOP_PATH)

    def counted(self, endpoint: str, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """`handler` counted in the metrics under `endpoint`, its refusals and bugs answered in OpenAI's shape."""

        async def run(request: Request) -> Response:
            try:
                response = await handler(request)
            except (APIError, MlxInferError, ClientDisconnect) as error:  # the request's fault, not a bug
                response = as_api_error(error).response()
            except Exception as error:  # noqa: BLE001 - a bug answers 500 in the API's shape; the server goes on
                log.exception("%s failed", endpoint)
                response = as_api_error(error).response()
            self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        return run

    def trusted(self, request: Request) -> bool:
        """Whether the request shows this server's per-user token: it comes from the user's own front end
        (`mlxinfer chat`, `mlxinfer.connect()`), which may name models by path."""
        return shows_token(request.headers.get("authorization"), self.settings.local_token)

    async def start(
        self,
        request: Request,
        parse: Callable[[bytes], tuple[Any, GenerationParams]],
        encode: Callable[[Any, Any], Prepared] = prepare_chat,
    ) -> Running:
        """Read the body, parse it (`parse`: raw bytes to an OpenAI-shaped request and its parameters),
        encode it for its model and queue it: every front end (OpenAI, Ollama, Anthropic) starts here."""
        request.state.arrived = time.perf_counter()
        raw = await read_body(request, self.settings)
        served, prepared, params = await self._prepare(raw, parse, encode, request)
        return self._submit(request, served, prepared, params)

    async def encode_only(
        self,
        request: Request,
        parse: Callable[[bytes], tuple[Any, GenerationParams]],
        encode: Callable[[Any, Any], Prepared] = prepare_chat,
    ) -> Prepared:
        """What `start` would queue, without queueing it (token counting); the model is given back at once."""
        raw = await read_body(request, self.settings)
        served, prepared, _ = await self._prepare(raw, parse, encode, request)
        self.models.release(served)
        return prepared

    async def _prepare(
        self,
        raw: bytes,
        parse: Callable[[bytes], tuple[Any, GenerationParams]],
        encode: Callable[[Any, Any], Prepared],
        request: Request,
    ) -> tuple[ServedModel, Prepared, GenerationParams]:
        """Parse, template, tokenize and compile any grammar in one pass through the gate, so a request is
        refused (429) before it is parsed or never. A model that must be loaded first loads outside the gate
        (no place held for it); the tokenizing then waits for a place without a 429."""
        trusted = self.trusted(request)
        gone = threading.Event()  # a grammar compiling for this request stops once its client leaves
        watching = asyncio.ensure_future(_set_when_disconnected(request, gone))
        try:
            with cancelled_by(gone):  # copied into the preparing threads with the rest of this context
                return await self._prepare_for(raw, parse, encode, trusted)
        finally:
            watching.cancel()

    async def _prepare_for(
        self,
        raw: bytes,
        parse: Callable[[bytes], tuple[Any, GenerationParams]],
        encode: Callable[[Any, Any], Prepared],
        trusted: bool,
    ) -> tuple[ServedModel, Prepared, GenerationParams]:
        def everything() -> tuple[Any, GenerationParams, ServedModel | None, Prepared | None]:
            body, params = parse(raw)
            if isinstance(body, ChatRequest):  # images from files only for the user's own front ends
                body = replace(body, image_sources=RequestSources(paths=trusted, urls=self.settings.image_urls))
            served = self.models.acquire_loaded(params.model, trusted)  # held: never unloaded under it
            return body, params, served, None if served is None else self._encode(encode, served, body)

        body, params, served, prepared = await self.preparing.run(everything)
        if served is None or prepared is None:
            served = await run_in_threadpool(self.models.acquire, params.model, trusted)  # loads it
            try:
                prepared = await self.preparing.run(encode, served.model, body, admitted=True)
            except BaseException:
                self.models.release(served)
                raise
        return served, prepared, params

    def _encode(self, encode: Callable[[Any, Any], Prepared], served: ServedModel, body: Any) -> Prepared:
        try:
            return encode(served.model, body)
        except BaseException:
            self.models.release(served)
            raise

    def _submit(self, request: Request, served: ServedModel, prepared: Prepared, params: GenerationParams) -> Running:
        """Queue the job on the model held for it; the model is released when the job's events end (or here,
        if it cannot be queued)."""
        name = request.headers.get(ANSWER_HEADER) if self.trusted(request) else None

        def release() -> None:
            if name is not None:
                self._named.pop(name, None)
            self.models.release(served, params.keep_alive)

        try:
            job, events = self._queue(served, prepared, params)
        except BaseException:
            release()
            raise
        clock = TokenClock(self.metrics, request.state.arrived)
        running = Running(served, job, events, Answer(prepared.parser), params, clock, len(prepared.ids), release)
        if name is not None:
            self._named[name] = running
        return running

    def stop(self, name: str) -> bool:
        """End the answer a user's own front end named `name` as a finished one ends ("cancelled", with its counts);
        False if there is none (already ended)."""
        running = self._named.get(name)
        if running is not None:
            running.served.scheduler.cancel(running.job)
        return running is not None

    def _queue(self, served: ServedModel, prepared: Prepared, params: GenerationParams) -> tuple[Job, JobEvents]:
        ids = prepared.ids
        room = served.model.context_tokens - len(ids)
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; the model's context is {served.model.context_tokens}",
                "messages",
                "context_length_exceeded",
            )
        max_tokens = params.max_tokens or min(self.settings.default_max_tokens, room)
        if max_tokens > room and max_tokens <= MAX_TOKENS:
            raise APIError(
                400,
                f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of "
                f"{served.model.context_tokens} tokens; lower max_tokens to at most {room}",
                "max_tokens",
                "context_length_exceeded",
            )
        events = JobEvents(self._ended)
        job = Job(
            ids,
            events.put,
            max_tokens,
            with_defaults(params.sampling, served.model.sampling_defaults.values),
            params.stop,
            self.settings.request_timeout_s,
            constraint=prepared.constraint,
            keep_special_tokens=prepared.keep_special_tokens,
            speculate=served.model.speculate,
            images=prepared.images,
            adapter=served.adapter,  # held with the model: `release` gives both back
        )
        served.scheduler.submit(job)
        return job, events

    async def whole(
        self,
        request: Request,
        running: Running,
        render: Callable[[Done], Response],
        on_delta: Callable[[dict[str, Any]], Any] | None = None,
        error: Callable[[APIError], Response] = APIError.response,
    ) -> Response:
        """The whole answer as one response (`render` shapes it; `on_delta` sees each delta on the way, `error`
        shapes a failure); 499 (never sent) and the job cancelled if the client leaves first."""

        async def gather() -> Response:
            async for item in running.deltas():
                if isinstance(item, Done):
                    return render(item)
                if isinstance(item, APIError):
                    return error(item)
                if on_delta is not None:
                    on_delta(item)
            raise AssertionError("the event stream ended without a final event")

        body, gone = asyncio.ensure_future(gather()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            answered = body.done()
            if not answered:
                body.cancel()
            running.cancel()  # a no-op once it finished
        return body.result() if answered else Response(status_code=499)  # 499: never sent, the client is gone

    def _ended(self, event: Event) -> None:
        if not isinstance(event, Finished):
            self.metrics.finished.labels("error").inc()
            return
        self.metrics.record(event.stats)
        if self._on_finished is not None:
            try:
                self._on_finished(event.stats)
            except Exception:  # noqa: BLE001 - a listener's bug must not fail the answer
                log.exception("on_finished listener failed")


async def read_body(request: Request, settings: ServerSettings) -> bytes:
    """The body: 413 past the size limit (before reading, when Content-Length says so), 408 when it has not
    all arrived `body_timeout_s` after the headers, 499 (never sent) when the client leaves half-way."""
    limit = settings.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and (not (length.isascii() and length.isdigit()) or len(length) > 18 or int(length) > limit):
        raise _too_large(limit)  # 18 digits: no slow int() of a 16 KiB header
    deadline = time.monotonic() + settings.body_timeout_s
    chunks, size, more = [], 0, True
    while more:
        message = await _receive_by(request, deadline, settings.body_timeout_s)
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    # The unread rest of the body would otherwise be taken for the next request: close the connection.
    return APIError(
        413,
        f"the request body is larger than {limit} bytes ({limit / 2**20:g} MiB); send smaller images, or start the "
        "server with a larger --max-body-mb",
        code="body_too_large",
        close=True,
    )


async def _receive_by(request: Request, deadline: float, timeout_s: float) -> dict[str, Any]:
    try:
        return await asyncio.wait_for(request.receive(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        # The rest of the body may still be on its way: this connection cannot carry another request.
        raise APIError(
            408, f"the request body did not arrive within {timeout_s:g} s", code="body_timeout", close=True
        ) from None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _set_when_disconnected(request: Request, gone: threading.Event) -> None:
    await _disconnected(request)
    gone.set()
