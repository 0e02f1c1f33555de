"""`mlxinfer pull` against planted links and a hostile endpoint (issue 30, class 3).

A link in the download folder is never opened, written, moved or deleted through: the pull stops with one line
and whatever the link points at is left byte for byte. Malformed HTTP gives one line, not a traceback, and an
endpoint that drips a byte now and then is given up on after MLXINFER_HUB_STALL_S seconds. The endpoint is a
tiny raw-socket server on loopback, so each answer can be any bytes at any pace.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxinfer.cli import main
from tests.conftest import TINY

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
FILES = {p.name: p.read_bytes() for p in (TINY / "llama_classic").iterdir() if p.name != "golden.safetensors"}
STALL_S = "0.5"  # the stall limit the tests set: a pull that waits longer for progress has hung


# -- a raw-socket stand-in for the Hub ------------------------------------------------------------


def http(status: str, body: bytes, *headers: str) -> bytes:
    head = "".join(
        f"{h}\r\n" for h in (f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close", *headers)
    )  # this server closes every connection after one answer, and says so
    return f"{head}\r\n".encode() + body


def drip(head: bytes, every_s: float, give_up_s: float) -> Iterator[bytes]:
    """`head` at once, then one byte every `every_s` seconds, for `give_up_s` seconds at most."""
    yield head
    end = time.monotonic() + give_up_s
    while time.monotonic() < end:
        time.sleep(every_s)
        yield b"x"


class RawHub:
    """Serves REPO at COMMIT (listing, files, Range) on loopback; `hostile[key]` replaces one answer with raw bytes
    (or an iterator of them, sent as they come): key "listing", or a file name for its whole-file GET."""

    def __init__(self) -> None:
        self.hostile: dict[str, bytes | Iterator[bytes]] = {}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)  # so close() ends the accept loop at once
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:  # a timeout, or closed
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                head += conn.recv(4096) or b"\r\n\r\n"
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1] if len(lines[0].split(" ")) == 3 else ""
            ranged = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("range:")), None)
            answer = self._answer_for(path, ranged)
            try:
                for piece in [answer] if isinstance(answer, bytes) else answer:
                    if self.stopped.is_set():
                        return
                    conn.sendall(piece)
            except OSError:  # the client gave up
                return

    def _answer_for(self, path: str, ranged: str | None) -> bytes | Iterator[bytes]:
        if path.startswith(f"/api/models/{REPO}/revision/"):
            return self.hostile.get("listing") or http("200 OK", json.dumps(listing()).encode())
        name = path.removeprefix(f"/{REPO}/resolve/{COMMIT}/")
        if name not in FILES:
            return http("404 Not Found", b"not found")
        if ranged is None and name in self.hostile:
            return self.hostile[name]
        body = FILES[name]
        if ranged is None:
            return http("200 OK", body)
        first, _, last = ranged.removeprefix("bytes=").partition("-")
        start, end = int(first), min(int(last) if last else len(body) - 1, len(body) - 1)
        return http("206 Partial Content", body[start : end + 1], f"Content-Range: bytes {start}-{end}/{len(body)}")


def listing() -> dict:
    siblings = []
    for name, body in FILES.items():
        entry = {"rfilename": name, "size": len(body)}
        if name.endswith(".safetensors"):
            entry["lfs"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body), "pointerSize": 134}
        else:
            entry["blobId"] = hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()
        siblings.append(entry)
    return {"id": REPO, "sha": COMMIT, "siblings": siblings}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RawHub]:
    """The endpoint, with the models and cache folders in tmp_path/models and tmp_path/cache."""
    served = RawHub()
    for key, name in (("MLXINFER_MODELS_DIR", "models"), ("MLXINFER_CACHE_DIR", "cache")):
        monkeypatch.setenv(key, str(tmp_path / name))
    (tmp_path / "models").mkdir()
    monkeypatch.setenv("MLXINFER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", served.url)
    monkeypatch.setenv("MLXINFER_HUB_STALL_S", STALL_S)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield served
    served.close()


def pull() -> tuple[int, str]:
    """Run `mlxinfer pull REPO --yes`; (exit code, its one error line), after checking it ended on a handled error."""
    result = CliRunner().invoke(main, ["pull", REPO, "--yes"])
    assert isinstance(result.exception, SystemExit), f"not a one-line error: {result.exception!r}\n{result.output}"
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and result.output.rstrip().endswith(errors[0]), result.output
    return result.exit_code, errors[0]


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every file (its bytes), folder and link (its target) under `root`, links not followed."""
    found: dict[str, bytes | str] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            key = str(path.relative_to(root))
            found[key] = f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes() if name in files else "/"
    return found


