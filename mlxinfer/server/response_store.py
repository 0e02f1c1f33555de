"""The Responses API's stored responses: what `previous_response_id` continues, and what GET retrieves.

Bounded by count and by bytes, the least recently used going first; a response that alone is larger than
the whole budget is not kept (its id then answers "not found", with why). Each entry keeps the conversation
up to and including its answer in chat-message form, so a continued response is the same chat request the
client could have sent whole, and the prefix cache finds everything before the new input.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20  # images travel as data URLs inside the messages: a few MB each at most (the body limit)


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: its object as the client got it, and the conversation it ends (instructions left
    out: OpenAI does not carry them into a continued response)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    nbytes: int


class ResponseStore:
    """Stored responses by id; safe to use from the event loop and the preparing threads at once."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep `response` (by its id) and its conversation; False when it alone exceeds the byte budget."""
        nbytes = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(messages, ensure_ascii=False))
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = StoredResponse(response, messages, nbytes)
            self._bytes += nbytes
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)  # a conversation in use stays
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
