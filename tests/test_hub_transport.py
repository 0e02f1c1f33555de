"""The rules hub/transport.py sets below huggingface_hub: the token stays with the endpoint, a body keeps to its
limit, https never goes down to http. (The stall limit and malformed HTTP: tests/test_pull_hostile.py.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlxinfer.errors import HubError
from mlxinfer.hub import Unanswered, bounded, http_client
from mlxinfer.hub.repo import list_files

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Recorder:
    """A loopback server answering every GET with `answer(path)` -> (status, headers, body); records each
    request's path and Authorization header."""

    def __init__(self, answer) -> None:
        self.seen: list[tuple[str, str | None]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                recorder.seen.append((self.path, self.headers.get("Authorization")))
                status, headers, body = answer(self.path)
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()  # quick shutdown
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[list[Recorder]]:
    made: list[Recorder] = []
    yield made
    for server in made:
        server.close()


def listing_body(siblings: int = 1) -> bytes:
    files = [{"rfilename": f"f{i}.json", "size": 2, "blobId": "0" * 40} for i in range(siblings)]
    return json.dumps({"id": REPO, "sha": COMMIT, "siblings": files}).encode()


def test_the_token_goes_to_the_endpoint_and_never_to_a_redirect_elsewhere(servers, monkeypatch):
    elsewhere = Recorder(lambda path: (200, {}, listing_body()))
    endpoint = Recorder(lambda path: (302, {"Location": elsewhere.url + path}, b""))
    servers += [elsewhere, endpoint]
    monkeypatch.setenv("HF_ENDPOINT", endpoint.url)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert [f.name for f in list_files(REPO, "main").files] == ["f0.json"]
    asked = [auth for path, auth in endpoint.seen if path.startswith(f"/api/models/{REPO}/revision/main")]
    assert asked == ["Bearer hf_secret"], (endpoint.seen, elsewhere.seen)
    assert elsewhere.seen and all(auth is None for _, auth in elsewhere.seen), elsewhere.seen


def test_a_listing_over_its_limit_is_refused_in_one_line(servers, monkeypatch):
    endpoint = Recorder(lambda path: (200, {}, listing_body(siblings=200)))
    servers.append(endpoint)
    monkeypatch.setenv("HF_ENDPOINT", endpoint.url)
    monkeypatch.setattr("mlxinfer.hub.repo.MAX_LISTING_BYTES", 4096)
    with pytest.raises(HubError, match="more than 4096 bytes; refused") as raised:
        list_files(REPO, "main")
    assert "\n" not in str(raised.value)


def test_https_never_goes_down_to_http():
    with bounded() as rules, http_client() as client:
        rules.scheme = "https"  # as after a first request to an https endpoint
        with pytest.raises(Unanswered, match="from https to http://127.0.0.1:9/x, which is not allowed"):
            client.get("http://127.0.0.1:9/x")


def test_rules_left_behind_by_a_generator_closed_elsewhere_are_not_in_force():
    import contextvars

    import httpx2

    def suspended() -> Iterator[None]:
        with bounded() as rules:
            rules.scheme = "https"  # as after a first request to an https endpoint
            yield

    inside = suspended()
    next(inside)  # this context now holds the generator's rules, as a generator left suspended leaves them
    contextvars.Context().run(inside.close)  # closed where the garbage collector might close it: the reset
    # cannot run here, yet a request made here is no longer held to those rules (port 9: nothing listens)
    with http_client() as client, pytest.raises(httpx2.ConnectError):
        client.get("http://127.0.0.1:9/x")


def test_a_range_a_server_ignores_is_cut_to_the_bytes_asked_for(servers):
    body = bytes(range(256)) * 4
    server = Recorder(lambda path: (200, {}, body))  # ignores Range: the whole file, status 200
    servers.append(server)
    with bounded() as rules, http_client() as client:
        got = client.get(server.url + "/f", headers={"Range": "bytes=8-15"}).content
    assert got == body[8:16] and rules.failure is None


@pytest.mark.parametrize("value", ["not a url", "http://[::1", "ftp://example.com", "http://host:99999"])
def test_an_hf_endpoint_that_is_not_an_http_url_is_one_line(monkeypatch, value):
    """Checked before huggingface_hub is imported: its import fails on an endpoint it cannot parse."""
    monkeypatch.setenv("HF_ENDPOINT", value)
    with pytest.raises(HubError, match=r"^HF_ENDPOINT=.*: not an http\(s\) URL; fix it, or unset it"):
        list_files(REPO, "main")


@pytest.mark.parametrize("endpoint", ["https://127.0.0.1:9", "http://127.0.0.1:9"])
def test_the_endpoints_scheme_holds_from_the_first_request(endpoint, monkeypatch):
    """An https Hub never answers over http, even on a block's first request; an http endpoint (a test or a mirror)
    is not held to whatever scheme happened to be asked first (the flaky failures of test_model_library's pull)."""
    from mlxinfer.hub.repo import asking

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with asking("a listing", 64) as rules, http_client() as client:
        assert rules.scheme == endpoint.split(":")[0]
        if endpoint.startswith("https"):
            with pytest.raises(Unanswered, match="from https to http://127.0.0.1:9/x, which is not allowed"):
                client.get("http://127.0.0.1:9/x")
