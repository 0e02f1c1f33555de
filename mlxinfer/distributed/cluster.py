"""One model over the ranks of an `mx.distributed` group: agree on the split, load each rank's part, serve.

Every rank runs `join`: it says how much memory it can use, all ranks compute the
same split from everyone's figures (distributed/split.py), and each loads only its
part. Rank 0 then tells the others how it schedules (`hello`), and from there on
the others follow its turns (distributed/follower.py).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..api import Model
from ..cache import make_cache
from ..cache.layers import cuttable
from ..engine import SchedulerConfig
from ..errors import ConfigError
from ..memory import machine_memory
from ..memory.planner import default_prefix_cache_bytes
from ..models import LoadedModel, load_model
from ..models.config import SLIDING, ModelConfig, normalize_config
from ..models.shard import Stage
from .channel import Channel
from .layer_sizes import read_layer_sizes
from .replay import STALL_S, LeaderScheduler
from .split import split_layers

log = logging.getLogger("mlxinfer.distributed")

PARALLEL = ("pipeline", "tensor")


@dataclass(frozen=True)
class Launch:
    """What every rank is started with (the same on all of them)."""

    model: str
    parallel: str = "pipeline"
    dtype: str | None = None
    kv_bits: int | None = None
    split: tuple[int, ...] | None = None  # layers per rank, or None: by each rank's memory

    def __post_init__(self) -> None:
        if self.parallel not in PARALLEL:
            raise ConfigError(f"--parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Launch:
        split = data.get("split")
        return cls(**{**data, "split": tuple(split) if split is not None else None})


@dataclass
class Rank:
    """This process's share of the model, ready to serve (rank 0) or to follow."""

    group: Any
    model: Model
    stage: Stage | None
    channel: Channel

    @property
    def rank(self) -> int:
        return self.group.rank()


def join(launch: Launch, group: Any) -> Rank:
    """Load this rank's part of `launch.model` (collective: every rank of `group` calls it)."""
    path = Path(launch.model).expanduser()
    usable = agree(group, machine_memory().usable_bytes())
    stage = None
    if launch.parallel == "pipeline":
        stage = _stage(path, group, usable, launch)
    tensor_group = group if launch.parallel == "tensor" else None
    loaded = load_model(path, dtype=launch.dtype, stage=stage, tensor_group=tensor_group)
    log.info("rank %d of %d: %s; peak %.0f MiB while loading", group.rank(), group.size(), _holds(loaded, stage),
             mx.get_peak_memory() / 2**20)  # fmt: skip
    channel = Channel(group)
    one_kind = len(set(_config_of(path).layer_types)) == 1  # the whole model's, not this rank's layers
    budget = _prefix_budget(loaded, one_kind, channel)
    model = Model(loaded, prefix_cache_bytes=budget, kv_bits=launch.kv_bits, speculate="off", persist_prefixes=False)
    return Rank(group, model, stage, channel)


def agree(group: Any, value: int) -> list[int]:
    """Every rank's `value`, in rank order, on every rank."""
    mine = mx.zeros((group.size(),), dtype=mx.int64)
    mine[group.rank()] = value
    everyone = mx.distributed.all_sum(mine, group=group)
    mx.eval(everyone)
    return [int(v) for v in everyone.tolist()]


def leader_scheduler(rank: Rank, config: SchedulerConfig | None, stall_s: float = STALL_S) -> Any:
    """Rank 0's ServingThread factory for the server: the other ranks learn its config first."""

    def make(runtime: Any, slot_config: SchedulerConfig | None) -> LeaderScheduler:
        chosen = slot_config or config or SchedulerConfig()
        rank.channel.send({"scheduler": asdict(chosen)})
        return LeaderScheduler(runtime, chosen, rank.channel, stall_s)

    return make


def _stage(path: Path, group: Any, usable: list[int], launch: Launch) -> Stage:
    split, dtype, kv_bits = launch.split, launch.dtype, launch.kv_bits
    config = _config_of(path)
    total = len(config.layer_types)
    if split is None:  # each rank's share of the layers' weights and KV cache follows its memory
        sizes = read_layer_sizes(path, dtype=dtype, kv_bits=kv_bits)
        layer_bytes = [w + kv for w, kv in zip(sizes.layer_weight_bytes, sizes.layer_kv_bytes)]
        split = tuple(split_layers(layer_bytes, sizes.shared_weight_bytes + sizes.working_bytes, usable))
    if len(split) != group.size() or sum(split) != total or min(split) < 1:
        raise ConfigError(
            f"the split {list(split)} must give each of {group.size()} ranks one of {total} layers or more"
        )
    start = sum(split[: group.rank()])
    window = config.sliding_window
    whole = cuttable(make_cache(tuple((kind, window if kind == SLIDING else None) for kind in config.layer_types)))
    return Stage(group.rank(), group.size(), start, start + split[group.rank()], total, group, cuttable=whole)


def _config_of(path: Path) -> ModelConfig:
    if path.is_file() and path.suffix == ".gguf":
        from ..formats.gguf_file import GGUFFile
        from ..models.gguf import gguf_config

        with GGUFFile(path) as gguf:
            return normalize_config(gguf_config(gguf), source=f"{path} (GGUF metadata)")
    from ..models.checkpoint import open_folder

    return normalize_config(open_folder(path).config, source=str(path / "config.json"))


def _prefix_budget(loaded: LoadedModel, one_kind: bool, channel: Channel) -> int:
    """This rank's prefix-cache budget: rank 0's, per layer held, so every rank keeps and evicts the same
    prefixes (an entry's bytes grow with the layers a rank holds). Off where the model's layers differ in kind:
    a rank holding only some kinds would count an entry's bytes differently from the others."""
    if channel.rank == 0:
        unit = default_prefix_cache_bytes() // max(1, len(loaded.model.layers)) if one_kind else 0
        channel.send({"prefix_unit": unit})
    else:
        unit = channel.receive()["prefix_unit"]
    if not unit:
        log.info("the prefix cache is off: the layers differ in kind, so ranks would keep different prefixes")
    return unit * len(loaded.model.layers)


def _holds(loaded: LoadedModel, stage: Stage | None) -> str:
    part = "its share of every layer" if stage is None else f"layers {stage.start}-{stage.end - 1} of {stage.total}"
    return f"{part}, {loaded.weights_bytes / 2**20:.0f} MiB of weights"
