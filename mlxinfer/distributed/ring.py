"""Joining MLX's ring backend, on every rank: a port picked where the rank runs, and a join that can be given up.

MLX's ring (`mx.distributed.init(backend="ring")`) reads every rank's `ip:port` from the JSON file that
MLX_HOSTFILE names. A rank's port must be free on its own host, so each rank picks it there (`reserve`),
reports it (`port_line`), and receives the whole ring from rank 0 (`receive_ring`; launch.py is rank 0's side).

MLX's init blocks in accept()/connect() and holds the interpreter lock while it does, so no Python thread can
watch it. `join` therefore runs it in the main thread with handlers installed for SIGALRM (the deadline),
SIGCHLD (a rank process rank 0 started has ended) and SIGINT (Ctrl-C): a signal interrupts the blocking call,
MLX raises, and the join ends in one line.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import select
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import mlx.core as mx

from ..errors import ClusterError
from ..untrusted import shown

CONNECT_S = 120.0  # the other ranks must have started and reached the ring by then
PORT_LINE = "mlxinfer-ring-port"  # a rank's first line on its stdout: `mlxinfer-ring-port 50123`
RING_IP_ENV = "MLXINFER_RING_IP"  # the address a rank listens on, from the hostfile's `ips`
MAX_RANKS = 64
MAX_RING_BYTES = MAX_RANKS * 32
_ADDRESS = re.compile(r"(\d{1,3}(?:\.\d{1,3}){3}):(\d{1,5})")


def reserve(ip: str) -> socket.socket:
    """A socket bound to a free port on `ip`, this host's ring address; closed just before the join, when MLX
    binds the port itself."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((ip, 0))
    except (OSError, OverflowError) as e:
        sock.close()
        why = getattr(e, "strerror", None) or str(e)
        raise ClusterError(f"cannot listen on {ip} here ({why}); a host's ips must be its own address") from None
    return sock


def port_line(sock: socket.socket) -> str:
    return f"{PORT_LINE} {sock.getsockname()[1]}"


def parse_port(line: bytes) -> int | None:
    """The port a `port_line` reports; None for any other line (a remote shell may greet first)."""
    words = line.split()
    if len(words) != 2 or words[0] != PORT_LINE.encode() or not words[1].isdigit() or len(words[1]) > 5:
        return None
    port = int(words[1])
    return port if 0 < port < 65536 else None


def receive_ring(stream: BinaryIO, rank: int, timeout_s: float) -> list[list[str]]:
    """The ring rank 0 sends on this rank's stdin: one JSON line, then the end of the stream."""
    fd, data, deadline = stream.fileno(), b"", time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise ClusterError(f"rank 0 sent no ring addresses within {timeout_s:g} s")
        chunk = os.read(fd, MAX_RING_BYTES + 1 - len(data))
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_RING_BYTES:
            raise ClusterError(f"rank 0 sent more than {MAX_RING_BYTES} bytes of ring addresses")
    if not data:
        raise ClusterError("rank 0 ended before it sent the ring's addresses")
    return checked_ring(data, rank)


def checked_ring(data: bytes, rank: int) -> list[list[str]]:
    """`data` as a ring: one list of `ipv4:port` per rank, this rank among them."""
    try:
        ring = json.loads(data)
    except (ValueError, RecursionError):
        ring = None
    if not (isinstance(ring, list) and 0 <= rank < len(ring) <= MAX_RANKS and all(_is_node(n) for n in ring)):
        raise ClusterError(f"rank {rank} got no valid ring addresses from rank 0: {shown(data)}")
    return ring


def _is_node(node: Any) -> bool:
    return isinstance(node, list) and 0 < len(node) <= MAX_RANKS and all(_is_address(a) for a in node)


def _is_address(text: Any) -> bool:
    match = _ADDRESS.fullmatch(text) if isinstance(text, str) else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        return False
    try:
        return bool(ipaddress.IPv4Address(match.group(1)))
    except ValueError:
        return False


def join(rank: int, ring: list[list[str]], timeout_s: float, ended: Callable[[], str | None] = lambda: None) -> Any:
    """Join the ring as `rank` within `timeout_s`. ClusterError in one line when `ended()` names a rank process
    that has ended (checked when SIGCHLD wakes the join), when time is up or when MLX fails; Ctrl-C raises
    KeyboardInterrupt."""
    handle, path = tempfile.mkstemp(prefix="mlxinfer-ring-", suffix=".json")
    with os.fdopen(handle, "w") as f:
        json.dump(ring, f)
    os.environ.update(MLX_HOSTFILE=path, MLX_RANK=str(rank))
    deadline = time.monotonic() + timeout_s
    try:
        with _interruptible(timeout_s):
            why = ended()
            if why is None:
                try:
                    return mx.distributed.init(backend="ring", strict=True)
                except (RuntimeError, ValueError) as error:  # "Accept failed (error: 4)": a signal woke it
                    why = ended() or _timed_out(deadline, timeout_s) or f"joining the ring failed: {error}"
    finally:
        os.unlink(path)
    raise ClusterError(why)


def _timed_out(deadline: float, timeout_s: float) -> str | None:
    if time.monotonic() < deadline - 0.05:
        return None
    return f"the ranks did not all join the ring within {timeout_s:g} s; check each host's ips and firewall"


@contextlib.contextmanager
def _interruptible(timeout_s: float) -> Iterator[None]:
    """Signals that end a blocking join: the deadline's SIGALRM and SIGCHLD (SIGINT's handler is Python's).
    Handlers are only the main thread's to set; elsewhere the join waits as long as MLX does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGALRM, signal.SIGCHLD)
    previous = {number: signal.signal(number, _wake) for number in signals}
    # Past the deadline it rings every half second: one ring may land while MLX sleeps between attempts.
    signal.setitimer(signal.ITIMER_REAL, max(timeout_s, 0.01), 0.5)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


def _wake(signum: int, frame: Any) -> None:
    """Nothing to do: that the signal interrupted MLX's accept()/connect() is the point."""
