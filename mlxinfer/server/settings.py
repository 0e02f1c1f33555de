"""How the server runs, checked for safety before it binds."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from ..engine import SchedulerConfig, check_startup_mode
from ..errors import SamplingError, ServerConfigError
from ..untrusted import is_finite_number, is_int, shown

LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
# Well below macOS's default limit of 256 open files: the model's files, logs and the
# listening socket need their share too.
MAX_CONNECTIONS = 100
MAX_TIMEOUT_S = 86400


def is_loopback(host: str) -> bool:
    """True for names and addresses that never leave this machine (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    allow_remote: bool = False  # binding beyond loopback needs this and an api_key
    api_key: str | None = None  # when set, /v1, /api and /metrics need `Authorization: Bearer <key>`
    # The per-user token in the state file (state.py): it also opens the API, and lets the user's own front
    # ends name models by path.
    local_token: str | None = None
    cors_origins: tuple[str, ...] = ()  # browser origins (other than this server's own) allowed to call the API
    max_body_bytes: int = 4 << 20
    request_timeout_s: float = 600.0  # from arrival to the last token, queueing included
    default_max_tokens: int = 2048  # when a request gives none (at most the context left)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Hostile or broken clients: these bound what sockets and bodies can hold on to.
    header_timeout_s: float = 10.0  # a request's headers, from connecting (or from the previous answer)
    body_timeout_s: float = 30.0  # the whole body, once its headers arrived
    max_connections: int = MAX_CONNECTIONS  # past it the longest-idle connection is closed, or the new one gets 503
    prepare_workers: int = 4  # requests parsed, templated and tokenized at once, on threads off the event loop
    prepare_queue: int = 64  # requests waiting for one of those workers; past that, 429
    image_urls: bool = False  # fetch images given as http(s) addresses (vision/fetch.py's bounds); else refused
    # What `mlxinfer serve` loads its model with (mlxinfer.load): every request decodes with the model's mode.
    speculate: str = "auto"
    draft_model: Path | None = None

    def __post_init__(self) -> None:
        if not is_loopback(self.host):
            if not self.allow_remote:
                raise ServerConfigError(
                    f"--host {self.host} would expose the model beyond this machine; "
                    "pass --allow-remote together with --api-key (or MLXINFER_API_KEY) to do so"
                )
            if not self.api_key:
                raise ServerConfigError(
                    f"--host {self.host} with --allow-remote needs an --api-key (or MLXINFER_API_KEY)"
                )
        if self.api_key is not None and len(self.api_key) < 8:
            raise ServerConfigError("the API key is shorter than 8 characters; use a long random one")
        if any(origin.strip() in ("*", "null") for origin in self.cors_origins):
            raise ServerConfigError(
                "a wildcard or null CORS origin is not allowed; name each origin (https://host:port)"
            )
        if not 0 <= self.port < 65536:
            raise ServerConfigError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        if self.request_timeout_s <= 0 or self.max_body_bytes <= 0:
            raise ServerConfigError("--request-timeout and the body limit must be positive")
        self._check_limits()
        self._check_speculation()

    def _check_speculation(self) -> None:
        try:  # the engine's rule (an unknown mode; "draft" without a draft model), before the port is taken
            check_startup_mode(self.speculate, self.draft_model)  # (whether they fit is found as they load)
        except SamplingError as e:
            raise ServerConfigError(str(e)) from None

    def _check_limits(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (is_finite_number(value) and 0 < value <= MAX_TIMEOUT_S):
                raise ServerConfigError(
                    f"the server setting {name} must be seconds in (0, {MAX_TIMEOUT_S}], got {shown(value)}"
                )
        for name, lowest in (("max_connections", 1), ("prepare_workers", 1), ("prepare_queue", 0)):
            value = getattr(self, name)
            if not (is_int(value) and value >= lowest):
                raise ServerConfigError(f"the server setting {name} must be an integer >= {lowest}, got {shown(value)}")
