"""The server's response_format, tools and reasoning: enforced output, parsed calls, OpenAI error objects.

The real default model answers schemas through the official client; tiny random models, each wearing a
real family's chat template, make and read back tool calls in that family's own syntax.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

import mlxinfer
from mlxinfer.chat import Content, OutputParser, Reasoning, ToolCall, output_format
from mlxinfer.engine import SchedulerConfig
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.deltas import Answer
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILIES = {  # a model name: the real template of its parser family (tests/fixtures/chat_templates/README.md)
    "hermes": "Qwen-Qwen3-0.6B.jinja",  # with <think> reasoning
    "llama3_json": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "mistral_v3": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "mistral_v11": "mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "harmony": "openai-gpt-oss-120b.jinja",
    "gemma": "google-gemma-4-31B-it.jinja",
}
# ChatML whose generation prompt opens a think block (as DeepSeek-R1's and QwQ's do): all output starts as reasoning.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
QUESTION = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {  # enums and booleans only: every family's call grammar bounds them (Gemma's has no maxLength)
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now.", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone.",
            "parameters": {"type": "object",
                           "properties": {"zone": {"enum": ["UTC", "CET"]}, "dst": {"type": "boolean"}},
                           "required": ["zone", "dst"], "additionalProperties": False},
        },
    },
]  # fmt: skip
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
ITEMS = {  # nested objects, arrays, enums and bounded numbers
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "kind": {"enum": ["book", "film", "song"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "author": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "kind", "rating", "tags", "author"],
    "additionalProperties": False,
}


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


def tiny_with_template(folder: Path, template: str) -> mlxinfer.Model:
    """The tiny llama_classic checkpoint (byte-level tokenizer) with its chat template replaced, and a context
    long enough for prompts with tools written one byte a token."""
    shutil.copytree(TINY / "llama_classic", folder, ignore=shutil.ignore_patterns("golden.safetensors"))
    for name, changes in (
        ("config.json", {"max_position_embeddings": 8192}),
        ("tokenizer_config.json", {"chat_template": template}),
    ):
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), **changes}))
    return mlxinfer.load(folder)


@pytest.fixture(scope="module")
def smol_server(smol):
    models = ModelSet()
    served = models.add(smol, SchedulerConfig(max_batch=4))
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        running.model_id = served.id
        yield running
    models.close()  # its scheduler; the shared model stays loaded


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """One server for the tiny models: one per tool-call family, one thinking, one plain ChatML (llama_classic), and
    that one again with a context long enough for tools in the default format ("plain")."""
    root = tmp_path_factory.mktemp("templates")
    models = ModelSet()
    for family, name in FAMILIES.items():
        models.add(tiny_with_template(root / family, (TEMPLATES / name).read_text()), SchedulerConfig(), family)
    models.add(tiny_with_template(root / "thinking", THINKING_TEMPLATE), SchedulerConfig(), "thinking")
    models.add(mlxinfer.load(TINY / "llama_classic"), SchedulerConfig(), "chatml")
    chatml = json.loads((TINY / "llama_classic" / "tokenizer_config.json").read_text())["chat_template"]
    models.add(tiny_with_template(root / "plain", chatml), SchedulerConfig(), "plain")  # no tool syntax, long context
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        yield running
    models.close()


def post(server, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300)


def streamed(server, body: dict, path: str = "/v1/chat/completions") -> list[dict]:
    """The chunks of a streamed answer (without the final [DONE])."""
    chunks = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def reassembled(chunks: list[dict]) -> dict:
    """A streamed chat answer put back together as OpenAI clients do: text appended, calls gathered by index."""
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in chunks:
        assert "error" not in chunk, chunk
        choice = chunk["choices"][0]
        delta, finish = choice["delta"], choice["finish_reason"] or finish
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls", []):
            whole = message["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            whole["id"] = call.get("id") or whole.get("id")
            whole["name"] += call["function"].get("name") or ""
            whole["arguments"] += call["function"].get("arguments") or ""
    message["tool_calls"] = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
    return {"message": message, "finish_reason": finish}


# ---- the real default model: response_format ----


def test_openai_client_parse_returns_a_parsed_object(smol_server):
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    answer = client.chat.completions.parse(
        model=smol_server.model_id, messages=QUESTION, response_format=Person, max_tokens=60, temperature=0
    )
    person = answer.choices[0].message.parsed
    assert isinstance(person, Person)
    assert answer.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(answer.choices[0].message.content) == person


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_json_schema_answers_validate_streamed_or_not(smol_server, path):
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEMS, "strict": True}}
    body = {"max_tokens": 200, "temperature": 0, "response_format": response_format}
    body |= {"messages": QUESTION} if path.endswith("chat/completions") else {"prompt": "A favourite item as JSON:"}
    whole = post(smol_server, body, path)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    jsonschema.validate(json.loads(text), ITEMS)
    assert choice["finish_reason"] == "stop"
    chunks = streamed(smol_server, body, path)
    if "message" in choice:
        assert reassembled(chunks)["message"]["content"] == text
    else:
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text


def test_json_object_is_an_object_streamed_or_not(smol_server):
    question = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    body = {"messages": question, "max_tokens": 60, "temperature": 0, "response_format": {"type": "json_object"}}
    whole = post(smol_server, body).json()["choices"][0]
    assert isinstance(json.loads(whole["message"]["content"]), dict)
    assert whole["finish_reason"] == "stop"
    assert reassembled(streamed(smol_server, body))["message"]["content"] == whole["message"]["content"]
    text = post(smol_server, {**body, "response_format": {"type": "text"}, "max_tokens": 8}).json()
    assert text["choices"][0]["message"]["content"]  # "text" is no constraint at all


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def call_history(question: list[dict], call: dict) -> list[dict]:
    return [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"celsius": 21}'},
    ]


A_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
BAD_CHATS = [  # (case, body, path, param, words in the message)
    ("invalid schema", {"response_format": schema_format({"type": "objekt"})}, "/v1/chat/completions",
     "response_format.json_schema.schema", "objekt"),
    ("unsupported keyword", {"response_format": schema_format({"not": {"type": "string"}})}, "/v1/chat/completions",
     "response_format.json_schema.schema", '"not"'),
    ("unknown format type", {"response_format": {"type": "xml"}}, "/v1/chat/completions",
     "response_format.type", "xml"),
    ("format name missing", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "/v1/chat/completions", "response_format.json_schema.name", "name"),
    ("format name with spaces", {"response_format": {"type": "json_schema",
     "json_schema": {"name": "a b", "schema": {}}}}, "/v1/chat/completions", "response_format.json_schema.name", "64"),
    ("schema not an object", {"response_format": schema_format([1])}, "/v1/chat/completions",
     "response_format.json_schema.schema", "schema"),
    ("unknown tool_choice name", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "/v1/chat/completions", "tool_choice", "nope"),
    ("tool message without tool_call_id",
     {"messages": [*ASK_WEATHER, {"role": "assistant", "tool_calls": [A_CALL]}, {"role": "tool", "content": "21"}]},
     "/v1/chat/completions", "messages[2].tool_call_id", "tool_call_id"),
    ("tool call arguments not JSON",
     {"messages": [*ASK_WEATHER, {"role": "assistant", "tool_calls": [
         {**A_CALL, "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]},
     "/v1/chat/completions", "messages[1].tool_calls[0].function.arguments", "JSON"),
    ("tools on completions", {"prompt": "x", "tools": TOOLS}, "/v1/completions", "tools", "chat"),
    ("a schema past the grammar limit", {"response_format": schema_format(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40_000)}})},
     "/v1/chat/completions", "response_format.json_schema.schema", "at most"),
    ("too many tools", {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "/v1/chat/completions", "tools", "128"),
    ("response_format with a forced call", {"tools": TOOLS, "tool_choice": "required",
     "response_format": {"type": "json_object"}}, "/v1/chat/completions", "response_format", "tool_choice"),
    # x-guidance would set the matcher's own options (lenient: drop unsupported keywords silently).
    ("a schema setting the matcher's options", {"response_format": schema_format(
        {"type": "object", "x-guidance": {"lenient": True}})}, "/v1/chat/completions",
     "response_format.json_schema.schema", "x-guidance"),
    ("the matcher's options as not a mapping, with tools", {"tools": TOOLS, "response_format": schema_format(
        {"type": "object", "x-guidance": 5})}, "/v1/chat/completions", "response_format.json_schema.schema",
     "x-guidance"),
    ("tool parameters setting the matcher's options", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "x-guidance": {"whitespace_flexible": True}}}}]},
     "/v1/chat/completions", "tools[0].function.parameters", "x-guidance"),
]  # fmt: skip


@pytest.mark.parametrize("case,extra,path,param,words", BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_formats_and_tools_get_an_openai_error(smol_server, case, extra, path, param, words):
    body = {"messages": QUESTION, "max_tokens": 4} if path.endswith("chat/completions") else {"max_tokens": 4}
    response = post(smol_server, {**body, **extra}, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and words in error["message"]


def test_the_server_keeps_serving_after_refusals(smol_server):
    for case in BAD_CHATS:
        post(smol_server, {"messages": QUESTION, "max_tokens": 4, **case[1]}, case[2])
    answer = post(smol_server, {"messages": QUESTION, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]


def test_grammars_compile_on_the_preparing_threads_not_the_schedulers(tiny_server, monkeypatch):
    from mlxinfer.grammar.compiled import Vocabulary

    threads, compile_ = [], Vocabulary.compile

    def compile(self, grammar):
        threads.append(threading.current_thread().name)
        return compile_(self, grammar)

    monkeypatch.setattr(Vocabulary, "compile", compile)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    body = {"model": "chatml", "messages": QUESTION, "max_tokens": 20, "response_format": schema_format(schema)}
    answer = post(tiny_server, body).json()["choices"][0]["message"]["content"]
    assert json.loads(answer)["n"] in range(10)
    assert threads and not any(name.startswith("mlxinfer") for name in threads), threads  # device threads' names


# ---- tiny models with each family's template: tool calls ----


def check_call(call: dict, tools: list[dict]) -> None:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call["function"]["name"])
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    assert call["type"] == "function" and call["id"]


CANDIDATES = ["What is the weather in Paris?", "What time is it?", "What weather London?", "weather tool please?",
              "Is it cold in London?", "weather rain London?", "please Paris London?"]  # fmt: skip


def calling_question(server, family: str) -> list[dict]:
    """A question whose greedy answer starts with the call itself. Where the family may reason before a
    forced call (Qwen3, Gemma 4), a random model may open a reasoning block it never closes."""
    for question in CANDIDATES:
        messages = [{"role": "user", "content": question}]
        body = {"model": family, "messages": messages, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
        if not post(server, {**body, "max_tokens": 12}).json()["choices"][0]["message"].get("reasoning_content"):
            return messages
    raise AssertionError(f"every question opens a reasoning block with {family}'s template")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_tool_round_trip(tiny_server, family):
    question = calling_question(tiny_server, family)
    body = {"model": family, "messages": question, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 300, "temperature": 0}  # fmt: skip
    answer = post(tiny_server, body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    check_call(call, TOOLS)

    again = reassembled(streamed(tiny_server, body))  # greedy: the same call, streamed
    assert again["finish_reason"] == "tool_calls" and again["message"]["content"] == ""
    assert [(c["name"], c["arguments"]) for c in again["message"]["tool_calls"]] == [
        (call["function"]["name"], call["function"]["arguments"])
    ]

    history = call_history(question, call)
    final = post(tiny_server, {"model": family, "messages": history, "tools": TOOLS, "max_tokens": 16})
    assert final.status_code == 200, final.text
    assert isinstance(final.json()["choices"][0]["message"]["content"], str)


def test_a_template_without_tool_syntax_calls_tools_in_the_default_format(tiny_server):
    # llama_classic's ChatML template renders no tools: the default format tells them in the system turn and holds a
    # required or named call by the grammar; the history's call and result go back as text. Without the default, it
    # was a 400 naming tools.
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for choice, names in (("required", {"get_weather", "get_time"}), ({"type": "function",
                          "function": {"name": "get_time"}}, {"get_time"})):  # fmt: skip
        answer = client.chat.completions.create(model="plain", messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice,
                                                parallel_tool_calls=False, max_tokens=200, temperature=0)  # fmt: skip
        final = answer.choices[0]
        assert final.finish_reason == "tool_calls" and not final.message.content
        (call,) = final.message.tool_calls
        check_call(call.model_dump(), TOOLS)
        assert call.function.name in names
    history = call_history(ASK_WEATHER, call.model_dump())
    after = client.chat.completions.create(model="plain", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    told = client.chat.completions.create(model="plain", messages=ASK_WEATHER, max_tokens=8, temperature=0)
    assert after.usage.prompt_tokens > told.usage.prompt_tokens  # the tools, the call and its result were read


def test_the_openai_client_streams_a_named_call(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    choice = {"type": "function", "function": {"name": "get_time"}}
    with client.chat.completions.stream(
        model="llama3_json", messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0
    ) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert final.message.tool_calls  # parallel_tool_calls defaults to true: one call or more, all to get_time
    for call in final.message.tool_calls:
        check_call(call.model_dump(), TOOLS)
        assert call.function.name == "get_time"


def test_tool_choice_none_answers_in_text(tiny_server):
    body = {"model": "hermes", "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8}
    message = post(tiny_server, body).json()["choices"][0]["message"]
    assert isinstance(message["content"], str) and "tool_calls" not in message


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_response_format_with_tools_the_model_may_call(tiny_server, family):
    """tool_choice auto with a response format: a call in the family's syntax, or JSON in the format."""
    body = {"model": family, "messages": ASK_WEATHER, "tools": TOOLS, "max_tokens": 300, "temperature": 0,
            "parallel_tool_calls": False, "response_format": schema_format(WEATHER)}  # fmt: skip
    answer = post(tiny_server, body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    message = choice["message"]
    if message.get("tool_calls"):
        (call,) = message["tool_calls"]
        check_call(call, TOOLS)
        assert (choice["finish_reason"], message["content"]) == ("tool_calls", None)
    else:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(message["content"]), WEATHER)


