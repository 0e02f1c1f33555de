"""Chat templates render under a total budget; preparing a prompt never stops other threads.

A template comes from an untrusted model folder. Per-operation caps did not stop nested loops, string doubling,
recursion or huge joins; now loop iterations plus calls, nesting, wall time, characters written and the size of any
one value are budgeted per render, and going over is one ChatTemplateError. Real templates (the fixtures', ChatML,
Llama 3, Gemma, Qwen's with tools) still render exactly as transformers renders them.
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc

import pytest

from mlxinfer.errors import ChatTemplateError
from mlxinfer.tokenizer import Tokenizer, chat_template
from mlxinfer.tokenizer.chat_template import render_chat
from tests.conftest import ARCHITECTURES, TINY

BUDGET = "exhausted its budget"
HI = [{"role": "user", "content": "hi"}]
# Every refusal here takes under half a second on a 2-core CI box: 10 s catches a hang or a blow-up
# (minutes, unbudgeted) with 20x slack for a busy machine.
LIMIT_S = 10.0


@pytest.fixture
def small_budget(monkeypatch):
    """Fewer steps, so that a test of a step-bound attack takes milliseconds; the other limits stay real."""
    monkeypatch.setattr(chat_template, "MAX_RENDER_STEPS", 20_000)


def render_refused(template: str, messages=HI, limit_s: float = LIMIT_S, clock: bool = False) -> str:
    """The one-line refusal of `template`, in bounded time.

    Unless `clock`, the render's time budget is out of reach (60 s), so that what stops the attack is a budget that
    does not depend on the machine's speed (steps, depth, size): a busy machine neither fails the test nor hides a
    budget that no longer works behind the clock."""
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp, pytest.raises(ChatTemplateError) as error:
        if not clock:
            mp.setattr(chat_template, "MAX_RENDER_SECONDS", 60.0)
        render_chat(template, messages)
    assert time.perf_counter() - start < limit_s
    message = str(error.value)
    assert "\n" not in message
    return message


# -- attacks, generated ------------------------------------------------------------------------


def nested_loops(depth: int, iterable: str) -> str:
    return "".join(f"{{% for x{i} in {iterable} %}}" for i in range(depth)) + "{% endfor %}" * depth


LOOP_SOURCES = ["range(100000)", "'x' * 100000", "messages * 100000", "(range(1000)|list) * 100", "range(300)|batch(1)"]


@pytest.mark.slow
@pytest.mark.parametrize("depth", [2, 3, 5])
@pytest.mark.parametrize("iterable", LOOP_SOURCES)
def test_nested_loops_stop_at_the_step_budget(small_budget, depth, iterable):
    assert "20,000 loop iterations and calls" in render_refused(nested_loops(depth, iterable))


DOUBLINGS = {
    "concat": "{% set ns.v = ns.v ~ ns.v %}",
    "plus": "{% set ns.v = ns.v + ns.v %}",
    "times": "{% set ns.v = ns.v * 2 %}",
    "join": "{% set ns.v = [ns.v, ns.v]|join %}",
    "join method": "{% set ns.v = ''.join([ns.v, ns.v]) %}",
    "format": "{% set ns.v = '%s%s'|format(ns.v, ns.v) %}",
    "percent": "{% set ns.v = '%s%s' % (ns.v, ns.v) %}",
    "replace": "{% set ns.v = ns.v|replace(ns.v[:1], ns.v[:2] * 2) %}",
    "replace method": "{% set ns.v = ns.v.replace(ns.v[:1], ns.v[:2] * 2) %}",
    "block": "{% set block %}{{ ns.v }}{{ ns.v }}{% endset %}{% set ns.v = block %}",
    "format method": "{% set ns.v = '{}{}'.format(ns.v, ns.v) %}",
}
SEEDS = {"text": "'x'", "unicode": "'😀'", "list": "['x']", "nested list": "[['x']]"}
TEXT_ONLY = {"join method", "replace", "replace method"}  # lists have no .replace; ''.join takes only strings


@pytest.mark.slow
@pytest.mark.parametrize(
    "doubling, seed",
    [(d, s) for d in DOUBLINGS for s in SEEDS if "list" not in s or d not in TEXT_ONLY],
)
def test_doubling_a_value_stops_at_the_size_budget(doubling, seed):
    loop = f"{{% for i in range(200) %}}{DOUBLINGS[doubling]}{{% endfor %}}"
    message = render_refused(f"{{% set ns = namespace(v={SEEDS[seed]}) %}}{loop}{{{{ ns.v|length }}}}")
    assert BUDGET in message and ("16,000,000" in message or "1,000,000 items" in message)


@pytest.mark.parametrize(
    "fan_out, depth", [(f, d) for f in (1, 2, 3) for d in (40, 200, 10**6) if f > 1 or d > chat_template.MAX_CALL_DEPTH]
)
def test_recursive_macros_stop_at_the_depth_or_step_budget(small_budget, fan_out, depth):
    body = "{{ f(n - 1) }}" * fan_out
    template = f"{{% macro f(n) %}}{{% if n %}}{body}{{% endif %}}{{% endmacro %}}{{{{ f({depth}) }}}}"
    message = render_refused(template)
    assert BUDGET in message and ("nested more than 64 deep" in message or "loop iterations and calls" in message)


@pytest.mark.parametrize("depth", [1, 10, chat_template.MAX_CALL_DEPTH - 2])
def test_macros_nested_within_the_limit_render(depth):
    template = "{% macro f(n) %}{% if n %}({{ f(n - 1) }}){% endif %}{% endmacro %}{{ f(" + str(depth) + ") }}"
    assert render_chat(template, HI) == "(" * depth + ")" * depth


RECURSIVE_LOOPS = [
    "{% for x in range(100000) recursive %}{{ loop(range(100000)) }}{% endfor %}",
    "{% for x in [1] recursive %}{{ loop([1, 1]) }}{% endfor %}",
    "{% for x in range(10) recursive %}{{ loop(range(10)) }}{{ loop(range(10)) }}{% endfor %}",
]
TRICKS = [
    "{% set c = cycler(*range(1000)) %}{% for i in range(100000) %}{% for j in range(100000) %}{{ c.next() }}"
    "{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ loop.cycle('a', 'b') }}{% endfor %}{% endfor %}",
    "{% set j = joiner('x' * 100000) %}{% for i in range(100000) %}{{ j() }}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% if loop.changed(j) %}{% endif %}{% endfor %}"
    "{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% continue %}{% endfor %}{% endfor %}",
    "{% for m in messages * 100000 %}{% for n in messages * 100000 %}{% endfor %}{% endfor %}",
]


@pytest.mark.parametrize("template", RECURSIVE_LOOPS + TRICKS)
def test_recursive_loops_and_loop_tricks_stop(small_budget, template):
    assert BUDGET in render_refused(template)


ONE_BIG_OPERATION = [
    "{% for i in range(10**9) %}{% endfor %}",
    "{% for i in range(200000) %}{% endfor %}",
    "{% for i in range(0, 10**12, 7) %}{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ [1] * 10**10 }}",
    "{{ [['x' * 1000000] * 1000] * 1000 }}",
    "{{ range(100000)|join('y' * 100000) }}",
    "{{ ('y' * 100000).join(range(100000)|map('string')) }}",
    "{{ ('x' * 1000000)|list|join('y' * 1000) }}",
    "{{ 'x'|center(10**9) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ 'x'.zfill(10**9) }}",
    "{{ '%999999999d'|format(1) }}",
    "{{ '%*d'|format(999999999, 1) }}",
    "{{ '%.999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '{:>{w}}'.format(1, w=999999999) }}",
    "{{ ('a\\n' * 1000000)|indent(1000) }}",
    "{{ ('a\\n' * 1000000)|indent('y' * 1000) }}",
    "{{ ('x' * 1000000)|replace('', 'y' * 30) }}",
    "{{ ('x' * 1000000).replace('x', 'y' * 30) }}",
    "{{ ('\\t' * 1000000).expandtabs(1000) }}",
    "{{ 10 ** 100000000 }}",
    "{{ range(100000)|batch(1)|sum(start=[]) }}",
    "{{ messages|tojson(indent=10**9) }}",
    "{{ [1]|batch(10**9, fill_with=0)|list }}",
    "{{ strftime_now('%c' * 1000000) }}",
    "{% set big = 'x' * 1000000 %}{% set s %}{% for i in range(100000) %}{{ big }}{% endfor %}{% endset %}{{ s }}",
    "{% for i in range(100000) %}{% for j in range(100) %}{{ 'x' * 10000 }}{% endfor %}{% endfor %}",
    "{% macro m() %}{{ 'x' * 1000000 }}{% endmacro %}{% for i in range(100000) %}{{ m() }}{% endfor %}",
    "{% filter upper %}{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}{% endfilter %}",
]


MAX_PEAK_BYTES = 256 << 20  # these peak at 62 MiB (collecting up to the size budget); built, they would take >= 1 GB


@pytest.mark.slow
@pytest.mark.parametrize("template", ONE_BIG_OPERATION)
def test_operations_that_would_make_huge_values_are_measured_first(template):
    assert BUDGET in render_refused(template)
    # Measured first, not built and then refused: memory, unlike time, does not depend on how busy the machine is.
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError):
            render_chat(template, HI)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_PEAK_BYTES, f"{peak / 2**20:.0f} MiB"


BIG_NUMBERS_AS_VALUES = {
    "{{ 20240101|string }}": "20240101",
    "{{ '%d' % 20240101 }}": "20240101",
    "{{ '%08d'|format(123456789012) }}": "123456789012",
    "{{ '{}-{x}'.format(12345678901, x=10**15) }}": "12345678901-1000000000000000",
    "{{ {'id': 10**12}|tojson }}": '{"id": 1000000000000}',
    "{{ [10**12, 1]|join(',') }}": "1000000000000,1",
    "{% macro m(n) %}{{ n + 1 }}{% endmacro %}{{ m(10**12) }}": "1000000000001",
    "{{ {'a': 10**12}.get('b', 10**13) }}": "10000000000000",
    "{{ (10**12) % 7 }}{{ 2 ** 64 }}": f"{10**12 % 7}{2**64}",
}


@pytest.mark.parametrize("template", list(BIG_NUMBERS_AS_VALUES))
def test_big_numbers_as_values_are_not_widths(template):
    assert render_chat(template, HI) == BIG_NUMBERS_AS_VALUES[template]


@pytest.mark.parametrize("template", ["{{ lipsum(10**6) }}", "{{ lipsum(n=1000, min=10**6, max=10**6) }}"])
def test_generators_of_text_from_small_numbers_are_gone(template):
    assert "'lipsum' is undefined" in render_refused(template)


@pytest.mark.slow
def test_the_real_budget_stops_nested_loops_in_bounded_time():
    # About 2 s of steps here, with the real clock on: the step budget stops it, the clock is only a backstop.
    message = render_refused(nested_loops(2, "range(100000)"), limit_s=2 * chat_template.MAX_RENDER_SECONDS, clock=True)
    assert BUDGET in message and "took more than" not in message
    assert f"budget: more than {chat_template.MAX_RENDER_STEPS:,} loop iterations and calls" in message


def test_the_time_budget_stops_a_render(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_STEPS", 10**12)
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.2)
    assert "took more than 0.2 s" in render_refused(nested_loops(3, "range(100000)"), limit_s=4.0, clock=True)


def test_the_clock_is_a_generous_backstop_not_the_limit():
    """Renders share the GIL: 4 at once on 2 cores take several times as long as one, and must not be refused for
    that. A 4 MiB prompt renders in well under a second here; the clock allows 20 s."""
    assert chat_template.MAX_RENDER_SECONDS >= 20
    assert chat_template.MAX_RENDER_STEPS <= 1_000_000 and chat_template.MAX_RENDER_CHARS <= 16_000_000  # primary


WRITES = {  # 20,000 characters written, each case through one of the code generator's output hooks only
    "template text (_output_const_repr)": "{% for i in range(1000) %}" + "x" * 20 + "{% endfor %}",
    "an expression (_output_child_pre/_post)": "{% for i in range(1000) %}{{ messages[0].content * 10 }}{% endfor %}",
    # 200 characters of text (under the limit), written again by each of 99 filter blocks
    "filter blocks' output (start_write/end_write)": "{% filter upper %}" * 99 + "x" * 200 + "{% endfilter %}" * 99,
}


@pytest.mark.parametrize("template", list(WRITES.values()), ids=list(WRITES))
def test_every_kind_of_write_counts_against_the_written_budget(monkeypatch, template):
    """These hooks override jinja2 internals (pinned <4): if one stopped firing, its writes would go uncounted."""
    monkeypatch.setattr(chat_template, "MAX_WRITTEN_CHARS", 1_000)  # ~20,000 written; far under every other limit
    message = render_refused(template, messages=[{"role": "user", "content": "ab"}])
    assert "more than 1,000 characters written" in message


def test_renders_in_other_threads_keep_their_own_budget(small_budget):
    outcomes: list[str] = []

    def hostile():
        try:
            render_chat(nested_loops(2, "range(100000)"), HI)
        except ChatTemplateError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=hostile) for _ in range(4)]
    for thread in threads:
        thread.start()
    for _ in range(50):  # meanwhile a real template renders, every time, in full
        assert render_chat(CHATML, HI * 200).count("<|im_start|>user") == 200
    for thread in threads:
        thread.join()
    assert len(outcomes) == 4 and all(BUDGET in o and "took more than" not in o for o in outcomes)  # steps, not time


# -- real templates render exactly as transformers renders them ------------------------------------

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
QWEN_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == "user" and ns.last_user == messages|length - 1 %}
        {%- set ns.last_user = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
        {{- '<|im_start|>' + message.role + ('\\n' + content if content else '') }}
        {%- for tool_call in message.tool_calls | default([]) %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' ~ tool_call.name ~ '", "arguments": ' }}
            {{- tool_call.arguments | tojson(indent=2, sort_keys=true) }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content|string + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if ns.last_user >= 0 %}{{- '<!-- last user turn: %d -->' % ns.last_user }}{%- endif %}
{%- endif %}"""
MACROS_AND_FILTERS = """{%- macro render(content, depth=0) -%}
{%- if content is string -%}{{ content | trim | replace('\\t', '    ') | indent(2 * depth) }}
{%- elif content is mapping -%}
{% for key, value in content | dictsort %}{{ key | upper }}={{ render(value, depth + 1) }}
{% endfor %}
{%- else -%}{{ content | map('string') | join(', ') | truncate(60) | center(70) }}{%- endif -%}
{%- endmacro -%}
{%- for message in messages | selectattr('role', 'ne', 'ignored') -%}
[{{ loop.cycle('odd', 'even') }} {{ '%-9s' | format(message.role) }} {{ loop.index }}/{{ loop.length }}]
{{ render(message.content) }}{{ '{:>4}'.format(message.content | length) }}
{% endfor -%}
{{ messages | map(attribute='role') | unique | list | join('|') }} {{ [1, 2, 3] | sum }} {{ 'ab' * 3 }}"""
CHATS = {
    "one turn": [{"role": "user", "content": "What is the capital of France?"}],
    "alternating": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  Tell me a joke\t "},
    ],
    "system first": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "<think>scattering</think>\n\nRayleigh scattering."},
        {"role": "user", "content": "ñ€😀 <|im_end|> {{ not a template }} {% raw %}"},
    ],
    "tool calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris", "days": [1, 2]}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"rain": false}'},
        {"role": "user", "content": "Thanks"},
    ],
    "structured content": [
        {"role": "user", "content": {"b": "two", "a": {"c": "three\tx", "d": "four"}}},
        {"role": "assistant", "content": [1, 2.5, "three"]},
    ],
    "long": [{"role": "user", "content": "word " * 200_000}],
    "many turns": [{"role": r, "content": f"turn {i}"} for i, r in enumerate(["user", "assistant"] * 2_000)],
}


