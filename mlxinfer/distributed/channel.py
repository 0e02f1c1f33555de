"""Rank 0's decisions, broadcast to every rank over the model's own `mx.distributed` group.

A message is JSON: its length, then its bytes, each summed over the group with every
other rank adding zeros (MLX has no broadcast; a sum is one collective every backend has).
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx

from ..errors import ClusterError

MAX_MESSAGE_BYTES = 64 * 2**20  # a turn's new prompts; a prompt is bounded by the model's context long before


class Channel:
    """`send` on rank 0 and `receive` on the others, in the same order on every rank."""

    def __init__(self, group: Any):
        self.group, self.rank = group, group.rank()
        self.sent_bytes = 0  # what rank 0's messages cost each link, for the bench

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise ClusterError(f"a turn's message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
        self._exchange(len(data), data)

    def receive(self) -> dict[str, Any]:
        return json.loads(self._exchange(0, b"").decode())

    def all_true(self, mine: bool) -> bool:
        """Whether `mine` is true on every rank (each rank calls it at the same point)."""
        return int(self._sum(mx.array([0 if mine else 1], dtype=mx.int32)).item()) == 0

    def _exchange(self, length: int, data: bytes) -> bytes:
        size = int(self._sum(mx.array([length], dtype=mx.int64)).item())
        if not 0 < size <= MAX_MESSAGE_BYTES:
            raise ClusterError(f"rank 0 announced a message of {size} bytes")
        payload = mx.zeros((size,), dtype=mx.uint8) if not data else mx.array(memoryview(data), dtype=mx.uint8)
        summed = self._sum(payload)
        self.sent_bytes += 8 + size
        return bytes(memoryview(summed)) if not data else data

    def _sum(self, value: mx.array) -> mx.array:
        out = mx.distributed.all_sum(value, group=self.group)
        mx.eval(out)
        return out
