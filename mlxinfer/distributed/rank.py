"""A rank after 0: `python -m mlxinfer.distributed.rank LAUNCH_JSON`, started by `mlxinfer serve --hostfile`.

It reports the ring port it picked on its own address (its first line on stdout), joins the ring rank 0 sends
on its stdin, loads its part of the model and follows rank 0's turns; it exits
when rank 0 stops (0) or is gone (1, one line on stderr).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
from typing import Any

from ..engine import SchedulerConfig
from ..errors import MlxInferError
from .cluster import Launch, join
from .follower import follow
from .ring import CONNECT_S, RING_IP_ENV, port_line, receive_ring, reserve
from .ring import join as join_ring


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    faulthandler.enable()  # a crash in MLX says where, not just that the rank vanished
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: where a stuck rank waits
    rank_number = int(os.environ.get("MLX_RANK", "-1"))
    try:
        launch = Launch.from_json(json.loads(argv[0]))
        group = _join_ring(rank_number)
        rank = join(launch, group)
        config = SchedulerConfig(**rank.channel.receive()["scheduler"])
        model = rank.model
        follow(model.runtime, config, rank.channel, model.config.vocab_size)
    except (MlxInferError, RuntimeError, ValueError, IndexError) as error:
        print(f"mlxinfer rank {rank_number}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C reaches every rank on this terminal: rank 0 says what stopped
        return 130
    return 0


def _join_ring(rank: int) -> Any:
    """Report this rank's ring port (picked here, on its own address) to rank 0, then join the ring it sends."""
    reserved = reserve(os.environ.get(RING_IP_ENV, "127.0.0.1"))
    try:
        print(port_line(reserved), flush=True)
        ring = receive_ring(sys.stdin.buffer, rank, CONNECT_S)
    finally:
        reserved.close()  # MLX binds the port itself
    return join_ring(rank, ring, CONNECT_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
