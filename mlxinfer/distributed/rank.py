"""A rank after 0: `python -m mlxinfer.distributed.rank LAUNCH_JSON`, started by `mlxinfer serve --hostfile`.

It joins the ring, loads its part of the model and follows rank 0's turns; it exits
when rank 0 stops (0) or is gone (1, one line on stderr).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys

from ..engine import SchedulerConfig
from ..errors import MlxInferError
from .cluster import Launch, join
from .follower import follow
from .launch import connect, rank_ring


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    faulthandler.enable()  # a crash in MLX says where, not just that the rank vanished
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: where a stuck rank waits
    rank_number = int(os.environ.get("MLX_RANK", "-1"))
    try:
        launch = Launch.from_json(json.loads(argv[0]))
        group = connect(rank_number, rank_ring())
        rank = join(launch, group)
        config = SchedulerConfig(**rank.channel.receive()["scheduler"])
        model = rank.model
        follow(model.runtime, config, rank.channel, model.config.vocab_size)
    except (MlxInferError, RuntimeError, ValueError, IndexError) as error:
        print(f"mlxinfer rank {rank_number}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
