"""The rules every Hub request keeps, below huggingface_hub: bounded in time and size, explained in one line.

huggingface_hub makes the Hub requests (its model_info, parse_safetensors_file_metadata and http_get) through the
httpx2 client installed here with its set_client_factory. Outside `bounded()` that client behaves as
huggingface_hub's own; inside it, where mlxinfer's calls run:
- every read of an answer (status line, headers and body alike, across redirects) waits only until the current
  stall window closes: at least MIN_PROGRESS_BYTES must arrive in every window (STALL_S, or MLXINFER_HUB_STALL_S
  seconds), else the request fails with Stalled. A per-read timeout (HF_HUB_DOWNLOAD_TIMEOUT) never trips on an
  endpoint that drips a byte now and then; connecting waits at most CONNECT_TIMEOUT_S.
- a body holds at most the limit given to bounded() (a listing, a config), and the answer to a Range request with an
  end holds at most the bytes asked for: from a server that ignores Range, only those bytes are read.
- a redirect never goes from https down to http; h11 bounds the header block (16 KiB).
- a failure raises Unanswered, which huggingface_hub does not retry by itself (it retries its own httpx errors five
  times, a second apart): a pull stops and says how to resume. A failure in the middle of a body ends the body there
  instead, so huggingface_hub writes what came (it writes in 10 MB pieces) before it finds the file short; the
  failure is kept in the Rules that bounded() yields, and the caller reports it.
The default model's index is read through the same client (client()), under the same rules.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpcore2
import httpx2

from ..errors import HubError
from ..untrusted import first_line, plain

CONNECT_TIMEOUT_S = 30.0
STALL_S = 60.0  # default stall window
MAX_STALL_S = 86400.0
STALL_ENV = "MLXINFER_HUB_STALL_S"
MIN_PROGRESS_BYTES = 1024  # per stall window: a slower answer has stalled


class Unanswered(Exception):
    """No usable answer: the network, a stall, malformed HTTP, a refused redirect or a body over its limit.
    str() is one short printable line."""


class Stalled(Unanswered):
    """Fewer than the minimum bytes arrived within one stall window."""


@dataclass
class Rules:
    limit: int | None  # bytes a body may hold; None: no limit (a download, checked against its listed size)
    scheme: str | None = None  # the first request's scheme: after https, never http
    failure: Unanswered | None = None  # why a body ended early, when it did
    open: bool = True  # False once its bounded() block has ended, wherever that was


_rules: ContextVar[Rules | None] = ContextVar("mlxinfer_hub_rules", default=None)


@contextlib.contextmanager
def bounded(limit: int | None = None, scheme: str | None = None) -> Iterator[Rules]:
    """The rules above for the requests made inside (in this thread or task), each body at most `limit` bytes;
    `scheme` "https" (the endpoint's) holds every request to https from the first (None: the first request's)."""
    rules = Rules(limit, scheme)
    token = _rules.set(rules)
    try:
        yield rules
    finally:
        rules.open = False
        try:
            _rules.reset(token)
        except ValueError:  # ended in another context (a generator suspended in here, closed by the garbage
            pass  # collector): the value left behind in the first context is closed, and _active() ignores it


def _active() -> Rules | None:
    """The rules in force for a request made here: those of the innermost bounded() block still open."""
    rules = _rules.get()
    return rules if rules is not None and rules.open else None


class Pace:
    """At least `min_bytes` must arrive in every `window_s` seconds, from the request's start on."""

    def __init__(self, window_s: float, min_bytes: int = MIN_PROGRESS_BYTES):
        self.window_s, self.min_bytes = window_s, min_bytes
        self._start, self._got = time.monotonic(), 0

    def wait_s(self) -> float:
        """How long the next read may wait; Stalled once the window has closed."""
        left = self._start + self.window_s - time.monotonic()
        if left <= 0:
            raise self.stalled()
        return left

    def got(self, count: int) -> None:
        self._got += count
        if self._got >= self.min_bytes:  # enough in this window: a new one starts now
            self._start, self._got = time.monotonic(), 0

    def stalled(self) -> Stalled:
        return Stalled(
            f"stalled: fewer than {self.min_bytes} bytes came in {self.window_s:g} s ({STALL_ENV} sets that limit)"
        )


def stall_s() -> float:
    """The stall window in seconds: MLXINFER_HUB_STALL_S, else STALL_S."""
    text = os.environ.get(STALL_ENV)
    if not text:
        return STALL_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_STALL_S):
        raise HubError(f"{STALL_ENV}={plain(text)}: expected seconds in (0, {MAX_STALL_S:g}]; unset it for {STALL_S:g}")
    return value


def reason_of(error: BaseException) -> str:
    """Why a request failed, on one short printable line."""
    if isinstance(error, Unanswered):
        return str(error)
    if isinstance(error, (httpx2.RemoteProtocolError, httpx2.LocalProtocolError, httpx2.DecodingError)):
        return f"not valid HTTP: {plain(first_line(error)) or 'the answer ended early or is malformed'}"
    if isinstance(error, httpx2.TimeoutException):
        return f"timed out ({type(error).__name__})"
    return plain(first_line(error)) or type(error).__name__


# -- the client huggingface_hub uses -----------------------------------------------------------------------