def distinct(named: dict[str, str]) -> dict[str, str]:
    """The first name for each distinct value: fixtures that ship the same file are the same case."""
    first: dict[str, str] = {}
    for name, value in named.items():
        first.setdefault(value, name)
    return {name: value for value, name in first.items()}


# The tiny fixtures share their tokenizer files today (one template, one tokenizer.json); each distinct one is a case.
FIXTURE_TEMPLATES = distinct(
    {name: json.loads((TINY / name / "tokenizer_config.json").read_text())["chat_template"] for name in ARCHITECTURES}
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")
DISTINCT_TOKENIZERS = list(
    distinct(
        {
            name: "\0".join(
                (TINY / name / file).read_text() if (TINY / name / file).exists() else "" for file in TOKENIZER_FILES
            )
            for name in ARCHITECTURES
        }
    )
)
TEMPLATES = {
    **FIXTURE_TEMPLATES,
    "chatml": CHATML,
    "llama3": LLAMA3,
    "gemma": GEMMA,
    "qwen tools": QWEN_TOOLS,
    "macros and filters": MACROS_AND_FILTERS,
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"city": {"type": "string"}}}}]


def transformers_render(template: str, messages, **variables) -> str:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template).render(messages=messages, **variables)


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_real_templates_render_as_transformers_does(template, chat):
    variables = dict(add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    if template == "qwen tools":
        variables["tools"] = TOOLS
    try:
        expected = transformers_render(TEMPLATES[template], CHATS[chat], **variables)
    except Exception:  # noqa: BLE001 - the template refuses this chat (Gemma and a system role): so must we
        with pytest.raises(ChatTemplateError):
            render_chat(TEMPLATES[template], CHATS[chat], **variables)
        return
    assert render_chat(TEMPLATES[template], CHATS[chat], **variables) == expected


def test_a_four_megabyte_prompt_renders_within_the_budget():
    content = "é" * (4 << 20)
    assert render_chat(CHATML, [{"role": "user", "content": content}]).count("é") == 4 << 20


# -- preparing a prompt off the scheduler thread must not stop it ------------------------------------


def longest_pause_of_another_thread(work) -> tuple[float, float]:
    """(seconds `work` took, longest gap between ticks of a thread that sleeps 1 ms at a time meanwhile)."""
    gaps: list[float] = []
    done = threading.Event()

    def ticker():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.02)
    start = time.perf_counter()
    try:
        work()
    finally:
        took = time.perf_counter() - start
        done.set()
        thread.join()
    return took, max(gaps)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(TINY / "llama_classic")


