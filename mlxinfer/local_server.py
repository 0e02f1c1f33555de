"""How the user's front ends find the one resident server: a small state file in the user's runtime dir.

`mlxinfer serve` and the menubar helper publish their URL, PID and a per-user token there
(a file only the user can read); `mlxinfer chat` / `generate` and `mlxinfer.connect()` read it
and talk to that server instead of loading a second copy of the weights. A file left by a
server that died, or one whose server does not know its token, is ignored with a one-line note.

Anyone who can write the user's runtime dir, or listen on a loopback port, may have put something else
there: the file is read without blocking and only when it is a regular file; the token goes only to the
loopback address the file names, never along a redirect; and the identity check ends at one deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import logging
import os
import secrets
import socket
import stat
import sys
import time
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import platformdirs

from .errors import RemoteServerError, ServerConfigError

log = logging.getLogger("mlxinfer")
STATE_FILE = "server.json"
MAX_STATE_BYTES = 4096
PROBE_TIMEOUT_S = 2.0  # the whole identity check: connecting, asking and reading the answer
_POSIX = sys.platform != "win32"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO in the file's place must not hold the open until a writer comes
MAX_PID = 2**31 - 1  # past any platform's PIDs (os.kill overflows on larger ones)
IDENTITY_PATH = "/api/mlxinfer"  # answers {"pid": ...} to a request that shows the token
# A front end names its answer in this header; a stop sent to STOP_PATH ({"answer": name}, with the token) ends it
# the way a finished one ends, so its stream still brings the true token counts (a closed connection would not).
ANSWER_HEADER = "X-Mlxinfer-Answer"
STOP_PATH = "/api/mlxinfer/stop"
MAX_ANSWER_BYTES = 1 << 20


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an HTTPError: following one would send the token to wherever it names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())  # loopback: no proxy either


@dataclass(frozen=True)
class LocalServer:
    url: str  # http://127.0.0.1:PORT
    pid: int
    token: str

    def __post_init__(self) -> None:  # whatever builds one, its token can only go to this machine
        if _loopback_address(self.url) is None:
            raise RemoteServerError(
                f"{self.url!r} is not an http://IP:PORT loopback address; the token goes nowhere else"
            )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def runtime_dir() -> Path:
    """$MLXINFER_RUNTIME_DIR, else the platform's per-user runtime dir (/run/user/UID/mlxinfer on Linux)."""
    override = os.environ.get("MLXINFER_RUNTIME_DIR")
    if override:
        return Path(override).expanduser()
    with warnings.catch_warnings():  # no XDG_RUNTIME_DIR (a container, ssh): its /tmp fallback is fine, see publish
        warnings.simplefilter("ignore")
        return Path(platformdirs.user_runtime_dir("mlxinfer"))


def state_path() -> Path:
    return runtime_dir() / STATE_FILE


def new_token() -> str:
    return secrets.token_urlsafe(32)


def publish(url: str, token: str, pid: int | None = None) -> Path:
    """Write the state file (readable by the user only) atomically; returns its path.

    ServerConfigError when the folder is not the user's own private one (a shared /tmp fallback another user
    made first): the token must not land where others can read or redirect it."""
    folder = runtime_dir()
    folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder.mkdir(exist_ok=True, mode=0o700)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or (_POSIX and (info.st_uid != os.getuid() or info.st_mode & 0o077)):
        raise ServerConfigError(f"{folder} is not a private folder of this user; set MLXINFER_RUNTIME_DIR")
    path = folder / STATE_FILE
    part = folder / f".{STATE_FILE}.{os.getpid()}.part"
    data = json.dumps({"url": url, "pid": os.getpid() if pid is None else pid, "token": token}).encode()
    with contextlib.suppress(FileNotFoundError):
        part.unlink()  # ours, left by a crash of a process with this PID
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)  # never through a planted link
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(part, path)
    return path


def withdraw(token: str) -> None:
    """Remove the state file if it is still the one this server wrote (same token)."""
    path = state_path()
    entry = _read(path)
    if entry is not None and secrets.compare_digest(entry.get("token", ""), token):
        with contextlib.suppress(OSError):
            path.unlink()


def find_server() -> LocalServer | None:
    """The running resident server, or None (no state file, or a stale one: noted in one line)."""
    try:
        path = state_path()
    except OSError as e:  # platformdirs refuses a runtime folder someone else made
        log.warning("note: no resident server is looked for: %s", e)
        return None
    entry = _read(path)
    if entry is None:
        return None
    server = _checked(entry)
    if server is None:
        log.warning("note: ignoring %s: it does not describe a local mlxinfer server", path)
        return None
    if not _alive(server.pid):
        log.warning("note: ignoring %s: its server (pid %d) is no longer running", path, server.pid)
        return None
    answer = _identity(server)
    if answer != server.pid:
        log.warning("note: ignoring %s: %s", path, _why_not(server, answer))
        return None
    return server


