"""Limits below the ASGI app, on the sockets themselves: slow or idle connections cannot pile up.

uvicorn accepts every connection and never times out a request whose headers dribble in
(its keep-alive timer stops at the first byte, and is not started for a new connection),
so a few hundred slow sockets would use up the process's file descriptors (256 by default
on macOS). Here every connection must finish a request's headers within `header_timeout_s`
of connecting or of its previous answer, and past `max_connections` one that holds no
work yet is closed to make room: the longest idle, else the one whose body has been
arriving longest (a slow upload loses to a flood of them, not to a legitimate request).
When every connection is busy being answered, the new one gets 503. (Bodies have their
own deadline too: core.read_body.)
"""

from __future__ import annotations

import asyncio
import http
import json
from typing import Any

import h11
from prometheus_client import Counter
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError
from .settings import ServerSettings


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol (always h11, so the limits behave the same wherever httptools is installed)."""

    header_timeout_s: float
    max_connections: int
    dropped: Counter  # by reason: header_timeout, evicted_idle, evicted_receiving, refused_full

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_request(None)
        if len(self.connections) > self.max_connections:
            self._make_room()

    def on_response_complete(self) -> None:
        self._await_request(self.cycle)  # first: the base class may start a pipelined request right away
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    @property
    def idle(self) -> bool:
        """Open and answering nothing: waiting for (the rest of) a request's headers."""
        return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

    @property
    def receiving(self) -> bool:
        """Its request's headers came, its body is still arriving: nothing has been done for it yet."""
        return self.conn.their_state is h11.SEND_BODY and not self.idle and not self.transport.is_closing()

    def _await_request(self, cycle: Any) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._idle_since = self.loop.time()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late, cycle)

    def _headers_late(self, cycle: Any) -> None:
        if self.cycle is not cycle or not self.idle:  # a request came in time (and may still be running)
            return
        self.dropped.labels("header_timeout").inc()
        if self.conn.trailing_data[0]:  # part of a request came (h11 holds it): say why it goes unanswered
            message = f"the request headers did not arrive within {self.header_timeout_s:g} s"
            self._answer_and_close(APIError(408, message, code="header_timeout"))
        else:
            self.transport.close()  # an idle keep-alive connection: nothing to answer

    def _make_room(self) -> None:
        others = [c for c in self.connections if c is not self and isinstance(c, LimitedH11Protocol)]
        spare = [c for c in others if c.idle or c.receiving]
        if spare:  # idle ones first, then the longest waiting
            victim = min(spare, key=lambda c: (not c.idle, c._idle_since))
            self.dropped.labels("evicted_idle" if victim.idle else "evicted_receiving").inc()
            victim.transport.close()
            return
        self.dropped.labels("refused_full").inc()
        message = f"the server already has {self.max_connections} connections answering requests; retry shortly"
        self._answer_and_close(APIError(503, message, code="too_many_connections", retry_after_s=1))

    def _answer_and_close(self, error: APIError) -> None:
        """Answer outside h11's state machine (the request is incomplete or never started), then close."""
        body = json.dumps(error.body()).encode()
        headers = {**error.headers(), "Content-Type": "application/json", "Content-Length": str(len(body))}
        lines = [f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in headers.items() if name != "Connection"]
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        self.transport.close()


def accept_backlog(settings: ServerSettings) -> int:
    """The listen backlog. asyncio accepts up to this many sockets in one go, before any of them can make room,
    so a burst overshoots `max_connections` by about twice this, briefly (uvicorn's default is 2048)."""
    return min(64, settings.max_connections)


def protocol_class(settings: ServerSettings, dropped: Counter) -> type[LimitedH11Protocol]:
    """The protocol uvicorn builds for each connection, with these settings' limits."""
    limits = {"header_timeout_s": settings.header_timeout_s, "max_connections": settings.max_connections}
    return type("ServerH11Protocol", (LimitedH11Protocol,), {**limits, "dropped": dropped})