@pytest.mark.slow
@pytest.mark.parametrize(
    "prepare",
    [
        lambda tok, text: tok.encode(text),
        lambda tok, text: tok.encode_chat([{"role": "user", "content": text}]),
        lambda tok, text: tok.encode_chat([{"role": "user", "content": text + "<|im_end|>" + text}]),
    ],
    ids=["encode", "encode_chat", "encode_chat with special-token text"],
)
def test_tokenizing_a_long_prompt_lets_other_threads_run(tok, prepare):
    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB: half a second to a second here
    # Holding the GIL, the pause would be the whole call; now it is the Python list of ids being made (took / 40
    # here). Up to three tries: a GIL held every time fails each, one scheduling hiccup of a busy machine does not.
    for _ in range(3):
        took, pause = longest_pause_of_another_thread(lambda: prepare(tok, text))
        if pause < took / 2:
            break
    assert pause < took / 2, (took, pause)


@pytest.mark.parametrize("name", DISTINCT_TOKENIZERS)
def test_fast_encoding_gives_the_same_ids(name):
    tok = Tokenizer.from_folder(TINY / name)
    for text in ["", "a", "hello world", "añ€😀 <|im_end|> ok\n\n  x", "The end. " * 2_000]:
        for special in (True, False):
            expected = tok._plain.encode(text, add_special_tokens=special).ids
            assert tok.encode(text, add_special_tokens=special) == expected


