"""A model answered by the user's resident server, with the same generate / chat / stream as a loaded Model.

`connect()` is how notebooks and scripts share one copy of the weights with the menubar helper and
the terminal: it talks to the server the state file names (local_server.py), and loads the
model in this process only when no server runs or when asked to (`local=True`).
"""

from __future__ import annotations

import http.client
import json
import logging
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .api import GenerationResult, Model, load
from .defaults import SAMPLING_FIELDS as SAMPLING
from .engine import GenerationStats, SamplingParams
from .errors import RemoteServerError, SamplingError
from .local_server import ANSWER_HEADER, OPENER, STOP_PATH, LocalServer, find_server

log = logging.getLogger("mlxinfer")
LOCAL_ONLY = ("prefill_chunk_tokens", "use_cache", "snapshot_every", "speculate")
MAX_LINE_BYTES = 1 << 20  # one server-sent event; the server's own are a few hundred bytes
MAX_ERROR_BYTES = 64 << 10
READ_TIMEOUT_S = 660.0  # between two reads: past the server's own request timeout (600 s), it is gone
STOP_TIMEOUT_S = 5.0  # a stop is answered at once; a server that does not is left as a closed connection


def connect(model: str | Path | None = None, *, local: bool = False, **load_options: Any) -> Model | RemoteModel:
    """The model from the resident server when one runs (no second copy of the weights), else loaded here.

    MODEL: a name `mlxinfer ls` shows, a model folder or .gguf file, or None for the server's first model
    (the default model when loading here). `local=True`, or any load option (dtype, kv_bits, draft_model,
    speculate), loads it in this process.

    Example:
        >>> llm = mlxinfer.connect()
        >>> print(llm.chat("Hello!").text)
    """
    server = None if local or load_options else find_server()
    if server is None:
        if not local and not load_options:
            log.info("no mlxinfer server is running: loading the model in this process")
        return load(model, **load_options)
    return RemoteModel(server, model_field(model))


def model_field(model: str | Path | None) -> str | None:
    """What to name the model in requests: a path that exists on this machine by its full path (the server
    loads it for the user's own front ends), anything else as the name given."""
    if model is None:
        return None
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


class RemoteModel:
    """Generate with a model of the resident server; options as in Model.generate (sampling, max_tokens,
    stop, schema). `name` is what the server calls the model (known after the first answer)."""

    def __init__(self, server: LocalServer, model: str | None):
        self.server, self.model, self.name = server, model, model

    def __repr__(self) -> str:
        return f"RemoteModel({self.name or 'default'} via {self.server.url})"

    def generate(self, prompt: Any, *, chat: bool | None = None, **options: Any) -> GenerationResult:
        run = self.stream(prompt, chat=chat, **options)
        for _ in run:
            pass
        return GenerationResult(text=run.text(), token_ids=[], stats=run.stats)

    def chat(self, messages: str | Sequence[dict[str, Any]], **options: Any) -> GenerationResult:
        return self.generate(messages, chat=True, **options)

    def stream(self, prompt: Any, *, chat: bool | None = None, **options: Any) -> RemoteStream:
        """Text chunks as the server sends them; `.stats` once done. Closing it early ends the request."""
        path, body = _request_body(prompt, chat, options)
        if self.model is not None:
            body["model"] = self.model
        return RemoteStream(self, path, body)


