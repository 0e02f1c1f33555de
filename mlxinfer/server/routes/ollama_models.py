"""Ollama's /api/delete and /api/copy over the model library: `mlxinfer rm` and a copy under a new name.

Deleting over HTTP is held to what is safe to do for a caller the server cannot see:
- it needs the server's API key (`serve --api-key`) or the user's own token (`mlxinfer chat`, `connect()`), since
  any program of any user on this machine can reach a loopback port;
- it deletes only what mlxinfer wrote (the models folder, its cache); an added model is only unregistered, its
  files are the user's; the Hugging Face cache, which other tools share, is left to `mlxinfer rm`;
- a model answering a request is not deleted (409); a loaded idle one stops being served first.
A copy writes only a new name into the models folder (library/copying.py), so it needs no key, as a pull does.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ... import library
from ...errors import LibraryError
from ...untrusted import shown
from ..core import API, read_body
from ..errors import APIError
from ..schema import parse_json
from .ollama import ollama_errors


def routes(api: API) -> list[Route]:
    async def delete(request: Request) -> Response:
        body = parse_json(await read_body(request, api.settings))
        if api.settings.api_key is None and not api.trusted(request):
            raise APIError(
                403,
                "deleting a model over HTTP needs this server's API key (start it with `mlxinfer serve --api-key "
                "KEY`) or `mlxinfer rm NAME` on this machine",
                "model",
            )
        await run_in_threadpool(_delete, api, _name(body, "model"))
        return Response(status_code=200)

    async def copy(request: Request) -> Response:
        body = parse_json(await read_body(request, api.settings))
        source, destination = _name(body, "source"), _name(body, "destination")
        await run_in_threadpool(_copy, api, source, destination)
        return Response(status_code=200)

    return [
        Route("/api/delete", api.counted("ollama_delete", ollama_errors(delete)), methods=["DELETE"]),
        Route("/api/copy", api.counted("ollama_copy", ollama_errors(copy)), methods=["POST"]),
    ]


def _name(body: dict[str, Any], field: str) -> str:
    value = body.get(field) or (body.get("name") if field == "model" else None)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{field} must name a model (see GET /api/tags)", field)
    return value


def _found(name: str, field: str) -> library.LocalModel:
    model = library.find_model(name)
    if model is None:
        raise APIError(404, f"model {shown(name)} not found; GET /api/tags lists the models", field)
    return model


def _delete(api: API, name: str) -> None:
    model = _found(name, "model")
    if model.source == library.HF_CACHE:
        raise APIError(
            403,
            f"{name} is in the Hugging Face cache, which other tools share; `mlxinfer rm {name}` deletes it there",
            "model",
        )
    if not api.models.remove_idle(model.path):
        raise APIError(409, f"{name} is answering a request; delete it once it is idle", "model")
    try:
        library.remove_model(model)
    except LibraryError as e:  # gone or moved since it was found, or not deletable: said, nothing else touched
        raise APIError(400, str(e), "model") from None


def _copy(api: API, source: str, destination: str) -> None:
    model = _found(source, "source")
    if library.find_model(destination) is not None:
        raise APIError(409, f"a model called {shown(destination)} exists already; nothing is replaced", "destination")
    try:
        library.copy_model(model, destination)
    except LibraryError as e:  # a name that is no file name, one taken meanwhile, no room: nothing was added
        raise APIError(400, str(e), "destination") from None
