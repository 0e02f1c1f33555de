"""Running the app on uvicorn: in the foreground (`mlxinfer serve`) or on a background thread.

The listening sockets are opened first (`listen`), before a model loads, so a taken port is
reported in one line at once; uvicorn is then handed those very sockets (no second bind to race).
On SIGTERM or Ctrl-C every scheduler is told to end its requests first, so each in-flight
stream gets a final error event and ends; uvicorn then finds its connections
closing and exits instead of waiting out long generations.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from types import FrameType

import uvicorn

from ..engine import GenerationStats
from ..errors import BindError, PortInUseError
from ..grammar import end_compiles
from .app import create_app
from .connections import accept_backlog, protocol_class
from .model_pool import ModelSet
from .settings import ServerSettings

GRACEFUL_SHUTDOWN_S = 10
PORTS_TO_SUGGEST = 10  # how far past a taken port to look for a free one to suggest
PROBE_TIMEOUT_S = 0.2  # a listener on this machine answers a connect at once
# BSD/macOS let a SO_REUSEADDR socket bind 127.0.0.1:P while another process listens on *:P
# (AirPlay Receiver holds *:5000 and *:7000), so a successful bind there does not mean the port is free.
PROBE_BEFORE_BIND = sys.platform == "darwin"
WILDCARD_PROBES = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # a wildcard address is reached through loopback


def listen(settings: ServerSettings) -> list[socket.socket]:
    """Bind and listen on `settings.host`:`settings.port` now, and return the sockets for `serve`.

    Listening, not just binding, holds the port: on Linux a bound but idle socket does not keep
    another SO_REUSEADDR process (another uvicorn) off it. Connections that arrive before serving
    starts wait in the backlog. A name like "localhost" gets a socket per address, as uvicorn would.

    Example:
        >>> sockets = listen(ServerSettings(port=0))  # raises PortInUseError when the port is taken
    """
    found = _addresses(settings)
    try:
        return _listen_on(found, settings)
    except PortInUseError:
        if settings.port != 0:
            raise
        # --port 0 takes the first address's free port for the others too, where it may be taken: pick again, once.
        return _listen_on(found, settings)


def _addresses(settings: ServerSettings) -> list[tuple[socket.AddressFamily, tuple]]:
    """(family, sockaddr) of each address `settings.host` names, each once (a hosts file may repeat one)."""
    host = settings.host.strip("[]")
    try:
        found = socket.getaddrinfo(host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"--host {settings.host} cannot be resolved ({e.strerror}); use 127.0.0.1") from None
    except UnicodeError:  # the IDNA codec refuses an empty or over-long label ("a..b")
        raise BindError(f"--host {settings.host} is not a valid host name; use 127.0.0.1") from None
    return list(dict.fromkeys((family, address) for family, _, _, _, address in found))


def _listen_on(found: list[tuple[socket.AddressFamily, tuple]], settings: ServerSettings) -> list[socket.socket]:
    sockets: list[socket.socket] = []
    port = settings.port
    try:
        for family, address in found:
            if PROBE_BEFORE_BIND and port and port_answers(WILDCARD_PROBES.get(address[0], address[0]), port):
                raise OSError(errno.EADDRINUSE, "a listener answers on it")
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: old connections in TIME_WAIT
            if family == socket.AF_INET6:  # as asyncio: the IPv4 socket, if any, takes IPv4
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))  # with --port 0, every address gets the first one's port
            sock.listen(accept_backlog(settings))
            port = sock.getsockname()[1]
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise _bind_error(e, settings, port) from None
    return sockets


def port_answers(address: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections on `address`:`port` (a listener binding did not notice)."""
    try:
        socket.create_connection((address, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def url_of(sock: socket.socket) -> str:
    """http://host:port of a listening socket (its real port, also with --port 0)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _bind_error(error: OSError, settings: ServerSettings, port: int) -> BindError:
    where = f"port {settings.port} on {settings.host}"
    if error.errno == errno.EADDRINUSE and settings.port == 0:
        return PortInUseError(
            f"--port 0 picked port {port} on one address of {settings.host}, but another address has it in use; "
            "run again, or pick a port with --port"
        )
    if error.errno == errno.EADDRINUSE:
        free = _free_port_after(settings.host.strip("[]"), settings.port)
        example = f"--port {free}" if free else "--port 0 (any free port)"
        return PortInUseError(
            f"{where} is already in use (another mlxinfer serve?); pick another with --port, e.g. {example}"
        )
    if error.errno == errno.EACCES:
        return BindError(f"{where} needs administrator rights (ports below 1024 are privileged); use --port 8080")
    if error.errno == errno.EADDRNOTAVAIL:
        return BindError(f"--host {settings.host} is not an address of this machine; use 127.0.0.1 or one of its own")
    return BindError(f"cannot listen on {where}: {error.strerror or error}")


def _free_port_after(host: str, port: int) -> int | None:
    """A port just above `port` that binds right now (a suggestion; nothing is held)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in range(port + 1, min(port + 1 + PORTS_TO_SUGGEST, 65536)):
        with socket.socket(family) as probe:
            try:
                probe.bind((host, candidate))
            except OSError:
                continue
            return candidate
    return None


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, models: ModelSet, on_ready: Callable[[], None] | None = None):
        super().__init__(config)
        self.models, self.on_ready = models, on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:  # accepting from here on
            self.on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.models.abort_all("the server is shutting down")
        end_compiles("the server is shutting down")  # native compiles cannot be interrupted: their children can
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
    models: ModelSet,
    settings: ServerSettings,
    log_level: str,
    on_finished: Callable[[GenerationStats], None] | None = None,
    on_ready: Callable[[], None] | None = None,
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
    return _Server(config, models, on_ready)


def serve(
    models: ModelSet,
    settings: ServerSettings,
    log_level: str = "info",
    sockets: list[socket.socket] | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGTERM / Ctrl-C; the models are closed on the way out.

    `sockets` come from `listen` (called here when None); `on_ready(url)` runs once connections are answered.
    """
    try:
        sockets = sockets or listen(settings)
        ready = None if on_ready is None else partial(on_ready, url_of(sockets[0]))
        _server(models, settings, log_level, on_ready=ready).run(sockets=sockets)
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
        self._sockets = listen(settings)  # here: a taken port is a PortInUseError before anything slow starts
        self.url = url_of(self._sockets[0])
        try:
            self._server = _server(models, settings, log_level, on_finished)
        except BaseException:
            self._close()  # nothing will serve on them
            raise
        self._thread = threading.Thread(target=self._run, name="mlxinfer-server", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Serve on the thread and return once connections are answered; BindError if it exits or takes too long."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise BindError(f"the server on {self.url} exited as it started (see the log above)")
            if time.monotonic() > deadline:
                self.stop(GRACEFUL_SHUTDOWN_S)
                self._close()  # also if its thread is stuck
                raise BindError(f"the server on {self.url} did not start within {timeout:g} s; it was stopped")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving: requests in flight end with an error event; the models stay loaded."""
        if self._thread.ident is None:  # never started: only the port to give back
            self._close()
            return
        self._server.models.abort_all("the server is stopping")
        end_compiles("the server is stopping")
        self._server.should_exit = True
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._server.run(sockets=self._sockets)
        finally:
            self._close()

    def _close(self) -> None:
        for sock in self._sockets:
            sock.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
