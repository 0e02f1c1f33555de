"""Chat messages in (OpenAI's form), messages out in the form Hugging Face chat templates read.

Roles system, developer, user, assistant and tool. Content is a string or a list
of text parts (joined) and image parts (kept as parts); an assistant message with
`tool_calls` may have none.
Tool-call arguments arrive as JSON text and leave as dicts, as templates expect.
"""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any

from ..untrusted import shown
from .formats import OutputFormat
from .tools import refuse

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_TOOL_CALLS = 128  # per assistant message; as many as a request may define tools
MAX_ARGUMENT_DEPTH = 64  # as deep as a request body may nest


def check_messages(messages: object) -> list[dict[str, Any]]:
    """The messages, checked, with text parts joined and tool-call arguments parsed to dicts.

    Example:
        >>> check_messages([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
        [{'role': 'user', 'content': 'Hi'}]
    """
    if not isinstance(messages, list) or not messages:
        raise refuse("messages must be a non-empty list of {role, content} objects", "messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str) or role not in ROLES:  # a list or object role is not hashable: check first
        raise refuse(f"{where} needs a role among {sorted(ROLES)}", f"{where}.role")
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls is not None and calls != []:
        out = {"role": role, "content": _content(message.get("content"), where, optional=True)}
        out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        return _extras(message, out)
    out = {"role": role, "content": _content(message.get("content"), where)}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise refuse(
                f"{where} (role tool) needs tool_call_id, the id of the call it answers", f"{where}.tool_call_id"
            )
        out["tool_call_id"] = call_id
    return _extras(message, out)


def _extras(message: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Optional fields some templates read: a tool's (or speaker's) name, an earlier turn's reasoning.

    Client text like the rest: the tokenizer escapes its special-token text when it renders the chat."""
    for key in ("name", "reasoning_content"):
        if isinstance(message.get(key), str) and message[key]:
            out[key] = message[key]
    return out


def _content(content: Any, where: str, optional: bool = False) -> str | list[dict[str, Any]]:
    """Text, or (where images are among the parts) the parts as {"type": "text", "text"} and {"type": "image",
    "image": its source}, which the server reads with the model's image processor."""
    if isinstance(content, str):
        return content
    if content is None and optional:
        return ""  # templates concatenate and search content: an empty string renders where None fails
    if isinstance(content, list):
        parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    raise refuse(f"{where}.content must be a string or a list of text and image parts", f"{where}.content")


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    source = image_source(part) if kind in IMAGE_PARTS else None
    if isinstance(source, str) and source:
        return {"type": "image", "image": source}
    raise refuse(
        f'{where} must be {{"type": "text", "text"}} or {{"type": "image_url", "image_url": {{"url"}}}}', where
    )


IMAGE_PARTS = frozenset({"image", "image_url", "input_image"})  # ours and Hugging Face's, OpenAI's, Responses'


def image_source(part: dict[str, Any]) -> Any:
    """Where an image part's picture is: OpenAI's image_url (a string or {"url"}), Hugging Face's image, url or
    path; None if it names none."""
    if part.get("type") not in IMAGE_PARTS:
        return None
    found = next((part[k] for k in ("image_url", "image", "url", "path") if part.get(k) is not None), None)
    return found.get("url") if isinstance(found, dict) else found


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise refuse(f"{where} must be a list of at most {MAX_TOOL_CALLS} tool calls, got {shown(calls)}", where)
    return [_tool_call(call, f"{where}[{j}]") for j, call in enumerate(calls)]


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise refuse(f'{where} must be {{"id", "type": "function", "function": {{name, arguments}}}}', where)
    call_id, function = call.get("id"), call.get("function")
    if not isinstance(call_id, str) or not call_id:
        raise refuse(f"{where}.id must be a non-empty string (the id tool messages answer)", f"{where}.id")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise refuse(f"{where}.function must be an object with a name and arguments", f"{where}.function")
    arguments = _arguments(function.get("arguments"), f"{where}.function.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments(arguments: Any, where: str) -> dict[str, Any]:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
            raise refuse(
                f"{where} must be a JSON object as text; it does not parse ({type(e).__name__})", where
            ) from None
    if not isinstance(arguments, dict):
        raise refuse(f"{where} must be a JSON object (as text), got {shown(arguments)}", where)
    if _depth(arguments) > MAX_ARGUMENT_DEPTH:  # rendering walks them recursively
        raise refuse(f"{where} nests deeper than {MAX_ARGUMENT_DEPTH} levels", where)
    return arguments


def _depth(value: Any) -> int:
    """How deep lists and objects nest in `value`, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_ARGUMENT_DEPTH:
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def template_messages(messages: list[dict[str, Any]], fmt: OutputFormat) -> list[dict[str, Any]]:
    """Checked messages adapted to what this model's template insists on; call before rendering.

    Mistral's templates refuse tool-call ids that are not 9 letters or digits, but
    OpenAI clients send back ids like "call_..."; each becomes a stable 9-character
    id, the same in the assistant's call and in the tool message answering it.
    """
    if fmt.tools != "mistral":
        return messages
    out = []
    for message in messages:
        message = dict(message)
        if "tool_calls" in message:
            message["tool_calls"] = [{**c, "id": _nine(c["id"])} for c in message["tool_calls"]]
        if "tool_call_id" in message:
            message["tool_call_id"] = _nine(message["tool_call_id"])
        out.append(message)
    return out


_ALNUM = string.ascii_letters + string.digits


def _nine(call_id: str) -> str:
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(number // 62**k) % 62] for k in range(9))
