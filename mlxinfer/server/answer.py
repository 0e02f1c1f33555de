"""Generated text in, OpenAI answer fields out: content, reasoning_content and tool_calls, streamed or whole.

Streaming and whole answers come from the same pieces in the same order, so the streamed deltas,
concatenated, are the whole answer: the same content, reasoning and calls.
"""

from __future__ import annotations

from typing import Any

from ..chat import Content, OutputParser, Piece, Reasoning, ToolCall


class Answer:
    """One answer being generated: `feed` each Delta's text, `finish` at the end; each returns the new deltas."""

    def __init__(self, parser: OutputParser | None):
        self._parser = parser
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._parser is None:
            return self._take([Content(text)] if text else [])
        return self._take(self._parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._take(self._parser.finish() if self._parser is not None else [])

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's "tool_calls" when the model called tools and stopped on its own; else the engine's reason."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def message(self) -> dict[str, Any]:
        """The whole chat message: content is None when the model only called tools, as OpenAI's is."""
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in self.calls]
        return message

    @property
    def text(self) -> str:
        return "".join(self.content)

    def _take(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        """Record the pieces; their deltas, adjacent text of one kind joined into one delta."""
        deltas: list[dict[str, Any]] = []
        for piece in pieces:
            delta = self._record(piece)
            if delta is None:
                continue
            key = next(iter(delta))
            if deltas and key != "tool_calls" and next(iter(deltas[-1])) == key:
                deltas[-1][key] += delta[key]
            else:
                deltas.append(delta)
        return deltas

    def _record(self, piece: Piece) -> dict[str, Any] | None:
        if isinstance(piece, ToolCall):
            call = {
                "index": piece.index,
                "id": piece.id,
                "type": "function",
                "function": {"name": piece.name, "arguments": piece.arguments},
            }
            self.calls.append(call)
            return {"tool_calls": [call]}
        if not piece.text:
            return None
        if isinstance(piece, Reasoning):
            self.reasoning.append(piece.text)
            return {"reasoning_content": piece.text}
        self.content.append(piece.text)
        return {"content": piece.text}