@pytest.mark.parametrize("family", ["harmony", "hermes"])
def test_a_response_format_alone_is_the_content_whatever_the_family(tiny_server, family):
    # The JSON comes from the first token: read as harmony markup or reasoning, it would be lost or held back.
    body = {"model": family, "messages": QUESTION, "max_tokens": 300, "temperature": 0,
            "response_format": schema_format(WEATHER)}  # fmt: skip
    whole = post(tiny_server, body).json()["choices"][0]
    jsonschema.validate(json.loads(whole["message"]["content"]), WEATHER)
    assert "reasoning_content" not in whole["message"] and whole["finish_reason"] == "stop"
    chunks = streamed(tiny_server, {**body, "stream": True})
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for t in texts if t) > 1  # streamed as it comes, not held to the end
    assert reassembled(chunks)["message"]["content"] == whole["message"]["content"]


# ---- reasoning ----


def test_reasoning_is_split_from_content_streamed_or_not(tiny_server):
    body = {"model": "thinking", "messages": ASK_WEATHER, "max_tokens": 40, "temperature": 0}
    message = post(tiny_server, body).json()["choices"][0]["message"]
    assert message["reasoning_content"]  # the generation prompt opened <think>: the output is reasoning
    again = reassembled(streamed(tiny_server, body))["message"]
    assert (again["reasoning_content"], again["content"]) == (message["reasoning_content"], message["content"])


