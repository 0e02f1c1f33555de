"""Rank 0: start the other ranks, join them, load its part; the server then serves with `scheduler`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine import SchedulerConfig
from ..errors import ConfigError
from .cluster import Launch, Rank, join, leader_scheduler
from .hosts import Host
from .launch import Ranks, ring_ips
from .replay import STALL_S
from .ring import CONNECT_S, reserve
from .ring import join as join_ring

log = logging.getLogger("mlxinfer.distributed")


@dataclass
class Cluster:
    """Rank 0's view: its own rank, the processes it started, and the ServingThread factory for the server."""

    rank: Rank
    ranks: Ranks
    scheduler: Callable[..., Any]

    def stop(self) -> None:
        self.ranks.stop()


def start(
    hosts: Sequence[Host],
    launch: Launch,
    config: SchedulerConfig | None = None,
    stall_s: float = STALL_S,
    quiet: bool = False,
) -> Cluster:
    """Start ranks 1..N-1 on `hosts[1:]`, join them as rank 0 (this process, on `hosts[0]`) and load.

    Each rank picks its ring port where it runs and reports it; rank 0 then gives every rank the whole ring."""
    if len(hosts) < 2:
        raise ConfigError("a hostfile for a distributed model needs at least two hosts")
    ips = ring_ips(hosts)
    deadline = time.monotonic() + CONNECT_S
    mine = reserve(ips[0])  # rank 0's ring port, picked here as every rank picks its own
    ranks = None
    try:
        ranks = Ranks(hosts, launch, ips, quiet=quiet)
        ports = [mine.getsockname()[1], *ranks.gather_ports(deadline)]
        ring = [[f"{ip}:{port}"] for ip, port in zip(ips, ports)]
        ranks.send_ring(ring)
        mine.close()  # MLX binds it now
        group = join_ring(0, ring, deadline - time.monotonic(), ranks.ended)
        rank = join(launch, group)
    except BaseException:
        mine.close()
        if ranks is not None:
            ranks.stop()
        raise
    return Cluster(rank, ranks, leader_scheduler(rank, config, stall_s))
