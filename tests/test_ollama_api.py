"""Ollama's API on the server, through the official `ollama` client: the answers are the OpenAI routes' answers.

Tiny random models answer greedily, so each Ollama answer is checked against the same request sent to
/v1 (the reference); a tiny model wearing Llama 3.2's template makes a real tool call.
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest

import mlxinfer
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.routes.ollama import to_openai_messages
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY

LLAMA3_TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "meta-llama-Llama-3.2-3B-Instruct.jinja"
HI = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0, "num_predict": 8}
WEATHER = {  # enums only: a random model's call ends within a few dozen tokens
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CALL = {"name": "get_weather", "description": "The weather.", "parameters": WEATHER}
TOOLS = [{"type": "function", "function": CALL}]


def tiny_model(folder: Path, template: str | None = None, context: int | None = None) -> Path:
    """A copy of the tiny llama_classic checkpoint, with another chat template and context if given."""
    shutil.copytree(TINY / "llama_classic", folder, ignore=shutil.ignore_patterns("golden.safetensors"))
    for name, changes in (
        ("config.json", {"max_position_embeddings": context} if context else {}),
        ("tokenizer_config.json", {"chat_template": template} if template else {}),
    ):
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), **changes}))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Models "chatml" (the tiny model as it is), "llama3" (Llama 3.2's tool template, a context for the tools)
    and, in an otherwise empty models folder, "local_tiny": listed and shown, never loaded."""
    root = tmp_path_factory.mktemp("ollama")
    tiny_model(root / "models" / "local_tiny")
    with pytest.MonkeyPatch.context() as env:
        for name, folder in (("MLXINFER_MODELS_DIR", "models"), ("MLXINFER_CACHE_DIR", "cache"),
                             ("MLXINFER_CONFIG_DIR", "config"), ("HF_HUB_CACHE", "hub")):  # fmt: skip
            env.setenv(name, str(root / folder))
        models = ModelSet()
        models.add(mlxinfer.load(tiny_model(root / "chatml")))
        models.add(mlxinfer.load(tiny_model(root / "llama3", LLAMA3_TEMPLATE.read_text(), 8192)))
        with BackgroundServer(models, ServerSettings(port=0)) as running:
            running.client = ollama.Client(host=running.url, timeout=300)
            yield running
        models.close()


