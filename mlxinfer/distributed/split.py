"""Split a model's decoder layers over pipeline ranks by each host's memory, not evenly.

Every rank computes the split itself from the same numbers (the checkpoint's headers and the
hosts' memory), so only integers are used: no float rounding can make two ranks disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise

from ..errors import MemoryBudgetError
from ..untrusted import is_int, plain, shown

FIXES = (
    "use more or bigger hosts, a shorter or quantized KV cache (--context, --kv-bits), or a smaller quantization "
    "(`mlxinfer convert MODEL --out DIR --bits 4`)"
)


class SplitError(MemoryBudgetError):
    """The layers cannot be split over these hosts: fewer layers than hosts, a host with no room, too little
    memory in all."""


def split_layers(
    layer_bytes: Sequence[int],
    shared_bytes: int,
    usable_bytes: Sequence[int],
    names: Sequence[str] | None = None,
) -> list[int]:
    """Contiguous layer counts per host, rank 0's (the first layers) first.

    Each host holds `shared_bytes` (embeddings, final norm and head, which every rank keeps) and its
    layers. Its *room* is its usable memory less the shared bytes, and its share of the layer bytes is
    in proportion to its room: the cut after host k is the layer boundary whose running total of layer
    bytes is nearest the rooms of hosts 0..k over all rooms; on a tie the earlier host takes the layer
    (the last rank's head is the heaviest shared work). When rounding to whole layers overfills a host,
    hosts are filled in rank order instead; SplitError when that does not fit either.

    Example:
        >>> split_layers([10] * 12, shared_bytes=5, usable_bytes=[205, 105])  # rooms 200 : 100
        [8, 4]
    """
    names = _checked(layer_bytes, shared_bytes, usable_bytes, names)
    rooms = [usable - shared_bytes for usable in usable_bytes]
    if len(layer_bytes) < len(rooms):
        raise SplitError(
            f"{len(layer_bytes)} layers cannot be split over {len(rooms)} hosts (each needs at least one); "
            f"use at most {len(layer_bytes)} hosts"
        )
    for name, usable, room in zip(names, usable_bytes, rooms, strict=True):
        if room <= 0:
            raise SplitError(
                f"{name} can use {binary_size(usable)} but every host holds {binary_size(shared_bytes)} (embeddings, "
                "final norm, head and working memory) before any layer; give it more memory or leave it out"
            )
    counts = _proportional(layer_bytes, rooms)
    if _overfull(layer_bytes, rooms, counts) is None:
        return counts
    filled = _fill_in_rank_order(layer_bytes, rooms)
    if filled is not None:
        return filled
    raise SplitError(_does_not_fit(layer_bytes, shared_bytes, usable_bytes, names, counts))


def even_split(n_layers: int, n_hosts: int) -> list[int]:
    """`n_layers` in `n_hosts` contiguous runs that differ by at most one layer, the longer runs first
    (for when the hosts' memory is not known).

    Example:
        >>> even_split(10, 4)
        [3, 3, 2, 2]
    """
    if not (is_int(n_layers) and is_int(n_hosts) and n_hosts >= 1):
        raise SplitError(
            f"even_split needs integer layers and at least one host, got {shown(n_layers)}, {shown(n_hosts)}"
        )
    if n_layers < n_hosts:
        raise SplitError(f"{n_layers} layers cannot be split over {n_hosts} hosts; use at most {n_layers} hosts")
    base, extra = divmod(n_layers, n_hosts)
    return [base + (rank < extra) for rank in range(n_hosts)]


def layer_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Each host's layers as [start, end) from its count: [8, 4] -> [(0, 8), (8, 12)]."""
    ends = list(accumulate(counts, initial=0))
    return list(pairwise(ends))


def binary_size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point: '1.50 GiB', '340.0 MiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}" if unit in ("TiB", "GiB") else f"{n / size:,.1f} {unit}"
    return f"{n} B"


def _checked(
    layer_bytes: Sequence[int], shared_bytes: int, usable_bytes: Sequence[int], names: Sequence[str] | None
) -> list[str]:
    """The hosts' names (default 'rank i') once every argument is a non-negative integer of matching length."""
    for what, values in (("layer_bytes", layer_bytes), ("usable_bytes", usable_bytes)):
        bad = next((i for i, v in enumerate(values) if not (is_int(v) and v >= 0)), None)
        if bad is not None:
            raise SplitError(f"{what}[{bad}] must be a non-negative integer, got {shown(values[bad])}")
    if not (is_int(shared_bytes) and shared_bytes >= 0):
        raise SplitError(f"shared_bytes must be a non-negative integer, got {shown(shared_bytes)}")
    if not usable_bytes:
        raise SplitError("no hosts to split the layers over; give at least one")
    if names is None:
        return [f"rank {rank}" for rank in range(len(usable_bytes))]
    if len(names) != len(usable_bytes):
        raise SplitError(f"{len(names)} host names for {len(usable_bytes)} hosts; give one name per host")
    return [plain(name) for name in names]


def _proportional(layer_bytes: Sequence[int], rooms: Sequence[int]) -> list[int]:
    n, hosts = len(layer_bytes), len(rooms)
    prefix = list(accumulate(layer_bytes, initial=0))
    if prefix[-1] == 0:  # weightless layers (a test's): share them by count
        prefix = list(range(n + 1))
    total, all_rooms = prefix[-1], sum(rooms)
    cuts, rooms_before = [0], 0
    for k in range(hosts - 1):
        rooms_before += rooms[k]
        target = total * rooms_before  # the cut c wants prefix[c] / total == rooms_before / all_rooms
        later = hosts - 1 - k  # hosts after k, each owed one layer
        cut = min(range(cuts[-1] + 1, n - later + 1), key=lambda c: (abs(prefix[c] * all_rooms - target), -c))
        cuts.append(cut)
    cuts.append(n)
    return [end - start for start, end in pairwise(cuts)]


def _overfull(layer_bytes: Sequence[int], rooms: Sequence[int], counts: Sequence[int]) -> int | None:
    """The first host whose layers overfill its room, None when all fit."""
    for rank, (start, end) in enumerate(layer_ranges(counts)):
        if sum(layer_bytes[start:end]) > rooms[rank]:
            return rank
    return None


def _fill_in_rank_order(layer_bytes: Sequence[int], rooms: Sequence[int]) -> list[int] | None:
    """Each host takes as many layers as fit, leaving one for each later host; None when some do not fit."""
    n, hosts = len(layer_bytes), len(rooms)
    counts, start = [], 0
    for rank, room in enumerate(rooms):
        last = n if rank == hosts - 1 else n - (hosts - 1 - rank)
        end, used = start, 0
        while end < last and used + layer_bytes[end] <= room:
            used += layer_bytes[end]
            end += 1
        if end == start:
            return None
        counts.append(end - start)
        start = end
    return counts if start == n else None


def _does_not_fit(
    layer_bytes: Sequence[int], shared_bytes: int, usable_bytes: Sequence[int], names: list[str], counts: list[int]
) -> str:
    """The one line that names the host furthest short in the proportional split, and by how much."""
    ranges = layer_ranges(counts)
    needs = [shared_bytes + sum(layer_bytes[start:end]) for start, end in ranges]
    rank = max(range(len(needs)), key=lambda r: (needs[r] - usable_bytes[r], -r))
    start, end = ranges[rank]
    short = needs[rank] - usable_bytes[rank]
    missing = shared_bytes * len(needs) + sum(layer_bytes) - sum(usable_bytes)
    together = (
        f"the {len(needs)} hosts together are {binary_size(missing)} short"
        if missing > 0
        else "together they have room, but no split into whole layers fits"
    )
    return (
        f"the layers do not fit: {names[rank]} would hold layers {start}-{end - 1} "
        f"({binary_size(needs[rank] - shared_bytes)}) and the {binary_size(shared_bytes)} every host holds, "
        f"{binary_size(needs[rank])} in all, but can use {binary_size(usable_bytes[rank])} "
        f"({binary_size(short)} short); {together}; {FIXES}"
    )
