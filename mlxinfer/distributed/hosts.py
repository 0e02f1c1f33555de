"""The hosts of a pipeline: MLX's hostfile (`mlx.launch --hostfile`) with mlxinfer's fields, or `--hosts 64GB,32GB`.

A hostfile came from somewhere else: its size and host count are bounded, every field is type-checked and
every error is one line naming the file, the host and the field. See
https://ml-explore.github.io/mlx/build/html/usage/launching_distributed.html for MLX's part of the format.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..untrusted import (
    NotRegularFileError,
    TooLargeError,
    first_line,
    is_finite_number,
    is_int,
    read_capped,
    shown,
    shown_path,
)

MAX_HOSTFILE_BYTES = 64 << 10
MAX_HOSTS = 64
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB: far above any Mac
MAX_LINK_GBPS = 10_000.0
MAX_TEXT_CHARS = 1024  # a host name, an address, an interpreter's path
MAX_OPTION_CHARS = 4096
MLX_HOST_FIELDS = ("ssh", "ips", "rdma")  # mlx.launch reads these itself
OUR_HOST_FIELDS = ("memory_gb", "link_gbps", "python")
MLX_FILE_FIELDS = ("backend", "envs", "hosts")  # the object form of MLX's hostfile
# A size: a number and a binary unit. Macs' memory is sold in binary units, so 64GB is 64 GiB.
_SIZE = re.compile(r"(\d{1,9}(?:\.\d{1,6})?)\s*(?:([kmgt])(?:i?b)?)?", re.IGNORECASE)
_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
# What `ssh` may be given: a host name (labels of letters, digits and inner hyphens as in RFC 1123, and
# underscores, which ~/.ssh/config aliases use) or an IP address, optionally after `user@`. Nothing may start
# with "-": ssh would read it as an option (-oProxyCommand=...).
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}")
_SCOPE = re.compile(r"[A-Za-z0-9_.-]{1,32}")  # an IPv6 zone, as in fe80::1%en0
SSH_EXAMPLE = "a host name (mac1.local), an address (10.0.0.2, fe80::1%en0), optionally after user@"
HOSTS_EXAMPLE = "e.g. --hosts studio=192GB,mbp=64GB or --hosts 64,32 (GiB) or --hosts hosts.json"


class HostsError(ConfigError):
    """A hostfile or a --hosts value is malformed, too large, or lacks what planning needs."""


@dataclass(frozen=True)
class Host:
    """One rank's machine. `ssh` is None for a host given only by its size (`--hosts 64GB`)."""

    name: str
    ssh: str | None
    ips: tuple[str, ...] = ()
    memory_bytes: int | None = None  # usable memory to plan with; None: ask the host at launch
    link_gbps: float | None = None  # the link to the next rank; None: the command's --link-gbps
    python: str | None = None  # the interpreter to run there; None: the launcher's default


def parse_hosts(value: str) -> list[Host]:
    """The `--hosts` option: comma-separated `NAME=SIZE` or `SIZE` entries, or a hostfile's path.

    Every host then has its memory: a hostfile given here must state `memory_gb` for each.

    Example:
        >>> [h.memory_bytes for h in parse_hosts("studio=192GB,mbp=64GB")]
        [206158430208, 68719476736]
    """
    text = value.strip()
    if len(text) > MAX_OPTION_CHARS:
        raise HostsError(f"--hosts: {len(text)} characters is more than the {MAX_OPTION_CHARS} it may have")
    entries = [entry.strip() for entry in text.split(",")]
    path = Path(text).expanduser()
    if all(_is_entry(entry) for entry in entries):
        return _sized_hosts(entries)
    if not (path.is_file() or path.suffix == ".json" or "/" in text):
        bad = next(entry for entry in entries if not _is_entry(entry))
        raise HostsError(f"--hosts: {shown(bad)} is not NAME=SIZE or SIZE, nor a hostfile; {HOSTS_EXAMPLE}")
    hosts = read_hostfile(path)
    for rank, host in enumerate(hosts):
        if host.memory_bytes is None:
            raise HostsError(
                f"{shown_path(path)}: host {rank} ({host.name}) has no memory_gb, which planning needs; add the "
                'memory it may use, e.g. "memory_gb": 48'
            )
    return hosts