def repo_downloads(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "downloads" / "tiny-org--tiny-llama"


# -- links in the download folder ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
@pytest.mark.parametrize("name", ["model.safetensors.part", "config.json.part"])
def test_a_part_file_that_is_a_link_is_never_written_through(hub, tmp_path, name, kind):
    victim = tmp_path / "outside" / "precious.bin"
    victim.parent.mkdir()
    victim.write_bytes(b"precious\n" * 20)  # shorter than either file: a resume would append to it
    folder = repo_downloads(tmp_path) / COMMIT
    folder.mkdir(parents=True)
    (folder / name).symlink_to(victim) if kind == "symlink" else os.link(victim, folder / name)
    code, error = pull()
    assert victim.read_bytes() == b"precious\n" * 20
    assert code == 1 and name in error and "link" in error, error
    assert os.path.lexists(folder / name)  # not ours to delete either
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.parametrize("linked", ["tiny-org--tiny-llama", f"tiny-org--tiny-llama/{COMMIT}"])
def test_a_download_folder_that_is_a_link_is_never_entered(hub, tmp_path, linked):
    outside = tmp_path / "outside"
    for path, body in {f"{OTHER_COMMIT}/precious.txt": b"keep", f"{COMMIT}/model.safetensors.part": b"keep",
                       "model.safetensors.part": b"keep"}.items():  # fmt: skip
        (outside / path).parent.mkdir(parents=True, exist_ok=True)
        (outside / path).write_bytes(body)
    before = snapshot(outside)
    link = tmp_path / "cache" / "downloads" / linked
    link.parent.mkdir(parents=True)
    link.symlink_to(outside, target_is_directory=True)
    code, error = pull()
    assert snapshot(outside) == before  # nothing deleted (an "old commit"), written or made there
    assert code == 1 and linked.split("/")[-1] in error and "link" in error, error
    assert link.is_symlink() and list((tmp_path / "models").iterdir()) == []


# -- malformed HTTP and a dripping endpoint -----------------------------------------------------------

MALFORMED = {
    "garbage status line": b"garbage\x00\x1b[31m not http\r\n\r\n",
    # Past the header block's bound (httpcore's 100 KiB): one long line, or many short ones.
    "huge header": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    "too many headers": b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(15_000)) + b"\r\n",
    "bad chunking": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("where", ["listing", "model.safetensors"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_http_gives_one_line(hub, tmp_path, case, where):
    hub.hostile[where] = MALFORMED[case]
    code, error = pull()
    assert code == 1 and "not valid HTTP" in error and error.isprintable(), error
    assert list((tmp_path / "models").iterdir()) == []


def test_a_dripping_download_is_given_up_after_the_stall_limit(hub, tmp_path):
    size = len(FILES["model.safetensors"])
    hub.hostile["model.safetensors"] = drip(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode(), 0.05, 4)
    started = time.monotonic()
    code, error = pull()
    assert time.monotonic() - started < 3  # the endpoint drips for 4 s: the pull gave up after 0.5 s
    assert code == 1 and "model.safetensors" in error and "stalled" in error and "resume" in error, error
    assert (repo_downloads(tmp_path) / COMMIT / "model.safetensors.part").stat().st_size > 0  # kept, to resume


@pytest.mark.slow
def test_an_endpoint_dripping_its_headers_stops_pull_with_one_line(hub, tmp_path):
    hub.hostile["listing"] = drip(b"H", 0.1, 60)  # never a whole status line
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    done = subprocess.run([sys.executable, "-m", "mlxinfer.cli", "pull", REPO, "--yes"], env=env,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "stalled" in lines[0], done.stderr
    assert list((tmp_path / "models").iterdir()) == []
