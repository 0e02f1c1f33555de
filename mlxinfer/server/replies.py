"""Response bodies in OpenAI's shapes: whole completions and server-sent-event chunks."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine import GenerationStats
from .answer import Answer


def usage(stats: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def event(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class Reply:
    """The id, model and shape shared by every body of one answer; `chat` picks chat or text completions."""

    model: str
    chat: bool
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {
            "id": prefix + self.id,
            "object": kind + (".chunk" if chunk and self.chat else ""),
            "created": self.created,
            "model": self.model,
        }

    def whole(self, answer: Answer, stats: GenerationStats) -> dict[str, Any]:
        reason = answer.finish_reason(stats.finish_reason) if self.chat else stats.finish_reason
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["message"] = answer.message()
        else:
            choice["text"] = answer.text
        return {**self._head(chunk=False), "choices": [choice], "usage": usage(stats)}

    def chunk(
        self, delta: dict[str, Any] | None = None, finish_reason: str | None = None, role: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk; `delta` holds content, reasoning_content or tool_calls (text completions: content)."""
        delta = delta or {}
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = {"role": "assistant", **delta} if role else delta
        else:
            choice["text"] = delta.get("content", "")
        return {**self._head(chunk=True), "choices": [choice]}

    def usage_chunk(self, stats: GenerationStats) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": usage(stats)}
