"""A Responses API request (POST /v1/responses) as the OpenAI chat body schema.parse_chat checks.

Input items become chat messages (function calls and their outputs included), function tools become chat
tools, `text.format` becomes `response_format`, `previous_response_id` puts the stored conversation first.
So every check, template, grammar and cache rule of the chat route holds here too.
Follows https://platform.openai.com/docs/api-reference/responses/create
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...defaults import SAMPLING_FIELDS
from ...untrusted import shown
from ..errors import APIError
from ..response_store import ResponseStore

MAX_ITEMS = 100_000  # input items, and content parts per item
MAX_METADATA = 16  # OpenAI's limits on metadata: keys, key length, value length
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
# Refused unless left at their default: each asks for something this server does not do.
REFUSED = {
    "background": "background responses are not supported; leave background out",
    "conversation": "conversations are not stored here; use previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported; leave it out",
    "top_logprobs": "logprobs are not supported; leave top_logprobs out",
}


@dataclass
class Turn:
    """One request as read: the chat body, the conversation it continues plus its input (kept with the answer
    when `store`), and the fields a response object repeats back."""

    chat: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    echo: dict[str, Any] = field(default_factory=dict)
    store: bool = True


def read_turn(body: dict[str, Any], store: ResponseStore) -> Turn:
    """`body` checked and turned into a chat body (run on a preparing thread: the store is locked inside)."""
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, 0):
            raise APIError(400, why, name)
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(
            400, 'truncation must be "disabled": a prompt past the context is refused, not cut', "truncation"
        )
    store_it = _flag(body, "store", True)
    previous = _previous(body.get("previous_response_id"), store)
    history = previous + _input(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, f"instructions must be a string, got {shown(instructions)}", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": system + history,
        "max_tokens": body.get("max_output_tokens"),
        "stream": body.get("stream"),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        **{name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None},  # top_k and on: ours
        "reasoning_effort": _effort(body.get("reasoning")),
        **_tools(body.get("tools")),
        **_tool_choice(body.get("tool_choice")),
        **_text_format(body.get("text")),
    }
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": _metadata(body.get("metadata")),
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") if isinstance(body.get("reasoning"), dict) else None,
        "store": store_it,
        "text": body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "truncation": "disabled",
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
    }
    return Turn(chat, history, echo, store_it)


def _previous(response_id: Any, store: ResponseStore) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    if not isinstance(response_id, str):
        raise APIError(400, f"previous_response_id must be a string, got {shown(response_id)}", "previous_response_id")
    stored = store.get(response_id)
    if stored is None:
        raise APIError(
            400,
            f"previous response {shown(response_id)} not found: it was never stored (store: false), or this server "
            f"restarted or let it go to keep within {store.max_responses} responses",
            "previous_response_id",
        )
    return list(stored.messages)


def _input(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items or len(items) > MAX_ITEMS:
        raise APIError(400, f"input must be a string or a non-empty list of at most {MAX_ITEMS} items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))
        elif kind != "reasoning":  # an earlier answer's reasoning: chat templates leave it out too
            raise APIError(
                400,
                f"{where} is {shown(kind)}: input items here are messages, function_call and function_call_output "
                "(send an item itself rather than an item_reference)",
                where,
            )
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(400, f"{where}.role must be user, assistant, system or developer, got {shown(role)}", where)
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or len(content) > MAX_ITEMS:
        raise APIError(400, f"{where}.content must be a string or a list of content parts", f"{where}.content")
    return {"role": role, "content": [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]}


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get(TEXT_PARTS[kind]), str):
        return {"type": "text", "text": part[TEXT_PARTS[kind]]}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    if kind == "input_image":
        raise APIError(
            400, f"{where}: an input_image needs image_url (a data: URL); file ids are not stored here", where
        )
    raise APIError(400, f"{where} must be an input_text or input_image part, got {shown(kind)}", where)


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A function_call item joins the assistant turn just before it (calls made together are one turn)."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name and isinstance(arguments, str)):
        raise APIError(400, f'{where} must be {{"type": "function_call", "call_id", "name", "arguments"}}', where)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and isinstance(last.get("content"), (str, type(None))):
        messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", []), call]}  # a stored turn is never changed
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise APIError(400, f"{where}.call_id must be the call_id of the function_call it answers", where)
    if isinstance(output, list):  # text parts joined; the tool's images would need a model turn of their own
        parts = [_part(part, f"{where}.output[{j}]") for j, part in enumerate(output[:MAX_ITEMS])]
        if any(part["type"] != "text" for part in parts):
            raise APIError(400, f"{where}.output: only text is read from a function's output", where)
        output = "".join(part["text"] for part in parts)
    if not isinstance(output, str):
        raise APIError(400, f"{where}.output must be a string or a list of input_text parts", where)
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _tools(tools: Any) -> dict[str, Any]:
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(
                400, f"tools[{i}] is {shown(kind)}: only function tools {{type, name, parameters}} run here", "tools"
            )
        function = {key: tool.get(key) for key in ("name", "description", "parameters", "strict")}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return {"tools": out}


def _tool_choice(choice: Any) -> dict[str, Any]:
    if choice is None or isinstance(choice, str):
        return {} if choice is None else {"tool_choice": choice}
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"tool_choice": {"type": "function", "function": {"name": choice.get("name")}}}
    raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name"}', "tool_choice")


def _text_format(text: Any) -> dict[str, Any]:
    """`text.format` as response_format; `text.verbosity` is a hint for OpenAI's own models, left unused."""
    if text is None:
        return {}
    spec = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or spec is None:
        return {} if isinstance(text, dict) else _bad_text(text)
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("text", "json_object"):
        return {"response_format": {"type": kind}}
    if kind == "json_schema":
        fields = {key: spec.get(key) for key in ("name", "schema", "strict", "description")}
        return {"response_format": {"type": kind, "json_schema": {k: v for k, v in fields.items() if v is not None}}}
    return _bad_text(spec)


def _bad_text(value: Any) -> dict[str, Any]:
    raise APIError(
        400, f'text.format must be {{"type": "text", "json_object" or "json_schema"}}, got {shown(value)}', "text"
    )


def _effort(reasoning: Any) -> Any:
    """`reasoning.effort` as the chat body's reasoning_effort (checked there); `reasoning.summary` is not made."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise APIError(400, f'reasoning must be an object {{"effort": ...}}, got {shown(reasoning)}', "reasoning")
    return reasoning.get("effort")


def _metadata(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    ok = isinstance(metadata, dict) and len(metadata) <= MAX_METADATA
    ok = ok and all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY for k in metadata)
    if not ok or not all(isinstance(v, str) and len(v) <= MAX_METADATA_VALUE for v in metadata.values()):
        raise APIError(
            400,
            f"metadata must be at most {MAX_METADATA} string pairs (keys up to {MAX_METADATA_KEY} characters, values"
            f" up to {MAX_METADATA_VALUE})",
            "metadata",
        )
    return dict(metadata)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {shown(value)}", name)
    return value
