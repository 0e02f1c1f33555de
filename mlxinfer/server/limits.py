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

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on a worker thread once a place is free; 429 when too many wait already."""
        if self._slots.locked() and self._waiting >= self._queue:
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
        try:
            return await run_in_threadpool(work, *args)
        finally:
            self._slots.release()
