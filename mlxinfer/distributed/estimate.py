"""Expected decode tokens/s and time to first token of a layer pipeline, from bandwidths alone.

A deliberately simple model, stated in `PipelineEstimate.assumptions`: one request; each host reads its
layers' weights once per token (memory bandwidth) or computes 2 FLOPs per weight (whichever is slower);
each hop sends one hidden state per token; the last rank's output is then summed into every rank (a ring
all-reduce, as models/shard.py does) and every rank computes the head. Estimates, not measurements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..defaults import PREFILL_CHUNK_TOKENS

DEFAULT_MEMORY_GBPS = 100.0  # GB/s: a base M2/M3 chip (M1 68, M4 120, Pro ~200-270, Max ~400-550, Ultra ~800)
# Apple GPUs pair about 34 half-precision FLOPs with each byte/s of memory bandwidth (M1-M4, base to
# Ultra); 30 leaves a little for what matmuls do not reach.
FLOPS_PER_BYTE = 30
DEFAULT_LINK_GBPS = 40.0  # Gb/s: Thunderbolt 4
LINK_GBPS = {"Thunderbolt 5": 80, "Thunderbolt 4": 40, "10 Gigabit Ethernet": 10, "Gigabit Ethernet": 1}
DEFAULT_HOP_LATENCY_S = 50e-6  # one message over Thunderbolt or Ethernet, TCP included
PROMPT_TOKENS = 512


@dataclass(frozen=True)
class StageLoad:
    """What one token costs a host: the weights it reads and the multiply-adds it does."""

    read_bytes: int
    parameters: int  # 2 FLOPs each per token


@dataclass(frozen=True)
class LinkLoad:
    """One ring link, rank `source` to rank `target`, and what each token sends over it."""

    source: int
    target: int
    gbps: float
    bytes_per_token: int
    hop_bytes: int  # the hidden state handed to the next stage (0 on the link that closes the ring)
    sum_bytes: int  # this link's part of the all-reduce that gives every rank the last one's output


@dataclass(frozen=True)
class PipelineEstimate:
    decode_tps: float
    ttft_s: float  # to the first token of a `prompt_tokens` prompt
    prompt_tokens: int
    stage_s: tuple[float, ...]  # each host's time per decoded token
    links: tuple[LinkLoad, ...]
    memory_gbps: float
    latency_s: float
    assumptions: tuple[str, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_pipeline(
    stages: Sequence[StageLoad],
    head: StageLoad,
    hidden_bytes: int,
    link_gbps: Sequence[float],
    memory_gbps: float = DEFAULT_MEMORY_GBPS,
    latency_s: float = DEFAULT_HOP_LATENCY_S,
    prompt_tokens: int = PROMPT_TOKENS,
) -> PipelineEstimate:
    """Decode tokens/s and TTFT of `stages` (one per rank, in order) linked by `link_gbps` (rank i to i+1,
    the last back to rank 0); `head` is what every rank computes for the logits; `hidden_bytes` is one
    token's hidden state (hidden_size x activation bytes).

    Example:
        >>> round(estimate_pipeline([StageLoad(10**9, 10**9)] * 2, StageLoad(0, 0), 8192, [40, 40]).decode_tps, 1)
        49.6
    """
    if len(link_gbps) != len(stages) or not stages:
        raise ValueError(f"one link per stage (rank i to i+1, the last to 0): {len(link_gbps)} for {len(stages)}")
    hosts = len(stages)
    memory_bps, flops = memory_gbps * 1e9, memory_gbps * 1e9 * FLOPS_PER_BYTE
    links = _links(hosts, hidden_bytes, link_gbps)

    def compute_s(load: StageLoad, tokens: int) -> float:
        return max(load.read_bytes / memory_bps, 2 * load.parameters * tokens / flops)

    def traffic_s(tokens: int) -> float:
        """The hops between stages, then the all-reduce: 2(hosts - 1) steps, each as slow as the slowest link."""
        hops = sum(latency_s + tokens * link.hop_bytes / (link.gbps * 1e9 / 8) for link in links if link.hop_bytes)
        if hosts == 1:
            return hops
        slowest = min(link.gbps for link in links) * 1e9 / 8
        return hops + 2 * (hosts - 1) * latency_s + tokens * max(link.sum_bytes for link in links) / slowest

    stage_s = tuple(compute_s(load, 1) for load in stages)
    step_s = sum(stage_s) + traffic_s(1) + compute_s(head, 1)
    full, rest = divmod(prompt_tokens, PREFILL_CHUNK_TOKENS)
    chunks = [PREFILL_CHUNK_TOKENS] * full + ([rest] if rest else [])
    prefill_s = sum(sum(compute_s(load, n) for load in stages) + traffic_s(n) for n in chunks)
    return PipelineEstimate(
        decode_tps=1 / max(step_s, 1e-9),  # a weightless test model on one host costs nothing
        ttft_s=prefill_s + compute_s(head, 1),  # the logits of the prompt's last position only
        prompt_tokens=prompt_tokens,
        stage_s=stage_s,
        links=links,
        memory_gbps=memory_gbps,
        latency_s=latency_s,
        assumptions=_assumptions(memory_gbps, flops, latency_s),
    )


def _links(hosts: int, hidden_bytes: int, link_gbps: Sequence[float]) -> tuple[LinkLoad, ...]:
    if hosts == 1:
        return ()
    # A ring all-reduce sends 2(n - 1) chunks of 1/n of the tensor over every link.
    share = math.ceil(2 * (hosts - 1) * hidden_bytes / hosts)
    loads = []
    for rank in range(hosts):
        hop = hidden_bytes if rank < hosts - 1 else 0
        loads.append(LinkLoad(rank, (rank + 1) % hosts, float(link_gbps[rank]), hop + share, hop, share))
    return tuple(loads)


def _assumptions(memory_gbps: float, flops: float, latency_s: float) -> tuple[str, ...]:
    return (
        f"each host reads its layers' weights once per token at {memory_gbps:g} GB/s, or computes 2 FLOPs per "
        f"weight at {flops / 1e12:.1f} TFLOPS ({FLOPS_PER_BYTE} FLOPs per byte/s, as Apple GPUs), whichever is "
        "slower; MoE experts all counted (real MoE decoding reads fewer); KV-cache reads left out",
        f"each hop sends one hidden state per token at the link's nominal rate plus {latency_s * 1e6:g} us; "
        "the last rank's output is then summed into every rank (ring all-reduce) and every rank computes the head",
        f"one request at a time, hosts one after another (no overlap); prefill in {PREFILL_CHUNK_TOKENS}-token chunks",
    )