def parse_size(text: str) -> int:
    """Bytes of a size such as '64GB', '64G', '48GiB', '512MB' or a bare number of GiB ('1.5')."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise HostsError(f"--hosts: size {shown(text)} is not a number with a unit such as 64GB, 48GiB or 512MB")
    number, unit = match.groups()
    nbytes = int(Fraction(number) * _UNITS[(unit or "g").lower()])
    if nbytes > MAX_MEMORY_BYTES:
        raise HostsError(f"--hosts: size {shown(text)} is over {MAX_MEMORY_BYTES >> 40} TiB; check the unit")
    return nbytes


def read_hostfile(path: str | Path) -> list[Host]:
    """The hosts of an MLX hostfile: a JSON list of `{"ssh": ..., "ips": [...]}` (or an object with
    "hosts", "backend", "envs"), each with optional "memory_gb", "link_gbps" and "python"."""
    path = Path(path).expanduser()
    where = shown_path(path)
    data = _read_json(path, where)
    if isinstance(data, dict):
        _check_file_fields(data, where)
        data = data.get("hosts")
    if not isinstance(data, list) or not data:
        raise HostsError(
            f'{where}: expected a non-empty list of hosts such as [{{"ssh": "mac1.local"}}], got {shown(data)}'
        )
    if len(data) > MAX_HOSTS:
        raise HostsError(f"{where}: {len(data)} hosts is more than the {MAX_HOSTS} a pipeline may have")
    return [_host(entry, f"{where}: host {rank}") for rank, entry in enumerate(data)]


def local_hostfile(n: int) -> list[dict[str, Any]]:
    """A hostfile's contents for `n` ranks on this machine over loopback (to try a pipeline on one Mac)."""
    if not (is_int(n) and 1 <= n <= MAX_HOSTS):
        raise HostsError(f"local_hostfile needs 1 to {MAX_HOSTS} ranks, got {shown(n)}")
    return [{"ssh": "localhost", "ips": ["127.0.0.1"]} for _ in range(n)]


def _is_entry(entry: str) -> bool:
    name, _, size = entry.rpartition("=")
    return bool(_SIZE.fullmatch(size.strip())) and (not name or bool(_NAME.fullmatch(name.strip())))


def _sized_hosts(entries: list[str]) -> list[Host]:
    if len(entries) > MAX_HOSTS:
        raise HostsError(f"--hosts: {len(entries)} hosts is more than the {MAX_HOSTS} a pipeline may have")
    hosts = []
    for rank, entry in enumerate(entries):
        name, _, size = entry.rpartition("=")
        hosts.append(Host(name=name.strip() or f"rank {rank}", ssh=None, memory_bytes=parse_size(size)))
    return hosts


