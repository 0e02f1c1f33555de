"""Anthropic's Messages API (/v1/messages) through the official anthropic client; greedy answers must equal
the OpenAI route's (/v1/chat/completions) for the same conversation."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

import mlxinfer
from mlxinfer.engine import SchedulerConfig
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.routes.anthropic import to_openai
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY
from tests.test_structured_server import FAMILIES, TEMPLATES, tiny_with_template

CHAT = "chatml"  # the tiny llama_classic with its ChatML template
TOOLS_MODEL = "llama3_json"  # the same weights with Llama 3.2's template: it writes tool calls
SYSTEM = "You answer in one word."
QUESTION = {"role": "user", "content": "What is the capital of France?"}
# anthropic 2.x's create() has no temperature parameter any more; the API still takes it (default 1).
GREEDY = {"max_tokens": 8, "extra_body": {"temperature": 0}}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}, "dst": {"type": "boolean"}},
    "required": ["zone", "dst"],
    "additionalProperties": False,
}
TOOL = {"name": "get_time", "description": "The time in a time zone.", "input_schema": TIME_SCHEMA}
OPENAI_TOOL = {"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                                "parameters": TIME_SCHEMA}}  # fmt: skip
KEY = "k" * 24


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    models = ModelSet()
    models.add(tiny_llama, SchedulerConfig(), CHAT)
    template = (TEMPLATES / FAMILIES[TOOLS_MODEL]).read_text()
    folder = tmp_path_factory.mktemp("anthropic") / TOOLS_MODEL
    models.add(tiny_with_template(folder, template), SchedulerConfig(), TOOLS_MODEL)
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        yield running
    models.close()  # its schedulers; the shared model stays loaded


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x" * 8, max_retries=0, timeout=120)


def openai_answer(server, messages: list[dict], model: str = CHAT, **extra) -> dict:
    """The OpenAI route's greedy answer: the reference."""
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 8, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def text_of(message) -> str:
    assert all(block.type == "text" for block in message.content), message.content
    return "".join(block.text for block in message.content)


def same_answer(a, b) -> None:
    """Two messages alike but for their ids and how much of the prompt came from the prefix cache."""
    skip = {"id", "usage"}
    assert a.model_dump(exclude=skip) == b.model_dump(exclude=skip)
    assert a.usage.output_tokens == b.usage.output_tokens
    total = [m.usage.input_tokens + m.usage.cache_read_input_tokens for m in (a, b)]
    assert total[0] == total[1]


