"""The models a server serves, by id: a request's `model` field only ever selects among these.

A model can be unloaded (its weights, KV and prompt cache freed) and stays
listed; the next request for it loads it again from where it was first loaded.
Loading runs on a device thread (engine/threads.py), never on the event loop.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx

from ..api import Model, load
from ..engine import Scheduler, SchedulerConfig
from ..engine.threads import call_on_device_thread
from ..untrusted import shown
from .errors import APIError


@dataclass
class ServedModel:
    id: str
    model: Model
    scheduler: Scheduler


@dataclass
class _Slot:
    id: str
    loader: Callable[[], Model]
    config: SchedulerConfig | None
    served: ServedModel | None = None
    verified: bool = True  # the family was checked against transformers (models/fallback.py runs the others)
    loading: threading.Lock = field(default_factory=threading.Lock)  # one load; other requests for it wait


def model_id(model: Model) -> str:
    """The name clients use: the model folder's name, or the .gguf file's without the suffix."""
    path = model.path
    return path.stem if path.is_file() else path.name


class ModelSet:
    """Loaded (or unloaded, reloadable) models, each with its own Scheduler: batch, queue and prefix cache."""

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()  # adding, removing and unloading, one at a time

    def add(self, model: Model, config: SchedulerConfig | None = None, name: str | None = None) -> ServedModel:
        """Serve a loaded model; if it is unloaded later, it reloads from the same path and settings
        (its draft model and speculation mode included)."""
        draft = model.draft.path if model.draft is not None else None
        loader = partial(
            load,
            model.path,
            dtype=model.compute_dtype,
            kv_bits=model.kv_bits,
            draft_model=draft,
            speculate=model.speculate,
        )
        slot = _Slot(name or model_id(model), loader, config, verified=model.verified)
        with self._lock:
            self._stop(self._slots.pop(slot.id, None), "the model was replaced")
            slot.served = ServedModel(slot.id, model, Scheduler(model.runtime, config))
            self._slots[slot.id] = slot
        return slot.served

    def remove(self, name: str) -> None:
        """Stop serving `name` at all (its running requests end with an error)."""
        with self._lock:
            self._stop(self._slots.pop(name, None), "the model was removed")
        _free_memory()

    def unload(self, name: str) -> None:
        """Free `name`'s memory (weights, KV, prompt cache); the next request for it loads it again."""
        with self._lock:
            slot = self._slots.get(name)
            self._stop(slot, "the model was unloaded")
            if slot:
                slot.served = None
        _free_memory()

    def get(self, name: str | None) -> ServedModel:
        """The model called `name` (with no name, the first), loading it if it was unloaded."""
        slot = next(iter(self._slots.values()), None) if name is None else self._slots.get(name)
        if slot is None:
            loaded = ", ".join(self._slots) or "none"
            raise APIError(
                404,
                f"model {shown(name)} is not loaded (loaded: {loaded}); it is never loaded on request",
                "model",
                "model_not_found",
            )
        served = slot.served
        if served is not None:
            return served
        with slot.loading:
            if slot.served is None:
                model = call_on_device_thread(slot.loader)
                slot.served = ServedModel(slot.id, model, Scheduler(model.runtime, slot.config))
            return slot.served

    def is_loaded(self, name: str) -> bool:
        slot = self._slots.get(name)
        return slot is not None and slot.served is not None

    @property
    def ids(self) -> list[str]:
        return list(self._slots)

    def verified(self, name: str) -> bool:
        slot = self._slots.get(name)
        return slot is None or slot.verified

    def __iter__(self) -> Iterator[ServedModel]:
        """The loaded models."""
        return iter([s.served for s in list(self._slots.values()) if s.served is not None])

    def schedulers(self) -> list[Scheduler]:
        return [s.scheduler for s in self]

    @property
    def memory_in_use(self) -> int:
        """MLX memory in use as the schedulers last saw it (one process-wide figure)."""
        return max((s.memory_in_use for s in self.schedulers()), default=0)

    def abort_all(self, reason: str) -> None:
        """End every request in flight (each stream gets a final error event); the models stay loaded.

        Does not wait, so it is safe in a signal handler."""
        for served in self:
            served.scheduler.abort(reason)

    def close(self, reason: str = "the server is shutting down") -> None:
        with self._lock:
            for slot in self._slots.values():
                self._stop(slot, reason)
                slot.served = None
        _free_memory()

    @staticmethod
    def _stop(slot: _Slot | None, reason: str) -> None:
        if slot is not None and slot.served is not None:
            slot.served.scheduler.stop(reason)


def _free_memory() -> None:
    gc.collect()  # the model's arrays go once nothing refers to them
    mx.clear_cache()
