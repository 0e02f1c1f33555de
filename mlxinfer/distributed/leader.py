"""Rank 0: start the other ranks, join them, load its part; the server then serves with `scheduler`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine import SchedulerConfig
from ..errors import ConfigError
from .cluster import Launch, Rank, join, leader_scheduler
from .hosts import Host
from .launch import Ranks, connect, ring_addresses
from .replay import STALL_S

log = logging.getLogger("mlxinfer.distributed")


@dataclass
class Cluster:
    """Rank 0's view: its own rank, the processes it started, and the Scheduler factory for the server."""

    rank: Rank
    ranks: Ranks
    scheduler: Callable[..., Any]

    def stop(self) -> None:
        self.ranks.stop()


def start(
    hosts: Sequence[Host],
    launch: Launch,
    config: SchedulerConfig | None = None,
    port: int = 0,
    stall_s: float = STALL_S,
    quiet: bool = False,
) -> Cluster:
    """Start ranks 1..N-1 on `hosts[1:]`, join them as rank 0 (this process, on `hosts[0]`) and load."""
    if len(hosts) < 2:
        raise ConfigError("a hostfile for a distributed model needs at least two hosts")
    ring = ring_addresses(hosts, port)
    ranks = Ranks(hosts, launch, ring, quiet=quiet)
    try:
        group = connect(0, ring, ranks)
        rank = join(launch, group)
    except BaseException:
        ranks.stop()
        raise
    return Cluster(rank, ranks, leader_scheduler(rank, config, stall_s))
