"""Reasoning switched on or off per request: Ollama's `think`, OpenAI's `reasoning_effort`, the Responses API's
`reasoning.effort` and Anthropic's `thinking`, as the variables the model's own chat template reads.

The expected prompts are the real templates rendered by plain jinja2 with those variables (what transformers'
apply_chat_template passes them as); tiny models wear the templates.
"""

from __future__ import annotations

import json
from datetime import datetime

import anthropic
import httpx
import jinja2
import jinja2.meta
import ollama
import openai
import pytest

from mlxinfer.chat import thinking_variables
from mlxinfer.engine import SchedulerConfig
from mlxinfer.errors import ToolCallError
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.test_structured_server import TEMPLATES, THINKING_TEMPLATE, tiny_with_template

QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
HI = [{"role": "user", "content": "Hi"}]


def reference_tokens(server, template: str, **variables) -> int:
    """The reference: the template rendered as transformers does, by jinja2 itself, and tokenized with its special
    tokens read as such (the tokenizers library's own encode)."""
    return len(server.tokenizer.backend.encode(jinja_prompt(template, **variables), add_special_tokens=False).ids)


def jinja_prompt(template: str, **variables) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw)
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=HI, add_generation_prompt=True, **variables)


@pytest.mark.parametrize(
    "effort, template, reasons, expected",
    [
        ("none", QWEN3, True, {"enable_thinking": False}),
        ("high", QWEN3, True, {"enable_thinking": True}),
        ("minimal", GPT_OSS, True, {"reasoning_effort": "low"}),
        ("high", GPT_OSS, True, {"reasoning_effort": "high"}),
        (None, QWEN3, True, {}),
        ("none", THINKING_TEMPLATE, True, {}),  # reasons by itself, no switch: as it is
        ("none", "{{ messages[0]['content'] }}", False, {}),  # never reasons: nothing to turn off
    ],
)
def test_the_variables_each_template_reads(effort, template, reasons, expected):
    variables = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    assert thinking_variables(effort, frozenset(variables), reasons) == expected


@pytest.mark.parametrize(
    "effort, template, reasons, words",
    [("none", GPT_OSS, True, "always reasons"), ("low", "{{ messages[0]['content'] }}", False, "does not reason")],
)
def test_what_a_template_cannot_do_is_refused(effort, template, reasons, words):
    variables = frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    with pytest.raises(ToolCallError, match=words) as refused:
        thinking_variables(effort, variables, reasons)
    assert refused.value.param == "reasoning_effort"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    models = ModelSet()
    chatml = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>'}}{% endfor %}"
    for name, template in (("qwen3", QWEN3), ("gpt_oss", GPT_OSS), ("plain", chatml + "<|im_start|>assistant\n")):
        models.add(tiny_with_template(root / name, template), SchedulerConfig(), name)
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        running.tokenizer = models.loaded("qwen3").model.tokenizer
        yield running
    models.close()


def test_every_api_switches_qwen3s_thinking_off_as_its_template_does(server):
    expected = {think: reference_tokens(server, QWEN3, enable_thinking=think) for think in (True, False)}
    assert expected[False] > expected[True]  # the empty <think></think> block the template writes
    client = ollama.Client(host=server.url)
    for think in (True, False):
        answer = client.chat(model="qwen3", messages=HI, think=think, options={"num_predict": 1})
        assert answer.prompt_eval_count == expected[think]
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    off = chat.chat.completions.create(model="qwen3", messages=HI, max_tokens=1, reasoning_effort="none")
    assert off.usage.prompt_tokens == expected[False]
    response = chat.responses.create(model="qwen3", input=HI, max_output_tokens=1, reasoning={"effort": "none"})
    assert response.usage.input_tokens == expected[False]
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused")
    message = claude.messages.create(model="qwen3", max_tokens=1, messages=HI, thinking={"type": "disabled"})
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected[False]


def test_gpt_oss_takes_an_effort_and_a_model_without_reasoning_refuses_think(server):
    high = reference_tokens(server, GPT_OSS, reasoning_effort="high")
    client = ollama.Client(host=server.url)
    assert client.chat(model="gpt_oss", messages=HI, think="high", options={"num_predict": 1}).prompt_eval_count == high
    for model, think, words in (("gpt_oss", False, "always reasons"), ("plain", True, "does not reason")):
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(model=model, messages=HI, think=think, options={"num_predict": 1})
        assert refused.value.status_code == 400 and str(refused.value).startswith(f"think: this model {words}")
    assert client.chat(model="plain", messages=HI, think=False, options={"num_predict": 1}).done  # nothing to turn off
    bad = httpx.post(server.url + "/api/chat", json={"model": "plain", "messages": HI, "think": "max"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"].startswith("think must be true, false")
