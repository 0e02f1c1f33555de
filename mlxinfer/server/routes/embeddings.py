"""OpenAI's /v1/embeddings and Ollama's /api/embed: a model's final hidden states, pooled and unit length
(engine/embed.py).

Follows https://platform.openai.com/docs/api-reference/embeddings/create, plus `pooling` ("mean", the default, or
"last"); Ollama's body (`input`, `truncate`, `dimensions`; its `options` tune llama.cpp and are ignored, as there)
answers in its shape (`embeddings`, durations in nanoseconds, errors as {"error": message}). The body is parsed
and its texts tokenized (plain encode, no chat template) on the prepare workers; the forward passes run on a device
thread, one request at a time, so neither the event loop nor a scheduler's thread waits on them. A client that
leaves mid-request does not stop its passes: they run to the end (bounded by the limits below) and the answer is
dropped.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...api import MAX_CHARS_PER_TOKEN, Model
from ...engine import POOLINGS, call_on_device_thread, check_ids, embed, embeddable, split_inputs
from ...errors import EmbeddingError, SamplingError, TokenizerError
from ...untrusted import is_int, shown
from ..core import API, read_body
from ..errors import APIError
from ..limits import WorkGate
from ..model_pool import ServedModel
from ..schema import parse_json
from .ollama import NS, ollama_errors

MAX_INPUTS = 256  # per request (OpenAI allows 2048; each of ours is a forward pass of its own)
MAX_TOTAL_TOKENS = 32768  # per request, all inputs together
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    items: list[str | list[int]]  # one per input: text, or token ids
    encoding_format: str
    dimensions: int | None
    pooling: str
    truncate: bool = False  # an input past the context keeps its first tokens (Ollama's), else it is refused


def routes(api: API) -> list[Route]:
    passes = WorkGate(1, api.settings.prepare_queue)  # one request's forward passes at a time, the rest wait

    def handler(parsed: Callable[[bytes], EmbeddingRequest], reply: Callable[..., Response]) -> Callable:
        async def embeddings(request: Request) -> Response:
            raw = await read_body(request, api.settings)
            trusted, started = api.trusted(request), time.perf_counter()

            def everything() -> tuple[EmbeddingRequest, ServedModel | None, list[list[int]] | None]:
                body = parsed(raw)
                served = api.models.acquire_loaded(body.model, trusted)  # held: never unloaded under its passes
                try:
                    return body, served, None if served is None else prepare(served.model, body)
                except BaseException:
                    if served is not None:
                        api.models.release(served)
                    raise

            body, served, ids = await api.preparing.run(everything)
            try:
                if served is None:  # a model that must load first loads outside the gate, as core.API's
                    served = await run_in_threadpool(api.models.acquire, body.model, trusted)
                if served.adapter.slot:
                    raise APIError(400, f"embeddings come from the base model; name {served.id!r}", "model")
                if ids is None:
                    ids = await api.preparing.run(prepare, served.model, body, admitted=True)
                return await passes.run(reply, served, ids, body, started)
            finally:
                if served is not None:
                    api.models.release(served)

        return embeddings

    return [
        Route("/v1/embeddings", api.counted("embeddings", handler(parse, _answer)), methods=["POST"]),
        Route(
            "/api/embed",
            api.counted("ollama_embed", ollama_errors(handler(parse_ollama, _ollama_answer))),
            methods=["POST"],
        ),
    ]


def parse_ollama(raw: bytes) -> EmbeddingRequest:
    """Ollama's /api/embed body as the OpenAI one: `input` a string or a list of strings, `truncate` (default true:
    an input past the context keeps its first tokens), `dimensions`. Errors name Ollama's fields."""
    body = parse_json(raw)
    if not isinstance(body.get("input"), (str, list)):
        raise APIError(400, f"input must be a string or a list of strings, got {shown(body.get('input'))}", "input")
    inputs = [body["input"]] if isinstance(body["input"], str) else body["input"]
    if not all(isinstance(text, str) for text in inputs):
        raise APIError(400, "input must be a string or a list of strings", "input")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise APIError(400, f"truncate must be true or false, got {shown(truncate)}", "truncate")
    openai = {"model": body.get("model"), "input": inputs, "dimensions": body.get("dimensions")}
    return replace(parse(json.dumps(openai).encode()), truncate=truncate)


