"""Start the ranks of a distributed model: rank 0 here, the others on their hosts, joined by MLX's ring backend.

This does what `mlx.launch --backend ring` does (one process per host, each told
its rank and the ring's addresses in MLX_RANK / MLX_HOSTFILE), but keeps rank 0
alive when another rank dies: mlx.launch ends every rank when one fails, and a
server should instead answer that it is unhealthy. Hosts on this machine are
started as child processes, others over ssh (as mlx.launch does).
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ..errors import ClusterError
from .cluster import Launch
from .hosts import Host

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
RING_ENV = "MLXINFER_RING"  # the ring's addresses as JSON; each rank writes its own MLX_HOSTFILE from it
CONNECT_S = 120.0  # the other ranks must have started and reached the ring by then


def is_local(host: Host) -> bool:
    return host.ssh in LOCAL_NAMES or host.ssh == socket.gethostname()


def ring_addresses(hosts: Sequence[Host], port: int = 0) -> list[list[str]]:
    """One `ip:port` per rank; port 0 picks free ports (all ranks on this machine, e.g. for tests)."""
    addresses = []
    for i, host in enumerate(hosts):
        ip = host.ips[0] if host.ips else "127.0.0.1"
        addresses.append([f"{ip}:{port + i if port else _free_port(ip)}"])
    return addresses


def _free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class Ranks:
    """The processes of ranks 1..N-1, ended when this process ends."""

    def __init__(self, hosts: Sequence[Host], launch: Launch, ring: list[list[str]], quiet: bool = False):
        self.processes: list[subprocess.Popen] = []
        for rank, host in enumerate(hosts[1:], start=1):
            self.processes.append(_start(rank, host, launch, ring, quiet))
        atexit.register(self.stop)

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit code) of each rank that has ended."""
        return [(i + 1, p.returncode) for i, p in enumerate(self.processes) if p.poll() is not None]

    def stop(self, timeout: float = 5.0) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()


def _start(rank: int, host: Host, launch: Launch, ring: list[list[str]], quiet: bool) -> subprocess.Popen:
    env = {RING_ENV: json.dumps(ring), "MLX_RANK": str(rank)}
    command = [host.python or sys.executable, "-m", "mlxinfer.distributed.rank", json.dumps(launch.to_json())]
    output = subprocess.DEVNULL if quiet else None
    if is_local(host):
        return subprocess.Popen(command, env={**os.environ, **env}, stdout=output, stdin=subprocess.DEVNULL)
    remote = shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *command])
    return subprocess.Popen(["ssh", host.ssh, remote], stdout=output, stdin=subprocess.DEVNULL)


def connect(rank: int, ring: list[list[str]], ranks: Ranks | None = None, timeout_s: float = CONNECT_S) -> Any:
    """Join the ring as `rank`; rank 0 gives up (ClusterError) when a rank it started ends or never comes."""
    handle, path = tempfile.mkstemp(prefix="mlxinfer-ring-", suffix=".json")
    with os.fdopen(handle, "w") as f:
        json.dump(ring, f)
    os.environ.update(MLX_HOSTFILE=path, MLX_RANK=str(rank))
    outcome: dict[str, Any] = {}

    def init() -> None:
        try:
            outcome["group"] = mx.distributed.init(backend="ring", strict=True)
        except Exception as error:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = error

    thread = threading.Thread(target=init, name="mlxinfer-ring-connect", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    try:
        while thread.is_alive():
            thread.join(0.2)
            dead = ranks.dead() if ranks is not None else []
            if dead:
                raise ClusterError(f"rank {dead[0][0]} exited with code {dead[0][1]} before joining; see its output")
            if time.monotonic() > deadline:
                raise ClusterError(f"the ranks did not all join within {timeout_s:g} s; check the hostfile's ips")
    finally:
        os.unlink(path)
    if "error" in outcome:
        raise ClusterError(f"joining the ring failed: {outcome['error']}")
    return outcome["group"]


def rank_ring() -> list[list[str]]:
    """The ring's addresses a launched rank was given."""
    try:
        ring = json.loads(os.environ[RING_ENV])
    except (KeyError, ValueError) as e:
        raise ClusterError(f"{RING_ENV} is missing or not JSON: start ranks with `mlxinfer serve --hostfile`") from e
    return ring
