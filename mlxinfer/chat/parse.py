"""The model's output, streamed, split into content, reasoning and tool calls.

Text is released only once it cannot turn out to be markup: a possible start of a
marker at the end of what arrived is held back until the next piece decides it.
Whitespace that only separates markup (before a tool call, after </think>) is
dropped; output without markup comes back exactly. A tool call that never closes or
does not parse comes back as content, never lost.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from .formats import MARKERS, REASONING_MARKERS, OutputFormat
from .syntax import Call, JsonScanner, call_from_arguments, call_from_object, gemma_call, json_value
from .tools import Tool


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object as text


Piece = Content | Reasoning | ToolCall

_REASONING_MARKERS = {"think": ("<think>", "</think>"), "gemma": ("<|channel>thought", "<channel|>")}
_CALL_MARKERS = {  # opener, closer (None: the call's JSON ends it)
    "hermes": ("<tool_call>", "</tool_call>"),
    "gemma4": ("<|tool_call>", "<tool_call|>"),
    "function_gemma": ("<start_function_call>", "<end_function_call>"),
    "mistral": ("[TOOL_CALLS]", None),
    "llama3_json": ("<|python_tag|>", None),
}
_GEMMA_QUOTES = {"gemma4": '<|"|>', "function_gemma": "<escape>"}
_HEADER_LIMIT = 256  # a harmony header (role, channel, recipient) is far shorter


class _Markers:
    """Finds the first of a set of markers in text, and how much of its end may begin one."""

    def __init__(self, markers: Iterable[str]):
        found = sorted({m for m in markers if m}, key=len, reverse=True)  # longest first at a position
        self._regex = re.compile("|".join(map(re.escape, found))) if found else None
        self._prefixes = {m[:k] for m in found for k in range(1, len(m))}
        self._longest = len(found[0]) if found else 0

    def find(self, text: str, final: bool = False) -> re.Match[str] | None:
        """The first marker in `text`; None also while what follows may still make a longer one (unless `final`)."""
        match = self._regex.search(text) if self._regex else None
        return None if match and not final and text[match.start() :] in self._prefixes else match

    def held(self, text: str) -> int:
        """The length of the longest end of `text` that is the start of a marker."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0


@lru_cache(maxsize=64)
def _markers(found: frozenset[str]) -> _Markers:
    """Cached: a tokenizer may have thousands of special tokens, and every request makes a parser."""
    return _Markers(found)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _Output:
    """Pieces for one feed, with the whitespace rules of the module docstring."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.lstrip = False  # drop whitespace that starts the next text (it follows markup)
        self.pending = ""  # whitespace that ends the text so far: kept only if more text follows
        self.dropped = ""  # the whitespace the last markup dropped: a call that turns out not to be one gets it back
        self.calls = 0

    def text(self, kind: type[Content] | type[Reasoning], text: str) -> None:
        if self.lstrip:
            text = text.lstrip()
            self.lstrip = not text
        if not text:
            return
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body) :]
        if body:
            self.add(kind(body))

    def add(self, piece: Piece) -> None:
        last = self.pieces[-1] if self.pieces else None
        if isinstance(piece, (Content, Reasoning)) and type(last) is type(piece):
            self.pieces[-1] = type(piece)(last.text + piece.text)  # type: ignore[union-attr]
        else:
            self.pieces.append(piece)

    def call(self, call: Call) -> None:
        self.add(ToolCall(self.calls, new_call_id(), *call))
        self.calls += 1

    def raw(self, text: str) -> None:
        """A call that did not parse: shown as content, as written (with the whitespace before it)."""
        self.lstrip = False
        self.text(Content, self.dropped + text)

    def boundary(self) -> None:
        """Markup: the whitespace around it is not content."""
        self.dropped, self.pending, self.lstrip = self.pending, "", True

    def take(self) -> list[Piece]:
        pieces, self.pieces = self.pieces, []
        return pieces


class OutputParser:
    """Splits streamed output into Content, Reasoning and ToolCall pieces.

    Example:
        >>> parser = OutputParser(fmt, tools, prompt_text=prompt)
        >>> pieces = [p for chunk in chunks for p in parser.feed(chunk)] + parser.finish()
    """

    def __init__(self, fmt: OutputFormat, tools: list[Tool], prompt_text: str = ""):
        harmony = fmt.tools == "harmony" or fmt.reasoning == "harmony"
        self._impl = _HarmonyParser(fmt, tools, prompt_text) if harmony else _TaggedParser(fmt, tools, prompt_text)

    def feed(self, text: str) -> list[Piece]:
        return self._impl.feed(text)

    def finish(self) -> list[Piece]:
        return self._impl.finish()


def _special_drops(fmt: OutputFormat, markup: Iterable[str]) -> set[str]:
    """Special tokens that are not this family's markup: end-of-turn tokens and the like, never content."""
    return set(fmt.special_tokens) - set(markup) if fmt.keep_special_tokens else set()