@pytest.mark.slow
@pytest.mark.parametrize("method", ["encode", "encode_chat"])
def test_health_answers_while_a_long_prompt_is_tokenized(method):
    import mlxinfer
    from mlxinfer.server import ModelSet, ServerSettings
    from mlxinfer.server.uvicorn_host import BackgroundServer

    text = "The quick brown fox jumps over the lazy dog. " * 80_000  # 3.6 MB: past the context, refused once counted
    endpoint, body = {
        "encode": ("completions", {"prompt": text}),
        "encode_chat": ("chat/completions", {"messages": [{"role": "user", "content": text}]}),
    }[method]
    model = mlxinfer.load(TINY / "llama_classic")
    tokenized: list[float] = []  # how long the server's tokenizer call took: the test needs it to have run
    real = getattr(model.tokenizer, method)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            tokenized.append(time.perf_counter() - start)

    setattr(model.tokenizer, method, timed)
    models = ModelSet()
    models.add(model)
    with BackgroundServer(models, ServerSettings(port=0)) as server:
        # Holding the GIL, /health would wait for the whole call. Up to three tries: a GIL held every time fails
        # each, one scheduling hiccup of a busy machine does not.
        for _ in range(3):
            tokenized.clear()
            status, latencies = _health_during(server.url, endpoint, body)
            if tokenized and latencies and max(latencies) < tokenized[0] / 2:
                break
    assert status == 400  # past the model's context
    assert tokenized, "the server no longer tokenizes this prompt: give the test one it does"
    assert latencies, f"the POST ended ({tokenized[0]:.3f} s tokenizing) before the first /health: give a longer prompt"
    # Ratios, not seconds: the tokenizing must take many /health round trips for a held GIL to show (any machine).
    assert tokenized[0] > 5 * min(latencies), ("tokenizing is too quick to tell: give a longer prompt", tokenized)
    assert max(latencies) < tokenized[0] / 2, (tokenized, max(latencies))


