"""Ollama's /api/pull: a Hugging Face checkpoint into the models folder, through `mlxinfer pull`'s own steps.

The model is a Hub id, ORG/NAME (or Ollama's `hf.co/ORG/NAME`); Ollama's library names (`llama3.2`) are not on the
Hub and get a 400 saying what to send. The pull is checked before any weight comes (hub/pull.py: the family, the
files, each shard's header, the disk), runs on a thread of its own (never the event loop's or a scheduler's), and
streams Ollama's progress lines (`status`, `total`, `completed`) unless `stream` is false. A model already in the
models folder answers `success` at once, as Ollama does for one it has; a repository being pulled already is a 409.
A client that leaves does not stop the download: it finishes into the models folder.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...errors import MlxInferError
from ...hub import check_disk, download, finish, plan_pull
from ...library import models_dir
from ...untrusted import shown
from ..core import API, read_body
from ..errors import APIError
from ..schema import parse_json
from .ollama import ollama_errors

_HUB_ID = re.compile(r"(?:(?:hf\.co|huggingface\.co)/)?([A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})")
REPORT_EVERY = 1 << 20  # bytes between progress lines (and each file's end)
_PULLING: set[str] = set()  # repositories a pull is downloading now
_PULLING_LOCK = threading.Lock()


def routes(api: API) -> list[Route]:
    async def pull(request: Request) -> Response:
        body = parse_json(await read_body(request, api.settings))
        repo = hub_id(body.get("model") or body.get("name"))
        with _PULLING_LOCK:
            if repo in _PULLING:  # two downloads into one folder's .part files would interleave their writes
                raise APIError(409, f"{repo} is being pulled already; wait for that pull to end", "model")
            _PULLING.add(repo)
        events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=_pull, args=(repo, events), name="mlxinfer-pull", daemon=True).start()
        if body.get("stream", True) is False:
            last = await asyncio.to_thread(_last, events)
            status = 200 if "error" not in last else 400
            return JSONResponse(last, status_code=status)
        return StreamingResponse(_lines(events), media_type="application/x-ndjson")

    return [Route("/api/pull", api.counted("ollama_pull", ollama_errors(pull)), methods=["POST"])]


def hub_id(name: Any) -> str:
    """The Hub repository an Ollama model name asks for; a 400 for any other name."""
    found = _HUB_ID.fullmatch(name) if isinstance(name, str) else None
    if found is None:
        raise APIError(
            400,
            f"model must be a Hugging Face repository, ORG/NAME or hf.co/ORG/NAME, got {shown(name)}; "
            "Ollama's library names are not on the Hub",
            "model",
        )
    return found.group(1)


def _pull(repo: str, events: queue.Queue[dict[str, Any] | None]) -> None:
    """The pull's steps, each told in `events` (Ollama's lines), then None."""
    try:
        events.put({"status": "pulling manifest"})
        if (models_dir() / repo.split("/")[1]).exists():
            events.put({"status": "success"})
            return
        plan = plan_pull(repo)
        check_disk(plan)
        told = [0]

        def progress(done: int, total: int) -> None:
            if done - told[0] >= REPORT_EVERY or done >= total:
                told[0] = done
                events.put({"status": f"pulling {repo}", "digest": repo, "total": total, "completed": done})

        download(plan, progress=False, report=progress)
        events.put({"status": "verifying files"})
        finish(plan)
        events.put({"status": "success"})
    except MlxInferError as e:
        events.put({"error": str(e)})
    finally:
        with _PULLING_LOCK:
            _PULLING.discard(repo)
        events.put(None)


def _last(events: queue.Queue[dict[str, Any] | None]) -> dict[str, Any]:
    last: dict[str, Any] = {}
    while (event := events.get()) is not None:
        last = event
    return last


async def _lines(events: queue.Queue[dict[str, Any] | None]) -> AsyncIterator[str]:
    while (event := await asyncio.to_thread(events.get)) is not None:
        yield json.dumps(event) + "\n"
