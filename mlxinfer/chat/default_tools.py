"""Tools for a model whose chat template has no tool syntax (SmolLM2's, say): one documented default format.

The calls are Hermes' markup, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which the parser and the
forced-call grammar already read, so `tool_choice` "required" or a named function holds by the grammar alone and
"auto" parses the same way. Such a template renders neither tools nor calls nor results, so they become text: the
system turn lists the tools (as JSON) and says how to call them; an earlier call stays in the assistant's content as
the same markup; a tool's result comes back as a user turn inside <tool_response>. (LM Studio gives such models a
default format too; vLLM satisfies a named choice with the grammar alone.)
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from .formats import OutputFormat
from .tools import Tool, template_tools

DEFAULT_TOOLS = "hermes"
INSTRUCTIONS = (
    "You can call functions. To call one, answer with only this line, once per call:\n"
    '<tool_call>{"name": "FUNCTION NAME", "arguments": {ITS ARGUMENTS AS JSON}}</tool_call>\n'
    "A call's result comes back in <tool_response>. The functions:\n"
)


def with_default_tools(fmt: OutputFormat) -> OutputFormat:
    """`fmt` with the default call syntax where its template has none (its reasoning markup kept)."""
    return fmt if fmt.tools is not None else replace(fmt, tools=DEFAULT_TOOLS)


def default_tool_messages(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """Checked `messages` as a template without tool syntax can render them: the tools told in the system turn
    (where there are any), calls as markup in the assistant's content, results as user turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("tool_calls"):
            calls = "".join(_call_text(call["function"]) for call in message["tool_calls"])
            text = message.get("content") if isinstance(message.get("content"), str) else ""
            out.append({"role": "assistant", "content": text + calls})
        elif message["role"] == "tool":
            result = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # a turn's results together: templates alternate the roles
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append(message)
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if not tools:
        return out
    listed = INSTRUCTIONS + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in template_tools(tools))
    if out and out[0]["role"] == "system" and isinstance(out[0].get("content"), str):
        return [{**out[0], "content": f"{out[0]['content']}\n\n{listed}"}, *out[1:]]
    return [{"role": "system", "content": listed}, *out]


def _call_text(function: dict[str, Any]) -> str:
    body = {"name": function["name"], "arguments": function.get("arguments") or {}}
    return f"<tool_call>{json.dumps(body, ensure_ascii=False)}</tool_call>"