class _TaggedParser:
    """Families whose calls and reasoning sit between markers: hermes, llama3_json, mistral, gemma, <think>."""

    def __init__(self, fmt: OutputFormat, tools: list[Tool], prompt_text: str):
        self.names = {t.name for t in tools}
        self.family = (fmt.dialect if fmt.tools == "gemma" else fmt.tools) if fmt.tools and tools else None
        self.opener, self.closer = _CALL_MARKERS.get(self.family or "", (None, None))
        self.quote = _GEMMA_QUOTES.get(self.family or "", "")
        think_open, think_close = _REASONING_MARKERS.get(fmt.reasoning or "", (None, None))
        family_markup = set(MARKERS.get(self.family or "", ()))
        reasoning_markup = {m for m in (think_open, think_close) if m} | set(
            REASONING_MARKERS.get(fmt.reasoning or "", ())
        )
        all_markup = {*MARKERS.get(fmt.tools or "", ()), *MARKERS.get(fmt.dialect or "", ())}
        drops = _special_drops(fmt, family_markup | reasoning_markup | all_markup)
        # What each marker does, by mode. "drop": removed; "cut": removed, and no text joins across it.
        self.actions = {
            "text": {
                **dict.fromkeys(drops, "drop"),
                **dict.fromkeys(family_markup | reasoning_markup, "cut"),
                **({think_open: "reasoning"} if think_open else {}),
                **({self.opener: "call"} if self.opener else {}),
            },
            "reasoning": {
                **dict.fromkeys(drops, "drop"),
                **dict.fromkeys(reasoning_markup, "cut"),
                **({think_close: "text"} if think_close else {}),
            },
        }
        self.markers = {mode: _markers(frozenset(actions)) for mode, actions in self.actions.items()}
        self.closer_markers = _markers(frozenset({self.closer} if self.closer else ()))
        self.out = _Output()
        self.buf, self.opener_seen, self.final = "", "", False
        self.mode = "reasoning" if _opened(prompt_text, think_open, think_close) else "text"
        self.at_start = True  # llama3_json: a call is output that starts with "{"
        self.scanner: JsonScanner | None = None
        if self.mode == "reasoning":
            self.out.lstrip = True

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        while self._step():
            pass
        return self.out.take()

    def finish(self) -> list[Piece]:
        self.final = True  # nothing more comes: a marker that could have grown into a longer one is that marker
        while self._step():
            pass
        if self.mode == "call":
            self.out.raw(self.opener_seen + self.buf)
        else:
            kind = Reasoning if self.mode == "reasoning" else Content
            self.out.text(kind, self.buf)
            if self.out.pending and kind is Content:
                self.out.add(Content(self.out.pending))
        self.buf, self.out.pending = "", ""
        return self.out.take()

    def _step(self) -> bool:
        """Move on as far as the buffer allows; True when the mode changed (step again)."""
        if self.mode == "call":
            return self._call()
        if self.mode == "after_call":  # llama3_json: "; " joins parallel calls
            head = self.buf.lstrip()
            if not head:
                return False
            self.mode, self.buf = "text", head
            if head.startswith(";"):
                self._enter_call(";", head[1:])
            return True
        if self.family == "llama3_json" and self.at_start and self.mode == "text":
            head = self.buf.lstrip()
            if not head:
                return False
            self.at_start = False
            if head.startswith("{"):
                self._enter_call("", head)
                return True
        return self._region(Reasoning if self.mode == "reasoning" else Content)

    def _region(self, kind: type[Content] | type[Reasoning]) -> bool:
        markers, actions = self.markers[self.mode], self.actions[self.mode]
        match = markers.find(self.buf, self.final)
        if match is None:
            keep = markers.held(self.buf)
            self.out.text(kind, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        self.out.text(kind, self.buf[: match.start()])
        rest, action = self.buf[match.end() :], actions[match.group()]
        self.at_start = False
        if action == "drop":
            self.buf = rest
            return True
        self.out.boundary()
        if action == "call":
            self._enter_call(match.group(), rest)
        else:
            self.buf = rest
            self.mode = action if action != "cut" else self.mode
        return True

    def _enter_call(self, opener: str, rest: str) -> None:
        self.mode, self.buf, self.opener_seen, self.scanner = "call", rest, opener, None

    def _call(self) -> bool:
        """The call region: returns True once it ended (a call, or raw text), False while it is open."""
        if self.closer:
            match = self.closer_markers.find(self.buf)
            if match is None:
                return False
            body, self.buf = self.buf[: match.start()], self.buf[match.end() :]
            self._emit_call(self._tagged_call(body), self.opener_seen + body + match.group())
            return True
        return self._json_call()

    def _tagged_call(self, body: str) -> list[Call] | None:
        if self.family == "hermes":
            call = call_from_object(json_value(body.strip()), self.names)
        else:
            call = gemma_call(body, self.quote, self.names)
        return [call] if call else None

    def _json_call(self) -> bool:
        """mistral ([TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}) and llama3_json ({...}; {...})."""
        head = self.buf.lstrip()
        if not head:
            return False
        name = ""
        if self.family == "mistral" and not head.startswith("["):
            args_at = head.find("[ARGS]")
            if args_at < 0:
                if len(head) > 128 or "\n" in head:  # far past any name and call id: not a call
                    return self._not_a_call()
                return False
            name = head[:args_at].split("[CALL_ID]")[0].strip()
            head = head[args_at + len("[ARGS]") :].lstrip()
            if not head:
                return False
        if not head.startswith(("{", "[")):
            return self._not_a_call()
        start = len(self.buf) - len(head)
        self.scanner = self.scanner or JsonScanner()
        end = self.scanner.end(head)
        if end is None:
            return False
        written, self.buf = self.buf[: start + end], self.buf[start + end :]
        self._emit_call(self._json_calls(name, head[:end]), self.opener_seen + written)
        return True

    def _json_calls(self, name: str, body: str) -> list[Call] | None:
        if name:
            call = call_from_arguments(name, body, self.names)
            return [call] if call else None
        value = json_value(body)
        items = value if isinstance(value, list) and value else [value]
        calls = [call_from_object(item, self.names) for item in items]
        return calls if all(calls) else None  # type: ignore[return-value]

    def _emit_call(self, calls: list[Call] | None, written: str) -> None:
        if calls is None:
            self.out.raw(written)
        else:
            self.out.boundary()
            for call in calls:
                self.out.call(call)
        self.mode, self.scanner = "after_call" if self.family == "llama3_json" else "text", None

    def _not_a_call(self) -> bool:
        self.out.raw(self.opener_seen + self.buf)
        self.mode, self.buf, self.scanner = "text", "", None
        return True


def _opened(prompt_text: str, opener: str | None, closer: str | None) -> bool:
    """Whether the prompt ends inside an open reasoning block (the template opened it)."""
    if not opener or not closer or not prompt_text:
        return False
    return prompt_text.rfind(opener) > prompt_text.rfind(closer)


class _HarmonyParser:
    """gpt-oss: messages of a header (role, channel, recipient) and a body, joined by special tokens.

    `<|channel|>analysis<|message|>...<|end|>` is reasoning, `<|channel|>final<|message|>...` content,
    and `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` a call
    (the recipient may also stand before the channel, as the template writes history).
    """

    ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|channel|>")

    def __init__(self, fmt: OutputFormat, tools: list[Tool], prompt_text: str):
        self.names = {t.name for t in tools} if fmt.tools == "harmony" else set()
        markup = MARKERS["harmony"]
        self.drops = _special_drops(fmt, markup) | {"<|message|>", "<|constrain|>"}
        self.body_markers = _markers(frozenset({*self.ENDS, *self.drops}))
        self.out = _Output()
        self.buf, self.mode, self.header_seen, self.final = "", "header", False, False
        self.mode_kind: type[Content] | type[Reasoning] = Content
        self.call_name: str | None = None
        tail = prompt_text[prompt_text.rfind("<|start|>") :] if "<|start|>" in prompt_text else ""
        if "<|message|>" in tail and not any(end in tail.split("<|message|>")[-1] for end in self.ENDS):
            self._open(tail[: tail.rfind("<|message|>")])

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        while self._step():
            pass
        return self.out.take()

    def finish(self) -> list[Piece]:
        self.final = True
        while self._step():
            pass
        if self.mode == "header":
            if self.buf.strip() and not self.header_seen and "<|" not in self.buf:
                self.out.add(Content(self.buf))  # plain text, never in harmony form
        elif self.mode == "call":
            self._close_call(self.buf)  # <|call|> is an end-of-sequence token: output may stop before it
        else:
            self.out.text(self.mode_kind, self.buf)
            if self.out.pending and self.mode_kind is Content:
                self.out.add(Content(self.out.pending))
        self.buf, self.out.pending = "", ""
        return self.out.take()

    def _step(self) -> bool:
        if self.mode == "header":
            at = self.buf.find("<|message|>")
            if at < 0:
                if len(self.buf) > _HEADER_LIMIT and not self.header_seen and "<|" not in self.buf:
                    self.mode, self.mode_kind = "body", Content  # not harmony at all: plain text
                    return True
                return False
            self._open(self.buf[:at])
            self.buf = self.buf[at + len("<|message|>") :]
            return True
        match = self.body_markers.find(self.buf, self.final)
        if match is None:
            if self.mode == "body":
                keep = self.body_markers.held(self.buf)
                self.out.text(self.mode_kind, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
            return False
        body, marker = self.buf[: match.start()], match.group()
        self.buf = self.buf[match.end() :]
        if marker in self.drops:
            if self.mode == "body":
                self.out.text(self.mode_kind, body)
            elif self.mode == "call":
                self.buf = body + self.buf  # a stray token inside the arguments: keep reading them
            return True
        if self.mode == "call":
            self._close_call(body)
        elif self.mode == "body":
            self.out.text(self.mode_kind, body)
        self.out.boundary()
        self.mode, self.header_seen = "header", True
        if marker == "<|channel|>":
            self.buf = marker + self.buf
        return True

    def _open(self, header: str) -> None:
        """Start the body that `header` announces."""
        self.header_seen = True
        self.out.boundary()
        channel = re.search(r"<\|channel\|>\s*([A-Za-z_]+)", header)
        recipient = re.search(r"\bto=([^\s<]+)", header)
        if recipient and recipient.group(1).startswith("functions.") and self.names:
            self.mode, self.call_name = "call", recipient.group(1)[len("functions.") :]
        elif channel and channel.group(1) == "analysis" and not recipient:
            self.mode, self.mode_kind = "body", Reasoning
        else:
            self.mode, self.mode_kind = "body", Content

    def _close_call(self, body: str) -> None:
        call = call_from_arguments(self.call_name or "", body.strip(), self.names)
        if call:
            self.out.boundary()
            self.out.call(call)
        else:
            self.out.raw(body)
