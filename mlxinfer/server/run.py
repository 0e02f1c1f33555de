"""Running the app on uvicorn: in the foreground (`mlxinfer serve`) or on a background thread.

On SIGTERM or Ctrl-C every scheduler is told to end its requests first, so each in-flight
stream gets a final error event and ends; uvicorn then finds its connections
closing and exits instead of waiting out long generations.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from ..engine import GenerationStats
from .app import create_app
from .connections import accept_backlog, protocol_class
from .models import ModelSet
from .settings import ServerSettings

GRACEFUL_SHUTDOWN_S = 10


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, models: ModelSet):
        super().__init__(config)
        self.models = models

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.models.abort_all("the server is shutting down")
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal after a clean shutdown, which turns Ctrl-C into a
        # KeyboardInterrupt ("Aborted!", status 1) after everything closed well; here a
        # clean shutdown ends with status 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _server(
    models: ModelSet, settings: ServerSettings, log_level: str, on_finished: Callable[[GenerationStats], None] | None
) -> _Server:
    app = create_app(models, settings, on_finished)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,
        http=protocol_class(settings, app.state.api.metrics.dropped),
        backlog=accept_backlog(settings),
        ws="none",  # no WebSocket routes: an upgrade request stays an ordinary (refused) request
    )
    return _Server(config, models)


def serve(models: ModelSet, settings: ServerSettings, log_level: str = "info") -> None:
    """Serve until SIGTERM / Ctrl-C; the models are closed on the way out."""
    try:
        _server(models, settings, log_level, None).run()
    finally:
        models.close()


class BackgroundServer:
    """The server on a daemon thread (for tests, notebooks and the menubar helper).

    Example:
        >>> with BackgroundServer(models, ServerSettings(port=0)) as server:
        ...     print(server.url)
    """

    def __init__(
        self,
        models: ModelSet,
        settings: ServerSettings,
        log_level: str = "warning",
        on_finished: Callable[[GenerationStats], None] | None = None,
    ):
        self._server = _server(models, settings, log_level, on_finished)
        self._thread = threading.Thread(target=self._server.run, name="mlxinfer-server", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (is the port taken?)")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving: requests in flight end with an error event; the models stay loaded."""
        self._server.models.abort_all("the server is stopping")
        self._server.should_exit = True
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
