"""The HTTP server against hostile clients, over real sockets on 127.0.0.1.

Slow or stalled headers and bodies, hundreds of idle sockets, deep JSON, numbers that
overflow, odd types in every field, clients that leave half-way and floods of prompts to
tokenize: each gets a quick one-line answer (or a closed socket), never a 500, and the
server keeps answering /health and real requests while bounded in sockets and threads.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import re
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx
import psutil
import pytest

import mlxinfer
from mlxinfer.errors import ServerConfigError
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.connections import accept_backlog
from mlxinfer.server.errors import APIError, as_api_error
from mlxinfer.server.limits import WorkGate
from mlxinfer.server.schema import MAX_DEPTH, nesting_depth, openai_chat, openai_completion
from mlxinfer.server.uvicorn_host import BackgroundServer
from tests.conftest import TINY

TIMEOUT_S = 1.0  # header and body deadlines of the test servers
MAX_CONNECTIONS = 32
SLACK_S = 2.5  # a deadline's answer may come this much later on a busy 2-core machine
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class ErrorRecords(logging.Handler):
    """ERROR records (tracebacks) from the server's and uvicorn's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def running_server(model: mlxinfer.Model, **settings):
    """A server for `model` with short deadlines; `.errors` collects its ERROR log records."""
    models = ModelSet()
    models.add(model)
    errors = ErrorRecords()
    loggers = [logging.getLogger(name) for name in ("mlxinfer.server", "uvicorn.error", "uvicorn")]
    for logger in loggers:
        logger.addHandler(errors)
    defaults = {"header_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S, "max_connections": MAX_CONNECTIONS}
    try:
        with BackgroundServer(models, ServerSettings(port=0, **{**defaults, **settings})) as server:
            server.port = int(server.url.rsplit(":", 1)[1])
            server.errors, server.models = errors.records, models
            yield server
    finally:
        models.close()  # its scheduler's thread; the model itself stays loaded for the next server
        for logger in loggers:
            logger.removeHandler(errors)


@pytest.fixture(scope="module")
def model() -> mlxinfer.Model:
    return mlxinfer.load(TINY / "llama_classic")


@pytest.fixture(scope="module")
def shared_server(model):
    with running_server(model) as running:
        yield running


@pytest.fixture
def server(shared_server):
    shared_server.errors.clear()
    yield shared_server
    assert not shared_server.errors, [r.getMessage() for r in shared_server.errors]  # no traceback, no 500


# --- raw sockets -------------------------------------------------------------------------------------------


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def dribble(sock: socket.socket, data: bytes, gap_s: float, stop: threading.Event) -> threading.Thread:
    """Send `data` one byte per `gap_s` on a thread, until it is all sent, the server closes or `stop`."""

    def run() -> None:
        for i in range(len(data)):
            if stop.wait(gap_s):
                return
            try:
                sock.sendall(data[i : i + 1])
            except OSError:
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    """Everything the server sends until it closes the connection (a test failure past `limit_s`)."""
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open past {limit_s} s; got {data[:200]!r}")
    except ConnectionResetError:
        pass
    return data


def responses(data: bytes) -> list[tuple[int, dict, bytes]]:
    """The HTTP responses in `data`, one after the other: (status, JSON body or {}, head)."""
    found = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
        body, data = rest[:length], rest[length:]
        is_json = re.search(rb"(?im)^content-type: *application/json", head)
        found.append((int(head.split(b" ", 2)[1]), json.loads(body) if is_json else {}, head))
    return found


def status_and_body(data: bytes) -> tuple[int, dict]:
    (status, body, _), *_ = responses(data)
    return status, body


def request_head(method: str, path: str, **headers: str) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def statuses(url: str, status: str) -> float:
    return sum(
        metric(url, "mlxinfer_requests_total", f'{{endpoint="{e}",status="{status}"}}') for e in ("chat", "completions")
    )


def assert_still_serving(url: str) -> None:
    """/health answers at once and a generation is taken (a 503 for memory other programs hold is an answer too)."""
    started = time.monotonic()
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - started < 2
    reply = httpx.post(url + COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
    assert generated(reply), reply.text


def generated(reply: httpx.Response) -> bool:
    """Answered (200), or refused for memory that other programs on this machine hold (503): not our fault."""
    if reply.status_code == 503:
        return reply.json()["error"]["code"] == "insufficient_memory"
    return reply.status_code == 200


def eventually(check, seconds: float = 30.0) -> bool:
    """True once `check()` is, False if it never is in time (generous: the tests run in parallel on a busy machine)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- slow and stalled requests ---------------------------------------------------------------------------

BODY = json.dumps({"prompt": "Hello there", "max_tokens": 2}).encode()
CHUNKED = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (BODY[:10], BODY[10:])) + b"0\r\n\r\n"
HEALTH = request_head("GET", "/health")
CHUNKED_HEAD = request_head("POST", COMPLETIONS, transfer_encoding="chunked")
SLOW = [
    # (case, sent at once, then dribbled one byte per 0.2 s, the statuses answered before the server closes)
    ("headers byte by byte", b"", HEALTH, [408]),
    ("headers stop half-way", b"GET /health HTTP/1.1\r\nHost: 127.", b"", [408]),
    ("request line stops", b"POS", b"", [408]),
    ("connected, sends nothing", b"", b"", []),
    ("body byte by byte", request_head("POST", COMPLETIONS, content_length=str(len(BODY))), BODY, [408]),
    ("body stops half-way", request_head("POST", COMPLETIONS, content_length=str(len(BODY))) + BODY[:9], b"", [408]),
    ("chat body stops", request_head("POST", CHAT, content_length="500") + b'{"messages": [', b"", [408]),
    (
        "chunked stops in a chunk",
        CHUNKED_HEAD + b"a\r\n{",
        b"",
        [408],
    ),
    (
        "chunked, no last chunk",
        CHUNKED_HEAD + CHUNKED[:-5],
        b"",
        [408],
    ),
    ("chunked byte by byte", CHUNKED_HEAD, CHUNKED, [408]),
    ("a body nobody reads stalls", request_head("GET", "/health", content_length="100") + b"{", b"", [200]),
    ("the next request dribbles", HEALTH, HEALTH * 3, [200, 408]),
    ("the next request stalls", HEALTH + HEALTH[:20], b"", [200, 408]),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,first,trickle,expected", SLOW, ids=[c[0] for c in SLOW])
def test_slow_or_stalled_requests_are_cut_off_at_their_deadline(server, case, first, trickle, expected):
    stop = threading.Event()
    with connect(server.port) as sock:
        started = time.monotonic()
        sock.sendall(first)
        dribble(sock, trickle, 0.2, stop)
        try:
            data = read_until_closed(sock, TIMEOUT_S * 2 + SLACK_S)
        finally:
            stop.set()
        elapsed = time.monotonic() - started
    assert elapsed >= TIMEOUT_S * 0.9, f"closed after {elapsed:.2f} s, before the deadline"
    answered = responses(data)
    assert [status for status, _, _ in answered] == expected, data[:400]
    if expected and expected[-1] == 408:
        status, body, head = answered[-1]
        assert re.search(rb"(?im)^connection: *close", head)
        assert body["error"]["type"] == "invalid_request_error"
        assert re.fullmatch(r"the request (headers|body) did not arrive within 1 s", body["error"]["message"])
    assert_still_serving(server.url)


def test_a_body_is_cut_off_at_its_total_deadline_not_per_chunk(server):
    """A byte every 0.2 s never waits a whole second, yet the body as a whole is late: 408."""
    stop = threading.Event()
    long_body = b'{"prompt": "' + b"x" * 100 + b'"}'
    with connect(server.port) as sock:
        started = time.monotonic()
        sock.sendall(request_head("POST", COMPLETIONS, content_length=str(len(long_body))))
        dribble(sock, long_body, 0.2, stop)
        try:
            data = read_until_closed(sock, TIMEOUT_S + SLACK_S)
        finally:
            stop.set()
    assert status_and_body(data)[1]["error"]["code"] == "body_timeout"
    assert TIMEOUT_S * 0.9 <= time.monotonic() - started < TIMEOUT_S + SLACK_S


# --- many sockets ----------------------------------------------------------------------------------------

IDLE = {
    "silent": b"",
    "partial headers": b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
    "partial body": request_head("POST", COMPLETIONS, content_length="1000") + b'{"prompt": ',
    "partial chunked": request_head("POST", COMPLETIONS, transfer_encoding="chunked") + b"100\r\n{",
}


def server_sockets(port: int) -> int:
    """Sockets this process holds on the server's side (its accepted connections); the clients' are apart."""
    return sum(
        1 for c in psutil.Process().net_connections("tcp") if c.laddr and c.laddr.port == port and c.status != "LISTEN"
    )


def evictions(url: str) -> float:
    reasons = ("evicted_idle", "evicted_receiving")
    return sum(metric(url, "mlxinfer_connections_dropped_total", f'{{reason="{r}"}}') for r in reasons)


@contextmanager
def more_open_files(wanted: int):
    """Raise this process's soft limit on open files if it is below `wanted` (macOS starts at 256)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        yield
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def patient_server(model):
    """Deadlines longer than the test: on a busy machine, connecting 300 sockets outlasts the shared server's 1 s
    header deadline, and a socket that times out is not one that had to be evicted to make room."""
    with running_server(model, header_timeout_s=300.0, body_timeout_s=300.0) as running:
        yield running
    assert not running.errors, [r.getMessage() for r in running.errors]


@pytest.mark.parametrize("kind", list(IDLE))
def test_three_hundred_idle_sockets_cannot_exhaust_descriptors(patient_server, kind):
    server = patient_server
    count, burst = 300, accept_backlog(ServerSettings(max_connections=MAX_CONNECTIONS))
    transient = MAX_CONNECTIONS + 2 * burst + 2  # accepted at once before any makes room, or closed but not yet let go
    fds_before = psutil.Process().num_fds()
    evicted = evictions(server.url)
    with more_open_files(4 * count), ExitStack() as sockets:
        for i in range(count):
            sock = sockets.enter_context(connect(server.port))
            sock.sendall(IDLE[kind])
            if i % 25 == 24:
                held = server_sockets(server.port)
                assert held <= transient, f"the server holds {held} sockets after {i + 1} connected"
        assert eventually(lambda: evictions(server.url) - evicted >= count - MAX_CONNECTIONS)  # all accepted
        assert eventually(lambda: server_sockets(server.port) <= MAX_CONNECTIONS + 1), server_sockets(server.port)
        assert psutil.Process().num_fds() - fds_before <= count + MAX_CONNECTIONS + 10  # our 300 plus its few
        assert_still_serving(server.url)
    assert eventually(lambda: psutil.Process().num_fds() <= fds_before + 5, 30)  # every socket was let go


@contextmanager
def slow_tokenizer(model: mlxinfer.Model, seconds: float):
    """`model`'s tokenizer as if every prompt were huge; yields the names of the threads it ran on and its peak."""
    encode, seen = model.tokenizer.encode, {"threads": set(), "active": 0, "peak": 0}
    lock = threading.Lock()

    def slow_encode(*args, **kwargs):
        with lock:
            seen["active"] += 1
            seen["peak"] = max(seen["peak"], seen["active"])
            seen["threads"].add(threading.current_thread().name)
        time.sleep(seconds)  # sleeping holds no GIL: only the server's own bounds limit the overlap
        with lock:
            seen["active"] -= 1
        return encode(*args, **kwargs)

    model.tokenizer.encode = slow_encode
    try:
        yield seen
    finally:
        del model.tokenizer.encode  # the class's method again


@pytest.mark.slow
def test_when_every_connection_is_busy_a_new_one_gets_503_at_once(model):
    with (
        slow_tokenizer(model, 3.0) as seen,
        running_server(model, max_connections=3) as server,
        ThreadPoolExecutor(3) as pool,
    ):
        busy = [pool.submit(httpx.post, server.url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}, timeout=30)]
        busy += [pool.submit(httpx.post, server.url + COMPLETIONS, json={"prompt": "Ho", "max_tokens": 1}, timeout=30)]
        busy += [pool.submit(httpx.post, server.url + COMPLETIONS, json={"prompt": "Ha", "max_tokens": 1}, timeout=30)]
        assert eventually(lambda: seen["active"] == 3), seen  # all three are past their bodies, being tokenized
        with connect(server.port) as extra:
            started = time.monotonic()
            extra.sendall(HEALTH)
            data = read_until_closed(extra, 2.0)
        status, body = status_and_body(data)
        assert status == 503 and time.monotonic() - started < 1.5  # not after the busy ones
        assert b"Retry-After: 1" in data and body["error"]["code"] == "too_many_connections"
        assert all(generated(f.result()) for f in busy)  # the busy ones were left alone
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert not server.errors


# --- hostile JSON ----------------------------------------------------------------------------------------

DEPTHS = [MAX_DEPTH + 1, 100, 1000, 5000, 100_000]
PLACES = {  # where the deep value goes: a field, inside messages, an unknown field
    "prompt": lambda deep: b'{"prompt": ' + deep + b', "max_tokens": 1}',
    "temperature": lambda deep: b'{"prompt": "x", "temperature": ' + deep + b"}",
    "content": lambda deep: b'{"messages": [{"role": "user", "content": ' + deep + b"}]}",
    "unknown field": lambda deep: b'{"prompt": "x", "max_tokens": 1, "extra": ' + deep + b"}",
}


def nested(kind: str, depth: int, closed: bool = True) -> bytes:
    opening, closing = (b"[", b"]") if kind == "array" else (b'{"a": ', b"}")
    return opening * depth + b"1" + (closing * depth if closed else b"")


def post(url: str, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)


def parse_refusal(path: str, raw: bytes) -> APIError | None:
    """The answer to a body refused while it is parsed: the parse and the error mapping that the server runs on every
    body before anything else (the end-to-end tests below show it answers just that); None if the parse takes it."""
    try:
        (openai_chat if path == CHAT else openai_completion)(raw)
    except Exception as e:  # noqa: BLE001 - mapped as the server maps it
        return as_api_error(e)
    return None


def test_deep_json_is_refused_before_parsing_on_the_parser():
    failures = []
    for place, kind, closed, depth in itertools.product(PLACES, ["array", "object"], [True, False], DEPTHS):
        error = parse_refusal(CHAT if place == "content" else COMPLETIONS, PLACES[place](nested(kind, depth, closed)))
        if not (error and error.status == 400 and error.message.startswith("the request body nests")):
            failures.append(f"{place} {kind} {'closed' if closed else 'unclosed'} {depth}: {error and error.body()}")
        elif f"at most {MAX_DEPTH}" not in error.message:
            failures.append(f"{place} {kind} {depth}: {error.message}")
    assert not failures, "\n".join(failures)


# End to end: every place, each kind and closedness twice, every depth.
@pytest.mark.parametrize(
    "place, kind, closed",
    [(place, ["array", "object"][i % 2], i // 2 % 2 == 0) for i, place in enumerate(PLACES)],
)
def test_deep_json_is_refused_before_parsing(server, place, kind, closed):
    path = CHAT if place == "content" else COMPLETIONS
    for depth in DEPTHS:
        response = post(server.url, path, PLACES[place](nested(kind, depth, closed)))
        assert response.status_code == 400, (depth, response.text[:300])
        message = response.json()["error"]["message"]
        assert message.startswith("the request body nests") and f"at most {MAX_DEPTH}" in message
    assert_still_serving(server.url)


@pytest.mark.parametrize("kind", ["array", "object"])
def test_json_within_the_depth_limit_is_parsed_and_judged_by_field(server, kind):
    for depth in (1, 2, MAX_DEPTH - 3):  # the body's own braces and the field's take three more levels
        response = post(server.url, CHAT, PLACES["content"](nested(kind, depth)))
        assert response.status_code == 400, response.text
        # A list's first item is judged as a content part (and named so); an object is no content at all.
        expected = "messages[0].content[0]" if kind == "array" else "messages[0].content"
        assert response.json()["error"]["param"] == expected
        assert len(response.json()["error"]["message"]) < 300  # the value is not echoed back whole


INSIDE_STRINGS = {
    "openers": json.dumps({"prompt": "[" * 5000, "max_tokens": 1}).encode(),
    "closers": json.dumps({"prompt": "]}" * 5000, "max_tokens": 1}).encode(),
    "escaped quotes": json.dumps({"prompt": '\\"[{' * 3000, "max_tokens": 1}).encode(),
    "escaped backslashes": json.dumps({"prompt": "\\" * 101 + "{" * 5000, "max_tokens": 1}).encode(),
    "unicode escapes": b'{"prompt": "' + b"\\u005b\\u007b" * 3000 + b'", "max_tokens": 1}',
    "in keys": b"{" + b"".join(b'"[%d{": 1, ' % i for i in range(3000)) + b'"prompt": "x", "max_tokens": 1}',
}


@pytest.mark.parametrize("raw", list(INSIDE_STRINGS.values()), ids=list(INSIDE_STRINGS))
def test_brackets_inside_strings_do_not_count(server, raw):
    assert nesting_depth(raw) <= 1
    response = post(server.url, COMPLETIONS, raw)
    assert generated(response) or response.json()["error"]["code"] == "context_length_exceeded", response.text
    assert "nests" not in response.text


TRICKY = ['"', "\\", '\\"', "[", "]", "{", "}", '\\\\"', "é", "\u2028", "x", " "]


def tricky_string(rng: random.Random) -> str:
    return "".join(rng.choices(TRICKY, k=rng.randint(0, 6)))


def random_json(rng: random.Random, depth: int) -> object:
    """A value exactly `depth` deep: a spine of containers with shallow siblings and tricky strings around it."""
    if depth == 0:
        return rng.choice([1, -2.5e300, None, True, tricky_string(rng)])
    inner = [random_json(rng, depth - 1)] + [random_json(rng, rng.randint(0, min(2, depth - 1))) for _ in range(2)]
    rng.shuffle(inner)
    return inner if rng.random() < 0.5 else {tricky_string(rng) + str(i): v for i, v in enumerate(inner)}


def test_nesting_depth_matches_the_parsed_depth_on_random_json():
    rng = random.Random(0)
    exact = 0
    for _ in range(400):
        depth = rng.randint(1, 100)
        raw = json.dumps(random_json(rng, depth), ensure_ascii=rng.random() < 0.5).encode()
        if depth > MAX_DEPTH or nesting_depth(raw) > MAX_DEPTH:
            assert nesting_depth(raw) == depth
            exact += 1
        else:  # within the limit it may answer the bracket count instead, never less than the depth
            assert nesting_depth(raw) >= depth
    assert exact > 100


NUMERIC_FIELDS = ["temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "top_k", "min_p"]
NUMERIC_FIELDS += ["repetition_penalty", "n", "best_of", "presence_penalty", "frequency_penalty"]
HUGE_NUMBERS = {
    "1e309": "1e309",
    "-1e309": "-1e309",
    "1e999999": "1e999999",
    "-1e999999": "-1e999999",
    "10**400": "1" + "0" * 400,  # an exact int that overflows a float
    "10**5000": "1" + "0" * 5000,  # past Python's 4300-digit int conversion limit
    "-(10**5000)": "-" + "9" * 5000,
    "500000 digits": "7" * 500_000,
    "long fraction": "0." + "1" * 100_000 + "e400",
}


def overflowing(path: str, field: str, literal: str) -> bytes:
    base = '"messages": [{"role": "user", "content": "x"}]' if path == CHAT else '"prompt": "x"'
    return f'{{{base}, "max_tokens": 2, "{field}": {literal}}}'.encode()


def test_numbers_that_overflow_are_refused_naming_their_field_on_the_parser():
    failures = []
    for path, field, name in itertools.product([CHAT, COMPLETIONS], NUMERIC_FIELDS, HUGE_NUMBERS):
        started = time.monotonic()
        error = parse_refusal(path, overflowing(path, field, HUGE_NUMBERS[name]))
        expected = "max_tokens" if field == "max_completion_tokens" else field
        if not (error and error.status == 400 and error.param == expected and error.message.startswith(expected)):
            failures.append(f"{path} {field} {name}: {error and error.body()}")
        elif len(error.message) >= 300 or time.monotonic() - started > 1:  # no slow exact conversion of the digits
            failures.append(f"{path} {field} {name}: {len(error.message)} characters, {time.monotonic() - started} s")
    assert not failures, "\n".join(failures)


# End to end: each path, every literal, in one field each (max_completion_tokens is answered as max_tokens).
@pytest.mark.parametrize("path, field", [(CHAT, "temperature"), (COMPLETIONS, "max_completion_tokens")])
def test_numbers_that_overflow_get_a_400_naming_their_field(server, field, path):
    for name, literal in HUGE_NUMBERS.items():
        started = time.monotonic()
        response = post(server.url, path, overflowing(path, field, literal))
        assert response.status_code == 400, (name, response.text[:300])
        error = response.json()["error"]
        expected = "max_tokens" if field == "max_completion_tokens" else field
        assert error["param"] == expected and error["message"].startswith(expected), (name, error)
        assert len(error["message"]) < 300
        assert time.monotonic() - started < 5, name  # no slow exact conversion of the digits
    assert_still_serving(server.url)


def test_overflowing_token_ids_name_the_prompt_on_the_parser():
    failures = []
    for name, literal in HUGE_NUMBERS.items():
        for prompt in (f"[{literal}]", f"[1, 2, {literal}]", f"[[{literal}]]"):
            error = parse_refusal(COMPLETIONS, f'{{"prompt": {prompt}, "max_tokens": 1}}'.encode())
            if not (error and error.status == 400 and error.param == "prompt"):
                failures.append(f"{name} in {prompt[:12]}: {error and error.body()}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("literal", [HUGE_NUMBERS["1e309"], HUGE_NUMBERS["500000 digits"]], ids=["1e309", "500000"])
def test_overflowing_token_ids_name_the_prompt(server, literal):
    """End to end: the smallest and the largest literal."""
    for prompt in (f"[{literal}]", f"[1, 2, {literal}]", f"[[{literal}]]"):
        response = post(server.url, COMPLETIONS, f'{{"prompt": {prompt}, "max_tokens": 1}}'.encode())
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text[:300]


ODD_VALUES = {
    "list": [],
    "nested list": [[[[1]]]],
    "object": {"a": {"b": 1}},
    "number": 7,
    "bool": True,
    "long string": "x" * 200_000,
    "huge int": 10**30,
}
ODD_FIELDS = {  # where each value goes in a chat body, and the param the 400 must name
    "role": (lambda v: {"messages": [{"role": v, "content": "x"}]}, "messages[0].role"),
    "content": (lambda v: {"messages": [{"role": "user", "content": v}]}, "messages[0].content"),
    "message": (lambda v: {"messages": [v]}, "messages[0].role"),
    "messages": (lambda v: {"messages": v}, "messages"),
    "model": (lambda v: {"messages": [{"role": "user", "content": "x"}], "model": v}, "model"),
    "stop": (lambda v: {"messages": [{"role": "user", "content": "x"}], "stop": [v]}, "stop"),
    "stream": (lambda v: {"messages": [{"role": "user", "content": "x"}], "stream": v}, "stream"),
    "stream_options": (
        lambda v: {"messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": v},
        "stream_options",
    ),
}
VALID_THERE = {  # values a client may send in that field (or refused by someone else's limit): not tested here
    ("content", "long string"),
    ("content", "list"),  # no parts: empty text
    ("stop", "long string"),
    ("stream", "bool"),
    ("stream_options", "list"),
    ("stream_options", "object"),
}


ODD_CASES = [(f, n) for f in ODD_FIELDS for n in ODD_VALUES if (f, n) not in VALID_THERE]
SERVED_MODEL_NAMES = {("model", "long string")}  # a string the parse takes: the server then finds no such model (404)


def test_odd_types_in_each_field_get_a_short_400_naming_it_on_the_parser():
    failures = []
    for field, name in ODD_CASES:
        build, param = ODD_FIELDS[field]
        error = parse_refusal(CHAT, json.dumps(build(ODD_VALUES[name])).encode())
        if (field, name) in SERVED_MODEL_NAMES:
            if error is not None:
                failures.append(f"{field} {name}: refused by the parse: {error.body()}")
        elif not (error and error.status == 400 and error.param and error.param.startswith(param)):
            failures.append(f"{field} {name}: {error and error.body()}")  # the field, or the part of it that is wrong
        elif len(error.message) >= 400:
            failures.append(f"{field} {name}: {len(error.message)} characters")
    assert not failures, "\n".join(failures)


def test_odd_types_in_each_field_get_a_short_400_naming_it(server):
    """End to end: each field with one odd value (in turn), and the model name no model has."""
    values = {field: [n for f, n in ODD_CASES if f == field] for field in ODD_FIELDS}
    cases = {field: values[field][i % len(values[field])] for i, field in enumerate(ODD_FIELDS)}
    for field, name in [*cases.items(), *SERVED_MODEL_NAMES]:
        build, param = ODD_FIELDS[field]
        response = httpx.post(server.url + CHAT, json=build(ODD_VALUES[name]), timeout=30)
        expected = 404 if (field, name) in SERVED_MODEL_NAMES else 400
        assert response.status_code == expected, (field, name, response.text[:300])
        error = response.json()["error"]
        assert error["param"].startswith(param), (field, name, error)
        assert len(error["message"]) < 400, (field, name, len(error["message"]))
    assert_still_serving(server.url)


def test_bodies_that_are_not_utf8_json_objects_get_400(server):
    for raw in (b"\xff\xfe{\x00}\x00", b"\x80", "{}".encode("utf-16"), b"", b"[]", b"null", b"1" * 5000):
        response = post(server.url, COMPLETIONS, raw)
        assert response.status_code == 400, (raw[:20], response.text)
        assert response.json()["error"]["message"].startswith("the request body")


CONTENT_LENGTHS = {  # the header's value, and who refuses it: h11 (400, plain text) or the server (413, JSON)
    "5000 digits": ("9" * 5000, 400),
    "20 digits": ("9" * 20, 413),
    "19 digits": ("9" * 19, 413),
    "one byte over": (str((4 << 20) + 1), 413),
    "negative": ("-1", 400),
    "hex": ("0x10", 400),
}


@pytest.mark.parametrize("value,status", list(CONTENT_LENGTHS.values()), ids=list(CONTENT_LENGTHS))
def test_content_length_out_of_bounds_is_refused_before_reading(server, value, status):
    with connect(server.port) as sock:
        started = time.monotonic()
        sock.sendall(request_head("POST", COMPLETIONS, content_length=value) + b"{}")
        data = read_until_closed(sock, 5)
    assert data.startswith(b"HTTP/1.1 %d " % status), data[:200]
    # Answered at once (some ms), and the connection closed; a body read first would be a 408 after TIMEOUT_S.
    assert time.monotonic() - started < SLACK_S
    if status == 413:
        assert status_and_body(data)[1]["error"]["code"] == "body_too_large"


# --- clients that leave ----------------------------------------------------------------------------------

LEAVES = {
    "after the headers": request_head("POST", COMPLETIONS, content_length="100"),
    "half-way through the body": request_head("POST", COMPLETIONS, content_length="100") + b'{"prompt": "x',
    "in a chunk": request_head("POST", CHAT, transfer_encoding="chunked") + b"20\r\n{",
    "between chunks": request_head("POST", CHAT, transfer_encoding="chunked") + b"1\r\n{\r\n",
}


def test_a_client_that_leaves_mid_body_is_counted_499_not_500(server):
    before = statuses(server.url, "499")
    for sent in LEAVES.values():
        with connect(server.port) as sock:
            sock.sendall(sent)
            time.sleep(0.2)  # the handler is waiting for the rest of the body
    deadline = time.monotonic() + 5
    while statuses(server.url, "499") < before + len(LEAVES) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert statuses(server.url, "499") == before + len(LEAVES)
    assert statuses(server.url, "500") == 0
    assert_still_serving(server.url)


# --- floods of CPU work ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_flood_of_prompts_is_tokenized_a_few_at_a_time_off_the_event_loop(model):
    workers, queue, clients = 2, 2, 10
    with (
        slow_tokenizer(model, 2.0) as seen,
        running_server(model, prepare_workers=workers, prepare_queue=queue) as server,
    ):

        def ask(i: int) -> tuple[int, float, str | None]:
            started = time.monotonic()
            reply = httpx.post(server.url + COMPLETIONS, json={"prompt": f"Hello {i}", "max_tokens": 1}, timeout=30)
            return reply.status_code, time.monotonic() - started, reply.headers.get("retry-after")

        with ThreadPoolExecutor(clients) as pool:
            answers = pool.map(ask, range(clients))
            time.sleep(0.3)
            started = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            health_s = time.monotonic() - started
            answers = list(answers)
        assert not server.errors
    codes = [code for code, _, _ in answers]
    assert set(codes) <= {200, 429} and codes.count(200) <= workers + queue and codes.count(429) >= 1, codes
    assert all(seconds < 1.5 and retry == "1" for code, seconds, retry in answers if code == 429), answers  # not queued
    assert seen["peak"] <= workers
    assert health_s < 1.0  # while tokenizations of 2 s run
    assert "mlxinfer-server" not in seen["threads"]  # the event loop's thread never tokenizes


def test_a_request_passes_the_prepare_gate_once_so_it_is_never_refused_after_parsing(model, monkeypatch):
    passes, run = [], WorkGate.run

    async def counted(self, work, *args, admitted=False):
        passes.append("admitted" if admitted else "may refuse")
        return await run(self, work, *args, admitted=admitted)

    monkeypatch.setattr(WorkGate, "run", counted)
    chat = (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    with running_server(model) as server:
        for path, body in (chat, (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1})):
            passes.clear()
            assert generated(httpx.post(server.url + path, json=body, timeout=30))
            assert passes == ["may refuse"], (path, passes)  # parse, template and tokenize: one pass
        server.models.unload(server.models.ids[0])
        passes.clear()
        assert generated(httpx.post(server.url + chat[0], json=chat[1], timeout=60))
        assert passes == ["may refuse", "admitted"]  # loaded outside the gate; the tokenizing is never refused
        assert not server.errors


def test_a_cancelled_request_keeps_its_place_until_its_thread_ends():
    """A client that leaves cancels its task, but its tokenizing goes on: the bound must still count it."""

    async def scenario() -> None:
        gate, started, release = WorkGate(workers=1, queue=0), threading.Event(), threading.Event()

        def work() -> str:
            started.set()
            release.wait(10)
            return "first"

        first = asyncio.ensure_future(gate.run(work))
        deadline = time.monotonic() + 10
        while not started.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert started.is_set(), "the work never started"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(APIError) as busy:  # the thread still runs: its place is still taken
            await gate.run(lambda: "second")
        assert busy.value.status == 429
        release.set()
        assert await asyncio.wait_for(gate.run(lambda: "third", admitted=True), 10) == "third"  # freed at its end
        assert await gate.run(lambda: "fourth") == "fourth"

    asyncio.run(scenario())


# --- settings --------------------------------------------------------------------------------------------

BAD_SETTINGS = {
    "header_timeout_s": [0, -1, float("nan"), float("inf"), "10", True, None, 10**5000, 86401],
    "body_timeout_s": [0, -0.5, float("nan"), float("-inf"), "1", False, 10**400],
    "max_connections": [0, -5, 2.5, "100", True, None, float("inf")],
    "prepare_workers": [0, -1, 1.5, "4", True],
    "prepare_queue": [-1, 0.5, "64", None, False],
}


BAD_SETTING_CASES = [(name, value) for name, values in BAD_SETTINGS.items() for value in values]


@pytest.mark.parametrize(
    "name,value", BAD_SETTING_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_SETTING_CASES)]
)
def test_bad_limit_settings_are_refused_naming_them(name, value):
    with pytest.raises(ServerConfigError, match=name) as refused:
        ServerSettings(**{name: value})
    assert len(str(refused.value)) < 200
