"""One resident server for every front end: the state file, attaching, keep-alive, loading by name, the budget."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

import mlxinfer
from mlxinfer.errors import RemoteServerError, SamplingError
from mlxinfer.local_server import STOP_PATH, LocalServer, find_server, new_token, publish, state_path, withdraw
from mlxinfer.resident_client import RemoteModel
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.errors import APIError
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY

HI = [{"role": "user", "content": "Say hi"}]
CLI = [sys.executable, "-m", "mlxinfer.cli"]


def chat(url: str, model: str | None = None, token: str | None = None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    payload = {"messages": HI, "max_tokens": 4, "temperature": 0, **body}
    if model is not None:
        payload["model"] = model
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=headers, timeout=120)


def wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture
def tiny_server():
    """A server of the tiny llama that keeps a model loaded 0.6 s after its last request, with a per-user token."""
    token = new_token()
    models = ModelSet(keep_alive_s=0.6)
    models.add(mlxinfer.load(TINY / "llama_classic"))
    with BackgroundServer(models, ServerSettings(port=0, local_token=token)) as running:
        running.models, running.token = models, token
        yield running
    models.close()


# -- the state file -------------------------------------------------------------------------------


def test_a_published_server_is_found_and_withdrawn(tiny_server):
    path = publish(tiny_server.url, tiny_server.token)
    assert path == state_path() and (path.stat().st_mode & 0o777) == 0o600  # only the user can read the token
    found = find_server()
    assert found == LocalServer(tiny_server.url, os.getpid(), tiny_server.token)
    withdraw("not-the-token-of-this-server")  # another server's token: the file stays
    assert path.exists()
    withdraw(tiny_server.token)
    assert not path.exists() and find_server() is None


def test_a_stale_state_file_is_ignored_with_a_one_line_note(tiny_server, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    publish(tiny_server.url, tiny_server.token, pid=dead.pid)
    with caplog.at_level(logging.WARNING, logger="mlxinfer"):
        assert find_server() is None
    assert [r.getMessage() for r in caplog.records] == [
        f"note: ignoring {state_path()}: its server (pid {dead.pid}) is no longer running"
    ]
    caplog.clear()
    publish(tiny_server.url, new_token())  # a live server that does not know this token (another took the port)
    with caplog.at_level(logging.WARNING, logger="mlxinfer"):
        assert find_server() is None
    (note,) = [r.getMessage() for r in caplog.records]
    assert "does not know its token" in note and "\n" not in note


def test_a_state_file_others_could_read_or_pointing_elsewhere_is_ignored(tiny_server, caplog):
    path = publish(tiny_server.url, tiny_server.token)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="mlxinfer"):
        assert find_server() is None
    assert "not the user's own private file" in caplog.text
    path.write_text(json.dumps({"url": "http://192.0.2.1:80", "pid": os.getpid(), "token": tiny_server.token}))
    path.chmod(0o600)
    assert find_server() is None  # the token is never sent beyond this machine
    path.write_text("{not json")
    assert find_server() is None
    path.unlink()


def test_the_identity_route_answers_only_with_the_token(tiny_server):
    assert httpx.get(tiny_server.url + "/api/mlxinfer").status_code == 401
    wrong = httpx.get(tiny_server.url + "/api/mlxinfer", headers={"Authorization": "Bearer " + "x" * 43})
    assert wrong.status_code == 401
    ok = httpx.get(tiny_server.url + "/api/mlxinfer", headers={"Authorization": f"Bearer {tiny_server.token}"})
    assert ok.status_code == 200 and ok.json()["pid"] == os.getpid() and ok.json()["models"] == ["llama_classic"]


# -- keep-alive -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_idle_model_unloads_after_its_keep_alive_and_reloads_on_the_next_request(tiny_server):
    models = tiny_server.models
    first = chat(tiny_server.url)
    assert first.status_code == 200 and models.is_loaded("llama_classic")
    assert wait_for(lambda: not models.is_loaded("llama_classic"), 10)  # 0.6 s after the request ended
    again = chat(tiny_server.url)
    assert again.status_code == 200 and models.is_loaded("llama_classic")
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


@pytest.mark.slow
def test_a_requests_keep_alive_overrides_the_default(tiny_server):
    models = tiny_server.models
    assert chat(tiny_server.url, keep_alive=-1).status_code == 200  # Ollama's "forever"
    assert math.isinf(models.expires_in("llama_classic"))
    time.sleep(1.0)
    assert models.is_loaded("llama_classic")
    assert chat(tiny_server.url, keep_alive="1h").status_code == 200
    assert 3500 < models.expires_in("llama_classic") <= 3600
    assert chat(tiny_server.url, keep_alive=0).status_code == 200  # unload right after
    assert wait_for(lambda: not models.is_loaded("llama_classic"), 5)
    assert chat(tiny_server.url).status_code == 200  # the next request's own keep-alive: the default again
    assert models.is_loaded("llama_classic") and 0 < models.expires_in("llama_classic") <= 0.6
    bad = chat(tiny_server.url, keep_alive="soon")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


@pytest.mark.slow
def test_a_model_answering_does_not_unload(tiny_server):
    models = tiny_server.models
    served = models.acquire("llama_classic")  # a request holds it
    models.keep_alive("llama_classic", 0.0)
    time.sleep(0.8)
    assert models.is_loaded("llama_classic") and models.expires_in("llama_classic") is None
    assert not models.unload("llama_classic", if_idle=True)  # what the reaper and the budget call
    models.release(served, 0.0)
    assert wait_for(lambda: not models.is_loaded("llama_classic"), 5)


# -- loading by name, by path, within the budget ---------------------------------------------------


def test_models_load_by_name_and_by_path_only_for_the_users_front_ends(tmp_path):
    other = TINY / "qwen3"
    token = new_token()
    models = ModelSet(catalog=lambda name: other if name == "my-qwen" else None)
    models.add(mlxinfer.load(TINY / "llama_classic"))
    with BackgroundServer(models, ServerSettings(port=0, local_token=token)) as server:
        assert chat(server.url, "my-qwen").status_code == 200
        assert models.is_loaded("my-qwen") and models.path_of("my-qwen") == other
        unknown = chat(server.url, "nope")
        assert unknown.status_code == 404 and "mlxinfer ls" in unknown.json()["error"]["message"]
        by_path = str(TINY / "gemma3")
        assert chat(server.url, by_path).status_code == 404  # a path from anyone else: never loaded
        answered = chat(server.url, by_path, token=token)
        assert answered.status_code == 200 and answered.json()["model"] == "gemma3"
        assert chat(server.url, str(other), token=token).json()["model"] == "my-qwen"  # the same copy, not a second
        assert sorted(models.ids) == ["gemma3", "llama_classic", "my-qwen"]
    models.close()


@pytest.mark.slow
def test_a_model_that_does_not_fit_unloads_idle_ones_first(tmp_path):
    small = mlxinfer.load(TINY / "llama_classic")
    room = small.footprint.weights_bytes + small.cache_stats.bytes_held
    models = ModelSet(catalog=lambda name: TINY / name, budget_bytes=room + room // 2)  # not two of them
    models.add(small)
    second = models.acquire("qwen3")  # held, as by a request answering
    assert models.is_loaded("qwen3") and not models.is_loaded("llama_classic")  # the idle one made room
    with pytest.raises(APIError) as refused:
        models.get("llama_classic")
    assert refused.value.status == 503 and "does not fit" in str(refused.value)
    models.release(second)
    assert models.get("llama_classic") and not models.is_loaded("qwen3")
    models.close()


# -- front ends attach: the real default model, separate processes --------------------------------


def run_measured(command: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, int]:
    """Run `command`; its output and its peak RSS in bytes (measured by a parent that runs nothing else)."""
    probe = (
        "import json, resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * (1 if sys.platform == 'darwin' else 1024)\n"
        "print(json.dumps({'rc': p.returncode, 'out': p.stdout, 'err': p.stderr, 'rss': rss}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, env=env, timeout=600)
    result = json.loads(done.stdout)
    return subprocess.CompletedProcess(command, result["rc"], result["out"], result["err"]), result["rss"]


@pytest.fixture(scope="module")
def resident(smol_path: Path, tmp_path_factory):
    """`mlxinfer serve` of the default model in its own process, published in a private runtime dir."""
    runtime = tmp_path_factory.mktemp("resident-runtime")
    runtime.chmod(0o700)
    env = {**os.environ, "MLXINFER_RUNTIME_DIR": str(runtime), "MLXINFER_CACHE_DIR": str(smol_path.parents[1])}
    process = subprocess.Popen([*CLI, "serve", "--port", "0"], env=env, stderr=subprocess.PIPE, text=True)
    state = runtime / "server.json"
    try:
        assert wait_for(state.exists, 300), "the server never published its state file"
        yield process, env, json.loads(state.read_text())
    finally:
        process.terminate()
        process.wait(60)
    assert not state.exists()  # withdrawn on the way out


def test_a_second_front_end_attaches_without_a_second_copy_of_the_weights(resident, smol):
    process, env, state = resident
    command = [*CLI, "generate", "-p", "What is the capital of France?", "--max-tokens", "12"]
    attached, attached_rss = run_measured(command, env)
    local, local_rss = run_measured([*command, "--local"], env)
    assert attached.returncode == 0 and local.returncode == 0, attached.stderr + local.stderr
    assert f"Using the mlxinfer server at {state['url']} (pid {process.pid})" in attached.stderr
    assert "Using" not in local.stderr
    assert attached.stdout == local.stdout and "Paris" in attached.stdout  # greedy: the same answer either way
    weights = smol.footprint.weights_bytes
    # The attached process holds no weights: it is smaller than the one that loads them by at least their size.
    assert attached_rss + weights < local_rss, (attached_rss, local_rss, weights)
    server_rss = psutil.Process(process.pid).memory_info().rss
    assert server_rss > weights  # the one copy is the server's


def test_connect_and_ps_use_the_resident_server(resident):
    process, env, state = resident
    script = (
        "import mlxinfer, json\n"
        "m = mlxinfer.connect()\n"
        "r = m.chat('What is the capital of France?', max_tokens=12)\n"
        "print(json.dumps([type(m).__name__, r.text, r.stats.generated_tokens, r.finish_reason]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    kind, text, tokens, reason = json.loads(done.stdout)
    assert kind == "RemoteModel" and "Paris" in text and tokens > 0 and reason in ("stop", "length")
    ps = subprocess.run([*CLI, "ps", "--json"], capture_output=True, text=True, env=env, timeout=120)
    (row,) = json.loads(ps.stdout)
    assert row["name"] == "SmolLM2-135M-Instruct.Q4_1" and row["memory_bytes"] > 0
    assert 0 < row["expires_in_s"] <= 300  # the default keep-alive: five minutes after the last request
    table = subprocess.run([*CLI, "ps"], capture_output=True, text=True, env=env, timeout=120).stdout
    assert "SmolLM2-135M-Instruct.Q4_1" in table and " in 4 min" in table


def test_remote_options_are_checked_before_sending(resident):
    _, env, state = resident
    server = LocalServer(state["url"], state["pid"], state["token"])
    remote = RemoteModel(server, None)
    with pytest.raises(SamplingError, match="connect\\(local=True\\)"):
        remote.generate("hi", regex="[a-z]+")
    with pytest.raises(SamplingError, match="temperature"):
        remote.generate("hi", temperature=-1)
    with pytest.raises(RemoteServerError, match="404"):
        RemoteModel(server, "no-such-model").generate("hi", max_tokens=2)


def test_without_a_server_front_ends_load_their_own_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_RUNTIME_DIR", str(tmp_path))
    assert isinstance(mlxinfer.connect(TINY / "llama_classic"), mlxinfer.Model)


@pytest.mark.slow
def test_requests_hold_their_model_from_lookup_to_their_last_event(tiny_server):
    """A held model is never unloaded by its keep-alive; every request gives it back exactly once, also when
    it fails, streams, or its client leaves before the first byte."""
    models, url = tiny_server.models, tiny_server.url
    held = models.acquire_loaded("llama_classic")
    models.keep_alive("llama_classic", 0.0)
    time.sleep(0.3)
    assert models.is_loaded("llama_classic")  # held: the expired keep-alive waits for the release
    models.release(held)
    anchor = models.acquire("llama_classic")  # one lease held throughout: a double release would show below it
    stream = {"messages": HI, "max_tokens": 4, "stream": True}
    assert chat(url, keep_alive=-1).status_code == 200
    assert chat(url, max_tokens=10**6).status_code == 400  # refused after the lookup
    with httpx.stream("POST", url + "/v1/chat/completions", json=stream) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    with httpx.stream("POST", url + "/v1/chat/completions", json={**stream, "max_tokens": 200}):
        pass  # gone before reading a byte
    assert wait_for(lambda: models.ps()[0]["in_flight"] == 1, 20)
    time.sleep(0.5)
    assert models.ps()[0]["in_flight"] == 1  # each request gave it back exactly once
    models.release(anchor)
    assert models.ps()[0]["in_flight"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/api/mlxinfer", "/v1/messages", "/v1/embeddings"])
def test_every_route_keeps_the_host_origin_and_body_rules(tiny_server, path):
    body = {"model": "llama_classic", "messages": HI, "max_tokens": 2}
    rebinding = httpx.post(tiny_server.url + path, json=body, headers={"Host": "evil.example"})
    assert rebinding.status_code == 403
    other_site = httpx.post(tiny_server.url + path, json=body, headers={"Origin": "https://evil.example"})
    assert other_site.status_code == 403
    if path != "/api/mlxinfer":  # a GET route
        too_big = httpx.post(tiny_server.url + path, content=b"{" + b" " * (5 << 20) + b"}")
        assert too_big.status_code == 413


def test_a_stream_cut_off_by_the_server_is_an_error_not_a_short_answer():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Dying(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunk = {"model": "m", "choices": [{"delta": {"content": "Hel"}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())  # then the server goes away: no [DONE]

        def log_message(self, *args):
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Dying) as stand_in:
        threading.Thread(target=stand_in.serve_forever, daemon=True).start()
        remote = RemoteModel(LocalServer(f"http://127.0.0.1:{stand_in.server_port}", os.getpid(), "t" * 32), None)
        with pytest.raises(RemoteServerError, match="ended the answer before its end"):
            remote.generate("hi", max_tokens=4)
        stand_in.shutdown()


# -- a state file or a server that is not what it says: one note, and the command goes on ----------


TOKEN = "k" * 40


def plant(folder: Path, content: str | dict) -> Path:
    """A state file as the user's own private file holds it (content is written as is, or as JSON)."""
    path = folder / "server.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    path.chmod(0o600)
    return path


