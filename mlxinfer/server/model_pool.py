"""The models a server serves, by name: loaded on the first request that names them, unloaded when idle.

A request's `model` names one of the models the server was given, or one of the
machine's local models (`catalog`: the same list `mlxinfer ls` shows); a local
front end that shows the server's per-user token may also name a model by its
path. Loading runs on a device thread (engine/threads.py), never on the event
loop, and first unloads idle models until the new one fits the memory budget.

Each model stays loaded for its keep-alive after its last request ends (Ollama's
`keep_alive`: the latest request's value, else the server's default; 0 unloads at
once, inf never). One reaper thread sleeps until the next expiry: an idle server
wakes no thread.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..adapters import BASE, NO_ADAPTER, Chosen
from ..api import Model, load
from ..defaults import DEFAULT_MAX_ADAPTERS
from ..display import mib
from ..engine import SchedulerConfig, ServingThread, call_on_device_thread
from ..formats.recommended_sampling import SamplingDefaults
from ..library import disk_bytes, find_model, sampling_of
from ..untrusted import shown
from .errors import APIError

log = logging.getLogger("mlxinfer.server")
DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: five minutes after the last request


@dataclass(frozen=True)
class ServedModel:
    id: str
    model: Model
    scheduler: ServingThread
    adapter: Chosen = NO_ADAPTER  # what a request holding it runs with ("id:adapter"): held until `release`


@dataclass
class _Slot:
    id: str
    path: Path
    loader: Callable[[], Model]
    config: SchedulerConfig | None
    served: ServedModel | None = None
    verified: bool = True  # the family was checked against transformers (models/fallback.py runs the others)
    sampling: SamplingDefaults | None = None  # what the model's files recommend; None: not read yet
    adapters: dict[str, Path] = field(default_factory=dict)  # its adapters' folders by name: a request says "id:name"
    loading: threading.Lock = field(default_factory=threading.Lock)  # one load; other requests for it wait
    in_flight: int = 0  # requests started and not yet ended
    keep_alive_s: float | None = None  # the latest request's keep_alive; None: the set's default
    last_used: float = 0.0  # monotonic time the last request ended (or the model loaded)
    loaded_at: float = 0.0  # wall-clock time, for `ps`


def local_catalog(name: str) -> Path | None:
    """A local model's path by the name `mlxinfer ls` shows (the models folder, the Hugging Face cache, added
    files), or None: what `mlxinfer serve` and the menubar helper load on a request that names one."""
    found = find_model(name)
    return found.path if found is not None else None


def model_id(model: Model) -> str:
    """The name clients use: the model folder's name, or the .gguf file's without the suffix."""
    return path_id(model.path)


def path_id(path: Path) -> str:
    return path.stem if path.is_file() else path.name


class ModelSet:
    """Loaded (or unloaded, reloadable) models, each with its own ServingThread: batch, queue and prefix cache.

    `catalog(name)` finds a local model's path by name (None: not one); `loader(path)` loads one found so;
    `budget_bytes` bounds the models' memory together (None: no bound but the machine's)."""

    def __init__(
        self,
        catalog: Callable[[str], Path | None] | None = None,
        loader: Callable[[Path], Model] = load,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        budget_bytes: int | None = None,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        scheduler: Callable[..., ServingThread] = ServingThread,
        adapter_catalog: Callable[[str], Path | None] | None = None,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
    ) -> None:
        self._scheduler = scheduler  # a distributed model's is rank 0's, which the other ranks follow
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()  # adding, removing and unloading, one at a time
        self._catalog, self._loader, self._config = catalog, loader, config
        self.keep_alive_s, self.budget_bytes, self._clock = keep_alive_s, budget_bytes, clock
        self._wake = threading.Condition()
        self._reaper: threading.Thread | None = None
        self._closed = self._dirty = False
        self._loading_bytes = 0  # memory reserved for models being loaded now (the budget counts them)
        # Adapters a request may name as MODEL:NAME beyond those a model was given (the models folder's), each
        # loaded over its model on first use; `max_adapters` per model stay loaded.
        self._adapter_catalog, self.max_adapters = adapter_catalog, max_adapters
        self._adapter_loading = threading.Lock()

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
            adapters=model.adapters or None,
        )
        slot = _Slot(name or model_id(model), model.path, loader, config or self._config, verified=model.verified)
        slot.adapters = model.adapters
        with self._lock:
            old = self._slots.pop(slot.id, None)
            replaced = self._detach(old)
            served = self._serve(slot, model)
            self._slots[slot.id] = slot
        _stop(replaced, "the model was replaced")
        self._arm()
        return served

    def remove(self, name: str) -> None:
        """Stop serving `name` at all (its running requests end with an error)."""
        with self._lock:
            removed = self._detach(self._slots.pop(name, None))
        _stop(removed, "the model was removed")
        _free_memory()

    def remove_idle(self, path: Path) -> bool:
        """Stop serving every model loaded from `path` (a model about to be deleted) unless one has a request in
        flight; then False, and nothing changed."""
        key = _resolved(str(path))
        with self._lock:
            slots = [slot for slot in self._slots.values() if _resolved(str(slot.path)) == key]
            if any(slot.in_flight for slot in slots):
                return False
            removed = [self._detach(self._slots.pop(slot.id)) for slot in slots]
        for served in removed:
            _stop(served, "the model was deleted")
        if removed:
            _free_memory()
        return True

    def unload(self, name: str, if_idle: bool = False) -> bool:
        """Free `name`'s memory (weights, KV, prompt cache); the next request for it loads it again.

        `if_idle`: only if no request holds it (checked in the same step that unloads). Whether it unloaded."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is None or slot.served is None or (if_idle and slot.in_flight):
                return False
            unloaded = self._detach(slot)
        _stop(unloaded, "the model was unloaded")  # outside the lock: requests for other models go on meanwhile
        _free_memory()
        log.info("unloaded %s", name)
        return True

    def loaded(self, name: str | None, allow_paths: bool = False) -> ServedModel | None:
        """The model `name` names if it is loaded now (None: not known yet, or unloaded). Not held: see `acquire`."""
        slot = self._find(name, allow_paths)
        return slot.served if slot is not None else None

    def acquire_loaded(self, name: str | None, allow_paths: bool = False) -> ServedModel | None:
        """`name`'s model, held for a request (never unloaded until `release`), if it is loaded now."""
        slot = self._find(name, allow_paths)
        with self._lock:
            served = self._hold(slot) if slot is not None else None
        return self._with_adapter(served, name) if served is not None else None

    def acquire(self, name: str | None, allow_paths: bool = False) -> ServedModel:
        """The model called `name` (with no name, the first), loaded if it is not, and held for a request until
        `release`. `allow_paths`: `name` may also be a model's path (the user's own front ends, never others)."""
        slot = self._find(name, allow_paths) or self._new_slot(name, allow_paths)
        with self._lock:
            served = self._hold(slot)
        if served is not None:
            return served
        with slot.loading:
            with self._lock:
                served = self._hold(slot)  # loaded by the request this one waited for
            if served is None:
                need = self._make_room(slot)
                try:
                    model = call_on_device_thread(slot.loader)
                finally:
                    with self._lock:
                        self._loading_bytes -= need
                with self._lock:
                    self._serve(slot, model)
                    served = self._hold(slot)
        self._arm()
        return self._with_adapter(served, name)

    def _with_adapter(self, served: ServedModel, name: str | None) -> ServedModel:
        """`served` running the adapter `name` asks for ("model:adapter"), loaded over it first if it is not (on
        the device thread) and held until `release`, never unloaded under the request; released and raised if it
        cannot be."""
        adapter = name.rpartition(":")[2] if name and name != served.id and ":" in name else None
        slot = self._slots.get(served.id)
        path = slot.adapters.get(adapter) if slot is not None and adapter is not None else None
        if path is None:
            return served
        try:
            with self._adapter_loading:  # loads one at a time, and nothing unloads it between its load and hold
                if adapter not in served.model.adapters:
                    call_on_device_thread(lambda: served.model.load_adapter(adapter, path, self.max_adapters))
                return replace(served, adapter=served.model.adapter_set.take(adapter))
        except BaseException:
            self.release(served)
            raise

    def get(self, name: str | None, allow_paths: bool = False) -> ServedModel:
        """The model called `name`, loaded if it is not (a use: its keep-alive counts again from now)."""
        served = self.acquire(name, allow_paths)
        self.release(served)
        return served

    def release(self, served: ServedModel, keep_alive_s: float | None = None) -> None:
        """A request that held `served` ended: it stays loaded for `keep_alive_s` from now (as in Ollama, each
        request's own; None: the set's default)."""
        if served.adapter.slot != BASE and served.model.adapter_set is not None:
            served.model.adapter_set.give_back(served.adapter)
        with self._lock:
            slot = self._slots.get(served.id)
            if slot is not None and slot.served is not None and slot.served.scheduler is served.scheduler:
                slot.in_flight = max(0, slot.in_flight - 1)
                slot.last_used, slot.keep_alive_s = self._clock(), keep_alive_s
        self._arm()

    def keep_alive(self, name: str, keep_alive_s: float) -> None:
        """Set `name`'s keep-alive from now without a request (Ollama's load / unload calls)."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is not None and slot.served is not None:
                slot.last_used, slot.keep_alive_s = self._clock(), keep_alive_s
        self._arm()

    def _hold(self, slot: _Slot) -> ServedModel | None:  # under self._lock
        if slot.served is not None:
            slot.in_flight += 1
        return slot.served

    def _detach(self, slot: _Slot | None) -> ServedModel | None:  # under self._lock; stop what it returns
        if slot is None or slot.served is None:
            return None
        served, slot.served, slot.in_flight = slot.served, None, 0
        return served

    def _find(self, name: str | None, allow_paths: bool) -> _Slot | None:
        if name is None:
            return next(iter(self._slots.values()), None)
        slot = self._named(name)
        if slot is None and allow_paths and _looks_like_path(name):
            path = _resolved(name)
            slot = next((s for s in self._slots.values() if s.path == path), None)
        return slot

    def _new_slot(self, name: str | None, allow_paths: bool) -> _Slot:
        path = self._catalog(name) if self._catalog is not None and name else None
        if path is None and allow_paths and name and _looks_like_path(name):
            path = _resolved(name)
            if not (path.is_dir() or path.suffix == ".gguf" and path.is_file()):
                raise APIError(404, f"{shown(name)} is not a model folder or .gguf file", "model", "model_not_found")
        if path is None:
            known = ", ".join(self._slots) or "none"
            raise APIError(
                404,
                f"model {shown(name)} is not one of this server's models ({known}) nor a local model; "
                "`mlxinfer ls` lists the local models, `mlxinfer pull` fetches one",
                "model",
                "model_not_found",
            )
        with self._lock:
            same = next((s for s in self._slots.values() if s.path == path), None)
            if same is not None:  # another name for a model already served
                return same
            slot_id = name if name != str(path) else path_id(path)  # a path: the name `ls` would show
            slot_id = slot_id if slot_id not in self._slots else str(path)
            slot = _Slot(slot_id, path, partial(self._loader, path), self._config)
            self._slots[slot.id] = slot
            return slot

    def _serve(self, slot: _Slot, model: Model) -> ServedModel:  # under self._lock
        slot.served = ServedModel(slot.id, model, self._scheduler(model.runtime, slot.config))
        slot.verified, slot.in_flight, slot.keep_alive_s = model.verified, 0, None
        slot.sampling = model.sampling_defaults
        slot.last_used, slot.loaded_at = self._clock(), time.time()
        self._dirty = True  # the reaper looks again (notified by the caller's _arm, or at its next wake-up)
        return slot.served

    # -- memory -----------------------------------------------------------

    def _make_room(self, slot: _Slot) -> int:
        """Unload idle models, least recently used first, until `slot`'s model fits the budget beside the rest
        (those loading now included); the bytes reserved for it (give them back once it loaded)."""
        need = disk_bytes(slot.path)[0] if self.budget_bytes is not None else 0
        while True:
            with self._lock:
                loaded = [s for s in self._slots.values() if s.served is not None and s is not slot]
                used = sum(_memory_of(s.served) for s in loaded) + self._loading_bytes
                if self.budget_bytes is None or used + need <= self.budget_bytes:
                    self._loading_bytes += need
                    return need
                idle = sorted((s for s in loaded if s.in_flight == 0), key=lambda s: s.last_used)
            if not idle:
                busy = ", ".join(s.id for s in loaded) or "none"
                raise APIError(
                    503,
                    f"model {slot.id} ({mib(need, 0)}) does not fit the server's memory budget of "
                    f"{mib(self.budget_bytes, 0)} beside the models answering or loading now ({busy}); "
                    "retry when they are idle",
                    "model",
                    "model_does_not_fit",
                    retry_after_s=5,
                )
            log.info("unloading %s to make room for %s", idle[0].id, slot.id)
            self.unload(idle[0].id, if_idle=True)  # a request that took it meanwhile keeps it: look again

    def memory_of(self, name: str) -> int:
        slot = self._slots.get(name)
        return _memory_of(slot.served) if slot is not None and slot.served is not None else 0

    # -- keep-alive -------------------------------------------------------

    def expires_in(self, name: str) -> float | None:
        """Seconds until `name` unloads (inf: never; None: not loaded, or answering now)."""
        slot = self._slots.get(name)
        if slot is None or slot.served is None or slot.in_flight:
            return None
        return max(0.0, self._expiry(slot) - self._clock())

    def _expiry(self, slot: _Slot) -> float:
        keep = self.keep_alive_s if slot.keep_alive_s is None else slot.keep_alive_s
        return slot.last_used + keep

    def unload_expired(self) -> float:
        """Unload the idle models whose keep-alive ran out; the time of the next expiry (inf: none)."""
        now, due, following = self._clock(), [], math.inf
        with self._lock:
            for slot in self._slots.values():
                if slot.served is None or slot.in_flight:
                    continue
                expiry = self._expiry(slot)
                if expiry <= now:
                    due.append(slot.id)
                else:
                    following = min(following, expiry)
        for name in due:
            self.unload(name, if_idle=True)  # a request that took it meanwhile keeps it
        return following

    def _arm(self) -> None:
        """Make sure the reaper runs, and have it look at the expiries again."""
        with self._wake:
            if self._reaper is None and not self._closed:
                self._reaper = threading.Thread(target=self._reap, name="mlxinfer-keep-alive", daemon=True)
                self._reaper.start()
            self._dirty = True
            self._wake.notify()

    def _reap(self) -> None:
        while True:
            try:
                following = self.unload_expired()
            except Exception:  # noqa: BLE001 - a failed unload must not end keep-alive for good
                log.exception("unloading idle models failed")
                following = self._clock() + 1.0
            with self._wake:
                if self._closed:
                    return
                wait = following - self._clock()
                if not self._dirty and wait > 0:  # a change since unload_expired looked: look again at once
                    self._wake.wait(None if math.isinf(wait) else wait)  # inf: until a request ends or a load
                self._dirty = False

    # -- what is served ---------------------------------------------------

    def _named(self, name: str) -> _Slot | None:
        """The slot `name` names: its id, or "id:adapter" for one of its adapters (those it was given, or one in
        the models folder, which it then knows)."""
        slot = self._slots.get(name)
        if slot is None and ":" in name:
            base, _, adapter = name.rpartition(":")
            slot = self._slots.get(base)
            if slot is None or adapter in slot.adapters:
                return slot
            path = self._adapter_catalog(adapter) if self._adapter_catalog is not None else None
            if path is None:
                return None
            slot.adapters = {**slot.adapters, adapter: path}
        return slot

    @property
    def adapter_ids(self) -> list[tuple[str, str, Path]]:
        """("id:adapter", id, folder) for every adapter of every model served: the names requests give them."""
        slots = list(self._slots.values())
        return [(f"{slot.id}:{name}", slot.id, path) for slot in slots for name, path in slot.adapters.items()]

    def is_loaded(self, name: str) -> bool:
        slot = self._slots.get(name)
        return slot is not None and slot.served is not None

    @property
    def ids(self) -> list[str]:
        return list(self._slots)

    def verified(self, name: str) -> bool:
        slot = self._named(name)
        return slot is None or slot.verified

    def sampling_defaults(self, name: str) -> dict[str, Any]:
        """The sampling a request that gives none gets from model `name`: read from its files once (the loaded
        model's own once it loads); may read a GGUF header, so not on the event loop."""
        slot = self._named(name)
        if slot is None:  # gone since it was listed
            return SamplingDefaults().in_force
        if slot.sampling is None:
            slot.sampling = sampling_of(slot.path)
        return slot.sampling.in_force

    def path_of(self, name: str) -> Path | None:
        slot = self._slots.get(name)
        return slot.path if slot is not None else None

    def ps(self) -> list[dict[str, Any]]:
        """The loaded models: name, path, memory, requests in flight and when each unloads."""
        rows = []
        for slot in list(self._slots.values()):
            served = slot.served
            if served is None:
                continue
            expires = self.expires_in(slot.id)
            rows.append(
                {
                    "name": slot.id,
                    "path": str(slot.path),
                    "weights_bytes": served.model.footprint.weights_bytes,
                    "memory_bytes": _memory_of(served),
                    "in_flight": slot.in_flight,
                    "loaded_at": slot.loaded_at,
                    "expires_in_s": None if expires is None or math.isinf(expires) else round(expires, 1),
                    "keep_alive_forever": expires is not None and math.isinf(expires),
                    "adapters": sorted(served.model.adapters),  # loaded now, at most max_adapters
                    "max_adapters": self.max_adapters,
                }
            )
        return rows

    def __iter__(self) -> Iterator[ServedModel]:
        """The loaded models."""
        return iter([s.served for s in list(self._slots.values()) if s.served is not None])

    def schedulers(self) -> list[ServingThread]:
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
        with self._wake:
            self._closed = True
            self._wake.notify()
        with self._lock:
            closing = [self._detach(slot) for slot in self._slots.values()]
        for served in closing:
            _stop(served, reason)
        _free_memory()


def _stop(served: ServedModel | None, reason: str) -> None:
    """End a detached model's requests and its scheduler's thread (waits for it: never under ModelSet's lock)."""
    if served is not None:
        served.scheduler.stop(reason)


def _memory_of(served: ServedModel) -> int:
    """A loaded model's own memory: its weights, adapters loaded since, and what its prefix caches hold."""
    model = served.model
    adapters = model.adapter_set.uncounted if model.adapter_set is not None else 0
    return model.footprint.weights_bytes + adapters + model.cache_stats.bytes_held


def _looks_like_path(name: str) -> bool:
    return len(name) <= 4096 and "\x00" not in name and (name.startswith(("/", "~")) or "/" in name and name[0] == ".")


def _resolved(name: str) -> Path:
    return Path(name).expanduser().resolve()


def _free_memory() -> None:
    gc.collect()  # the model's arrays go once nothing refers to them
    mx.clear_cache()
