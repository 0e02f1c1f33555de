"""Hostile schemas: bounded before they compile, compiled where a crash or a runaway ends only a child process,
and never able to end, stall or outlive the server.

The crashing inputs are the issue's classes: tens of thousands of `required` keys and a `$ref` chain a few
thousand definitions deep overflow llguidance's native stack (a segmentation fault), thousands of
`patternProperties` compile for minutes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from mlxinfer.errors import GrammarError, ShutdownError
from mlxinfer.grammar import bounds, check_schema, isolated, json_schema
from tests.conftest import TINY

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


def many_required(count: int) -> dict:
    return {"type": "object", "required": [f"k{i}" for i in range(count)]}


def ref_chain(count: int) -> dict:
    """#/$defs/d0 -> d1 -> ... -> d{count}, each an object whose one property is the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(count)}
    return {"$defs": {**defs, f"d{count}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def many_pattern_properties(count: int) -> dict:
    return {"type": "object", "patternProperties": {f"^p{i}[a-z]*x$": {"type": "integer"} for i in range(count)}}


def grammar_text(schema: dict) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False})


# --- the bounds, where they live ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema, words",
    [
        (many_required(30_000), "schema.required has 30,000 entries; at most 1,000 are accepted"),
        (ref_chain(3_000), "schema has 3,001 definitions ($defs); at most 1,000 are accepted"),
        (ref_chain(40), "schema is nested more than 64 levels deep (JSON objects and arrays, counting each $ref"),
        (many_pattern_properties(3_000), "patternProperties to 3,000; at most 64 are accepted"),
        (many_pattern_properties(65), "patternProperties to 65; at most 64 are accepted"),
        (
            {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "a+"} for i in range(600)}},
            "brings the schema's patterns to 513; at most 512 are accepted",
        ),
        ({"type": "string", "pattern": "a" * 1001}, "schema.pattern has a pattern of 1,001 characters; at most 1,000"),
        ({"type": "object", "properties": {f"k{i}": {"enum": list(range(30))} for i in range(900)}},
         "schema holds more than 20,000 JSON values"),
    ],
    ids=["required", "ref-chain", "ref-depth", "pattern-properties", "pattern-properties-65", "patterns",
         "pattern-length", "values"],
)  # fmt: skip
def test_a_schema_over_a_limit_is_refused_naming_it(schema, words):
    with pytest.raises(GrammarError) as raised:
        check_schema(schema, "schema")
    assert words in str(raised.value)
    assert "\n" not in str(raised.value)


def test_nesting_alone_counts_toward_the_depth():
    schema: dict = {"type": "integer"}
    for _ in range(40):  # 80 JSON levels: an object, then its "properties"
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(GrammarError, match="nested more than 64 levels deep"):
        check_schema(schema, "schema")


def test_real_schemas_pass_the_bounds():
    tree = {  # recursive: a reference back to an open schema adds no depth
        "$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}},
        "$ref": "#/$defs/node",
    }
    nested: dict = {"type": "integer"}
    for level in range(10):  # OpenAI's structured outputs allow 10 levels
        nested = {"type": "object", "properties": {f"f{level}": nested, "n": {"type": "string"}}, "required": ["n"]}
    wide = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 20} for i in range(1000)}}
    models = {f"M{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/M{i + 1}"}}} for i in range(12)}
    chain = {"$defs": {**models, "M12": {"type": "string"}}, "$ref": "#/$defs/M0"}  # pydantic-style nested models
    for schema in (tree, nested, wide, chain, many_required(1000), many_pattern_properties(64)):
        check_schema(schema, "schema")


