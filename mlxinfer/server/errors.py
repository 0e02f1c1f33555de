"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from ..defaults import SAMPLING_FIELDS
from ..errors import (
    AdapterError,
    BusyError,
    ChatTemplateError,
    ClusterError,
    GrammarError,
    MemoryBudgetError,
    RequestTimeoutError,
    SamplingError,
    ShutdownError,
    TokenizerError,
    ToolCallError,
)

PARAMS = frozenset({*SAMPLING_FIELDS, "max_tokens", "stop"})
# A grammar's errors begin with the request field it came from (Grammar.where): these are named as the param.
GRAMMAR_FIELDS = ("response_format", "tools", "tool_choice")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request the server refuses, with the status and OpenAI error object to send."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s, self.close = retry_after_s, close  # close: the connection cannot be reused

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    def headers(self) -> dict[str, str]:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}
        if self.close:
            headers["Connection"] = "close"
        return headers


def as_api_error(error: Exception) -> APIError:
    """The response for an error raised while taking or running a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ClientDisconnect):  # the client's doing, not a server error; the answer is never sent
        return APIError(499, "the client closed the connection before sending its whole request", code="client_closed")
    if isinstance(error, ToolCallError):
        return APIError(400, str(error), param=getattr(error, "param", None))
    if isinstance(error, GrammarError):
        name = getattr(error, "param", None) or str(error).split(" ", 1)[0].rstrip(":")
        return APIError(400, str(error), param=name if name.startswith(GRAMMAR_FIELDS) else None)
    if isinstance(error, SamplingError):
        name = str(error).split(" ", 1)[0]
        return APIError(400, str(error), param=name if name in PARAMS else None)
    if isinstance(error, (ChatTemplateError, TokenizerError)):
        return APIError(400, str(error), param="messages")
    if isinstance(error, AdapterError):  # the adapter the request named cannot run over this model
        return APIError(400, str(error), param="model", code="adapter_error")
    if isinstance(error, BusyError):
        return APIError(
            429, f"the server is busy: {error}; retry later", code="busy", retry_after_s=error.retry_after_s
        )
    if isinstance(error, MemoryBudgetError):
        return APIError(503, str(error), code="insufficient_memory", retry_after_s=30)
    if isinstance(error, RequestTimeoutError):
        return APIError(503, str(error), code="timeout", retry_after_s=10)
    if isinstance(error, ClusterError):
        return APIError(503, str(error), code="rank_lost")
    if isinstance(error, ShutdownError):
        return APIError(503, f"{error}; retry when it is back", code="shutting_down")
    return APIError(500, f"generation failed: {type(error).__name__}: {error}", code="internal_error")