def _read(path: Path) -> dict | None:
    """The state file's JSON object, if it is the user's own private regular file (not a link to one)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError:  # none, or a link
        return None
    try:
        info = os.fstat(fd)  # of the file opened, not of whatever the path names by now
        if not stat.S_ISREG(info.st_mode):  # a folder, a FIFO, a device: never read
            log.warning("note: ignoring %s: it is not a regular file", path)
            return None
        if _POSIX and (info.st_uid != os.getuid() or info.st_mode & 0o077):
            log.warning("note: ignoring %s: it is not the user's own private file", path)
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
    except OSError as e:
        log.warning("note: ignoring %s: it cannot be read (%s)", path, e.strerror or type(e).__name__)
        return None
    finally:
        os.close(fd)
    try:
        entry = json.loads(raw) if len(raw) <= MAX_STATE_BYTES else None
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        entry = None
    if not isinstance(entry, dict):
        log.warning("note: ignoring %s: it is not a server state file", path)
        return None
    return entry


def _checked(entry: dict) -> LocalServer | None:
    url, pid, token = entry.get("url"), entry.get("pid"), entry.get("token")
    if not (isinstance(url, str) and isinstance(token, str) and 16 <= len(token) <= 256):
        return None
    if type(pid) is not int or not 0 < pid <= MAX_PID:  # not a bool, nor an int os.kill cannot take
        return None
    address = _loopback_address(url)
    if address is None:
        return None  # the token is never sent beyond this machine
    host, port = address
    return LocalServer(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}", pid, token)


def _loopback_address(url: str) -> tuple[str, int] | None:
    """(IP, port) of an http://IP:PORT URL naming a loopback address; None for anything else, never an error."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port  # both raise ValueError on a malformed address
    except ValueError:
        return None
    if parts.scheme != "http" or port is None or not 0 < port < 65536 or not _is_loopback(host):
        return None
    return host, port


def _is_loopback(host: str) -> bool:
    """A loopback IP address (a name could resolve to where another user listens)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether it exists
    except OSError:  # gone, or another user's process that took the PID: not our server
        return False
    return True


def server_identity(server: LocalServer) -> dict:
    """What the server says of itself when shown the token: pid, version, models, loaded (RemoteServerError if not).

    Within PROBE_TIMEOUT_S in all, to the loopback address only (http.client follows no redirect)."""
    host, port = _loopback_address(server.url) or ("", 0)  # a LocalServer's URL always has one
    connection = _DeadlineConnection(host, port, time.monotonic() + PROBE_TIMEOUT_S)
    try:
        connection.request("GET", IDENTITY_PATH, headers=server.headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RemoteServerError(f"HTTP {response.status}")
        body = json.loads(response.read(MAX_ANSWER_BYTES))
    except OSError as e:  # refused, timed out, closed without an answer
        raise RemoteServerError(e.strerror or str(e) or type(e).__name__) from None
    except http.client.HTTPException:  # its status line or headers are not HTTP's (quoting them could be anything)
        raise RemoteServerError("its answer is not HTTP") from None
    except (ValueError, RecursionError):
        raise RemoteServerError("its answer is not a JSON object") from None
    finally:
        connection.close()
    if not isinstance(body, dict) or type(body.get("pid")) is not int or not 0 < body["pid"] <= MAX_PID:
        raise RemoteServerError("no pid in its answer")
    return body


class _DeadlineSocket(socket.socket):
    """A socket whose every wait ends by one deadline: a server dripping a byte a second cannot hold a
    caller that a timeout per read would let through."""

    deadline = 0.0

    def _time_left(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole answer within {PROBE_TIMEOUT_S:g} s")
        self.settimeout(left)

    def recv_into(self, *args, **kwargs) -> int:  # what the file http.client reads from calls
        self._time_left()
        return super().recv_into(*args, **kwargs)

    def sendall(self, *args, **kwargs) -> None:
        self._time_left()
        super().sendall(*args, **kwargs)


class _DeadlineConnection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, deadline: float):
        super().__init__(host, port)
        self._deadline = deadline

    def connect(self) -> None:  # the host is an IP address: no name to look up
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = _DeadlineSocket(family, socket.SOCK_STREAM)
        sock.deadline = self._deadline
        try:
            sock.settimeout(max(self._deadline - time.monotonic(), 1e-3))
            sock.connect((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _identity(server: LocalServer) -> int | str:
    """The PID the server says it has when shown the token, or why it did not answer."""
    try:
        return server_identity(server)["pid"]
    except RemoteServerError as e:
        return str(e)


def _why_not(server: LocalServer, answer: int | str) -> str:
    if answer == "HTTP 401":
        return f"the server at {server.url} does not know its token (another process took the port?)"
    if isinstance(answer, int):
        return f"the server at {server.url} is pid {answer}, not {server.pid}"
    return f"the server at {server.url} did not answer ({answer})"
