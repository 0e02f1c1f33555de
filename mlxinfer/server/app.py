"""The ASGI app put together: the shared core (core.API), every route module's routes, the guard in front of them.

The routes depend on the core and never on this module, so the server's imports have no circle:
app -> routes/* -> core -> deltas, model_pool, schema, structured.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from ..engine import GenerationStats
from .core import API
from .guard import GuardMiddleware
from .model_pool import ModelSet
from .routes import anthropic, embeddings, ollama, ollama_models, ollama_pull, openai, page, responses, status
from .settings import ServerSettings


def create_app(
    models: ModelSet, settings: ServerSettings, on_finished: Callable[[GenerationStats], None] | None = None
) -> Starlette:
    """The server's ASGI app over `models` (which the caller closes when done with them).

    `on_finished` is called (on a scheduler's thread) with the stats of every generation that ends."""
    api = API(models, settings, on_finished)

    middleware = [Middleware(GuardMiddleware, settings=settings)]
    if settings.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.cors_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["Authorization", "Content-Type"],
            )
        )
    app = Starlette(routes=all_routes(api), middleware=middleware)
    app.state.api = api
    return app


def all_routes(api: API) -> list[Route]:
    return [
        *openai.routes(api),  # /v1/chat/completions, /v1/completions, /v1/models
        *status.routes(api),  # /health, the identity route, /metrics
        *page.routes(),  # /, /page/{name}, /favicon.ico: the chat page
        *ollama.routes(api),  # /api/...: Ollama's API
        *ollama_pull.routes(api),  # /api/pull: a Hub checkpoint into the models folder
        *ollama_models.routes(api),  # /api/delete, /api/copy: the model library
        *anthropic.routes(api),  # /v1/messages
        *responses.routes(api),  # /v1/responses: OpenAI's Responses API
        *embeddings.routes(api),  # /v1/embeddings
    ]