def _health_during(url: str, endpoint: str, body: dict) -> tuple[int, list[float]]:
    """(the status of a POST to `endpoint`, how long each GET /health sent while it ran took to answer)."""
    import httpx

    answer: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answer.append(httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=120)))
    request.start()
    latencies = []
    while request.is_alive():
        sent = time.perf_counter()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        latencies.append(time.perf_counter() - sent)
        time.sleep(0.01)
    request.join()
    return answer[0].status_code, latencies  # empty if the POST ended before the first probe


NESTINGS = {
    "parentheses": (lambda n: "{{ " + "(" * n + "1" + ")" * n + " }}", lambda n: "1"),
    "lists": (lambda n: "{{ " + "[" * n + "]" * n + " }}", lambda n: "[" * n + "]" * n),
    "ifs": (lambda n: "{% if 1 %}" * n + "x" + "{% endif %}" * n, lambda n: "x"),
    "fors": (lambda n: "{% for i in [1] %}" * n + "x" + "{% endfor %}" * n, lambda n: "x"),
    "sums": (lambda n: "{{ 1" + " + 1" * n + " }}", lambda n: str(n + 1)),
    "filters": (lambda n: "{{ ' x '" + "|trim" * n + " }}", lambda n: "x"),
}


@pytest.mark.parametrize("name", list(NESTINGS))
def test_templates_nested_a_little_render(name):
    template, expected = NESTINGS[name]
    assert render_chat(template(20), HI) == expected(20)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, depth", [(n, d) for n in NESTINGS for d in (200, 3000, 20000) if d > 200 or n not in ("sums", "filters")]
)
def test_templates_nested_too_deeply_fail_in_one_line(name, depth):
    template, _ = NESTINGS[name]
    message = render_refused(template(depth))
    assert "nests its expressions or blocks too deeply" in message


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('no\\nsuch ' * 1000000) }}",
        "{{ raise_exception(messages[0].content) }}",
        "{{ 1 + messages[0].content }}",
        "{{ messages[0].content.nope() }}",
    ],
)
def test_errors_a_template_raises_stay_one_short_line(template):
    message = render_refused(template, [{"role": "user", "content": "huge\n" * 1_000_000}])
    assert len(message) < 500
