"""The OpenAI-compatible server over HTTP: the official client, bad input, safety, load, disconnects, shutdown."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

import mlxinfer
from mlxinfer.engine import Delta, Job, SchedulerConfig
from mlxinfer.errors import ServerConfigError
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def server(smol):
    models = ModelSet()
    served = models.add(smol, SchedulerConfig(max_batch=8, max_queue=64))
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        running.model_id = served.id
        running.served = served
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_openai_client_chat_and_completions_stream_and_not(server, client, smol):
    chat = client.chat.completions.create(model=server.model_id, messages=QUESTION, temperature=0, max_tokens=20)
    assert chat.choices[0].message.content == ANSWER
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens == len(smol.tokenizer.encode_chat(QUESTION))
    assert chat.usage.completion_tokens == len(smol.tokenizer.encode(ANSWER)) and chat.usage.total_tokens > 0

    chunks = list(
        client.chat.completions.create(
            model=server.model_id,
            messages=QUESTION,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt a second time

    ids = smol.tokenizer.encode_chat(QUESTION)
    whole = client.completions.create(model=server.model_id, prompt=ids, temperature=0, max_tokens=20)
    assert whole.choices[0].text == ANSWER
    streamed = client.completions.create(model=server.model_id, prompt=ids, temperature=0, max_tokens=20, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ANSWER

    text_prompt = client.completions.create(model=server.model_id, prompt="1, 2, 3,", temperature=0, max_tokens=4)
    assert text_prompt.choices[0].text.startswith(" 4,")
    assert text_prompt.choices[0].finish_reason == "length"


def test_stop_strings_and_seeded_sampling(server, client):
    stopped = client.chat.completions.create(
        model=server.model_id, messages=QUESTION, temperature=0, max_tokens=20, stop=[" Paris"]
    )
    assert stopped.choices[0].message.content == "The capital of France is"
    assert stopped.choices[0].finish_reason == "stop"
    sampled = [
        client.chat.completions.create(
            model=server.model_id, messages=QUESTION, temperature=0.9, top_p=0.9, seed=7, max_tokens=12
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_models_health_and_metrics(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server.model_id]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "mlxinfer_requests_total",
        "mlxinfer_prompt_tokens_total",
        "mlxinfer_completion_tokens_total",
        "mlxinfer_cached_prompt_tokens_total",
        "mlxinfer_time_to_first_token_seconds_bucket",
        "mlxinfer_time_per_output_token_seconds_bucket",
        "mlxinfer_queue_depth",
        "mlxinfer_prefix_cache_hit_rate",
        "mlxinfer_memory_in_use_bytes",
    ):
        assert name in text
    assert metric(server.url, "mlxinfer_memory_in_use_bytes") > 50e6  # the model's weights at least


def good_chat(**extra) -> dict:
    return {"messages": QUESTION, "max_tokens": 2, "temperature": 0, **extra}


BAD_REQUESTS = [
    ("not json", b"{'messages': ", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("NaN temperature", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None),
    ("infinite temperature", b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}', 400, None),
    ("huge temperature", good_chat(temperature=1e300), 400, "temperature"),
    ("string temperature", good_chat(temperature="0.5"), 400, "temperature"),
    ("negative max_tokens", good_chat(max_tokens=-1), 400, "max_tokens"),
    ("float max_tokens", good_chat(max_tokens=2.5), 400, "max_tokens"),
    ("huge max_tokens", good_chat(max_tokens=10**9), 400, "max_tokens"),
    ("max_tokens past the context", good_chat(max_tokens=8190), 400, "max_tokens"),
    ("top_p zero", good_chat(top_p=0), 400, "top_p"),
    ("top_p above one", good_chat(top_p=1.5), 400, "top_p"),
    ("string seed", good_chat(seed="7"), 400, "seed"),
    ("n two", good_chat(n=2), 400, "n"),
    ("too many stops", good_chat(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("stop not strings", good_chat(stop=[1]), 400, "stop"),
    ("no messages", {"max_tokens": 2}, 400, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (
        "image naming none",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0]",
    ),
    ("logprobs", good_chat(logprobs=True), 400, "logprobs"),
    ("frequency penalty", good_chat(frequency_penalty=0.5), 400, "frequency_penalty"),
    ("stream not bool", good_chat(stream="yes"), 400, "stream"),
    ("unknown model", good_chat(model="gpt-4o"), 404, "model"),
    ("a path as model", good_chat(model="/etc/passwd"), 404, "model"),
    ("a hub id as model", good_chat(model="Qwen/Qwen3-0.6B"), 404, "model"),
]


@pytest.mark.parametrize("case,body,status,param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_its_status_and_an_openai_error(server, case, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param


def status_of_oversized_post(url: str, size: int) -> int:
    """The status of a POST whose Content-Length says `size` bytes, read before the body is sent.

    The server answers 413 and closes without reading the body; a client still sending megabytes
    then races the close (the kernel resets a socket closed with unread data, which can drop
    the answer), so only the head and a little of the body are sent here.
    """
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b"x" * 1024)
        status_line = sock.makefile("rb").readline()
    return int(status_line.split()[1])


def test_other_refusals_and_the_server_keeps_serving(server):
    url = server.url
    assert status_of_oversized_post(url, 5 << 20) == 413
    assert httpx.get(url + "/v1/chat/completions").status_code == 405
    prompt_too_long = {"prompt": list(range(10, 8300)), "max_tokens": 2}
    response = httpx.post(url + "/v1/completions", json=prompt_too_long)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.post(url + "/v1/completions", json={"prompt": [10**7], "max_tokens": 2}).status_code == 400
    assert httpx.post(url + "/v1/completions", json={"prompt": "", "max_tokens": 2}).status_code == 400
    # After all of that (and the parametrized cases), a good request still works.
    response = httpx.post(url + "/v1/chat/completions", json=good_chat(max_tokens=20), timeout=300)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == ANSWER


def test_host_and_origin_checks(server):
    url = server.url
    assert httpx.get(url + "/health", headers={"host": "evil.example:8080"}).status_code == 403
    assert httpx.get(url + "/v1/models", headers={"host": "localhost"}).status_code == 200
    port = url.rsplit(":", 1)[1]
    same_origin = {"origin": f"http://127.0.0.1:{port}"}
    assert httpx.get(url + "/v1/models", headers=same_origin).status_code == 200
    response = httpx.post(url + "/v1/chat/completions", json=good_chat(), headers={"origin": "https://evil.example"})
    assert response.status_code == 403
    assert "access-control-allow-origin" not in response.headers


def test_unsafe_settings_are_refused():
    with pytest.raises(ServerConfigError, match="allow-remote"):
        ServerSettings(host="0.0.0.0")
    with pytest.raises(ServerConfigError, match="api-key"):
        ServerSettings(host="0.0.0.0", allow_remote=True)
    with pytest.raises(ServerConfigError, match="wildcard"):
        ServerSettings(cors_origins=("*",))
    assert ServerSettings(host="0.0.0.0", allow_remote=True, api_key="a-long-key").host == "0.0.0.0"
    assert ServerSettings(host="::1").host == "::1"


def test_the_cli_refuses_a_public_address_before_loading_anything():
    result = subprocess.run(
        [sys.executable, "-m", "mlxinfer.cli", "serve", "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "--allow-remote" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Loading" not in result.stderr


def test_api_key_and_listed_cors_origin():
    model = mlxinfer.load(TINY / "llama_classic")
    models = ModelSet()
    models.add(model)
    settings = ServerSettings(port=0, api_key="s3cret-key", cors_origins=("http://localhost:3000",))
    with BackgroundServer(models, settings) as running:
        url = running.url
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer wrong-key"}).status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/health").status_code == 401
        assert httpx.get(url + "/").status_code == 200  # the chat page itself asks for the key
        ok = httpx.get(url + "/v1/models", headers={"authorization": "Bearer s3cret-key"})
        assert ok.status_code == 200
        preflight = httpx.options(
            url + "/v1/chat/completions",
            headers={"origin": "http://localhost:3000", "access-control-request-method": "POST"},
        )
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        key = openai.OpenAI(base_url=url + "/v1", api_key="s3cret-key", max_retries=0)
        assert key.completions.create(model="llama_classic", prompt=[3, 4, 5], max_tokens=3).usage.completion_tokens


def test_full_queue_gets_429_with_retry_after(smol):
    models = ModelSet()
    served = models.add(smol, SchedulerConfig(max_batch=1, max_queue=1))
    holding, release = threading.Event(), threading.Event()

    def hold(event):  # runs on the scheduler's thread: while it waits, the only place stays taken
        if isinstance(event, Delta):
            holding.set()
            release.wait(60)

    with BackgroundServer(models, ServerSettings(port=0)) as running:
        served.scheduler.submit(Job(smol.encode_prompt("Hi", chat=True), hold, max_tokens=2))
        # Only once the held job runs is the one queue place free for the next request alone: while the held
        # job is still in the inbox it counts as queued, and a request sent then would take the place itself.
        assert holding.wait(60)
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(
                httpx.post, running.url + "/v1/chat/completions", json=good_chat(max_tokens=20), timeout=300
            )
            deadline = time.monotonic() + 30
            while served.scheduler.queued + len(served.scheduler._inbox) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert served.scheduler.queued + len(served.scheduler._inbox) == 1
            refused = httpx.post(running.url + "/v1/chat/completions", json=good_chat())
            release.set()
            assert refused.status_code == 429
            assert 1 <= int(refused.headers["retry-after"]) <= 60
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert queued.result().json()["choices"][0]["message"]["content"] == ANSWER


CANCELLED = ("mlxinfer_generations_total", '{reason="cancelled"}')


def test_disconnect_mid_stream_frees_the_slot(server):
    url = server.url
    cancelled = metric(url, *CANCELLED)
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in seen)
        assert metric(url, "mlxinfer_running_requests") == 1
    deadline = time.monotonic() + 60
    while metric(url, "mlxinfer_running_requests") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(url, "mlxinfer_running_requests") == 0
    assert metric(url, *CANCELLED) == cancelled + 1


def test_non_streaming_client_that_leaves_is_cancelled_too(server):
    url = server.url
    cancelled = metric(url, "mlxinfer_generations_total", '{reason="cancelled"}')
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=2.0))
    deadline = time.monotonic() + 60
    while (
        metric(url, "mlxinfer_generations_total", '{reason="cancelled"}') == cancelled and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert metric(url, "mlxinfer_generations_total", '{reason="cancelled"}') == cancelled + 1
    assert metric(url, "mlxinfer_running_requests") == 0


LOAD_QUESTIONS = [
    "What is the capital of France?",
    "What is 2+2?",
    "Name a primary color.",
    "What is the opposite of hot?",
    "How many legs does a cat have?",
    "What color is the sky?",
    "Say hello in Spanish.",
    "What is the largest planet?",
]


# Eight clients, one per question, each sending two in a row: every batch mixes all eight prompts and a
# client's second request joins a batch that is already decoding. Two rounds of the same work: memory held
# after round 1 (prefix cache filled) must not grow. (16 x 5 proved nothing more and took 5 minutes here; a third
# round cost about a minute of the suite's time.)
LOAD_CLIENTS, LOAD_REQUESTS, LOAD_ROUNDS = 8, 2, 2
RSS_GROWTH_LIMIT_BYTES = 64 * 2**20  # round 2 may not hold more than round 1 did, within noise


def test_load_concurrent_clients_match_serial_runs_and_rss_stays_flat(server):
    url = server.url
    requests_before = metric(url, "mlxinfer_requests_total", '{endpoint="chat",status="200"}')
    generations_before = sum(metric(url, "mlxinfer_generations_total", f'{{reason="{r}"}}') for r in ("stop", "length"))

    def ask(question: str) -> dict:
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        assert response.status_code == 200, response.text
        return response.json()

    serial = {q: ask(q)["choices"][0]["message"]["content"] for q in LOAD_QUESTIONS}

    def client_run(client: int) -> list[tuple[str, dict]]:
        questions = [LOAD_QUESTIONS[(client + i) % len(LOAD_QUESTIONS)] for i in range(LOAD_REQUESTS)]
        return [(q, ask(q)) for q in questions]

    rss = []
    for _ in range(LOAD_ROUNDS):
        with ThreadPoolExecutor(LOAD_CLIENTS) as pool:
            results = [item for run in pool.map(client_run, range(LOAD_CLIENTS)) for item in run]
        assert len(results) == LOAD_CLIENTS * LOAD_REQUESTS
        mismatched = [(q, b["choices"][0]["message"]["content"]) for q, b in results]
        mismatched = [(q, text) for q, text in mismatched if text != serial[q]]
        assert not mismatched, mismatched[:3]
        gc.collect()
        rss.append(psutil.Process().memory_info().rss)  # the server runs in this process
    print("RSS after each round (MiB):", [round(r / 2**20) for r in rss])
    assert max(rss[1:]) - rss[0] < RSS_GROWTH_LIMIT_BYTES, [r // 2**20 for r in rss]
    expected = len(LOAD_QUESTIONS) + LOAD_ROUNDS * LOAD_CLIENTS * LOAD_REQUESTS
    after = metric(url, "mlxinfer_requests_total", '{endpoint="chat",status="200"}')
    assert after - requests_before == expected
    generations = sum(metric(url, "mlxinfer_generations_total", f'{{reason="{r}"}}') for r in ("stop", "length"))
    assert generations - generations_before == expected  # every request generated once: none lost, none run twice
    assert metric(url, "mlxinfer_prefix_cache_hit_rate") > 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_ends_streams_with_a_final_event_and_exits(smol_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxinfer.cli", "serve", str(smol_path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2][6:])
        assert "shutting down" in final["error"]["message"]
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        output = process.stdout.read() if process.stdout else ""
    assert "Traceback" not in output, output


def test_serve_refuses_a_taken_port_before_loading(held_port):
    port = held_port
    command = [sys.executable, "-m", "mlxinfer.cli", "serve", str(TINY / "llama_classic"), "--port", str(port)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # no "Loading", no "Serving", no uvicorn log
    assert lines[0].startswith(f"Error: port {port} on 127.0.0.1 is already in use (another mlxinfer serve?); ")
    assert "pick another with --port, e.g. --port " in lines[0]


@pytest.mark.slow
def test_serve_says_serving_with_the_real_port_once_it_answers():
    command = [sys.executable, "-m", "mlxinfer.cli", "serve", str(TINY / "llama_classic"), "--port", "0",
               "--max-body-mb", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = next(line for line in process.stderr if line.startswith("Serving") or line.startswith("Error"))
        found = re.fullmatch(r"Serving llama_classic on http://127\.0\.0\.1:(\d+)/v1 \(Ctrl-C to stop\)\n", line)
        assert found, line
        port = int(found.group(1))
        assert port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200  # no retry: it is ready
        large = good_chat(messages=[{"role": "user", "content": "x" * (3 << 19)}])  # 1.5 MiB
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=large, timeout=30)
        assert refused.status_code == 413
        assert refused.json()["error"]["message"].endswith("(1 MiB); send smaller images, or start the server with "
                                                           "a larger --max-body-mb")  # fmt: skip
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_background_server_on_a_taken_port_raises_port_in_use(held_port):
    from mlxinfer.errors import PortInUseError

    with pytest.raises(PortInUseError, match=f"^port {held_port} on 127.0.0.1 is already in use .*--port"):
        BackgroundServer(ModelSet(), ServerSettings(port=held_port)).start()


def test_ipv6_loopback_serves_on_its_own_socket(tiny_llama):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    models = ModelSet()
    models.add(tiny_llama, SchedulerConfig())
    try:
        with BackgroundServer(models, ServerSettings(host="::1", port=0)) as running:
            assert running.url.startswith("http://[::1]:")
            assert httpx.get(running.url + "/health").status_code == 200
    finally:
        models.close()  # its scheduler; the shared model stays loaded


def test_the_probe_finds_a_wildcard_listener_through_loopback():
    # What listen() asks first on macOS, where binding 127.0.0.1:P succeeds beside a listener on *:P.
    from mlxinfer.server.uvicorn_host import port_answers

    with socket.socket() as wildcard:
        wildcard.bind(("0.0.0.0", 0))
        wildcard.listen()
        port = wildcard.getsockname()[1]
        assert port_answers("127.0.0.1", port)
    assert not port_answers("127.0.0.1", port)  # closed: refused at once


def test_listen_probes_first_where_binding_cannot_tell(monkeypatch):
    from mlxinfer.errors import PortInUseError
    from mlxinfer.server import uvicorn_host as run

    asked: list[tuple[str, int]] = []
    monkeypatch.setattr(run, "PROBE_BEFORE_BIND", True)
    monkeypatch.setattr(run, "port_answers", lambda address, port: asked.append((address, port)) or True)
    with pytest.raises(PortInUseError, match="^port 5000 on 0.0.0.0 is already in use"):
        run.listen(ServerSettings(host="0.0.0.0", port=5000, allow_remote=True, api_key="k" * 16))
    assert asked == [("127.0.0.1", 5000)]  # the wildcard is reached through loopback


def fake_addresses(*hosts: str):
    return lambda *args, **kwargs: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (h, 0)) for h in hosts]


def test_listen_binds_a_repeated_address_once(monkeypatch):
    from mlxinfer.server import uvicorn_host as run

    monkeypatch.setattr(run.socket, "getaddrinfo", fake_addresses("127.0.0.1", "127.0.0.1"))  # a repeated hosts line
    sockets = run.listen(ServerSettings(host="localhost", port=0))
    try:
        assert [s.getsockname()[0] for s in sockets] == ["127.0.0.1"]
    finally:
        for sock in sockets:
            sock.close()


def test_listen_names_a_bad_host_in_one_line():
    from mlxinfer.errors import BindError
    from mlxinfer.server import uvicorn_host as run

    with pytest.raises(BindError, match=r"^--host a\.\.b is not a valid host name; use 127\.0\.0\.1$"):
        run.listen(ServerSettings(host="a..b", port=0, allow_remote=True, api_key="k" * 16))


def test_port_0_clashing_on_a_second_address_says_so(monkeypatch):
    from mlxinfer.errors import PortInUseError
    from mlxinfer.server import uvicorn_host as run

    # 0.0.0.0 after 127.0.0.1 always clashes with that first socket's port, on every try.
    monkeypatch.setattr(run.socket, "getaddrinfo", fake_addresses("127.0.0.1", "0.0.0.0"))
    with pytest.raises(PortInUseError) as raised:
        run.listen(ServerSettings(host="localhost", port=0))
    assert re.fullmatch(
        r"--port 0 picked port [1-9]\d* on one address of localhost, but another .*--port", str(raised.value)
    )


def test_background_server_closes_its_sockets_when_the_app_cannot_be_made(monkeypatch):
    from mlxinfer.server import uvicorn_host as run

    opened: list[socket.socket] = []
    real_listen = run.listen
    monkeypatch.setattr(run, "listen", lambda settings: opened.extend(real_listen(settings)) or opened)
    monkeypatch.setattr(run, "create_app", lambda *args: (_ for _ in ()).throw(ValueError("broken app")))
    with pytest.raises(ValueError, match="broken app"):
        BackgroundServer(ModelSet(), ServerSettings(port=0))
    assert opened and all(sock.fileno() == -1 for sock in opened)


class StuckServer:
    """Stands in for uvicorn: never starts, and either exits at once or waits until told to exit."""

    def __init__(self, exits: bool):
        self.exits, self.started, self.should_exit = exits, False, False
        self.models = ModelSet()

    def run(self, sockets) -> None:
        while not self.exits and not self.should_exit:
            time.sleep(0.01)


@pytest.mark.parametrize(
    ("exits", "timeout", "said"), [(True, 30, "exited as it started"), (False, 0.1, "did not start within 0.1 s")]
)
def test_background_server_that_does_not_start_is_one_error(monkeypatch, exits, timeout, said):
    from mlxinfer.errors import BindError
    from mlxinfer.server import uvicorn_host as run

    monkeypatch.setattr(run, "_server", lambda *args: StuckServer(exits))
    server = BackgroundServer(ModelSet(), ServerSettings(port=0))
    with pytest.raises(BindError, match=f"^the server on {re.escape(server.url)} {said}"):
        server.start(timeout=timeout)
    server._thread.join(5)
    assert not server.running and all(sock.fileno() == -1 for sock in server._sockets)
