"""The server's own routes: /health, /metrics (Prometheus), and the identity and stop routes of the user's front
ends."""

from __future__ import annotations

import os

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ... import __version__
from ...local_server import IDENTITY_PATH, STOP_PATH
from ..core import API, read_body
from ..errors import APIError
from ..schema import parse_json


def routes(api: API) -> list[Route]:
    async def health(request: Request) -> Response:
        return _health(api)

    async def identity(request: Request) -> Response:
        """Who this server is, for the user's own front ends (local_server.find_server): only with the token."""
        if not api.trusted(request):
            return APIError(401, "this route is for the user's own front ends", code="invalid_api_key").response()
        body = {"pid": os.getpid(), "version": __version__, "models": api.models.ids, "loaded": api.models.ps()}
        return JSONResponse(body)

    async def stop(request: Request) -> Response:
        """Stop an answer of the user's own front end (`mlxinfer chat`'s Ctrl-C), which keeps reading its end."""
        if not api.trusted(request):
            return APIError(401, "this route is for the user's own front ends", code="invalid_api_key").response()
        name = parse_json(await read_body(request, api.settings)).get("answer")
        if not isinstance(name, str) or not api.stop(name):
            return APIError(404, "no such answer running (it may have ended)", "answer").response()
        return JSONResponse({"stopped": name})

    async def render_metrics(request: Request) -> Response:
        return Response(api.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return [
        Route("/health", health, methods=["GET"]),
        Route(IDENTITY_PATH, identity, methods=["GET"]),
        Route(STOP_PATH, stop, methods=["POST"]),
        Route("/metrics", render_metrics, methods=["GET"]),
    ]


def _health(api: API) -> Response:
    loaded = {s.id: s for s in api.models}
    models = [
        {
            "id": name,
            "loaded": name in loaded,
            "weights_bytes": loaded[name].model.footprint.weights_bytes if name in loaded else 0,
        }
        for name in api.models.ids
    ]
    body = {"status": "ok", "models": models, "memory_in_use_bytes": api.models.memory_in_use}
    broken = [reason for s in api.models.schedulers() if (reason := getattr(s, "broken", None))]
    if broken:  # a distributed model lost a rank: nothing can be served until the ranks restart
        return JSONResponse({**body, "status": "unhealthy", "reason": broken[0]}, status_code=503)
    return JSONResponse(body)