def openai_chat(server, model: str, messages: list[dict], **extra) -> dict:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 8, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_whole_and_streamed_is_the_openai_answer(server):
    reference = openai_chat(server, "chatml", HI)
    whole = server.client.chat(model="chatml", messages=HI, options=GREEDY)
    assert whole.message.content == reference["choices"][0]["message"]["content"] and whole.message.content
    assert (whole.done, whole.done_reason, whole.model) == (True, "length", "chatml")
    assert whole.eval_count == 8 and whole.prompt_eval_count == reference["usage"]["prompt_tokens"]
    assert 0 < whole.eval_duration <= whole.total_duration < 60e9  # nanoseconds
    assert datetime.fromisoformat(whole.created_at.replace("Z", "+00:00")).tzinfo == timezone.utc

    tagged = server.client.chat(model="chatml:latest", messages=HI, options=GREEDY)  # Ollama's default tag
    assert tagged.message.content == whole.message.content

    parts = list(server.client.chat(model="chatml", messages=HI, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 8


def test_stream_is_the_default_as_ndjson(server):
    body = {"model": "chatml", "messages": HI, "options": GREEDY}  # no "stream": Ollama streams
    response = httpx.post(server.url + "/api/chat", json=body, timeout=300)
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert len(lines) > 2 and lines[-1]["done"] is True and not any(line["done"] for line in lines[:-1])
    assert all(line["message"]["role"] == "assistant" for line in lines)


def test_generate_through_the_template_and_raw(server):
    system = "Be brief."
    reference = openai_chat(server, "chatml", [{"role": "system", "content": system}, *HI])
    templated = server.client.generate(model="chatml", prompt="Hi", system=system, options=GREEDY)
    assert templated.response == reference["choices"][0]["message"]["content"]
    assert templated.done_reason == "length" and templated.eval_count == 8

    body = {"model": "chatml", "prompt": "1, 2, 3,", "temperature": 0, "max_tokens": 8}
    completion = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    raw = server.client.generate(model="chatml", prompt="1, 2, 3,", raw=True, options=GREEDY)
    assert raw.response == completion["choices"][0]["text"] and raw.response != templated.response
    assert raw.prompt_eval_count == completion["usage"]["prompt_tokens"]
    streamed = server.client.generate(model="chatml", prompt="1, 2, 3,", raw=True, options=GREEDY, stream=True)
    assert "".join(p.response for p in streamed) == raw.response


def test_format_json_and_a_schema(server):
    question = [{"role": "user", "content": "Is it cold in London?"}]  # greedy: a short JSON object
    answer = server.client.chat(model="chatml", messages=question, format="json", options={"temperature": 0})
    assert answer.done_reason == "stop" and isinstance(json.loads(answer.message.content), dict)

    schema = server.client.chat(model="chatml", messages=HI, format=WEATHER, options={"temperature": 0})
    jsonschema.validate(json.loads(schema.message.content), WEATHER)
    streamed = server.client.chat(model="chatml", messages=HI, format=WEATHER, options={"temperature": 0}, stream=True)
    assert "".join(p.message.content for p in streamed) == schema.message.content


def test_a_tool_call_has_its_arguments_as_an_object(server):
    # Raw JSON, not the client: its Tool type drops additionalProperties, and the call would never end.
    body = {"model": "llama3", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS, "format": WEATHER, "options": {"temperature": 0, "num_predict": 200}}  # fmt: skip
    whole = httpx.post(server.url + "/api/chat", json={**body, "stream": False}, timeout=300).json()
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and whole["done_reason"] == "stop"
    jsonschema.validate(call["function"]["arguments"], WEATHER)  # an object, not JSON text
    parsed = ollama.ChatResponse.model_validate(whole)  # the client's own types read it
    assert parsed.message.tool_calls[0].function.arguments == call["function"]["arguments"]
    lines = httpx.post(server.url + "/api/chat", json=body, timeout=300).text.splitlines()
    streamed = [c for line in lines for c in json.loads(line)["message"].get("tool_calls", [])]
    assert streamed == [call]


def test_a_tool_call_history_is_the_openai_conversation(server):
    arguments = {"city": "Paris", "unit": "celsius"}
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"},
    ]  # fmt: skip
    translated = to_openai_messages(history)
    call_id = translated[1]["tool_calls"][0]["id"]
    assert translated[2]["tool_call_id"] == call_id and translated[2]["name"] == "get_weather"
    openai_history = [
        history[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "x1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "content": "18 degrees", "tool_call_id": "x1", "name": "get_weather"},
    ]  # fmt: skip
    reference = openai_chat(server, "llama3", openai_history, tools=TOOLS)
    body = {"model": "llama3", "messages": history, "tools": TOOLS, "options": GREEDY, "stream": False}
    answer = httpx.post(server.url + "/api/chat", json=body, timeout=300).json()  # the tools as they are
    assert answer["message"]["content"] == reference["choices"][0]["message"]["content"]


def test_tags_lists_local_and_served_models(server):
    listed = {m.model: m for m in server.client.list().models}
    assert set(listed) == {"local_tiny", "chatml", "llama3"}
    local = listed["local_tiny"]
    assert local.size > 100_000 and len(local.digest) == 64 and local.modified_at.year >= 2024
    assert (local.details.format, local.details.family, local.details.quantization_level) == (
        "safetensors", "llama", "F32"
    )  # fmt: skip


def test_show_a_loaded_and_an_unloaded_model(server):
    shown = server.client.show("llama3")
    assert shown.template == LLAMA3_TEMPLATE.read_text() and "tools" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] == 8192
    local = server.client.show("local_tiny")  # read from its files
    assert local.capabilities == ["completion", "tools"] and local.modelinfo["llama.context_length"] == 256
    assert local.template.startswith("{% for message in messages %}")
    assert "local_tiny" not in {m.model for m in server.client.ps().models}
    with pytest.raises(ollama.ResponseError) as missing:
        server.client.show("no-such-model")
    assert missing.value.status_code == 404


@pytest.mark.slow
def test_ps_unload_with_keep_alive_0_and_reload(server):
    server.client.chat(model="chatml", messages=HI, options=GREEDY)
    (row,) = [m for m in server.client.ps().models if m.model == "chatml"]
    assert row.size > 100_000 and row.context_length == 256 and row.details.family == "llama"
    left_s = row.expires_at.timestamp() - time.time()
    assert 250 < left_s <= 300  # the default keep-alive: five minutes
    raw = httpx.get(server.url + "/api/ps").json()["models"]
    assert next(m for m in raw if m["name"] == "chatml")["mlxinfer"]["in_flight"] == 0

    unloaded = server.client.generate(model="chatml", keep_alive=0)
    assert (unloaded.done, unloaded.done_reason, unloaded.response) == (True, "unload", "")
    assert "chatml" not in {m.model for m in server.client.ps().models}

    again = server.client.chat(model="chatml", messages=HI, options=GREEDY)  # loads it again
    assert again.message.content == openai_chat(server, "chatml", HI)["choices"][0]["message"]["content"]
    assert "chatml" in {m.model for m in server.client.ps().models}
    assert server.client.generate(model="chatml").done_reason == "load"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("request_body", "status", "words"),
    [
        ({"model": "nope", "messages": HI}, 404, "nope"),
        ({"model": "chatml", "messages": HI, "options": {"temperature": "hot"}}, 400, "options.temperature"),
        ({"model": "chatml", "messages": HI, "options": {"num_predict": 0}}, 400, "options.num_predict"),
        ({"model": "chatml", "messages": [{**HI[0], "images": ["aGk="]}]}, 400, "does not read images"),
        ({"model": "chatml", "messages": HI, "think": True}, 400, "think"),
        ({"model": "chatml", "messages": HI, "options": {"num_predict": 1000}}, 400, "options.num_predict: the prompt"),
    ],
)
def test_refusals_are_ollama_errors_and_the_server_keeps_serving(server, request_body, status, words):
    with pytest.raises(ollama.ResponseError) as refused:
        server.client.chat(**request_body)
    assert refused.value.status_code == status
    assert isinstance(refused.value.error, str) and words in refused.value.error  # Ollama's {"error": message}
    assert server.client.chat(model="chatml", messages=HI, options=GREEDY).done


