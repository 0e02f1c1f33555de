"""Turn a stream of token ids into text without ever splitting a character.

A multi-byte UTF-8 character can span several byte-level tokens, and
SentencePiece decoders drop a leading space when a piece is decoded alone.
So we decode a short window that starts one emitted chunk back (for spacing)
and emit only when the text does not end in an incomplete character.

The window is bounded: a character is at most 4 bytes, so ids that still end in
an incomplete character (or add no text) after MAX_HELD_IDS more are invalid
UTF-8 or silent tokens, and are emitted as they decode (with U+FFFD) rather than
re-decoded at every step, which would make a hostile id stream cost quadratic time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
MAX_HELD_IDS = 16  # a UTF-8 character spans at most 4 byte tokens; this leaves room for silent ones


class IncrementalDetokenizer:
    """Feed ids with `add`; each call returns the newly completed text (maybe "")."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._ids: list[int] = []  # the window: the last emitted chunk's ids, then those not emitted yet
        self._read = 0  # ids before this index in the window have been emitted

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is left, incomplete characters included, at the end of a stream."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        seen = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        complete = len(text) > len(seen) and not text.endswith(REPLACEMENT)
        if not (complete or final or len(self._ids) - self._read >= MAX_HELD_IDS):
            return ""
        del self._ids[: self._read]  # the chunk just emitted starts the next window
        self._read = len(self._ids)
        return text[len(seen) :]
