"""Continuous batching for a server: many requests, one model, one thread that owns the device.

The thread turns the generation loop (engine/loop.py) while there is work and
sleeps on a condition variable when there is none; which request runs when is
the loop's admission (engine/admission.py). All requests share the model's
prefix cache and one memory budget: a request that does not fit waits in a
bounded queue; past the queue it is refused with a retry time.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable

import mlx.core as mx

from ..errors import BusyError, ShutdownError
from ..memory import MachineMemory
from .job import Job
from .loop import BatchLoop
from .runtime import ModelRuntime, SchedulerConfig
from .threads import run_on_device_thread

log = logging.getLogger("mlxinfer.scheduler")


class ServingThread:
    """Runs Jobs on a background thread; `submit`, `cancel` and `stop` are safe from any thread."""

    def __init__(
        self,
        runtime: ModelRuntime,
        config: SchedulerConfig | None = None,
        machine: Callable[[], MachineMemory] | None = None,
    ):
        self.runtime, self.config = runtime, config or SchedulerConfig()
        self._loop = BatchLoop(runtime, self.config, machine)  # the thread's own
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._stopping: str | None = None
        self._aborting: str | None = None  # end what is in flight, keep serving
        # Read by other threads (metrics); plain ints are safe to read without the lock.
        self.queued = 0
        self.running = 0
        self.memory_in_use = mx.get_active_memory()
        self._stopped = run_on_device_thread(self._run, "mlxinfer-scheduler")

    @property
    def _batch(self):  # the decoding rows, for tests and metrics
        return self._loop.runner.batch

    @property
    def plain_batch_steps(self) -> dict[str, int]:
        """Batch steps taken plainly although a row could have speculated, by reason (a copy, for metrics)."""
        return dict(self._loop.runner.plain_batch_steps)

    # -- any thread -------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue `job`; raises SamplingError for a bad request, BusyError when the queue is full."""
        self._loop.admission.check(job)
        with self._cond:
            if self._stopping is not None:
                raise ShutdownError(self._stopping)
            if len(self._inbox) + self.queued >= self.config.max_queue:
                raise BusyError(f"all {self.config.max_queue} queue places are taken", self.retry_after_s())
            job.stamp()
            self._inbox.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        job.cancel()
        with self._cond:
            self._cond.notify()

    def abort(self, reason: str) -> None:
        """End every running and waiting request (each gets a Failed event) and go on serving new ones."""
        with self._cond:
            self._aborting = reason
            self._cond.notify()

    def stop(self, reason: str = "the server is shutting down", timeout: float | None = 10.0) -> None:
        """End every request (each gets a Failed event) and the thread."""
        with self._cond:
            self._stopping = self._stopping or reason
            self._cond.notify()
        self._stopped.wait(timeout)

    def retry_after_s(self) -> int:
        waiting = self.queued + len(self._inbox)
        return max(1, min(60, math.ceil(self._loop.output.service_s * (1 + waiting / self.config.max_batch))))

    # -- the loop's thread ------------------------------------------------

    def _run(self) -> None:
        loop = self._loop
        while True:
            with self._cond:
                while not (self._inbox or loop.has_work() or self._stopping or self._aborting):
                    self._cond.wait()
                for job in self._inbox:
                    loop.add(job)
                self._inbox.clear()
                stopping, aborting, self._aborting = self._stopping, self._aborting, None
            if stopping is not None:
                loop.end_all(ShutdownError(stopping))
                return
            if aborting is not None:
                loop.end_all(ShutdownError(aborting))
            try:
                loop.turn()
            except Exception as error:  # noqa: BLE001 - outside the guarded steps: end what is in flight, go on
                log.exception("scheduler turn failed")
                loop.end_all(error)
            self._measure()

    def _measure(self) -> None:
        loop = self._loop
        self.queued, self.running = loop.waiting, loop.running
        self.memory_in_use = mx.get_active_memory()
        for sequence in loop.runner.rows:
            stats = sequence.job.stats
            stats.peak_memory_bytes = max(stats.peak_memory_bytes, self.memory_in_use)