class RemoteStream:
    """An answer streaming from the server (server-sent events); iterate for text, then read `.stats`."""

    def __init__(self, owner: RemoteModel, path: str, body: dict[str, Any]):
        self._owner, self._chat = owner, path.endswith("chat/completions")
        self._pieces: list[str] = []
        self.stats = GenerationStats()
        self._started = time.perf_counter()
        self._name = secrets.token_hex(16)  # what a stop names this answer by (local_server.STOP_PATH)
        self._first: float | None = None  # when the first text came
        self._ended = False
        # here: a refused request raises at the call
        self._response = _post(owner.server, path, body, {ANSWER_HEADER: self._name})

    def text(self) -> str:
        return "".join(self._pieces)

    def __iter__(self) -> Iterator[str]:
        try:
            for data in _events(self._response, self._owner.server.url):
                count = len(self._pieces)
                self._take(data)
                if len(self._pieces) > count:
                    yield self._pieces[-1]
        except KeyboardInterrupt:  # Ctrl-C while waiting for the server (else the caller calls stop() itself)
            self.stop()
            raise
        finally:
            self._end()

    def stop(self) -> None:
        """Ctrl-C's end: the server stops this answer as a finished one ends, and its last events (the text in
        flight, the true token counts) are read; on any failure the connection just closes, as before."""
        if self._ended:
            return
        try:
            _post(self._owner.server, STOP_PATH, {"answer": self._name}, timeout=STOP_TIMEOUT_S).close()
            for data in _events(self._response, self._owner.server.url):
                self._take(data)
        except (RemoteServerError, OSError):
            pass
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._response.close()  # early: the server sees the client leave and ends the request
            self._timings(self._first)

    def _take(self, data: dict[str, Any]) -> None:
        """One event's text, finish reason and usage, recorded."""
        self._owner.name = data.get("model", self._owner.name)
        if "error" in data:
            raise RemoteServerError(_message(data))
        text, reason = self._piece(data)
        if text:
            self._first = self._first or time.perf_counter()
            self._pieces.append(text)
        if reason:
            self.stats.finish_reason = reason
        if data.get("usage"):
            self._usage(data["usage"])

    def _piece(self, data: dict[str, Any]) -> tuple[str, str | None]:
        choice = (data.get("choices") or [{}])[0]
        text = (choice.get("delta") or {}).get("content") if self._chat else choice.get("text")
        return text or "", choice.get("finish_reason")

    def _usage(self, usage: dict[str, Any]) -> None:
        self.stats.prompt_tokens = int(usage.get("prompt_tokens", 0))
        self.stats.generated_tokens = int(usage.get("completion_tokens", 0))
        self.stats.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        self.stats.prefilled_tokens = self.stats.prompt_tokens - self.stats.cached_tokens

    def _timings(self, first: float | None) -> None:
        """TTFT and rates as this client saw them (the network is loopback: they match the server's closely)."""
        now = time.perf_counter()
        self.stats.total_s = now - self._started
        if first is not None:
            self.stats.ttft_s = first - self._started
            self.stats.prefill_tps = self.stats.prefilled_tokens / max(self.stats.ttft_s, 1e-9)
            if self.stats.generated_tokens > 1:
                self.stats.decode_tps = (self.stats.generated_tokens - 1) / max(now - first, 1e-9)


def _request_body(prompt: Any, chat: bool | None, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The OpenAI request for Model.generate's arguments; a sampling field left out is left out (None too), so
    the server takes the model's own, as a local Model does."""
    local = [name for name in LOCAL_ONLY if name in options] + [
        name for name in ("regex", "choices") if options.get(name) is not None
    ]
    if local:
        raise SamplingError(f"{', '.join(local)}: only for a model loaded in this process; connect(local=True)")
    schema = options.pop("schema", None)
    options.pop("regex", None), options.pop("choices", None)
    unknown = set(options) - {*SAMPLING, "max_tokens", "stop"}
    if unknown:
        raise SamplingError(f"unknown generation option: {', '.join(sorted(unknown))}")
    sampling = {name: options[name] for name in SAMPLING if options.get(name) is not None}
    SamplingParams(**sampling)  # the same checks as a local model, before anything is sent
    body: dict[str, Any] = {**sampling, "max_tokens": options.get("max_tokens", 256), "stream": True}
    body["stream_options"] = {"include_usage": True}
    if options.get("stop") is not None:
        body["stop"] = options["stop"]
    if schema is not None:
        body["response_format"] = _response_format(schema)
    if isinstance(prompt, str) and chat:
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, str) or _token_ids(prompt):
        return "/v1/completions", {**body, "prompt": list(prompt) if not isinstance(prompt, str) else prompt}
    return "/v1/chat/completions", {**body, "messages": list(prompt)}


def _token_ids(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def _response_format(schema: Any) -> dict[str, Any]:
    if hasattr(schema, "model_json_schema"):  # a pydantic class
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        schema = json.loads(schema)
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _post(
    server: LocalServer, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
    timeout: float = READ_TIMEOUT_S,
) -> Any:  # fmt: skip
    data = json.dumps(body).encode()
    headers = {**server.headers, **(headers or {}), "Content-Type": "application/json"}
    request = urllib.request.Request(server.url + path, data=data, headers=headers, method="POST")
    try:
        return OPENER.open(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read(MAX_ERROR_BYTES))
        except (ValueError, RecursionError, OSError):  # not JSON, nested past the parser, or cut off
            detail = {}
        raise RemoteServerError(f"the server at {server.url} answered {e.code}: {_message(detail)}") from None
    except OSError as e:
        raise RemoteServerError(f"the server at {server.url} cannot be reached: {getattr(e, 'reason', e)}") from None


def _events(response: Any, url: str) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to [DONE]; RemoteServerError if it ends before."""
    try:
        while line := response.readline(MAX_LINE_BYTES):
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)
    except (OSError, ValueError, RecursionError, http.client.HTTPException) as e:  # dropped, cut off, nested deep
        raise RemoteServerError(f"the server at {url} stopped answering mid-answer ({e!r})") from None
    raise RemoteServerError(f"the server at {url} ended the answer before its end (did it stop?)")


def _message(detail: Any) -> str:
    error = detail.get("error") if isinstance(detail, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or detail or "no details")
