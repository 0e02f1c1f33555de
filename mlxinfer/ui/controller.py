"""What the menubar helper does, without any GUI: the tray icon only shows this object's labels and calls it.

The controller owns a ModelSet and a BackgroundServer. Everything it shows is
computed when asked (when the menu is drawn) or pushed by the server when an
answer finishes, so an idle helper runs no loop and wakes no thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import webbrowser
from collections.abc import Callable
from functools import partial
from pathlib import Path

from ..api import Model, load
from ..display import mib
from ..engine import GenerationStats, call_on_device_thread
from ..errors import ServerConfigError
from ..library import find_adapter, local_models
from ..local_server import find_server, new_token, publish, withdraw
from ..memory import machine_memory
from ..server import BackgroundServer, ModelSet, ServerSettings
from ..server.model_pool import local_catalog, model_id

log = logging.getLogger("mlxinfer.menubar")


class MenubarController:
    """Load a model, serve it, and answer the menu's questions and commands.

    Example:
        >>> controller = MenubarController(ServerSettings(), models_dir=Path("~/models").expanduser())
        >>> controller.start(default_path)
        >>> controller.open_chat()
    """

    def __init__(
        self,
        settings: ServerSettings,
        models_dir: Path,
        loader: Callable[[Path], Model] = load,
        open_url: Callable[[str], object] = webbrowser.open,
        default_model: Path | None = None,
    ):
        # The helper is the user's resident server: front ends find it by the state file and its token.
        settings = dataclasses.replace(settings, local_token=settings.local_token or new_token())
        self.settings, self.models_dir, self._loader, self._open_url = settings, models_dir, loader, open_url
        self.default_model = default_model
        budget = machine_memory().usable_bytes()  # as `mlxinfer serve`: other models load on request within it
        self.models = ModelSet(catalog=local_catalog, loader=loader, budget_bytes=budget, config=settings.scheduler,
                               adapter_catalog=find_adapter)  # fmt: skip
        self.server: BackgroundServer | None = None
        self.current: Path | None = None
        self.last_stats: GenerationStats | None = None
        self.on_change: Callable[[], None] = lambda: None  # the icon redraws its menu
        self._lock = threading.Lock()
        self._names: dict[Path, str] = {}  # the menu's names of the models available_models found

    # -- what the menu shows ----------------------------------------------

    @property
    def model_name(self) -> str | None:
        return self.models.ids[0] if self.models.ids else None

    @property
    def loaded(self) -> bool:
        return self.model_name is not None and self.models.is_loaded(self.model_name)

    @property
    def serving(self) -> bool:
        return self.server is not None and self.server.running

    @property
    def model_label(self) -> str:
        if self.model_name is None:
            return "No model"
        if not self.loaded:
            return f"{self.model_name}: unloaded (loads on the next request)"
        served = next(iter(self.models))
        return f"{self.model_name}: {mib(served.model.footprint.weights_bytes, 0)}"

    @property
    def speed_label(self) -> str:
        stats = self.last_stats
        if stats is None:
            return "No answer yet"
        return f"Last answer: {stats.decode_tps:.1f} tokens/s ({stats.generated_tokens} tokens)"

    @property
    def url(self) -> str:
        return self.server.url if self.serving and self.server else f"http://{self.settings.host}:{self.settings.port}"

    def available_models(self) -> list[Path]:
        """The default model, the models in `models_dir` when it is not the usual folder, then every model
        `mlxinfer ls` lists (the models folder, the Hugging Face cache, added files) but mlxinfer's own cache,
        whose one model is the default model (the CLI passes it when it was fetched)."""
        import os

        from ..library import CACHE, list_models, models_dir

        found = local_models(self.models_dir) if self.models_dir != models_dir() else []
        listed = [m for m in list_models() if m.source != CACHE]
        self._names.update({m.path: m.name for m in listed})
        found += [m.path for m in listed]
        paths = ([self.default_model] if self.default_model else []) + found
        unique: dict[str, Path] = {}
        for path in paths:  # a model listed twice (a link, models_dir being the usual folder) keeps its first place
            unique.setdefault(os.path.realpath(path), path)
        return list(unique.values())

    def name_of(self, path: Path) -> str:
        """The name `mlxinfer ls` gives a model (org/name for the Hugging Face cache, not its snapshot hash)."""
        return self._names.get(path, path.stem if path.suffix == ".gguf" else path.name)

    # -- what the menu does -----------------------------------------------

    def start(self, path: Path, on_bound: Callable[[], object] = lambda: None) -> None:
        """Take the port, load `path` and serve it; a taken port (PortInUseError) is found before the slow load.

        `on_bound` runs once the port is held, before the load (the CLI says "Loading ..." there).
        """
        server = self._bind()
        try:
            on_bound()
            self._use(path)
        except BaseException:
            server.stop()
            raise
        self._serve(server)

    def open_chat(self) -> None:
        """Open the chat page in the browser, starting the server first if it is stopped."""
        if not self.serving:
            self.start_server()
        self._open_url(self.url + "/")

    def switch_model(self, path: Path) -> None:
        """Serve `path` instead of the current model (whose memory is freed first)."""
        if path == self.current and self.loaded:
            return
        with self._lock:
            if self.model_name:
                self.models.remove(self.model_name)
            self._use(path)
        self.on_change()

    def unload(self) -> None:
        """Free the model's memory and its prompt cache; the next request loads it again."""
        if self.model_name:
            self.models.unload(self.model_name)
        self.on_change()

    def start_server(self) -> None:
        if not self.serving:
            self._serve(self._bind())

    def stop_server(self) -> None:
        if self.server is not None:
            withdraw(self.settings.local_token)
            self.server.stop()
            self.server = None
        self.on_change()

    def toggle_server(self) -> None:
        self.stop_server() if self.serving else self.start_server()

    def quit(self) -> None:
        """Stop serving and free every model; the icon stops after this."""
        self.stop_server()
        self.models.close("the menubar helper quit")

    # -- internals ----------------------------------------------------------

    def _use(self, path: Path) -> None:
        model = call_on_device_thread(partial(self._loader, path))
        self.models.add(model, self.settings.scheduler, name=model_id(model))
        self.current = path
        log.info("serving %s", path)

    def _bind(self) -> BackgroundServer:
        return BackgroundServer(self.models, self.settings, on_finished=self._finished)  # listens from here on

    def _serve(self, server: BackgroundServer) -> None:
        self.server = server.start()
        self._publish()
        self.on_change()

    def _publish(self) -> None:
        """Become the server `mlxinfer chat` and mlxinfer.connect() use, unless another one already is."""
        other = find_server()
        if other is not None:
            log.warning("the mlxinfer server at %s (pid %d) stays the one front ends use", other.url, other.pid)
            return
        try:
            publish(self.url, self.settings.local_token)
        except (OSError, ServerConfigError) as e:
            log.warning("front ends will not find this server: %s", e)

    def _finished(self, stats: GenerationStats) -> None:  # on a scheduler's thread
        if stats.generated_tokens:
            self.last_stats = stats
            self.on_change()
