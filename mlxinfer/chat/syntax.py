"""The bodies of tool calls: JSON objects and arrays, and Gemma's own value syntax.

A call is kept only when it names a known tool and its arguments are an object;
anything else is left to the caller to show as text.
"""

from __future__ import annotations

import json
import re
from typing import Any

Call = tuple[str, str]  # (name, arguments as compact JSON object text)


def arguments_text(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def json_value(text: str) -> Any:
    """`text` parsed as JSON, or None when it is not (or nests deeper than the parser allows)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def call_from_object(value: Any, names: set[str], keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    """{"name": ..., "arguments": {...}} (or "parameters") as a call to a known tool."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = next((value[k] for k in keys if k in value), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as the API returns them
        arguments = json_value(arguments)
    return (value["name"], arguments_text(arguments)) if isinstance(arguments, dict) else None


def call_from_arguments(name: str, body: str, names: set[str]) -> Call | None:
    arguments = json_value(body)
    return (name, arguments_text(arguments)) if name in names and isinstance(arguments, dict) else None


class JsonScanner:
    """Finds where one JSON object or array ends in text that arrives piece by piece.

    It tracks depth, strings and escapes only; the value found is parsed (and may still fail) afterwards.
    Each piece is read once, so a long value costs its length, not its length squared.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False

    def end(self, piece: str) -> int | None:
        """The index in `piece` (the next part of the text) just past the value, once it closed; None while open."""
        for at, char in enumerate(piece):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "[{":
                self.depth += 1
            elif char in "]}":
                self.depth -= 1
                if self.depth <= 0:
                    return at + 1
        return None


# -- Mistral v11: [TOOL_CALLS]NAME[ARGS]{...}, or NAME[CALL_ID]ID[ARGS]{...} ---------------

_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]{0,64}")  # as tools.py allows a function's name
_ID_CHARS = re.compile(r"[A-Za-z0-9]{0,64}")


def mistral_head(text: str) -> tuple[str, int] | bool:
    """`NAME[ARGS]` or `NAME[CALL_ID]ID[ARGS]` at the start of `text`: (NAME, where the arguments start);
    True while `text` may still grow into one, False once it cannot.

    Decided by `text` alone, so the answer does not depend on how the output was cut into pieces.
    """
    name = _NAME_CHARS.match(text).group()  # type: ignore[union-attr]  # {0,...} always matches
    rest, at = text[len(name) :], len(name)
    if not rest:
        return True
    if not name:
        return False
    if rest.startswith("[CALL_ID]"):
        call_id = _ID_CHARS.match(rest, len("[CALL_ID]")).group()  # type: ignore[union-attr]
        at += len("[CALL_ID]") + len(call_id)
        rest = text[at:]
        if not rest:
            return True
        if not call_id:
            return False
    elif "[CALL_ID]".startswith(rest):
        return True
    if rest.startswith("[ARGS]"):
        return name, at + len("[ARGS]")
    return "[ARGS]".startswith(rest)


# -- Gemma: call:NAME{key:value,...} with strings between quote markers ------------------

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_KEY = re.compile(r"[^\s:{}\[\],]+")
_WORDS = {"true": True, "false": False, "null": None, "None": None}


class _GemmaReader:
    """A recursive-descent reader of the values Gemma's template writes (format_argument)."""

    def __init__(self, text: str, quote: str):
        self.text, self.quote, self.pos = text, quote, 0

    def value(self, depth: int = 0) -> Any:
        if depth > 64:
            raise ValueError("nested too deeply")
        text, pos = self.text, self.pos
        if text.startswith(self.quote, pos):
            end = text.find(self.quote, pos + len(self.quote))
            if end < 0:
                raise ValueError("unterminated string")
            self.pos = end + len(self.quote)
            return text[pos + len(self.quote) : end]
        if text.startswith("{", pos):
            return self.mapping(depth)
        if text.startswith("[", pos):
            return self.sequence(depth)
        match = _NUMBER.match(text, pos)
        if match:
            self.pos = match.end()
            number = match.group()
            return float(number) if any(c in number for c in ".eE") else int(number)
        for word, value in _WORDS.items():
            if text.startswith(word, pos):
                self.pos += len(word)
                return value
        raise ValueError(f"unexpected text at {pos}")

    def mapping(self, depth: int) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        while not self.take("}"):
            if out:
                self.expect(",")
            key = self.key()
            self.expect(":")
            out[key] = self.value(depth + 1)
        return out

    def sequence(self, depth: int) -> list[Any]:
        self.expect("[")
        out: list[Any] = []
        while not self.take("]"):
            if out:
                self.expect(",")
            out.append(self.value(depth + 1))
        return out

    def key(self) -> str:
        if self.text.startswith(self.quote, self.pos):  # keys are quoted inside nested values of declarations
            key = self.value()
            if isinstance(key, str):
                return key
        match = _KEY.match(self.text, self.pos)
        if not match:
            raise ValueError(f"expected a key at {self.pos}")
        self.pos = match.end()
        return match.group()

    def take(self, char: str) -> bool:
        if self.text.startswith(char, self.pos):
            self.pos += len(char)
            return True
        if self.pos >= len(self.text):
            raise ValueError("unexpected end")
        return False

    def expect(self, char: str) -> None:
        if not self.take(char):
            raise ValueError(f"expected {char!r} at {self.pos}")


def gemma_call(body: str, quote: str, names: set[str]) -> Call | None:
    """`call:NAME{key:value,...}` (the text between the call markers) as a call to a known tool."""
    match = re.match(r"\s*call:([A-Za-z0-9_.-]{1,64})(?=\{)", body)
    if not match or match.group(1) not in names:
        return None
    reader = _GemmaReader(body, quote)
    reader.pos = match.end()
    try:
        arguments = reader.mapping(0)
    except (ValueError, RecursionError):
        return None
    if body[reader.pos :].strip():
        return None
    return match.group(1), arguments_text(arguments)