def test_schemas_at_the_limits_compile_on_a_small_thread_stack(tmp_path):
    """What passes the bounds compiles in this process too: with the 512 KiB a macOS thread may get, the deepest
    `$ref` chain, the most `required` keys and `patternProperties` allowed compile without a crash, in seconds."""
    deepest = ref_chain(21)  # 3 levels a hop: the deepest such chain the bounds let through
    check_schema(deepest, "schema")
    with pytest.raises(GrammarError):
        check_schema(ref_chain(22), "schema")
    schemas = [deepest, many_required(bounds.MAX_KEYS), many_pattern_properties(bounds.MAX_PATTERN_PROPERTIES)]
    script = textwrap.dedent(
        """
        import json, sys, threading, llguidance
        threading.stack_size(512 * 1024)
        def run():
            for text in json.loads(sys.stdin.read()):
                failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, None)
                assert not failed, messages
            print("compiled")
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([grammar_text(s) for s in schemas]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "compiled"), done.stderr[-2000:]


# --- the child process: a crash or a runaway ends only it --------------------------------------------------------


@pytest.mark.parametrize("schema", [many_required(30_000), ref_chain(3_000)], ids=["required", "ref-chain"])
def test_a_grammar_that_crashes_the_compiler_ends_only_the_child(schema, monkeypatch):
    # The crash comes within a second on an idle machine; a busy one (parallel tests) must not turn it into the
    # deadline's refusal, which test_a_runaway_compile_is_killed_at_the_deadline proves on its own.
    monkeypatch.setattr(isolated, "COMPILE_TIMEOUT_S", 60.0)
    text = grammar_text(schema)
    with pytest.raises(GrammarError, match=r"^schema crashed the grammar compiler \(SIGSEGV\); simplify it"):
        isolated.check_in_child([text], "schema")
    assert isolated.check_in_child([grammar_text({"type": "integer"})], "schema") == [None]  # still here


def test_a_request_larger_than_a_pipe_reaches_the_child_however_slowly_it_is_read(monkeypatch):
    # 8 grammars of ~25 KB each, and a poll so short the child has read nothing by the first timeout: a request
    # fed through communicate() lost its unsent part on the retry and the child waited for it until the deadline.
    monkeypatch.setattr(isolated, "POLL_S", 0.001)
    schemas = [
        {"type": "object", "properties": {f"p{i}_{j}": {"type": "integer"} for j in range(900)}} for i in range(8)
    ]
    texts = [grammar_text(schema) for schema in schemas]
    assert sum(map(len, texts)) > 3 * 65536  # three times what a Linux pipe holds
    assert isolated.check_in_child(texts, "schema") == [None] * 8


@pytest.mark.slow
def test_a_runaway_compile_is_killed_at_the_deadline(monkeypatch):
    monkeypatch.setattr(isolated, "COMPILE_TIMEOUT_S", 1.0)
    started = time.monotonic()
    with pytest.raises(GrammarError, match=r"^schema did not compile within 1 s; simplify it"):
        isolated.check_in_child([grammar_text(many_pattern_properties(2_000))], "schema")
    assert time.monotonic() - started < 5
    assert not _compile_children()


def test_an_invalid_grammar_is_refused_with_llguidance_s_reason_and_remembered():
    text = grammar_text({"type": "string", "pattern": "(unclosed"})
    [why] = isolated.check_in_child([text], "schema")
    assert "(unclosed" in why and "\n" not in why
    assert isolated.check_in_child([text], "schema") == [why]  # from memory: no second child
    assert not _compile_children()


def _compile_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "child_check.py" in " ".join(p.cmdline())]


@pytest.fixture
def slow_child(tmp_path, monkeypatch):
    """Every compile's child sleeps for a minute (as a runaway compile would), and the test waits for one."""
    sleeper = tmp_path / "child_check.py"  # the name the test looks for among this process's children
    sleeper.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(isolated, "_CHILD", sleeper)

    def started() -> None:
        deadline = time.monotonic() + 10
        while not _compile_children():
            assert time.monotonic() < deadline, "no compile started"
            time.sleep(0.02)

    return started


def _in_thread(work) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run():
        try:
            outcome.append(work())
        except Exception as e:  # noqa: BLE001 - the test reads what it raised
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_compile_stops_when_its_client_leaves(slow_child):
    gone = threading.Event()

    def compile_for_a_client():
        with isolated.cancelled_by(gone):
            return isolated.check_in_child(['start: "a"\n'], "schema")

    thread, outcome = _in_thread(compile_for_a_client)
    slow_child()
    gone.set()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(outcome[0], GrammarError)
    assert str(outcome[0]) == "compiling the schema was stopped: the client left"
    assert not _compile_children()


def test_a_compile_stops_when_the_server_stops(slow_child):
    thread, outcome = _in_thread(lambda: isolated.check_in_child(['start: "b"\n'], "schema"))
    slow_child()
    isolated.end_compiles("the server is shutting down")
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(outcome[0], ShutdownError)
    assert "the server is shutting down" in str(outcome[0])
    assert not _compile_children()


def test_a_server_stopping_while_a_compile_starts_still_stops_it(slow_child, monkeypatch):
    real_popen = subprocess.Popen

    def popen_then_stop(*args, **kwargs):  # the server stops between the child's start and its record
        child = real_popen(*args, **kwargs)
        stopping = threading.Thread(target=isolated.end_compiles, args=("the server is shutting down",))
        stopping.start()
        stopping.join(0.5)  # it waits for the record where the start is recorded under the same lock
        return child

    monkeypatch.setattr(isolated.subprocess, "Popen", popen_then_stop)
    with pytest.raises(ShutdownError, match="the server is shutting down"):
        isolated.check_in_child(['start: "c"\n'], "schema")
    assert not _compile_children()


def test_the_python_api_refuses_a_schema_over_the_bounds():
    with pytest.raises(GrammarError, match="schema.required has 30,000 entries"):
        json_schema(many_required(30_000))


# --- the server: it survives every class and answers the next request ------------------------------------------


def _serving_url(process: subprocess.Popen) -> str:
    for line in process.stderr:
        found = re.search(r"Serving \S+ on (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            return found.group(1)
    raise AssertionError(f"the server did not start (exit {process.wait()})")


def _model_with_tools(folder: Path, endless: bool = False) -> Path:
    """The tiny llama checkpoint wearing Qwen3's chat template (Hermes tool calls), with a long context;
    `endless`: with no end-of-sequence token, so a stream runs until something stops it (the random weights
    otherwise pick one now and then, and a stream meant to be running at SIGTERM would have ended)."""
    import shutil

    shutil.copytree(TINY / "llama_classic", folder, ignore=shutil.ignore_patterns("golden.safetensors"))
    no_eos = {"eos_token_id": None} if endless else {}
    for name, changes in (
        ("config.json", {"max_position_embeddings": 8192, **no_eos}),  # room for a stream still running at SIGTERM
        ("generation_config.json", no_eos),
        ("tokenizer_config.json", {"chat_template": (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()}),
        ("tokenizer_config.json", {"eos_token": None} if endless else {}),
    ):
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), **changes}))
    return folder


