"""HTTP for the Hub client, bounded in time and explained in one line.

urllib's timeout applies to each socket operation alone, so an endpoint that sends a byte every few seconds holds
a request forever. Here a request has a connect timeout, and every read of its answer (status line, headers and
body alike, across redirects) waits at most until the current stall window closes: at least MIN_PROGRESS_BYTES
must arrive in every stall window (STALL_S, or MLXINFER_HUB_STALL_S seconds), else the read fails with Stalled.
Headers are bounded by http.client itself (64 KiB a line, 100 lines). Only http and https are spoken, and a
redirect never goes from https down to http.
reason_of() turns any failure (the network, a stall, malformed HTTP) into one short printable line.
huggingface_hub's client cannot keep these rules: its timeouts (HF_HUB_DOWNLOAD_TIMEOUT, HF_HUB_ETAG_TIMEOUT) are per
socket read, which a dripping endpoint never trips, h11 accepts any number of headers, and http_get resumes a dropped
download by itself five times, a second apart, where a pull stops and says how to resume.
"""

from __future__ import annotations

import http.client
import io
import math
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ..errors import HubError
from ..untrusted import first_line, plain

CONNECT_TIMEOUT_S = 30
STALL_S = 60.0  # default stall window
MAX_STALL_S = 86400.0
STALL_ENV = "MLXINFER_HUB_STALL_S"
MIN_PROGRESS_BYTES = 1024  # per stall window: a slower answer has stalled
# What a failed request raises, besides HubError: urllib's errors (HTTPError first: it is an answer), the socket's,
# http.client's for malformed answers, and ValueError for the malformed ones it does not wrap (a bad chunk size).
NETWORK_ERRORS = (urllib.error.URLError, http.client.HTTPException, OSError, ValueError)


class Stalled(TimeoutError):
    """Fewer than the minimum bytes arrived within one stall window."""


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


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Redirects to http(s) only, and never from https down to http (urllib alone would follow both)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201 - urllib's signature
        old, new = urllib.parse.urlsplit(req.full_url).scheme, urllib.parse.urlsplit(newurl).scheme
        if new not in ("http", "https") or (old, new) == ("https", "http"):
            raise ValueError(f"{plain(req.full_url)} redirects to {plain(newurl)}, which is not allowed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def open_url(req: urllib.request.Request) -> http.client.HTTPResponse:
    """Open `req` (http or https, redirects followed) with a connect timeout and the stall limit on every read."""
    pace = Pace(stall_s())
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.UnknownHandler(),  # any other scheme (file:, ftp:, a redirect to one) is refused
        urllib.request.HTTPDefaultErrorHandler(),
        _Redirects(),
        urllib.request.HTTPErrorProcessor(),
        _PacedHTTP(pace),
        _PacedHTTPS(pace),
    ):
        opener.add_handler(handler)
    return opener.open(req, timeout=CONNECT_TIMEOUT_S)


def reason_of(error: BaseException) -> str:
    """Why a request failed, on one short printable line (URLError wraps the socket's error in `reason`)."""
    reason = getattr(error, "reason", error)
    if isinstance(reason, Stalled):
        return str(reason)
    if isinstance(reason, OSError):  # the network (a refused connection, a timeout, a reset)
        return plain(first_line(reason))
    if isinstance(reason, http.client.IncompleteRead):
        return "not valid HTTP: the body ended early or its chunks are malformed"
    if isinstance(reason, (http.client.HTTPException, ValueError)):
        return f"not valid HTTP: {plain(first_line(reason))}"
    return plain(first_line(reason)) if isinstance(reason, BaseException) else plain(str(reason))


# -- the stall limit, below urllib -------------------------------------------------------------------


class _PacedReader(io.RawIOBase):
    """A socket's incoming bytes, each read waiting only as long as `pace` allows."""

    def __init__(self, sock: socket.socket, pace: Pace):
        super().__init__()
        self._sock, self._pace = sock, pace
        self._io = sock.makefile("rb", buffering=0)  # keeps the socket open until this closes, as http.client needs

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        self._sock.settimeout(self._pace.wait_s())
        try:
            count = self._io.readinto(buffer)
        except TimeoutError:  # the read waited out the rest of the window
            raise self._pace.stalled() from None
        self._pace.got(count or 0)
        return count

    def fileno(self) -> int:
        return self._io.fileno()

    def close(self) -> None:
        self._io.close()
        super().close()


class _PacedSocket:
    """A connected socket whose answers are read through _PacedReader; everything else is the socket's own."""

    def __init__(self, sock: socket.socket, pace: Pace):
        self._sock, self._pace = sock, pace

    def makefile(self, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode != "rb":
            return self._sock.makefile(mode, *args, **kwargs)
        return io.BufferedReader(_PacedReader(self._sock, self._pace))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _paced(http_class: type, pace: Pace) -> type:
    """`http_class` (HTTPConnection or HTTPSConnection) reading its answers at `pace`, once connected."""

    class Paced(http_class):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            super().connect()  # within the connect timeout (and TLS set up, for https)
            self.sock = _PacedSocket(self.sock, pace)

    return Paced


class _PacedHandler:
    pace: Pace

    def do_open(self, http_class: type, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_paced(http_class, self.pace), req, **kwargs)  # type: ignore[misc]


class _PacedHTTP(_PacedHandler, urllib.request.HTTPHandler):
    def __init__(self, pace: Pace):
        super().__init__()
        self.pace = pace


class _PacedHTTPS(_PacedHandler, urllib.request.HTTPSHandler):
    def __init__(self, pace: Pace):
        super().__init__()
        self.pace = pace