THINKING_OUTPUT = "<think>\nThe user asks for a capital.\n</think>\n\nParis is the capital."


@pytest.mark.parametrize("step", [1, 3, len(THINKING_OUTPUT)])
def test_answer_assembly_splits_reasoning_from_a_stream_of_text(step):
    fmt = output_format((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    assert fmt.reasoning == "think"
    answer = Answer(OutputParser(fmt, []))
    deltas = []
    for start in range(0, len(THINKING_OUTPUT), step):
        deltas += answer.feed(THINKING_OUTPUT[start : start + step])
    deltas += answer.finish()
    message = answer.message()
    assert message["reasoning_content"].strip() == "The user asks for a capital."
    assert message["content"].strip() == "Paris is the capital."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert all(len(d) == 1 for d in deltas) and answer.finish_reason("stop") == "stop"


def test_answer_without_a_parser_is_the_text():
    answer = Answer(None)
    assert answer.feed("<think>x</think>") == [{"content": "<think>x</think>"}]
    assert answer.feed("") == [] and answer.finish() == []
    assert answer.message() == {"role": "assistant", "content": "<think>x</think>"}


@pytest.mark.slow
def test_answer_pieces_become_openai_fields():
    class Pieces:  # a parser that has already read a call and some text
        def feed(self, text):
            return [Reasoning("hm"), Content("a"), Content("b")]

        def finish(self):
            return [ToolCall(0, "call_x", "get_time", '{"zone":"UTC"}')]

    answer = Answer(Pieces())
    assert answer.feed("ignored") == [{"reasoning_content": "hm"}, {"content": "ab"}]
    (delta,) = answer.finish()
    assert delta["tool_calls"][0]["index"] == 0 and delta["tool_calls"][0]["function"]["name"] == "get_time"
    assert answer.message()["tool_calls"] == [
        {"id": "call_x", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}
    ]
    assert answer.finish_reason("stop") == "tool_calls" and answer.finish_reason("length") == "length"