def _serve(folder: Path, before: str = "") -> subprocess.Popen:
    """`mlxinfer serve` in its own process (a crash there must not end the tests), after `before` (Python)."""
    script = f"{before}\nimport sys\nfrom mlxinfer.cli import main\nsys.exit(main())"
    command = [sys.executable, "-c", script, "serve", str(folder), "--port", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = _serve(_model_with_tools(tmp_path_factory.mktemp("hostile") / "tools"))
    try:
        url = _serving_url(process)
        threading.Thread(target=process.stderr.read, daemon=True).start()  # its log must not fill the pipe
        yield url, process
    finally:
        process.kill()
        process.wait()


CHAT = {"model": "tools", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
PLAIN = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _tools(schema: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/chat/completions", {**CHAT, "response_format": schema_format(many_required(30_000))},
         "response_format.json_schema.schema", "required has 30,000 entries; at most 1,000 are accepted"),
        ("/v1/chat/completions", {**CHAT, "tools": _tools(ref_chain(3_000))},
         "tools[0].function.parameters", "3,001 definitions ($defs); at most 1,000 are accepted"),
        ("/api/chat", {"model": "tools", "messages": CHAT["messages"], "stream": False,
                       "format": many_pattern_properties(3_000)},
         None, "patternProperties to 3,000; at most 64 are accepted"),
        ("/v1/messages", {"model": "tools", "max_tokens": 2, "messages": CHAT["messages"],
                          "tools": [{"name": "f", "input_schema": ref_chain(40)}]},
         None, "nested more than 64 levels deep"),
    ],
    ids=["openai-response-format", "openai-tools", "ollama-format", "anthropic-tools"],
)  # fmt: skip
def test_the_server_refuses_each_class_and_answers_the_next_request(server, path, body, param, words):
    url, process = server
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert words in response.text
    if param is not None:
        assert response.json()["error"]["param"] == param
    after = httpx.post(
        url + "/v1/chat/completions",
        json={**CHAT, "response_format": schema_format(PLAIN)},
        timeout=60,
    )
    assert after.status_code == 200, after.text
    assert process.poll() is None


@pytest.mark.slow
def test_sigterm_ends_compiles_and_streams_and_exits_0(tmp_path):
    """With a compile running (its child sleeps, as a runaway would) and a stream open, SIGTERM ends both and the
    server exits 0 within seconds; a client that left first took its compile with it."""
    before = (
        "from pathlib import Path\nimport mlxinfer.grammar.isolated as isolated\n"
        f"isolated._CHILD = Path({str(tmp_path / 'child_check.py')!r})\n"
        "isolated.COMPILE_TIMEOUT_S = 60.0"  # past the test's waits: only a stop, not the deadline, ends a compile
    )
    (tmp_path / "child_check.py").write_text("import time\ntime.sleep(60)\n")
    process = _serve(_model_with_tools(tmp_path / "tools", endless=True), before)
    try:
        url = _serving_url(process)
        threading.Thread(target=process.stderr.read, daemon=True).start()
        server = psutil.Process(process.pid)

        def compiles() -> int:
            return sum("child_check.py" in " ".join(p.cmdline()) for p in server.children(recursive=True))

        schema_body = {
            **CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": PLAIN}},
        }
        with pytest.raises(httpx.ReadTimeout):  # the client leaves after a second
            httpx.post(url + "/v1/chat/completions", json=schema_body, timeout=1.0)
        _wait_until(lambda: compiles() == 0, "the compile of a client that left kept running")

        answers: list = []
        waiting = threading.Thread(
            target=lambda: answers.append(httpx.post(url + "/v1/chat/completions", json=schema_body, timeout=30))
        )
        waiting.start()
        _wait_until(lambda: compiles() == 1, "no compile started")
        stream_body = {"model": "tools", "prompt": "1, 2, 3,", "max_tokens": 8000, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=stream_body, timeout=30) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            stopped = time.monotonic()
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert process.wait(timeout=15) == 0
        assert time.monotonic() - stopped < 8
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
        waiting.join(10)
        assert answers and answers[0].status_code == 503 and "shutting down" in answers[0].text
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _wait_until(condition, why: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)
