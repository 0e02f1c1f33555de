"""Grammars that force a tool call in the model's own syntax (tool_choice "required" or a named function).

The output is llguidance Lark text: the family's markup (a special token as `<[ID]>`,
other markup as literal text) around each function's parameters schema, so the
arguments always parse. What the client wrote (enum and const values, property keys)
is always literal text, never a special token. JSON arguments are written with the separators the
model's template writes (no free whitespace); Gemma's values get a grammar of their own.
A reasoning block comes first only when the template's generation prompt opened it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import GrammarError
from ..grammar import check_in_child
from .formats import CALLS, REASONING, OutputFormat, call_markup, markup, require_tool_syntax
from .gemma_grammar import GemmaValues
from .tools import Tool, ToolChoice, refuse

# A reasoning block the template opened must close before a forced call: after this many characters
# (about 2k tokens) the grammar allows only its end.
MAX_REASONING_CHARS = 8000
_TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # tojson's
_COMPACT_JSON = {"whitespace_flexible": False}  # harmony's arguments: {"city":"Paris"}
_CALL_ID = r"/[A-Za-z0-9]{9}/"
_QUOTE = '"'
_ID_KEY = ', "id": "'


class _Lark:
    """Lark text for one grammar: the family's markup as special tokens where the tokenizer has them."""

    def __init__(self, tokenizer: Any, markup: frozenset[str]):
        specials = getattr(tokenizer, "special_ids", {}) if tokenizer is not None else {}
        self.ids = {text: i for i, text in specials.items() if text in markup}
        self._split = re.compile("|".join(re.escape(t) for t in sorted(self.ids, key=len, reverse=True)))
        self.rules: list[str] = []
        self.checks: list[tuple[int, str]] = []  # (tool index, a grammar of its schema alone) to compile first

    def lit(self, text: str) -> str:
        """Markup (or text around it) as a sequence: special-token texts as `<[ID]>`, the rest as string literals.

        Only for text this module writes: a string the client wrote goes through `text`."""
        parts, at = [], 0
        for match in self._split.finditer(text) if self.ids else ():
            if match.start() > at:
                parts.append(json.dumps(text[at : match.start()]))
            parts.append(f"<[{self.ids[match.group()]}]>")
            at = match.end()
        if at < len(text):
            parts.append(json.dumps(text[at:]))
        return " ".join(parts)

    @staticmethod
    def text(text: str) -> str:
        """A string the client wrote (an enum value, a property key): literal text, even where it spells
        markup, as it is in the rendered prompt. As a special token it could end the call mid-value."""
        return json.dumps(text)

    def until(self, name: str, close: str, max_chars: int | None = None) -> str:
        """Any text (up to `max_chars`), then `close`: a regex then the token when `close` is one special
        token, else a lazy regex (it ends at the first `close`)."""
        text = "(?s:.*)" if max_chars is None else f"(?s:.{{0,{max_chars}}})"
        if close in self.ids:
            return f"/{text}/ <[{self.ids[close]}]>"
        self.rules.append(f"{name}[lazy]: /{text}{_regex_text(close)}/")
        return name

    def json(self, name: str, schema: dict[str, Any], options: dict[str, Any]) -> str:
        guidance = (
            {**schema.get("x-guidance", {}), **options} if isinstance(schema.get("x-guidance"), dict) else options
        )
        self.rules.append(f"{name}: %json {json.dumps({**schema, 'x-guidance': guidance})}")
        return name


def _regex_text(text: str) -> str:
    return "".join(c if c.isalnum() or c == " " else "\\" + c if c in r"\^$.|?*+()[]{}/-" else c for c in text)


def call_grammar(
    fmt: OutputFormat, tools: list[Tool], choice: ToolChoice, parallel: bool, tokenizer: Any, prompt_text: str = ""
) -> str:
    """Lark text forcing a call in the model's own syntax: to `choice.name`, or to any tool for "required".

    With `parallel`, one or more calls, else exactly one. `prompt_text` (the rendered prompt) tells
    whether the template already opened a reasoning block. Raises ToolCallError for a format with no
    tool syntax or a choice that forces nothing, GrammarError for a parameters schema that cannot be compiled.

    Example:
        >>> grammar = call_grammar(fmt, tools, ToolChoice("named", "get_weather"), False, tokenizer)
    """
    require_tool_syntax(fmt)
    if choice.mode not in ("required", "named"):
        raise refuse(
            f'only tool_choice "required" or a named function forces a call, got {choice.mode!r}', "tool_choice"
        )
    chosen = [(i, t) for i, t in enumerate(tools) if choice.mode == "required" or t.name == choice.name]
    if not chosen:
        raise refuse(f"tool_choice names {choice.name!r}, which is not in tools", "tool_choice")
    lark = _Lark(tokenizer, markup(fmt))
    head, sep, tail = _BUILDERS[fmt.tools or ""](lark, fmt, chosen)
    _check_tools(lark)
    calls = " | ".join(f"call_{i}" for i, _ in chosen)
    body = f"{head} call ({sep} call)* {tail}" if parallel and fmt.tools != "harmony" else f"{head} call {tail}"
    reasoning = _reasoning(lark, fmt, prompt_text)
    rules = [f"start: {reasoning} {body}".replace("  ", " "), f"call: {calls}", *lark.rules]
    return "\n".join(rules) + "\n"


def _check_schema(lark: _Lark, name: str, schema: dict[str, Any], index: int, options: dict[str, Any]) -> str:
    """The schema's %json rule, to be tried alone (`_check_tools`) so that a refusal names the tool."""
    rule = lark.json(name, schema, options)
    lark.checks.append((index, f"start: {rule}\n{lark.rules[-1]}\n"))
    return rule