def test_an_answer_equals_the_openai_routes_streamed_or_not(server, client):
    reference = openai_answer(server, [{"role": "system", "content": SYSTEM}, QUESTION])
    message = client.messages.create(model=CHAT, system=SYSTEM, messages=[QUESTION], **GREEDY)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == CHAT
    assert text_of(message) == reference["choices"][0]["message"]["content"] != ""
    reason = reference["choices"][0]["finish_reason"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reason]
    assert message.stop_sequence is None
    usage = reference["usage"]
    assert message.usage.output_tokens == usage["completion_tokens"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == usage["prompt_tokens"]
    assert message.usage.cache_read_input_tokens > 0  # the OpenAI request left the same prompt in the cache

    with client.messages.stream(model=CHAT, system=SYSTEM, messages=[QUESTION], **GREEDY) as stream:
        same_answer(stream.get_final_message(), message)

    events = list(client.messages.create(model=CHAT, system=SYSTEM, messages=[QUESTION], stream=True, **GREEDY))
    kinds = [event.type for event in events]
    deltas = len(kinds) - 5
    assert deltas >= 1
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens == usage["prompt_tokens"]
    assert events[1].content_block.type == "text" and events[1].content_block.text == ""
    assert "".join(event.delta.text for event in events[2:-3]) == text_of(message)
    assert all(event.index == 0 for event in events[1:-2])
    assert events[-2].delta.stop_reason == message.stop_reason
    assert events[-2].usage.output_tokens == message.usage.output_tokens


def test_a_system_prompt_as_text_blocks_is_the_same_as_a_string(server, client):
    whole = client.messages.create(model=CHAT, system=SYSTEM, messages=[QUESTION], **GREEDY)
    halves = [{"type": "text", "text": SYSTEM[:7]}, {"type": "text", "text": SYSTEM[7:]}]
    blocks = client.messages.create(model=CHAT, system=halves, messages=[QUESTION], **GREEDY)
    same_answer(blocks, whole)
    without = client.messages.create(model=CHAT, messages=[QUESTION], **GREEDY)
    assert without.usage.input_tokens + without.usage.cache_read_input_tokens < (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )  # the system prompt is in the prompt


def test_max_tokens_is_required(client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=CHAT, messages=[QUESTION], max_tokens=anthropic.NOT_GIVEN)
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in refused.value.body["error"]["message"]


def test_max_tokens_reached(server, client):
    reference = openai_answer(server, [QUESTION], max_tokens=3)
    assert reference["choices"][0]["finish_reason"] == "length"  # the tiny model does not end within 3 tokens
    message = client.messages.create(model=CHAT, messages=[QUESTION], **{**GREEDY, "max_tokens": 3})
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 3
    assert text_of(message) == reference["choices"][0]["message"]["content"]


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    free = text_of(client.messages.create(model=CHAT, messages=[QUESTION], **GREEDY))
    # Two printable characters the greedy output reaches (the random tiny model writes stray bytes too),
    # past its start so that some text comes before; the answer ends before their first occurrence.
    stop = next(
        free[i : i + 2]
        for i in range(1, len(free) - 1)
        if all(c.isascii() and c.isprintable() for c in free[i : i + 2])
    )
    stops = ["never in this answer", stop]
    message = client.messages.create(model=CHAT, messages=[QUESTION], stop_sequences=stops, **GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == free[: free.index(stop)]
    with client.messages.stream(model=CHAT, messages=[QUESTION], stop_sequences=stops, **GREEDY) as stream:
        same_answer(stream.get_final_message(), message)

    unmet = client.messages.create(model=CHAT, messages=[QUESTION], stop_sequences=["never in this answer"], **GREEDY)
    assert unmet.stop_reason == "max_tokens" and unmet.stop_sequence is None


def test_a_named_tool_is_called_streamed_or_not(server, client):
    ask = [{"role": "user", "content": "What time is it?"}]
    choice = {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}
    request = {"model": TOOLS_MODEL, "messages": ask, "tools": [TOOL], "tool_choice": choice}
    message = client.messages.create(**request, **{**GREEDY, "max_tokens": 120})
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_time" and call.id
    jsonschema.validate(call.input, TIME_SCHEMA)
    named = {"type": "function", "function": {"name": "get_time"}}
    reference = openai_answer(server, ask, TOOLS_MODEL, max_tokens=120, tools=[OPENAI_TOOL], tool_choice=named,
                              parallel_tool_calls=False)["choices"][0]  # fmt: skip
    assert [json.loads(c["function"]["arguments"]) for c in reference["message"]["tool_calls"]] == [call.input]

    events = list(client.messages.create(**request, **{**GREEDY, "max_tokens": 120}, stream=True))
    start = next(event for event in events if event.type == "content_block_start").content_block
    assert start.type == "tool_use" and start.name == "get_time" and start.input == {}
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(parts)) == call.input
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(**request, **{**GREEDY, "max_tokens": 120}) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].input == call.input and streamed.content[0].name == call.name
    assert streamed.stop_reason == "tool_use"


def test_a_tool_use_and_its_result_in_the_history_read_as_openais(server, client):
    arguments = {"zone": "UTC", "dst": False}
    anthropic_history = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "get_time",
                                           "input": arguments}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "12:30"},
                                     {"type": "text", "text": "And in words?"}]},
    ]  # fmt: skip
    openai_history = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_01", "type": "function",
         "function": {"name": "get_time", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "12:30"},
        {"role": "user", "content": "And in words?"},
    ]  # fmt: skip
    reference = openai_answer(server, openai_history, TOOLS_MODEL)
    message = client.messages.create(model=TOOLS_MODEL, messages=anthropic_history, **GREEDY)
    assert text_of(message) == reference["choices"][0]["message"]["content"]
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert prompt == reference["usage"]["prompt_tokens"]  # the same prompt, token for token
    counted = client.messages.count_tokens(model=TOOLS_MODEL, messages=anthropic_history)
    assert counted.input_tokens == prompt