def one_note(caplog, path: Path, timeout_s: float = 10.0) -> str:
    """find_server() in a thread that must end within timeout_s: None, and exactly one one-line note naming path."""
    import threading

    found: list = []
    with caplog.at_level(logging.WARNING, logger="mlxinfer"):
        probe = threading.Thread(target=lambda: found.append(find_server()), daemon=True)
        probe.start()
        probe.join(timeout_s)
    assert not probe.is_alive(), "find_server() hung"
    assert found == [None]
    (note,) = [r.getMessage() for r in caplog.records]
    assert note.startswith(f"note: ignoring {path}: ") and "\n" not in note and len(note) < 400
    return note


@pytest.fixture
def runtime(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "runtime"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("MLXINFER_RUNTIME_DIR", str(folder))
    return folder


@pytest.mark.parametrize(
    "entry",
    [
        {"url": "http://127.0.0.1:99999", "pid": "me", "token": TOKEN},  # a port out of range
        {"url": "http://127.0.0.1:8o8o", "pid": "me", "token": TOKEN},  # letters in the port
        {"url": "http://[::1:8080", "pid": "me", "token": TOKEN},  # an unclosed IPv6 bracket
        {"url": "http://127.0.0.1:1", "pid": 2**70, "token": TOKEN},  # no such PID can exist
        "[" * 2000 + "]" * 2000,  # deeply nested JSON, within the size limit
    ],
    ids=["port-range", "port-letters", "ipv6-bracket", "huge-pid", "nested-json"],
)
def test_a_malformed_state_file_is_one_note(runtime, caplog, entry):
    if isinstance(entry, dict) and entry["pid"] == "me":
        entry = {**entry, "pid": os.getpid()}  # alive: only the URL is wrong
    one_note(caplog, plant(runtime, entry))


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_directory_or_a_fifo_in_the_state_files_place_is_one_note(runtime, caplog, kind):
    path = runtime / "server.json"
    if kind == "directory":
        path.mkdir(mode=0o700)
    else:
        os.mkfifo(path, 0o600)  # no writer: a blocking open waits for one forever
    try:
        assert "not a regular file" in one_note(caplog, path, timeout_s=5)
    finally:
        if kind == "fifo":
            with contextlib.suppress(OSError):  # wake an open that hangs (today's code) so its thread ends
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


class StandIn:
    """A loopback TCP server that answers every connection with `answer(connection)`, in a thread;
    `requests` holds the raw request heads it read."""

    def __init__(self, answer, host: str = "127.0.0.1"):
        import socket
        import threading

        self.answer, self.requests, self.stop = answer, [], threading.Event()
        self.sock = socket.create_server((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except OSError:
                continue
            with connection:
                connection.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head and (chunk := connection.recv(65536)):
                    head += chunk
                length = next(
                    (int(v) for k, v in re.findall(rb"\n([\w-]+): *(\d+)", head) if k.lower() == b"content-length"), 0
                )
                while len(head.partition(b"\r\n\r\n")[2]) < length and (chunk := connection.recv(65536)):
                    head += chunk  # the body too: closing on unread bytes would reset the connection
                self.requests.append(head.decode("latin-1"))
                with contextlib.suppress(OSError):
                    self.answer(self, connection)

    def close(self):
        self.stop.set()
        self.thread.join(15)
        self.sock.close()


@pytest.fixture
def stand_in():
    servers = []

    def start(answer, host: str = "127.0.0.1") -> StandIn:
        servers.append(StandIn(answer, host))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_a_server_that_drips_its_answer_is_given_up_on_at_a_deadline(runtime, caplog, stand_in, monkeypatch):
    def drip(server, connection):  # a byte every 0.2 s: each read succeeds, the answer never ends
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 10_000:
            if server.stop.wait(0.2):
                return
            connection.sendall(bytes([byte]))

    monkeypatch.setattr("mlxinfer.local_server.PROBE_TIMEOUT_S", 0.6)
    server = stand_in(drip)
    started = time.monotonic()
    note = one_note(caplog, plant(runtime, {"url": server.url, "pid": os.getpid(), "token": TOKEN}), timeout_s=4)
    assert "did not answer" in note and time.monotonic() - started < 3


def test_an_answer_that_is_not_http_is_one_note(runtime, caplog, stand_in):
    server = stand_in(lambda server, connection: connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" + b"\x00" * 64))
    note = one_note(caplog, plant(runtime, {"url": server.url, "pid": os.getpid(), "token": TOKEN}))
    assert "did not answer" in note


def loopback_elsewhere() -> str:
    """Another loopback address than 127.0.0.1 where the platform routes one (Linux: all of 127/8)."""
    import socket

    try:
        socket.create_server(("127.0.0.2", 0)).close()
    except OSError:
        return "127.0.0.1"
    return "127.0.0.2"


@pytest.mark.parametrize("caller", ["identity", "generate"])
def test_the_token_never_follows_a_redirect(runtime, caplog, stand_in, caller):
    elsewhere = stand_in(lambda server, connection: connection.sendall(b"HTTP/1.1 404 Not Found\r\n\r\n"),
                         host=loopback_elsewhere())  # fmt: skip

    def redirect(server, connection):
        location = elsewhere.url + "/api/mlxinfer"
        connection.sendall(f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode())

    server = stand_in(redirect)
    if caller == "identity":
        assert "302" in one_note(caplog, plant(runtime, {"url": server.url, "pid": os.getpid(), "token": TOKEN}))
    else:
        with pytest.raises(RemoteServerError, match="302"):
            RemoteModel(LocalServer(server.url, os.getpid(), TOKEN), None).generate("hi", max_tokens=2)
    assert len(server.requests) == 1 and f"Bearer {TOKEN}" in server.requests[0]
    time.sleep(0.2)  # a request that followed the redirect would have arrived by now
    assert elsewhere.requests == []  # neither the token nor anything else reached the address the redirect named


def test_a_local_server_is_only_ever_a_loopback_address():
    with pytest.raises(RemoteServerError, match="loopback"):
        LocalServer("http://192.0.2.1:80", os.getpid(), TOKEN)  # the token would leave this machine


def test_generate_goes_on_locally_after_one_note_on_a_malformed_state_file(runtime):
    path = plant(runtime, {"url": "http://127.0.0.1:99999", "pid": os.getpid(), "token": TOKEN})
    command = [*CLI, "generate", str(TINY / "llama_classic"), "-p", "hi", "--raw", "--max-tokens", "2"]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "server" in line]
    assert notes == [f"note: ignoring {path}: it does not describe a local mlxinfer server"]
    assert "Traceback" not in done.stderr and "2 generated" in done.stderr


NESTED = b"[" * 200_000 + b"]" * 200_000  # deeper than json.loads goes: a RecursionError, not a ValueError


@pytest.mark.parametrize("status", [b"500 Internal Server Error", b"200 OK"])
def test_an_answer_nested_past_the_parser_is_a_remote_error(stand_in, status):
    kind = b"application/json" if status.startswith(b"5") else b"text/event-stream"
    body = NESTED if status.startswith(b"5") else b"data: " + NESTED + b"\n\n"

    def answer(server, connection):
        head = b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
        connection.sendall(head + body)

    server = stand_in(answer)
    remote = RemoteModel(LocalServer(server.url, os.getpid(), TOKEN), None)
    with pytest.raises(RemoteServerError, match="500" if status.startswith(b"5") else "stopped answering"):
        remote.generate("hi", max_tokens=2)


def test_a_stopped_answer_still_brings_the_servers_true_counts(tiny_server):
    """Ctrl-C in `mlxinfer chat` through a server: the server stops the answer as a finished one ends, so the
    stream's end carries its usage (what `chat` prints), and the stop route is only for the user's front ends."""
    remote = RemoteModel(LocalServer(tiny_server.url, os.getpid(), tiny_server.token), None)
    run = remote.stream("Once upon a time", max_tokens=200)
    pieces = iter(run)
    first = [next(pieces), next(pieces)]
    run.stop()
    prompt = len(next(iter(tiny_server.models)).model.tokenizer.encode("Once upon a time"))
    assert run.stats.finish_reason == "cancelled" and run.stats.prompt_tokens == prompt
    assert len(first) <= run.stats.generated_tokens < 200 and run.text().startswith("".join(first))
    refused = httpx.post(tiny_server.url + STOP_PATH, json={"answer": "x"}, timeout=10)
    assert refused.status_code == 401
