"""The model's output, streamed, split into content, reasoning and tool calls.

Text is released only once it cannot turn out to be markup: a possible start of a
marker at the end of what arrived is held back until the next piece decides it.
Whitespace that only separates markup (before a tool call, after </think>) is
dropped; output without markup comes back exactly. A tool call that never closes or
does not parse comes back as content, never lost.

The parser runs on the server's event loop, so a feed costs the length of its text
plus a bounded look-back (a held marker start), never a rescan of what came before:
a long argument is kept as a list of pieces and searched only where it grew. Every
decision depends on the text alone, never on how it was cut into pieces.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby

from .formats import CALLS, HARMONY, REASONING, Markup, OutputFormat, markup
from .syntax import Call, JsonScanner, call_from_arguments, call_from_object, gemma_call, json_value, mistral_head
from .tools import Tool


@dataclass(frozen=True)
class _Text:
    text: str


class Content(_Text):
    """Text of the answer (`content`)."""


class Reasoning(_Text):
    """Text of the reasoning before the answer (`reasoning_content`)."""


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object as text


Piece = Content | Reasoning | ToolCall
TextKind = type[Content] | type[Reasoning]

_HEADER_LIMIT = 256  # a harmony header (role, channel, recipient) is far shorter
_CALL_STARTS = {"hermes": ("{",), "gemma4": ("call:",), "function_gemma": ("call:",)}  # a tagged call's body


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
    """The pieces of one feed, with the whitespace rules of the module docstring."""

    def __init__(self, parallel: bool) -> None:
        self.pieces: list[Piece] = []
        self.lstrip = False  # drop whitespace that starts the next text (it follows markup)
        # Whitespace that ends the text so far, kept only if more text follows. A list: a long run of
        # whitespace arriving a few characters at a time is joined once, not once per piece.
        self.pending: list[str] = []
        self.pending_kind: TextKind = Content
        self.dropped = ""  # the whitespace the last markup dropped: a call that turns out not to be one gets it back
        self.calls = 0
        self.parallel = parallel

    def text(self, kind: TextKind, text: str) -> None:
        if self.lstrip:
            text = text.lstrip()
            self.lstrip = not text
        body = text.rstrip()
        if body:
            self.pieces.append(kind("".join(self.pending) + body))
            self.pending = []
        if len(body) < len(text):
            self.pending.append(text[len(body) :])
            self.pending_kind = kind

    def call(self, call: Call) -> None:
        # parallel_tool_calls false: OpenAI returns at most one call, so the calls the model wrote after the
        # first are dropped, markup and all (they are not content either).
        if self.parallel or not self.calls:
            self.pieces.append(ToolCall(self.calls, new_call_id(), *call))
        self.calls += 1

    def raw(self, text: str) -> None:
        """Markup that turned out not to be a call: content, as written (with the whitespace before it)."""
        self.lstrip = False
        self.text(Content, self.dropped + text)
        self.dropped = ""

    def boundary(self) -> None:
        """Markup: the whitespace around it is not content."""
        self.dropped, self.pending, self.lstrip = "".join(self.pending), [], True

    def end(self) -> None:
        """The output ended: whitespace that ended the content is content after all (reasoning's is trimmed)."""
        if self.pending and self.pending_kind is Content:
            self.pieces.append(Content("".join(self.pending)))
        self.pending = []

    def take(self) -> list[Piece]:
        """The pieces so far, adjacent text of one kind joined (here, once: joining as they come is quadratic)."""
        pieces, self.pieces = self.pieces, []
        joined: list[Piece] = []
        for kind, group in groupby(pieces, key=type):
            if kind is ToolCall:
                joined += group
            else:
                joined.append(kind("".join(p.text for p in group)))  # type: ignore[union-attr]
        return joined


class OutputParser:
    """Splits streamed output into Content, Reasoning and ToolCall pieces.

    `parallel` is the request's parallel_tool_calls: when False, only the model's first call is returned.

    Example:
        >>> parser = OutputParser(fmt, tools, prompt_text=prompt)
        >>> pieces = [p for chunk in chunks for p in parser.feed(chunk)] + parser.finish()
    """

    def __init__(self, fmt: OutputFormat, tools: list[Tool], prompt_text: str = "", parallel: bool = True):
        harmony = fmt.tools == "harmony" or fmt.reasoning == "harmony"
        kind = _HarmonyParser if harmony else _TaggedParser
        self._impl: _Stream = kind(fmt, tools, prompt_text, parallel)

    def feed(self, text: str) -> list[Piece]:
        return self._impl.feed(text)

    def finish(self) -> list[Piece]:
        return self._impl.finish()


class _Stream:
    """What the parsers share: text collects in `buf`, and `_step` moves on, mode by mode, until it must wait."""

    def __init__(self, parallel: bool) -> None:
        self.out = _Output(parallel)
        self.buf, self.final = "", False

    def feed(self, text: str) -> list[Piece]:
        self.buf += text  # short: each step leaves at most a possible marker start (or a bounded header)
        while self._step():
            pass
        return self.out.take()

    def finish(self) -> list[Piece]:
        self.final = True  # nothing more comes: a marker that could have grown into a longer one is that marker
        while self._step():
            pass
        self._close()
        self.buf = ""
        self.out.end()
        return self.out.take()

    def _step(self) -> bool:
        """Move on as far as the buffer allows; True when the mode changed (step again)."""
        raise NotImplementedError

    def _close(self) -> None:
        """The output ended: release what the mode still holds."""
        raise NotImplementedError

    def _scan(self, markers: _Markers, sink: Callable[[str], None]) -> str | None:
        """The first marker in the buffer, taken off it with the text before it, which goes to `sink`.

        None while there is none yet: then all but a possible start of one goes to `sink`, so that the
        next feed searches only its own text and that start.
        """
        match = markers.find(self.buf, self.final)
        if match is None:
            cut = len(self.buf) - (0 if self.final else markers.held(self.buf))
            sink(self.buf[:cut])
            self.buf = self.buf[cut:]
            return None
        sink(self.buf[: match.start()])
        self.buf = self.buf[match.end() :]
        return match.group()


def _special_drops(fmt: OutputFormat, markup: Iterable[str]) -> set[str]:
    """Special tokens that are not this family's markup: end-of-turn tokens and the like, never content."""
    return set(fmt.special_tokens) - set(markup) if fmt.keep_special_tokens else set()


def _actions(fmt: OutputFormat, calls: Markup | None, thinking: Markup | None) -> dict[str, dict[str, str]]:
    """What each marker does, by mode: "drop", removed; "cut", removed, and no text joins across it;
    "call", "reasoning" or "text", removed, and the mode changes to that."""
    family = calls.markers if calls else frozenset()
    reasoning = thinking.markers if thinking else frozenset()
    drops = dict.fromkeys(_special_drops(fmt, family | reasoning | markup(fmt)), "drop")
    in_text = {**drops, **dict.fromkeys(family | reasoning, "cut")}
    in_reasoning = {**drops, **dict.fromkeys(reasoning, "cut")}
    if thinking and thinking.closer:
        in_text[thinking.opener] = "reasoning"
        in_reasoning[thinking.closer] = "text"
    if calls:
        in_text[calls.opener] = "call"
    return {"text": in_text, "reasoning": in_reasoning}


class _TaggedParser(_Stream):
    """Families whose calls and reasoning sit between markers: hermes, llama3_json, mistral, gemma, <think>.

    Modes: "text" and "reasoning"; "start" (llama3_json: a call may open the output without a marker);
    "call" (up to the closer: hermes, gemma); "head" (mistral v11's NAME[ARGS]); "json" (a call its
    JSON ends: mistral, llama3_json); "after_call" (llama3_json's "; " between calls).
    """

    def __init__(self, fmt: OutputFormat, tools: list[Tool], prompt_text: str, parallel: bool):
        super().__init__(parallel)
        self.names = {t.name for t in tools}
        self.family = (fmt.dialect if fmt.tools == "gemma" else fmt.tools) if fmt.tools and tools else None
        self.syntax = CALLS.get(self.family or "")
        self.dialect = fmt.dialect
        thinking = REASONING.get(fmt.reasoning or "")
        self.actions = _actions(fmt, self.syntax, thinking)
        self.markers = {mode: _markers(frozenset(actions)) for mode, actions in self.actions.items()}
        closer = self.syntax.closer if self.syntax else None
        self.closer = _markers(frozenset({closer} if closer else ()))
        # The open call: its opener, mistral v11's NAME[ARGS] and name, and the text after them, kept as
        # pieces (it may grow long); `started`, once its first characters showed it can be a call.
        self.opener, self.head, self.name, self.started = "", "", "", False
        self.call: list[str] = []
        self.scanner = JsonScanner()
        self.mode = "start" if self.family == "llama3_json" else "text"
        if thinking and _opened(prompt_text, thinking):
            self.mode, self.out.lstrip = "reasoning", True

    def _step(self) -> bool:
        return getattr(self, "_in_" + self.mode)()

    def _close(self) -> None:
        if self.mode in ("call", "head", "json"):  # a call cut short
            self.out.raw(self.opener + self.head + "".join(self.call) + self.buf)

    def _in_text(self) -> bool:
        kind = Reasoning if self.mode == "reasoning" else Content
        marker = self._scan(self.markers[self.mode], lambda text: self.out.text(kind, text))
        if marker is None:
            return False
        action = self.actions[self.mode][marker]
        if action != "drop":
            self.out.boundary()
            if action == "call":
                self._enter_call(marker)
            elif action != "cut":
                self.mode = action
        return True

    _in_reasoning = _in_text

    def _in_start(self) -> bool:
        """llama3_json: output that starts with "{" is a call (the template writes no marker before it)."""
        head = self.buf.lstrip()
        self.out.text(Content, self.buf[: len(self.buf) - len(head)])  # whitespace: held until text follows
        self.buf = head
        if not head:
            return False
        self.mode = "text"
        if head.startswith("{"):
            self.out.boundary()
            self._enter_call("")
        return True

    def _enter_call(self, opener: str) -> None:
        self.opener, self.head, self.name, self.call, self.started = opener, "", "", [], False
        self.scanner = JsonScanner()
        if self.syntax and self.syntax.closer:
            self.mode = "call"
        else:  # the `[` (JSON list) form is Mistral v3's; v11 writes NAME[ARGS]{...}
            self.mode = "head" if self.family == "mistral" and self.dialect != "v3" else "json"

    def _begins(self, starts: tuple[str, ...]) -> bool | None:
        """Whether the call's text, after whitespace, starts with one of `starts`; None while undecided."""
        head = self.buf.lstrip()
        self.call.append(self.buf[: len(self.buf) - len(head)])
        self.buf = head
        if head.startswith(starts):
            return True
        return None if not self.final and any(s.startswith(head) for s in starts) else False

    def _in_call(self) -> bool:
        """hermes and gemma: the call's text up to its closer."""
        if not self.started:
            begins = self._begins(_CALL_STARTS[self.family or ""])
            if not begins:
                return False if begins is None else self._not_a_call()
            self.started = True
        closer = self._scan(self.closer, self.call.append)
        if closer is None:
            return False
        body = "".join(self.call)
        self._emit(self._tagged_calls(body), self.opener + body + closer)
        return True

    def _tagged_calls(self, body: str) -> list[Call] | None:
        if self.family == "hermes":
            call = call_from_object(json_value(body.strip()), self.names)
        else:
            call = gemma_call(body, self.syntax.quote if self.syntax else "", self.names)
        return [call] if call else None

    def _in_head(self) -> bool:
        """Mistral v11: NAME[ARGS] (or NAME[CALL_ID]ID[ARGS]) right after the opener, then the arguments."""
        head = mistral_head(self.buf)  # the buffer stays short: a name and an id are at most 64 characters
        if not isinstance(head, tuple):
            return False if head and not self.final else self._not_a_call()
        self.name, at = head
        self.head, self.buf, self.mode = self.buf[:at], self.buf[at:], "json"
        return True

    def _in_json(self) -> bool:
        """A call its JSON ends: mistral ([TOOL_CALLS][{...}] or NAME[ARGS]{...}), llama3_json ({...}; {...})."""
        if not self.started:
            begins = self._begins(("{",) if self.name else ("[", "{"))
            if not begins:
                return False if begins is None else self._not_a_call()
            self.started = True
        end = self.scanner.end(self.buf)
        if end is None:
            self.call.append(self.buf)
            self.buf = ""
            return False
        self.call.append(self.buf[:end])
        self.buf = self.buf[end:]
        body = "".join(self.call)
        self._emit(self._json_calls(body), self.opener + self.head + body)
        return True

    def _json_calls(self, body: str) -> list[Call] | None:
        if self.name:
            call = call_from_arguments(self.name, body.strip(), self.names)
            return [call] if call else None
        value = json_value(body)
        items = value if isinstance(value, list) and value else [value]
        calls = [call_from_object(item, self.names) for item in items]
        return calls if all(calls) else None  # type: ignore[return-value]

    def _in_after_call(self) -> bool:
        """llama3_json: "; " joins parallel calls. The whitespace after a call is dropped either way."""
        self.buf = self.buf.lstrip()
        if not self.buf:
            return False
        self.mode = "text"
        if self.buf.startswith(";"):
            self.buf = self.buf[1:]
            self._enter_call(";")
        return True

    def _emit(self, calls: list[Call] | None, written: str) -> None:
        """The call region ended: its calls, or (they did not parse) what was written, as content."""
        if calls is None:
            self.out.raw(written)
            self.mode = "text"
            return
        self.out.boundary()
        for call in calls:
            self.out.call(call)
        self.mode = "after_call" if self.family == "llama3_json" else "text"

    def _not_a_call(self) -> bool:
        """What follows the opener cannot start a call: the opener is content, and the text after it is read
        again as text (it may hold a real call). Only a call's first characters are ever read again."""
        self.out.raw(self.opener)
        self.buf = self.head + "".join(self.call) + self.buf
        self.mode, self.head, self.call = "text", "", []
        return True


def _opened(prompt_text: str, thinking: Markup) -> bool:
    """Whether the prompt ends inside an open reasoning block (the template opened it)."""
    if not prompt_text or not thinking.closer:
        return False
    return prompt_text.rfind(thinking.opener) > prompt_text.rfind(thinking.closer)


class _HarmonyParser(_Stream):
    """gpt-oss: messages of a header (role, channel, recipient) and a body, joined by special tokens.

    `<|channel|>analysis<|message|>...<|end|>` is reasoning, `<|channel|>final<|message|>...` content,
    and `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` a call
    (the recipient may also stand before the channel, as the template writes history).
    Modes: "header" (up to <|message|>), "body" (a message's text) and "call" (a call's arguments).
    """

    ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|channel|>")

    def __init__(self, fmt: OutputFormat, tools: list[Tool], prompt_text: str, parallel: bool):
        super().__init__(parallel)
        self.names = {t.name for t in tools} if fmt.tools == "harmony" else set()
        self.drops = _special_drops(fmt, HARMONY) | {"<|message|>", "<|constrain|>"}
        self.markers = _markers(frozenset({*self.ENDS, *self.drops}))
        self.mode, self.kind = "header", Content
        self.after_start = False  # the header follows <|start|>: its first word is a role, not content
        self.call_name = ""
        self.args: list[str] = []  # the open call's arguments, kept as pieces (they may grow long)
        tail = prompt_text[prompt_text.rfind("<|start|>") :] if "<|start|>" in prompt_text else ""
        if "<|message|>" in tail and not any(end in tail.split("<|message|>")[-1] for end in self.ENDS):
            self._open(tail[: tail.rfind("<|message|>")])

    def _step(self) -> bool:
        return getattr(self, "_in_" + self.mode)()

    def _close(self) -> None:
        if self.mode == "call":  # <|call|> is an end-of-sequence token: the output may stop before it
            self._close_call("".join(self.args))
        elif self.mode == "header" and not self.after_start and not any(m in self.buf for m in HARMONY):
            self.out.text(Content, self.buf)  # not a header: text after a message's end, or no harmony at all

    def _in_header(self) -> bool:
        at = self.buf.find("<|message|>", 0, _HEADER_LIMIT + len("<|message|>"))
        if at >= 0:
            self._open(self.buf[:at])
            self.buf = self.buf[at + len("<|message|>") :]
            return True
        if len(self.buf) < _HEADER_LIMIT + len("<|message|>"):
            return False
        # Far longer than any header: content, cut at a fixed length so that the pieces do not depend on
        # how the output arrived. What follows is read as a message's text.
        self.out.text(Content, self.buf[:_HEADER_LIMIT])
        self.buf, self.mode, self.kind = self.buf[_HEADER_LIMIT:], "body", Content
        return True

    def _in_body(self) -> bool:
        marker = self._scan(self.markers, lambda text: self.out.text(self.kind, text))
        if marker is None:
            return False
        if marker not in self.drops:
            self._end_message(marker)
        return True

    def _in_call(self) -> bool:
        marker = self._scan(self.markers, self.args.append)  # a stray token inside the arguments is skipped
        if marker is None:
            return False
        if marker not in self.drops:
            self._close_call("".join(self.args))
            self._end_message(marker)
        return True

    def _open(self, header: str) -> None:
        """Start the body that `header` announces."""
        self.out.boundary()
        channel = re.search(r"<\|channel\|>\s*([A-Za-z_]+)", header)
        recipient = re.search(r"\bto=([^\s<]+)", header)
        if recipient and recipient.group(1).startswith("functions.") and self.names:
            self.mode, self.call_name, self.args = "call", recipient.group(1)[len("functions.") :], []
        else:
            analysis = channel and channel.group(1) == "analysis" and not recipient
            self.mode, self.kind = "body", Reasoning if analysis else Content

    def _end_message(self, marker: str) -> None:
        self.out.boundary()
        self.mode, self.after_start = "header", marker == "<|start|>"
        if marker == "<|channel|>":
            self.buf = marker + self.buf  # it begins the next header

    def _close_call(self, body: str) -> None:
        call = call_from_arguments(self.call_name, body.strip(), self.names)
        if call:
            self.out.boundary()
            self.out.call(call)
        else:
            self.out.raw(body)
