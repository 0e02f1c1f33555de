"""The models a server serves, by id: a request's `model` field only ever selects among these."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..api import Model
from ..engine import Scheduler, SchedulerConfig
from .errors import APIError


@dataclass
class ServedModel:
    id: str
    model: Model
    scheduler: Scheduler
    created: int = field(default_factory=lambda: int(time.time()))


def model_id(model: Model) -> str:
    """The name clients use: the model folder's name, or the .gguf file's without the suffix."""
    path = model.path
    return path.stem if path.is_file() else path.name


class ModelSet:
    """Loaded models, each with its own Scheduler (and so its own batch, queue and prefix cache)."""

    def __init__(self) -> None:
        self._served: dict[str, ServedModel] = {}

    def add(self, model: Model, config: SchedulerConfig | None = None, name: str | None = None) -> ServedModel:
        served = ServedModel(name or model_id(model), model, Scheduler(model.runtime, config))
        old = self._served.pop(served.id, None)
        if old:
            old.scheduler.stop("the model was replaced")
        self._served[served.id] = served
        return served

    def remove(self, name: str) -> None:
        """Stop serving `name` (its running requests end with an error)."""
        served = self._served.pop(name, None)
        if served:
            served.scheduler.stop("the model was unloaded")

    def get(self, name: str | None) -> ServedModel:
        """The model called `name`; with no name, the only (or first) one loaded."""
        if name is None and self._served:
            return next(iter(self._served.values()))
        if name in self._served:
            return self._served[name]
        loaded = ", ".join(self._served) or "none"
        raise APIError(
            404,
            f"model {name!r} is not loaded (loaded: {loaded}); it is never loaded on request",
            "model",
            "model_not_found",
        )

    def __iter__(self):
        return iter(list(self._served.values()))

    def __len__(self) -> int:
        return len(self._served)

    def schedulers(self) -> list[Scheduler]:
        return [s.scheduler for s in self]

    def request_stop(self, reason: str) -> None:
        """Tell every scheduler to end its requests, without waiting (safe in a signal handler)."""
        for served in self:
            served.scheduler.stop(reason, timeout=0)

    def close(self, reason: str = "the server is shutting down") -> None:
        for served in self:
            served.scheduler.stop(reason)
        self._served.clear()