def test_what_the_client_would_not_send_is_refused_too(server):
    for path, extra, words in (
        ("/api/generate", {"suffix": "end"}, "suffix"),
        ("/api/generate", {"images": ["aGk="]}, "does not read images"),
        ("/api/chat", {"messages": HI, "format": "yaml"}, 'format must be "json" or a JSON schema'),
        ("/api/chat", {"messages": HI, "format": {"type": "object", "x-guidance": {}}}, "format"),
        ("/api/chat", {"messages": HI, "options": ["temperature"]}, "options must be an object"),
    ):
        response = httpx.post(server.url + path, json={"model": "chatml", "prompt": "Hi", **extra}, timeout=300)
        assert response.status_code == 400 and words in response.json()["error"], response.text


def test_version(server):
    assert httpx.get(server.url + "/api/version").json() == {"version": mlxinfer.__version__}


@pytest.mark.slow
def test_an_api_key_server_needs_the_key():
    models = ModelSet()
    models.add(mlxinfer.load(TINY / "llama_classic"))
    with BackgroundServer(models, ServerSettings(port=0, api_key="s3cret-key")) as running:
        keyed = ollama.Client(host=running.url, headers={"Authorization": "Bearer s3cret-key"}, timeout=300)
        assert keyed.chat(model="llama_classic", messages=HI, options=GREEDY).eval_count == 8
        with pytest.raises(ollama.ResponseError) as refused:
            ollama.Client(host=running.url, timeout=300).chat(model="llama_classic", messages=HI, options=GREEDY)
        assert refused.value.status_code == 401
        assert isinstance(refused.value.error, str) and "API key" in refused.value.error  # Ollama's error shape
    models.close()
