"""OpenAI's Responses API through the official client: responses.create, .stream and .parse, tools and their
results, previous_response_id, stored responses.

A response runs as the chat request its input makes, so each answer is checked against that chat request sent to
/v1/chat/completions (the reference); the tiny model answers greedily.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

import mlxinfer
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.response_store import ResponseStore
from mlxinfer.server.routes.responses_input import read_turn
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.test_ollama_api import tiny_model

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather.", "parameters": WEATHER}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
ASK = "What is the weather in Paris?"


class Weather(BaseModel):  # enums only: a random model's answer ends within a few dozen tokens
    city: Literal["Paris", "Rome"]
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = ModelSet()
    models.add(mlxinfer.load(tiny_model(tmp_path_factory.mktemp("responses") / "tiny", context=8192)))
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        running.client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        yield running
    models.close()


def test_a_response_is_the_chat_answer_whole_and_streamed(server):
    client = server.client
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reference = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    whole = client.responses.create(model="tiny", instructions="Be brief.", input="Hi", max_output_tokens=8)
    assert whole.output_text == reference.choices[0].message.content and whole.output_text
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (reference.usage.prompt_tokens, 8)
    assert whole.instructions == "Be brief." and whole.model == "tiny" and whole.id.startswith("resp_")

    with client.responses.stream(model="tiny", instructions="Be brief.", input="Hi", max_output_tokens=8) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output[0].content[0].text == whole.output_text


def test_structured_output_parses_whole_and_streamed(server):
    client = server.client
    ask = [{"role": "user", "content": ASK}]
    reference = client.chat.completions.parse(model="tiny", messages=ask, response_format=Weather, max_tokens=100)
    expected = reference.choices[0].message.parsed
    parsed = client.responses.parse(model="tiny", input=ASK, text_format=Weather, max_output_tokens=100)
    assert parsed.status == "completed" and parsed.output_parsed == expected and isinstance(expected, Weather)
    with client.responses.stream(model="tiny", input=ASK, text_format=Weather, max_output_tokens=100) as stream:
        assert stream.get_final_response().output_parsed == expected


def test_a_tool_call_and_its_result_continue_from_the_stored_response(server):
    client = server.client
    one = {"tool_choice": "required", "parallel_tool_calls": False}
    first = client.responses.create(model="tiny", input=ASK, tools=[TOOL], max_output_tokens=100, **one)
    ask = [{"role": "user", "content": ASK}]
    reference = client.chat.completions.create(model="tiny", messages=ask, tools=CHAT_TOOLS, max_tokens=100, **one)
    [call], [expected] = first.output, reference.choices[0].message.tool_calls
    assert (first.status, call.type, call.name) == ("completed", "function_call", "get_weather")
    assert json.loads(call.arguments) == json.loads(expected.function.arguments)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, input=[result], tools=[TOOL], max_output_tokens=8
    )
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the stored turn's KV
    called = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [called]}]
    history.append({"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"})
    reference = client.chat.completions.create(model="tiny", messages=history, tools=CHAT_TOOLS, max_tokens=8)
    assert second.output_text == reference.choices[0].message.content
    assert second.usage.input_tokens == reference.usage.prompt_tokens
    named = client.responses.create(
        model="tiny", input=ASK, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False, max_output_tokens=100,
    )  # fmt: skip
    assert [item.name for item in named.output] == ["get_weather"]


def test_stored_responses_are_retrieved_deleted_or_not_kept(server):
    client = server.client
    kept = client.responses.create(model="tiny", input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    client.responses.delete(kept.id)
    not_kept = client.responses.create(model="tiny", input="Hi", max_output_tokens=4, store=False)
    for gone in (kept.id, not_kept.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        with pytest.raises(openai.BadRequestError, match="not found"):
            client.responses.create(model="tiny", input="Go on", previous_response_id=gone)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": "Hi", "background": True}, "background"),
        ({"input": "Hi", "truncation": "auto"}, "truncation"),
        ({"input": "Hi", "text": {"format": {"type": "grammar"}}}, "text"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": "Hi", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"input": "Hi", "temperature": 3}, "temperature"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
            "text.format",
        ),
    ],
)
def test_refusals_name_the_field_and_the_server_keeps_serving(server, body, param):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **body}, timeout=60)
    assert (response.status_code, response.json()["error"]["param"]) == (400, param)
    assert server.client.responses.create(model="tiny", input="Hi", max_output_tokens=2).status == "incomplete"


def test_input_items_are_the_chat_messages_they_stand_for():
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Answer in French."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            ]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "look", "arguments": "{\"x\": 1}"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "a cat"}]},
        ],
    }  # fmt: skip
    turn = read_turn(body, ResponseStore())
    assert turn.chat["messages"] == [  # OpenAI's chat form of the same conversation
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "look", "arguments": "{\"x\": 1}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
    ]  # fmt: skip
    assert turn.history == turn.chat["messages"][1:]  # instructions are not carried into a continued response


def test_the_store_keeps_to_its_count_and_bytes_oldest_unused_first():
    store = ResponseStore(max_responses=2, max_bytes=4000)
    message = [{"role": "user", "content": "x" * 1000}]
    for name in ("a", "b"):
        assert store.put({"id": name}, message)
    store.get("a")  # used: "b" is now the oldest
    assert store.put({"id": "c"}, message) and store.get("b") is None and len(store) == 2
    assert store.put({"id": "d"}, message * 3) and [n for n in "acd" if store.get(n)] == ["d"]  # bytes
    assert not store.put({"id": "e"}, message * 5) and store.get("e") is None and store.nbytes <= 4000