def test_an_output_format_is_openais_json_schema_format(server, client):
    fmt = {"type": "json_schema", "schema": TIME_SCHEMA}
    message = client.messages.create(model=CHAT, messages=[QUESTION], output_config={"format": fmt},
                                     **{**GREEDY, "max_tokens": 60})  # fmt: skip
    jsonschema.validate(json.loads(text_of(message)), TIME_SCHEMA)
    answer = {"type": "json_schema", "json_schema": {"name": "time", "schema": TIME_SCHEMA}}
    reference = openai_answer(server, [QUESTION], max_tokens=60, response_format=answer)
    assert text_of(message) == reference["choices"][0]["message"]["content"]
    assert message.stop_reason == "end_turn"


def test_count_tokens_counts_the_prompt_with_its_system_prompt(server, client):
    reference = openai_answer(server, [{"role": "system", "content": SYSTEM}, QUESTION], max_tokens=1)
    counted = client.messages.count_tokens(model=CHAT, system=SYSTEM, messages=[QUESTION])
    assert counted.input_tokens == reference["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any", "disable_parallel_tool_use": True}, {"tool_choice": "required", "parallel_tool_calls": False}),
        ({"type": "none"}, {"tool_choice": "none"}),
        ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": False},
         {"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "parallel_tool_calls": True}),
    ],
)  # fmt: skip
def test_tool_choices_become_openais(choice, expected):
    body = to_openai({"max_tokens": 8, "messages": [QUESTION], "tools": [TOOL], "tool_choice": choice})
    assert {key: body[key] for key in expected} == expected
    assert "parallel_tool_calls" in body or "parallel_tool_calls" not in expected


def test_history_blocks_become_openai_messages():
    call = {"type": "tool_use", "id": "t1", "name": "get_time", "input": {"zone": "UTC"}}
    history = [
        QUESTION,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "no clock"}]}]},
    ]  # fmt: skip
    assert to_openai({"max_tokens": 8, "messages": history})["messages"] == [
        QUESTION,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: no clock"},
    ]  # fmt: skip


BAD = [  # (body changes, status, Anthropic's error type, words of the message)
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     'source must be {"type": "base64"'),
    ({"model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature must be a number in [0, 1]"),
    ({"tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
    ({"messages": [QUESTION, {"role": "assistant", "content": "Pa"}]}, 400, "invalid_request_error", "last message"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid_request_error", "role"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "custom tools"),
    ({"stop_sequences": ["x"] * 17}, 400, "invalid_request_error", "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "status", "kind", "words"), BAD)
def test_refusals_are_anthropic_errors(server, change, status, kind, words):
    body = {"model": CHAT, "messages": [QUESTION], "max_tokens": 8, **change}
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=120)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert words in error["error"]["message"]


def test_the_client_raises_and_the_server_goes_on(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="this model does not read images"):
        client.messages.create(model=CHAT, messages=[{"role": "user", "content": [image]}], **GREEDY)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", messages=[QUESTION], **GREEDY)
    assert text_of(client.messages.create(model=CHAT, messages=[QUESTION], **GREEDY))


@pytest.mark.slow
def test_an_api_key_is_read_from_x_api_key():
    models = ModelSet()
    models.add(mlxinfer.load(TINY / "llama_classic"), SchedulerConfig(), CHAT)
    with BackgroundServer(models, ServerSettings(port=0, api_key=KEY)) as server:
        good = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
        assert good.messages.create(model=CHAT, messages=[QUESTION], **{**GREEDY, "max_tokens": 2}).content
        wrong = anthropic.Anthropic(base_url=server.url, api_key="w" * 24, max_retries=0, timeout=120)
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model=CHAT, messages=[QUESTION], **GREEDY)
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.count_tokens(model=CHAT, messages=[QUESTION])
    models.close()
