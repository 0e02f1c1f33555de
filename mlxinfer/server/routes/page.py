"""The chat page: / and its own files (server/page/), served with a policy that runs nothing from elsewhere."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from ..errors import APIError

PAGE = Path(__file__).parent.parent / "page"
PAGE_ASSETS = {"chat.js": "text/javascript", "chat.css": "text/css"}
# The page runs only its own files: no inline script, nothing fetched from elsewhere. Images it shows are the ones
# the user attached, read into data: URLs in the page.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
}


async def page(request: Request) -> Response:
    return FileResponse(PAGE / "index.html", headers=PAGE_HEADERS)


async def page_asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in PAGE_ASSETS:  # a fixed list: no path from the request ever reaches the file system
        return APIError(404, f"no page asset {name!r}").response()
    return FileResponse(PAGE / name, media_type=PAGE_ASSETS[name], headers=PAGE_HEADERS)


async def favicon(request: Request) -> Response:
    # The tray icon (ui/tray.py's icon_image at 16, 32 and 48 px), where browsers look for it.
    return FileResponse(PAGE / "favicon.ico", media_type="image/x-icon", headers=PAGE_HEADERS)


def routes() -> list[Route]:
    return [
        Route("/", page, methods=["GET"]),
        Route("/page/{name}", page_asset, methods=["GET"]),
        Route("/favicon.ico", favicon, methods=["GET"]),
    ]
