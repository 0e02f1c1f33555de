"""How the server runs, checked for safety before it binds."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from ..engine import SchedulerConfig
from ..errors import ServerConfigError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


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
    api_key: str | None = None  # when set, /v1 and /metrics need `Authorization: Bearer <key>`
    cors_origins: tuple[str, ...] = ()  # browser origins (other than this server's own) allowed to call the API
    max_body_bytes: int = 4 << 20
    request_timeout_s: float = 600.0  # from arrival to the last token, queueing included
    default_max_tokens: int = 2048  # when a request gives none (at most the context left)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

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
