"""(being written)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.routing import Route

if TYPE_CHECKING:
    from .app import API


def routes(api: API) -> list[Route]:
    return []