def _check_tools(lark: _Lark) -> None:
    """Every tool's schema compiled alone, all in one child process (llguidance's native code may crash or run
    away on a hostile schema; see grammar/isolated.py); a GrammarError names the first one refused."""
    verdicts = check_in_child([text for _, text in lark.checks], "tools")
    for (index, _), error in zip(lark.checks, verdicts):
        if error is not None:
            where = f"tools[{index}].function.parameters"
            raise refuse(f"{where} cannot be enforced: {error}", where, GrammarError)


def _hermes(lark: _Lark, fmt: OutputFormat, chosen: list[tuple[int, Tool]]) -> tuple[str, str, str]:
    close = lark.lit("}\n" + (CALLS["hermes"].closer or ""))
    for i, tool in chosen:  # <tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>
        args = _check_schema(lark, f"args_{i}", tool.parameters, i, _TEMPLATE_JSON)
        head = lark.lit(CALLS["hermes"].opener + '\n{"name": "' + tool.name + '", "arguments": ')
        lark.rules.append(f"call_{i}: {head} {args} {close}")
    return "", lark.lit("\n"), ""


def _llama3(lark: _Lark, fmt: OutputFormat, chosen: list[tuple[int, Tool]]) -> tuple[str, str, str]:
    for i, tool in chosen:  # {"name": "NAME", "parameters": {...}}
        args = _check_schema(lark, f"args_{i}", tool.parameters, i, _TEMPLATE_JSON)
        head = lark.lit('{"name": "' + tool.name + '", "parameters": ')
        lark.rules.append(f"call_{i}: {head} {args} {lark.lit('}')}")
    return "", lark.lit("; "), ""


def _mistral(lark: _Lark, fmt: OutputFormat, chosen: list[tuple[int, Tool]]) -> tuple[str, str, str]:
    if fmt.dialect == "v3":  # [TOOL_CALLS][{"name": "NAME", "arguments": {...}}, ...]; history adds "id"
        call_id = f"({lark.lit(_ID_KEY)} {_CALL_ID} {lark.lit(_QUOTE)})?"
        for i, tool in chosen:
            args = _check_schema(lark, f"args_{i}", tool.parameters, i, _TEMPLATE_JSON)
            head = lark.lit('{"name": "' + tool.name + '", "arguments": ')
            lark.rules.append(f"call_{i}: {head} {args} {call_id} {lark.lit('}')}")
        return lark.lit("[TOOL_CALLS]["), lark.lit(", "), lark.lit("]")
    call_id = f"({lark.lit('[CALL_ID]')} {_CALL_ID})?" if fmt.dialect == "v11_call_id" else ""
    for i, tool in chosen:  # [TOOL_CALLS]NAME[ARGS]{...}, one after another
        args = _check_schema(lark, f"args_{i}", tool.parameters, i, _TEMPLATE_JSON)
        lark.rules.append(f"call_{i}: {lark.lit('[TOOL_CALLS]' + tool.name)} {call_id} {lark.lit('[ARGS]')} {args}")
    return "", "", ""


def _harmony(lark: _Lark, fmt: OutputFormat, chosen: list[tuple[int, Tool]]) -> tuple[str, str, str]:
    # <|call|> ends the sequence, so the model makes one call per turn whatever `parallel` says.
    for i, tool in chosen:
        args = _check_schema(lark, f"args_{i}", tool.parameters, i, _COMPACT_JSON)
        head = lark.lit(f"<|channel|>commentary to=functions.{tool.name} <|constrain|>json<|message|>")
        lark.rules.append(f"call_{i}: {head} {args} {lark.lit('<|call|>')}")
    return "", "", ""


def _gemma(lark: _Lark, fmt: OutputFormat, chosen: list[tuple[int, Tool]]) -> tuple[str, str, str]:
    syntax = call_markup(fmt) or CALLS["gemma4"]
    opener, closer = syntax.opener, syntax.closer or ""
    values = GemmaValues(lark, syntax.quote)
    for i, tool in chosen:  # <|tool_call>call:NAME{key:value,...}<tool_call|>, keys sorted as the template sorts
        where = f"tools[{i}].function.parameters"
        try:
            args = values.object(f"g{i}", tool.parameters)
        except ValueError as e:
            raise refuse(f"{where} cannot be enforced in Gemma's call syntax: {e}", where, GrammarError) from None
        lark.rules.append(f"call_{i}: {lark.lit(opener + 'call:' + tool.name)} {args} {lark.lit(closer)}")
    return "", "", ""


_BUILDERS = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral, "harmony": _harmony, "gemma": _gemma}


def _reasoning(lark: _Lark, fmt: OutputFormat, prompt_text: str) -> str:
    """What comes before the call: the rest of a reasoning block the template opened, bounded so that
    the call always comes; none when the prompt did not open one (the call is forced from the start)."""
    if fmt.reasoning not in REASONING:
        return ""
    block = REASONING[fmt.reasoning]
    closer = block.closer or ""
    if fmt.reasoning == "harmony":  # the next message's header follows the analysis message
        opened = prompt_text.rstrip().endswith("<|message|>") and "analysis" in prompt_text[-40:]
        after = lark.lit("<|start|>assistant")
    else:
        opened = prompt_text.rfind(block.opener) > prompt_text.rfind(closer)
        after = "/\\n{0,2}/" if fmt.reasoning == "think" else ""  # Qwen3 writes </think>\n\n
    return f"{lark.until('reason_text', closer, MAX_REASONING_CHARS)} {after}".strip() if opened else ""