def _read_json(path: Path, where: str) -> Any:
    try:
        text = read_capped(path, MAX_HOSTFILE_BYTES).decode("utf-8")
    except NotRegularFileError:
        raise HostsError(f"{where}: not a regular file; a hostfile is a JSON file") from None
    except TooLargeError:
        raise HostsError(f"{where}: more than the {MAX_HOSTFILE_BYTES} bytes a hostfile may have") from None
    except UnicodeDecodeError as e:
        raise HostsError(f"{where}: not UTF-8 text (byte {e.start}); a hostfile is JSON") from None
    except FileNotFoundError:
        raise HostsError(f"{where}: no such hostfile; {HOSTS_EXAMPLE}") from None
    except OSError as e:
        raise HostsError(f"{where}: cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except RecursionError:
        raise HostsError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, a repeated key, NaN, an integer too long to convert
        raise HostsError(f"{where}: not valid JSON ({first_line(e)})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = next((key for key in keys if keys.count(key) > 1), None)
    if repeated is not None:
        raise ValueError(f"the key {shown(repeated)} appears twice in one object")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _check_file_fields(data: dict[str, Any], where: str) -> None:
    unknown = sorted(set(data) - set(MLX_FILE_FIELDS))
    if unknown:
        raise HostsError(
            f"{where}: unknown field {shown(unknown[0])}; a hostfile object has {', '.join(MLX_FILE_FIELDS)}"
        )
    if not isinstance(data.get("backend", ""), str):
        raise HostsError(f"{where}: backend must be a string, got {shown(data['backend'])}")
    envs = data.get("envs", [])
    if not (isinstance(envs, list) and all(isinstance(e, str) and len(e) <= MAX_TEXT_CHARS for e in envs)):
        raise HostsError(f"{where}: envs must be a list of NAME=VALUE strings, got {shown(envs)}")


def _host(entry: Any, where: str) -> Host:
    if not isinstance(entry, dict):
        raise HostsError(f'{where}: expected an object such as {{"ssh": "mac1.local"}}, got {shown(entry)}')
    unknown = sorted(set(entry) - set(MLX_HOST_FIELDS) - set(OUR_HOST_FIELDS))
    if unknown:
        known = ", ".join(MLX_HOST_FIELDS + OUR_HOST_FIELDS)
        raise HostsError(f"{where}: unknown field {shown(unknown[0])}; a host has {known}")
    ssh = _ssh(_text(entry.get("ssh"), f"{where}: ssh"), where)
    where = f"{where} ({ssh})"
    ips = entry.get("ips", [])
    if not (isinstance(ips, list) and len(ips) <= MAX_HOSTS and all(_is_ipv4(ip) for ip in ips)):
        raise HostsError(
            f'{where}: ips must be a list of IPv4 addresses such as ["192.168.1.2"] (MLX\'s ring backend connects '
            f"over IPv4), got {shown(ips)}"
        )
    _check_rdma(entry.get("rdma", []), where)
    return Host(
        name=ssh,
        ssh=ssh,
        ips=tuple(ips),
        memory_bytes=_memory(entry.get("memory_gb"), where),
        link_gbps=_link(entry.get("link_gbps"), where),
        python=None if entry.get("python") is None else _text(entry["python"], f"{where}: python"),
    )


def _text(value: Any, where: str) -> str:
    if not (isinstance(value, str) and 0 < len(value) <= MAX_TEXT_CHARS and value.isprintable()):
        raise HostsError(
            f"{where} must be a non-empty printable string of at most {MAX_TEXT_CHARS} characters, got {shown(value)}"
        )
    return value


def _ssh(value: str, where: str) -> str:
    """`value` if it names a host as written (see _LABEL); anything else is refused before it reaches ssh."""
    user, at, host = value.rpartition("@")
    if (not at or _USER.fullmatch(user)) and (_is_host_name(host) or _is_address(host)):
        return value
    raise HostsError(f"{where}: ssh {shown(value)} is not a host name or address; give {SSH_EXAMPLE}")


def _is_host_name(text: str) -> bool:
    labels = text.split(".")
    # An all-digit last label is a mistyped address (10.0.0.256), not a name
    return len(text) <= 253 and all(_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


def _is_address(text: str) -> bool:
    address, percent, scope = text.partition("%")
    if percent and not (":" in address and _SCOPE.fullmatch(scope)):
        return False
    return _is_ip(address)


def _is_ip(value: Any) -> bool:
    try:
        return isinstance(value, str) and len(value) <= 64 and bool(ipaddress.ip_address(value))
    except ValueError:
        return False


def _is_ipv4(value: Any) -> bool:
    return _is_ip(value) and ipaddress.ip_address(value).version == 4


def _check_rdma(value: Any, where: str) -> None:
    """MLX's RDMA devices (null, a device name, or a list of them per peer): checked, left to mlx.launch."""

    def device(d: Any) -> bool:
        return d is None or (isinstance(d, str) and len(d) <= 64)

    entries = value if isinstance(value, list) else None
    if (
        entries is None
        or len(entries) > MAX_HOSTS
        or not all(
            device(d) or (isinstance(d, list) and len(d) <= MAX_HOSTS and all(device(x) for x in d)) for d in entries
        )
    ):
        raise HostsError(
            f'{where}: rdma must be a list of device names or nulls such as [null, "rdma_en2"], got {shown(value)}'
        )


def _memory(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if not (is_finite_number(value) and 0 < value and value * 2**30 <= MAX_MEMORY_BYTES):
        raise HostsError(f"{where}: memory_gb must be a number of GB (GiB) above 0, e.g. 48, got {shown(value)}")
    return int(Fraction(value) * 2**30)


def _link(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if not (is_finite_number(value) and 0 < value <= MAX_LINK_GBPS):
        raise HostsError(
            f"{where}: link_gbps must be a link's bandwidth in Gb/s, e.g. 40 for Thunderbolt 4, got {shown(value)}"
        )
    return float(value)
