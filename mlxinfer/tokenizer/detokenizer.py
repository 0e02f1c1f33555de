"""Turn a stream of token ids into text without ever splitting a character.

A multi-byte UTF-8 character can span several byte-level tokens, and
SentencePiece decoders drop a leading space when a piece is decoded alone.
So we decode a short window that starts one emitted chunk back (for spacing)
and emit only when the text does not end in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed ids with `add`; each call returns the newly completed text (maybe "")."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids up to here have been emitted

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is left, incomplete characters included, at the end of a stream."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        seen = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(seen) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]