def parse(raw: bytes) -> EmbeddingRequest:
    """The body's fields checked; a 400 naming the field otherwise. `user` is accepted and ignored."""
    body = parse_json(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {shown(model)}", "model")
    if "input" not in body:
        raise APIError(400, "input is required: a string, a list of strings or token ids", "input")
    try:
        items = split_inputs(body["input"])
    except SamplingError as e:
        raise APIError(400, str(e), "input") from None
    if len(items) > MAX_INPUTS:
        raise APIError(
            400,
            f"input has {len(items)} items; at most {MAX_INPUTS} inputs per request; send the rest in more requests",
            "input",
        )
    empty = next((i for i, item in enumerate(items) if not item), None)
    if empty is not None:
        raise APIError(400, f"input[{empty}] is empty; every input needs some text or tokens", "input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise APIError(400, f"encoding_format must be float or base64, got {shown(encoding)}", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and not (is_int(dimensions) and dimensions > 0):
        raise APIError(400, f"dimensions must be a positive integer, got {shown(dimensions)}", "dimensions")
    pooling = body.get("pooling") or "mean"
    if pooling not in POOLINGS:
        raise APIError(400, f"pooling must be mean or last, got {shown(pooling)}", "pooling")
    return EmbeddingRequest(model, items, encoding, dimensions, pooling)


def prepare(model: Model, body: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, checked against `model`: a 400 for a model that cannot embed, dimensions it
    cannot give, an input past its context or the request's token budget, a token id out of its vocabulary."""
    reason = embeddable(model.runtime.decoder, alongside_generation=True)
    if reason is not None:
        raise APIError(400, f"{model.path.name} cannot give embeddings: {reason}", "model", "model_not_supported")
    hidden = model.config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        # Truncating would be right only for a model trained for it (Matryoshka): a decoder's states are not.
        raise APIError(
            400,
            f"dimensions is {body.dimensions}, but this model's embeddings have {hidden} (its hidden size) and "
            f"are not truncated; leave dimensions out or set it to {hidden}",
            "dimensions",
        )
    context, total, ids = model.context_tokens, 0, []
    for index, item in enumerate(body.items):
        if isinstance(item, str) and len(item) > context * MAX_CHARS_PER_TOKEN:  # cannot fit: not worth encoding
            if not body.truncate:
                raise _too_long(index, f"{len(item)} characters", context)
            item = item[: context * MAX_CHARS_PER_TOKEN]  # more than `context` tokens still: cut below
        try:
            one = _ids_of(model, item, index)
        except SamplingError as e:
            raise APIError(400, str(e), "input") from None
        if len(one) > context and body.truncate:
            one = one[:context]
        if len(one) > context:
            raise _too_long(index, f"{len(one)} tokens", context)
        total += len(one)
        if total > MAX_TOTAL_TOKENS:
            raise APIError(
                400,
                f"the inputs up to input[{index}] hold {total} tokens; at most {MAX_TOTAL_TOKENS} per request; "
                "send them in more requests",
                "input",
            )
        ids.append(one)
    return ids


def _ids_of(model: Model, item: str | list[int], index: int) -> list[int]:
    """Token ids of one input: its text encoded as it is (BOS where the tokenizer adds one), or its ids checked."""
    if isinstance(item, list):
        return check_ids(item, index, model.config.vocab_size)
    try:
        return model.tokenizer.encode(item)
    except TokenizerError as e:
        raise SamplingError(f"input[{index}]: {e}") from None


def _too_long(index: int, size: str, context: int) -> APIError:
    message = f"input[{index}] has {size}; the model's context is {context} tokens; shorten it"
    return APIError(400, message, "input", "context_length_exceeded")


def _answer(served: ServedModel, ids: list[list[int]], body: EmbeddingRequest, started: float) -> Response:
    """Run the passes on a device thread and render the reply (on the calling worker, never the event loop)."""
    vectors = _vectors(served, ids, body)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
        for i, vector in enumerate(vectors)
    ]
    tokens = sum(map(len, ids))
    reply = {
        "object": "list",
        "data": data,
        "model": served.id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return Response(json.dumps(reply), media_type="application/json")


def _ollama_answer(served: ServedModel, ids: list[list[int]], body: EmbeddingRequest, started: float) -> Response:
    vectors = _vectors(served, ids, body)
    reply = {
        "model": served.id,
        "embeddings": [vector.tolist() for vector in vectors],
        "total_duration": int((time.perf_counter() - started) * NS),
        "load_duration": 0,
        "prompt_eval_count": sum(map(len, ids)),
    }
    return Response(json.dumps(reply), media_type="application/json")


def _vectors(served: ServedModel, ids: list[list[int]], body: EmbeddingRequest) -> list[np.ndarray]:
    model = served.model
    try:
        work = partial(
            embed,
            model.runtime.decoder,
            ids,
            body.pooling,
            vocab_size=model.config.vocab_size,
            kv_bits=model.kv_bits,
            alongside_generation=True,
        )
        return call_on_device_thread(work, "mlxinfer-embed")
    except EmbeddingError as e:
        raise APIError(400, str(e), "model", "model_not_supported") from None


def _encoded(vector: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":  # OpenAI's form: the little-endian float32 bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
