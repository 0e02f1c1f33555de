"""Start the ranks of a distributed model: rank 0 here, the others on their hosts, joined by MLX's ring backend.

This does what `mlx.launch --backend ring` does (one process per host, each told its rank), with two changes:
- each rank picks its ring port on its own host and reports it on its stdout; rank 0 gathers them and sends
  every rank the whole ring on its stdin (ring.py is each rank's side);
- rank 0 stays alive when another rank dies: mlx.launch ends every rank when one fails, and a server should
  instead answer that it is unhealthy.
Hosts on this machine are started as child processes, others over ssh (as mlx.launch does).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from ..errors import ClusterError
from .cluster import Launch
from .hosts import Host
from .ring import RING_IP_ENV, parse_port

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
MAX_CHATTER_BYTES = 64 << 10  # what a rank may print before its port (a remote shell's greeting)


def is_local(host: Host) -> bool:
    return host.ssh in LOCAL_NAMES or host.ssh == socket.gethostname()


def ring_ips(hosts: Sequence[Host]) -> list[str]:
    """Each rank's ring address: its host's first `ips` entry, or loopback when every host is this machine."""
    alone = all(is_local(host) for host in hosts)
    ips = []
    for rank, host in enumerate(hosts):
        if not (host.ips or alone):
            raise ClusterError(
                f'host {rank} ({host.name}) has no "ips": give the address the other hosts reach it at, '
                'e.g. "ips": ["10.0.0.2"]'
            )
        ips.append(host.ips[0] if host.ips else "127.0.0.1")
    return ips


def remote_argv(host: Host, command: str) -> list[str]:
    """How a rank on another host starts: `command`, one shell line, over ssh. "--" ends ssh's options, so the
    host is never read as one (hosts.py refuses such names too). Tests put another way of reaching a host here."""
    return ["ssh", "--", str(host.ssh), command]


class Ranks:
    """The processes of ranks 1..N-1, ended when this process ends."""

    def __init__(self, hosts: Sequence[Host], launch: Launch, ips: Sequence[str], quiet: bool = False):
        self.hosts = list(hosts[1:])
        self.quiet = quiet
        self.processes: list[subprocess.Popen] = []
        atexit.register(self.stop)
        try:
            for rank, host in enumerate(self.hosts, start=1):
                self.processes.append(_start(rank, host, ips[rank], launch, quiet))
        except BaseException:
            self.stop()
            raise

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit code) of each rank that has ended."""
        return [(i + 1, p.returncode) for i, p in enumerate(self.processes) if p.poll() is not None]

    def ended(self) -> str | None:
        """One line on the first rank that has ended, if one has."""
        dead = self.dead()
        if not dead:
            return None
        rank, code = dead[0]
        host = self.hosts[rank - 1].name
        return f"rank {rank} ({host}) exited with code {code} before joining the ring; see its output above"

    def gather_ports(self, deadline: float) -> list[int]:
        """The ring port each rank reports on its stdout, in rank order; ClusterError as soon as one ends, or at
        the deadline. Waits in Python, so Ctrl-C ends it."""
        ports: dict[int, int] = {}
        said = [b""] * len(self.processes)
        with selectors.DefaultSelector() as selector:
            for i, process in enumerate(self.processes):
                selector.register(process.stdout, selectors.EVENT_READ, i)
            while len(ports) < len(self.processes):
                if (why := self.ended()) is not None:
                    raise ClusterError(why)
                if time.monotonic() > deadline:
                    late = [i + 1 for i in range(len(self.processes)) if i not in ports]
                    raise ClusterError(f"rank {late[0]} ({self.hosts[late[0] - 1].name}) did not report its ring "
                                       "port in time; see its output above")  # fmt: skip
                for key, _ in selector.select(0.2):
                    i = key.data
                    chunk = os.read(key.fd, 4096)
                    if not chunk:  # its output ended: it is ending, and ended() says so next
                        selector.unregister(key.fileobj)
                        continue
                    said[i] += chunk
                    port = self._port(i + 1, said[i])
                    if port is not None:
                        ports[i] = port
                        selector.unregister(key.fileobj)
        return [ports[i] for i in range(len(self.processes))]

    def _port(self, rank: int, said: bytes) -> int | None:
        for line in said.split(b"\n")[:-1]:  # whole lines only
            port = parse_port(line)
            if port is not None:
                return port
        if len(said) > MAX_CHATTER_BYTES:
            raise ClusterError(f"rank {rank} ({self.hosts[rank - 1].name}) printed {MAX_CHATTER_BYTES} bytes "
                               "without its ring port; is its python one with mlxinfer installed?")  # fmt: skip
        return None

    def send_ring(self, ring: list[list[str]]) -> None:
        """Every rank's address to every rank; from here on what a rank prints goes on to this stderr."""
        line = (json.dumps(ring) + "\n").encode()
        for process in self.processes:
            try:
                process.stdin.write(line)
                process.stdin.close()
            except OSError:  # it has ended: the join says so
                pass
            threading.Thread(target=_forward, args=(process.stdout, self.quiet), daemon=True).start()

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


def rank_argv(rank: int, host: Host, ip: str, launch: Launch) -> tuple[list[str], dict[str, str] | None]:
    """The command that starts `rank` on `host`, and its environment (None: this process's)."""
    env = {"MLX_RANK": str(rank), RING_IP_ENV: ip}
    command = [host.python or sys.executable, "-m", "mlxinfer.distributed.rank", json.dumps(launch.to_json())]
    if is_local(host):
        return command, {**os.environ, **env}
    # ssh passes on no variables: they travel in the command line, which the remote shell splits again
    return remote_argv(host, shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *command])), None


def _start(rank: int, host: Host, ip: str, launch: Launch, quiet: bool) -> subprocess.Popen:
    argv, env = rank_argv(rank, host, ip, launch)
    output = subprocess.DEVNULL if quiet else None
    try:
        return subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=output)
    except OSError as e:
        raise ClusterError(f"cannot start rank {rank} ({host.name}): {argv[0]}: {e.strerror or e}") from None


def _forward(stream: IO[bytes], quiet: bool) -> None:
    """A rank's stdout after its port line, on to this process's stderr (a full pipe would stop the rank)."""
    with stream:
        while chunk := os.read(stream.fileno(), 4096):
            if not quiet:
                os.write(2, chunk)
