"""The request's `tools` and `tool_choice`, checked and bounded (OpenAI's chat completions API).

Every refusal is a ToolCallError whose `param` names the request field, so the
server can answer a 400 that points at it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import GrammarError, ToolCallError
from ..grammar import check_schema
from ..untrusted import shown

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MODES = ("auto", "none", "required")


def refuse(message: str, param: str, error: type[ToolCallError | GrammarError] = ToolCallError) -> Exception:
    """`error(message)` with `param` set to the request field at fault (the server's 400 names it)."""
    exc = error(message)
    exc.param = param  # type: ignore[attr-defined]
    return exc


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})  # a JSON schema object


@dataclass(frozen=True)
class ToolChoice:
    """`tool_choice`: "auto", "none", "required", or "named" with the function's `name`."""

    mode: str
    name: str | None = None


def check_tools(tools: object) -> list[Tool]:
    """The OpenAI `tools` list as Tools: `[{"type": "function", "function": {name, description?, parameters?}}]`.

    Example:
        >>> check_tools([{"type": "function", "function": {"name": "get_weather"}}])
        [Tool(name='get_weather', description='', parameters={'type': 'object'})]
    """
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise refuse(f"tools must be a list of at most {MAX_TOOLS} function tools, got {shown(tools)}", "tools")
    checked = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    seen: set[str] = set()
    for i, tool in enumerate(checked):
        if tool.name in seen:
            raise refuse(
                f"tools[{i}]: the name {tool.name!r} is used twice; names must be unique", f"tools[{i}].function.name"
            )
        seen.add(tool.name)
    return checked


def _tool(tool: Any, where: str) -> Tool:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise refuse(f'{where} must be {{"type": "function", "function": {{...}}}}, got {shown(tool)}', f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise refuse(f"{where}.function must be an object with a name, got {shown(function)}", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise refuse(
            f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-', got {shown(name)}",
            f"{where}.function.name",
        )
    description = function.get("description")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise refuse(
            f"{where}.function.description must be a string, got {shown(description)}", f"{where}.function.description"
        )
    return Tool(name, description, _parameters(function.get("parameters"), f"{where}.function.parameters"))


def _parameters(schema: Any, where: str) -> dict[str, Any]:
    if schema is None or schema == {}:
        return {"type": "object"}
    if not isinstance(schema, dict):
        raise refuse(f"{where} must be a JSON schema object, got {shown(schema)}", where)
    try:
        check_schema(schema, where)
    except GrammarError as e:
        raise refuse(str(e), where) from None
    kind = schema.get("type", "object")
    if kind != "object":
        raise refuse(f'{where} must describe an object ("type": "object"), got type {shown(kind)}', f"{where}.type")
    return {**schema, "type": "object"}


def check_tool_choice(choice: object, tools: list[Tool]) -> ToolChoice:
    """`tool_choice` against the checked tools: None means "auto" (or "none" when there are no tools).

    Example:
        >>> check_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
        ToolChoice(mode='named', name='get_weather')
    """
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in MODES:
            raise refuse(
                f"tool_choice must be one of {', '.join(MODES)} or a named function, got {shown(choice)}", "tool_choice"
            )
        if choice == "required" and not tools:
            raise refuse('tool_choice "required" needs a non-empty tools list', "tool_choice")
        return ToolChoice(choice)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise refuse(
            f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": {{"name": ...}}}}, '
            f"got {shown(choice)}",
            "tool_choice",
        )
    if name not in {tool.name for tool in tools}:
        known = ", ".join(tool.name for tool in tools[:10]) or "none"
        raise refuse(
            f"tool_choice names the function {shown(name)}, which is not in tools (tools: {known})", "tool_choice"
        )
    return ToolChoice("named", name)


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as chat templates read them: OpenAI's form, as transformers passes it through."""
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools
    ]
