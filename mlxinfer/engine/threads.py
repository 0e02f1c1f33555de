"""Threads for device work that last as long as the process.

mlx.nn's activations are compiled functions, and MLX keeps per-thread state for
them; on MLX 0.32 a thread that ran one and then ends makes the whole process
abort at exit ("terminate called without an active exception"). So a thread
that ran model code is never ended: when its work returns it parks, and the
next piece of device work (a new ServingThread, after an unload) reuses it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("mlxinfer.threads")
_parked: queue.SimpleQueue[queue.SimpleQueue] = queue.SimpleQueue()


def run_on_device_thread(work: Callable[[], None], name: str = "mlxinfer-device") -> threading.Event:
    """Run `work` on a parked (or new) daemon thread; the returned event is set when it returns."""
    done = threading.Event()
    try:
        inbox = _parked.get_nowait()
    except queue.Empty:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name=name, daemon=True).start()
    inbox.put((work, done))
    return done


def _serve(inbox: queue.SimpleQueue) -> None:
    while True:
        work, done = inbox.get()
        try:
            work()
        except BaseException:  # noqa: BLE001 - a parked thread must survive its work failing
            log.exception("device work failed")
        finally:
            work = None  # a parked thread must not keep the finished work (a ServingThread, its model) alive
            done.set()
            _parked.put(inbox)


def call_on_device_thread(work: Callable[[], T], name: str = "mlxinfer-device") -> T:
    """Run `work` on a device thread and wait for its result (or its exception)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:  # noqa: BLE001 - handed back to the caller
            outcome["error"] = error

    run_on_device_thread(run, name).wait()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