_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Make huggingface_hub use client() from now on (once per process; outside bounded() nothing changes)."""
    global _installed
    with _install_lock:
        if not _installed:
            import huggingface_hub

            huggingface_hub.set_client_factory(client)
            _installed = True


def client() -> httpx2.Client:
    """huggingface_hub's default client (its request hook, redirects followed) on the transport below."""
    try:  # the hook that honours HF_HUB_OFFLINE and tags requests; private, so looked up, not required
        from huggingface_hub.utils._http import hf_request_event_hook

        hooks = [hf_request_event_hook]
    except ImportError:
        hooks = []
    return _Client(transport=_Transport(), event_hooks={"request": hooks}, follow_redirects=True, timeout=None)


class _Client(httpx2.Client):
    def _init_proxy_transport(self, proxy: Any, **kwargs: Any) -> httpx2.BaseTransport:
        return _Transport(proxy=proxy, **kwargs)  # a proxy from the environment keeps the rules too


class _Transport(httpx2.HTTPTransport):
    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        pool = self._pool  # httpcore2's ConnectionPool or proxy (a ConnectionPool too): it opens every connection
        pool._network_backend = _PacedBackend(pool._network_backend)

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        rules = _active()
        if rules is None:
            return super().handle_request(request)
        scheme = request.url.scheme
        if rules.scheme == "https" and scheme != "https":
            raise Unanswered(f"redirected from https to {plain(str(request.url))}, which is not allowed")
        rules.scheme = rules.scheme or scheme
        try:
            response = super().handle_request(request)
        except httpx2.TransportError as e:
            raise Unanswered(reason_of(e)) from None
        skip, keep = _asked_range(request, response.status_code)
        response.stream = _Body(response.stream, rules, skip, keep)
        return response


def _asked_range(request: httpx2.Request, status: int) -> tuple[int, int | None]:
    """(bytes to skip, bytes to keep) of an answer to `bytes=START-END`: a 206 holds at most END-START+1 bytes;
    a 200 (Range ignored) holds the whole file, of which bytes START..END are kept. (0, None) otherwise."""
    asked = request.headers.get("range", "")
    first, _, last = asked.removeprefix("bytes=").partition("-")
    if not (asked.startswith("bytes=") and first.isdigit() and last.isdigit()) or int(last) < int(first):
        return 0, None
    start, end = int(first), int(last)
    return (start if status == 200 else 0), end - start + 1


class _Body(httpx2.SyncByteStream):
    """An answer's body: `skip` bytes dropped, then at most `keep` bytes (a Range's end: the rest is not read),
    and over the rules' limit a failure; a failure in the middle ends the body where it broke, kept in `rules`."""

    def __init__(self, inner: httpx2.SyncByteStream, rules: Rules, skip: int, keep: int | None):
        self._inner, self._rules, self._skip, self._keep = inner, rules, skip, keep

    def __iter__(self) -> Iterator[bytes]:
        got, limit = 0, self._rules.limit
        try:
            for chunk in self._inner:
                if self._skip:
                    dropped = min(self._skip, len(chunk))
                    chunk, self._skip = chunk[dropped:], self._skip - dropped
                if self._keep is not None and got + len(chunk) >= self._keep:
                    yield chunk[: self._keep - got]
                    return
                got += len(chunk)
                if limit is not None and got > limit:
                    self._rules.failure = Unanswered(f"more than {limit} bytes; refused")
                    return
                yield chunk
        except httpx2.TransportError as e:
            self._rules.failure = Unanswered(reason_of(e))
        except Unanswered as e:
            self._rules.failure = e

    def close(self) -> None:
        self._inner.close()


# -- the stall limit, below httpcore2 --------------------------------------------------------------------


class _PacedBackend(httpcore2.NetworkBackend):
    """Connections whose reads keep to a Pace while bounded() rules apply; a connect timeout then too."""

    def __init__(self, inner: httpcore2.NetworkBackend):
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, **kwargs: Any) -> httpcore2.NetworkStream:
        if _active() is not None:
            timeout = CONNECT_TIMEOUT_S if timeout is None else min(timeout, CONNECT_TIMEOUT_S)
        return _PacedStream(self._inner.connect_tcp(host, port, timeout, **kwargs))

    def connect_unix_socket(self, path: str, timeout: float | None = None, **kwargs: Any) -> httpcore2.NetworkStream:
        return _PacedStream(self._inner.connect_unix_socket(path, timeout, **kwargs))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _PacedStream(httpcore2.NetworkStream):
    """A connection; each request written starts a new Pace, and each read of its answer waits only as it allows."""

    def __init__(self, inner: httpcore2.NetworkStream, pace: Pace | None = None):
        self._inner, self._pace, self._answering = inner, pace, False

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._pace is None or self._answering:  # the first bytes of a new request
            self._pace = Pace(stall_s()) if _active() is not None else None
            self._answering = False
        self._inner.write(buffer, timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        pace = self._pace if _active() is not None else None
        self._answering = True
        if pace is None:
            return self._inner.read(max_bytes, timeout)
        wait = pace.wait_s()
        window_ends = time.monotonic() + wait
        try:
            data = self._inner.read(max_bytes, wait if timeout is None else min(timeout, wait))
        except httpcore2.ReadTimeout:
            if time.monotonic() >= window_ends - 0.01:  # else the caller's own timeout came first
                raise pace.stalled() from None
            raise
        pace.got(len(data))
        return data

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore2.NetworkStream:
        return _PacedStream(self._inner.start_tls(*args, **kwargs), self._pace)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)
