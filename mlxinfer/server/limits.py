"""A bound on the CPU work requests line up before they generate: JSON parsing, chat templates, tokenizing.

That work runs on worker threads, never on the event loop, so /health and running streams
keep answering while a huge prompt is tokenized. At most `workers` run at once and `queue`
more may wait; past that a request gets 429 at once, so a flood of huge prompts cannot
pile unbounded CPU work onto the thread pool (40 threads, shared with everything else).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from .errors import APIError

T = TypeVar("T")


class WorkGate:
    def __init__(self, workers: int, queue: int):
        self._slots = asyncio.Semaphore(workers)
        self._workers, self._queue, self._waiting = workers, queue, 0

    async def run(self, work: Callable[..., T], *args: Any, admitted: bool = False) -> T:
        """`work(*args)` on a worker thread once a place is free; 429 when too many wait already, unless the
        request was `admitted` by an earlier pass (it then waits: a parsed request is never turned away).

        The place is freed when the thread's work ends, not when the awaiting task does: a client that
        leaves (its task cancelled) cannot free a place while its tokenizing still runs."""
        if not admitted and self._slots.locked() and self._waiting >= self._queue:
            raise APIError(
                429,
                f"the server is busy preparing {self._workers + self._waiting} other requests; retry shortly",
                code="busy",
                retry_after_s=1,
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        running = asyncio.ensure_future(run_in_threadpool(work, *args))
        running.add_done_callback(self._finished)
        return await asyncio.shield(running)  # a cancelled caller leaves `running` to end on its own

    def _finished(self, running: asyncio.Future[Any]) -> None:
        self._slots.release()
        if not running.cancelled():
            running.exception()  # retrieved: a caller that left never reads it
