"""Who may talk to the server: loopback Host names, same-origin or listed browser origins, the API key.

A web page the user visits can make the browser send requests to 127.0.0.1. The
Host check stops DNS rebinding (a page's own name resolving to 127.0.0.1), the
Origin check stops other sites' pages from starting generations, and no
response ever carries a wildcard CORS header.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError
from .settings import ServerSettings, is_loopback

PROTECTED = ("/v1/", "/api/", "/metrics", "/health")  # with an API key; the chat page's own files stay open


class GuardMiddleware:
    def __init__(self, app: ASGIApp, settings: ServerSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.check(scope["method"], scope["path"], Headers(scope=scope))
            if refusal is not None:
                await self._shaped(scope["path"], refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _shaped(path: str, refusal: APIError) -> Response:
        """The refusal in the shape the route's clients read: Ollama's {"error": message} under /api/."""
        if path.startswith("/api/"):
            return JSONResponse({"error": refusal.message}, status_code=refusal.status, headers=refusal.headers())
        return refusal.response()

    def check(self, method: str, path: str, headers: Headers) -> APIError | None:
        host = headers.get("host", "")
        if not self.settings.allow_remote and not is_loopback(host_name(host)):
            return APIError(
                403,
                f"Host {host!r} is not a loopback name; use http://127.0.0.1 or http://localhost "
                "(requests for other names are refused against DNS rebinding)",
                code="forbidden_host",
            )
        origin = headers.get("origin")
        if origin is not None and origin != f"http://{host}" and origin not in self.settings.cors_origins:
            return APIError(
                403,
                f"origin {origin!r} may not call this server; start it with --cors-origin {origin}",
                code="forbidden_origin",
            )
        key = self.settings.api_key
        if key and method != "OPTIONS" and path.startswith(PROTECTED):
            given = [headers.get("authorization")]
            if "x-api-key" in headers:  # Anthropic's clients send the key so
                given.append(f"Bearer {headers['x-api-key']}")
            if not any(shows_token(g, key) or shows_token(g, self.settings.local_token) for g in given):
                return APIError(
                    401,
                    "a valid API key is needed: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    code="invalid_api_key",
                )
        return None


def shows_token(authorization: str | None, token: str | None) -> bool:
    """Whether an Authorization header is `Bearer <token>` (compared in constant time; no token: never)."""
    if not token or authorization is None:
        return False
    return hmac.compare_digest(authorization.encode(errors="replace"), f"Bearer {token}".encode())


def host_name(host: str) -> str:
    """The name part of a Host header: 'localhost:8080' -> 'localhost', '[::1]:8080' -> '::1'.

    Anything malformed comes back whole, which no loopback check accepts."""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name if rest == "" or (rest.startswith(":") and rest[1:].isdigit()) else host
    name, _, port = host.partition(":")
    return name if port == "" or (port.isascii() and port.isdigit()) else host
