"""How the user's front ends find the one resident server: a small state file in the user's runtime dir.

`mlxinfer serve` and the menubar helper publish their URL, PID and a per-user token there
(a file only the user can read); `mlxinfer chat` / `generate` and `mlxinfer.connect()` read it
and talk to that server instead of loading a second copy of the weights. A file left by a
server that died, or one whose server does not know its token, is ignored with a one-line note.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import secrets
import stat
import sys
import urllib.error
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
PROBE_TIMEOUT_S = 2.0
_POSIX = sys.platform != "win32"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
IDENTITY_PATH = "/api/mlxinfer"  # answers {"pid": ...} to a request that shows the token
MAX_ANSWER_BYTES = 1 << 20
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


@dataclass(frozen=True)
class LocalServer:
    url: str  # http://127.0.0.1:PORT
    pid: int
    token: str

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
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:  # none, or a link
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())  # of the file opened, not of whatever the path names by now
        if not stat.S_ISREG(info.st_mode):
            return None
        if _POSIX and (info.st_uid != os.getuid() or info.st_mode & 0o077):
            log.warning("note: ignoring %s: it is not the user's own private file", path)
            return None
        raw = f.read(MAX_STATE_BYTES + 1)
    try:
        entry = json.loads(raw) if len(raw) <= MAX_STATE_BYTES else None
    except ValueError:
        entry = None
    if not isinstance(entry, dict):
        log.warning("note: ignoring %s: it is not a server state file", path)
        return None
    return entry


def _checked(entry: dict) -> LocalServer | None:
    url, pid, token = entry.get("url"), entry.get("pid"), entry.get("token")
    if not (isinstance(url, str) and isinstance(pid, int) and isinstance(token, str) and 16 <= len(token) <= 256):
        return None
    parts = urlsplit(url)
    if parts.scheme != "http" or not _is_loopback(parts.hostname or "") or parts.port is None:
        return None  # the token is never sent beyond this machine
    return LocalServer(f"http://{parts.netloc}", pid, token)


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
    """What the server says of itself when shown the token: pid, version, models, loaded (RemoteServerError if not)."""
    request = urllib.request.Request(server.url + IDENTITY_PATH, headers=server.headers)
    try:
        with OPENER.open(request, timeout=PROBE_TIMEOUT_S) as response:
            body = json.loads(response.read(MAX_ANSWER_BYTES))
    except urllib.error.HTTPError as e:
        raise RemoteServerError(f"HTTP {e.code}") from None
    except (OSError, ValueError) as e:
        raise RemoteServerError(str(getattr(e, "reason", e))) from None
    if not isinstance(body, dict) or not isinstance(body.get("pid"), int):
        raise RemoteServerError("no pid in its answer")
    return body


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
