"""Prompt-prefix cache: prompts that start like an earlier one skip that part of the prefill.

Entries are the keys and values of a token sequence that was run through the
model (a prompt and the answer tokens fed back while decoding). They hang off
a trie over token ids, so finding the longest cached prefix of a prompt walks
the prompt once, however many entries there are. A hit hands out slices of the
stored arrays (MLX arrays are immutable: the new request's cache copies them
once when it first grows, the entry itself is never written).

The cache holds at most `budget_bytes`. Inserting evicts the least recently
used entries that no running request holds; an entry that is a prefix of a
newer one (the previous turn of a chat) is dropped, since the newer one covers it.

With a PrefixStore, warmed prefixes (`insert(..., persist=True)`) are also on
disk, snapshots included. Entries found there at start-up join the trie with
their KV still on disk (and their snapshot positions, read from the file's
header); a hit loads it, and evicting one only drops the loaded copy.

A layer that cannot be cut back (a sliding window, a recurrent state) is kept as
snapshots: its state at chosen positions (the end of a prompt, of a chat
message, every N tokens of a long prefill; engine/prefill.py picks them). An
entry of such a model can resume a prompt only at one of its snapshots, so a
lookup takes the deepest snapshot at or before the shared prefix, and says so.
Full-attention layers of the same entry are cut there. Snapshots count in the
entry's bytes, and go (or stay on disk) with it.

A disk load happens on the thread that looks the prefix up (the scheduler's,
so every running stream waits for it): it is I/O-bound, reading the file once
in chunks (hashed as it goes, only the first time that very file is loaded)
into arrays of at most the prefix cache's byte budget. A lookup tries at most
MAX_LOADS_PER_LOOKUP files: if they are all bad (each is quarantined), the
prompt is prefilled and later lookups try the next ones.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .layers import Cache, snapshot
from .prefix_file import MAX_SNAPSHOTS
from .store import PrefixStore, StoredPrefix

log = logging.getLogger(__name__)
LayerState = tuple[mx.array, ...]  # a cache's `state`: arrays with positions on axis 2
MAX_LOADS_PER_LOOKUP = 4  # disk files one lookup may try: bad ones beyond it wait for later lookups


Snapshot = list["LayerState | None"]  # per layer: the state of a layer that cannot be cut; None for one that can


@dataclass
class PrefixHit:
    """What a lookup found: the first `tokens` positions of a cached entry."""

    tokens: int
    diverged_at: int | None  # where the prompt left the best entry; None if the entry ended first
    entry_id: int
    layers: list[LayerState | None]  # full-attention arrays (None: a layer restored from `snapshot`)
    snapshot: Snapshot | None = None  # the other layers' state at `tokens`
    shared: int = 0  # tokens the prompt shares with the cache; `tokens` is less when no snapshot sits there
    snapshots: dict[int, Snapshot] = field(default_factory=dict)  # the entry's snapshots up to `tokens`

    @property
    def reason(self) -> str:
        """Where the prompt resumed and why, for stats and logs."""
        if self.snapshot is None or self.shared == self.tokens:
            return f"resumed at {self.tokens}: the prompt shares {self.shared} tokens with a cached one"
        return (
            f"resumed at {self.tokens}: the prompt shares {self.shared} tokens with a cached one, and the "
            f"deepest state snapshot at or before that is at {self.tokens}"
        )

    def restore(self, caches: list[Cache]) -> list[Cache]:
        """`caches` (empty, of the kind the entry was made with) starting from the reused positions."""
        for i, (cache, state) in enumerate(zip(caches, self.layers)):
            if state is not None:
                cache.load_state(tuple(a[..., : self.tokens, :] for a in state))
            else:
                cache.load_state(self.snapshot[i], self.tokens)
        return caches


@dataclass
class PrefixCacheStats:
    """Running totals; `hit_rate` is the share of looked-up prompt tokens that came from the cache."""

    lookups: int = 0
    hits: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    evictions: int = 0
    entries: int = 0
    bytes_held: int = 0
    budget_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Entry:
    ids: tuple[int, ...]
    layers: list[LayerState | None] | None  # None: on disk only
    nbytes: int  # bytes held in memory
    pins: int = 0
    stored: StoredPrefix | None = None
    # None: every layer can be cut, any position can resume. While `layers` is None (on disk
    # only) the positions are known and each state is None.
    snapshots: dict[int, Snapshot | None] | None = None

    def resumes_at(self, depth: int) -> bool:
        return self.snapshots is None or depth in self.snapshots


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    entries: set[int] = field(default_factory=set)  # entries whose ids pass through this node
    stops: set[int] = field(default_factory=set)  # of those, the ones a prompt can resume from at this depth


class PrefixCache:
    """Longest-prefix reuse of KV state under a byte budget."""

    def __init__(self, budget_bytes: int, store: PrefixStore | None = None):
        self._root = _Node()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._ids = itertools.count()
        self.stats = PrefixCacheStats(budget_bytes=max(0, int(budget_bytes)))
        self.store = store
        for stored in store.scan() if store else []:
            self._add(_on_disk(stored))

    @property
    def budget_bytes(self) -> int:
        return self.stats.budget_bytes

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget, evicting at once if it shrank."""
        self.stats.budget_bytes = max(0, int(budget_bytes))
        self._evict_until(self.stats.budget_bytes)

    def lookup(self, ids: Sequence[int], reuse_all: bool = False) -> PrefixHit | None:
        """The longest cached prefix of `ids` a prompt can resume from; pins its entry.

        A prompt's last token is always left to prefill (its logits start decoding)
        unless `reuse_all`, for warming a prefix that may already be cached whole."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(ids)
        wanted = ids if reuse_all else ids[:-1]
        loads = 0
        while True:  # a bad file on disk drops its entry: then the next best, up to MAX_LOADS_PER_LOOKUP files
            node, depth, shared = self._deepest(wanted)
            if depth == 0:
                return None
            entry_id = max(node.stops, key=lambda i: self._entries[i].layers is not None)  # in memory first
            entry = self._entries[entry_id]
            if entry.layers is not None:
                break
            if loads == MAX_LOADS_PER_LOOKUP:
                return None  # enough disk reads for one prompt: it is prefilled
            loads += 1
            if self._load(entry_id):
                break
            if entry_id in self._entries:
                return None  # no room for it within the budget
        self._entries.move_to_end(entry_id)
        entry.pins += 1
        self.stats.hits += 1
        self.stats.cached_tokens += depth
        return _hit(entry_id, entry, ids, depth, shared)

    def resumable_tokens(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` a lookup could resume from now (in memory or on disk), without a lookup's
        pins, loads or counts: a read-only walk, so another thread may ask while the scheduler's thread inserts
        (the answer is then a hint, as any answer about a cache that may evict)."""
        return self._deepest(ids)[1]

    def shared_tokens(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` some cached entry shares (whether or not it can resume there)."""
        return self._deepest(ids)[2]

    def release(self, hit: PrefixHit | None) -> None:
        """The request that looked `hit` up is done with it."""
        entry = self._entries.get(hit.entry_id) if hit else None
        if entry is not None:
            entry.pins -= 1

    def insert(
        self,
        ids: Sequence[int],
        cache: Sequence[Cache],
        persist: bool = False,
        snapshots: dict[int, Snapshot] | None = None,
    ) -> bool:
        """Keep the state of `ids` (the first len(ids) positions of `cache`); False if it cannot fit.

        Layers that cannot be cut keep `snapshots` (position -> state, taken while
        prefilling) and their state now if they hold exactly `ids`. `persist` also
        writes the entry to the store, where it outlives this process."""
        ids, persist = tuple(ids), persist and self.store is not None
        if not ids or any(c.cuttable and c.length < len(ids) for c in cache):
            return False
        kept = _snapshots_upto(cache, len(ids), snapshots)
        if kept is not None:
            if not kept:
                return False  # no state of the uncuttable layers at or before the end of ids
            ids = ids[: max(kept)]  # positions past the last snapshot cannot be resumed from
        node = self._walk(ids) or _Node()
        covering = [i for i in node.stops if self._covers(i, kept, persist)]
        if covering:  # an entry already covers all of ids
            self._entries.move_to_end(max(covering))
            return True
        # Sized from shapes, before copying anything or folding the entries it would replace.
        nbytes = sum(a.nbytes // a.shape[2] * len(ids) for c in cache if c.cuttable for a in c.state)
        kept = _within(kept, self.stats.budget_bytes - nbytes, MAX_SNAPSHOTS if persist else None)
        nbytes += _snapshot_bytes(kept)
        if nbytes > self.stats.budget_bytes or kept == {}:
            return False
        layers = [_copy_prefix(c, len(ids)) if c.cuttable else None for c in cache]
        stored = None
        if persist:  # the entry in memory holds what the file holds: after an eviction it is loaded as it was
            path = self.store.save(ids, layers, kept)
            stored = StoredPrefix(path, ids, nbytes, tuple(sorted(kept or ())))
        # An entry of the file just written over would expect the snapshots it had.
        same_file = [i for i in node.stops if stored and self._entries[i].stored and self._entries[i].ids == ids]
        for entry_id in self._prefixes_of(ids, kept) + same_file:
            self._remove(entry_id)
        if not self._evict_until(self.stats.budget_bytes - nbytes):  # others in use: keep it on disk only
            if stored:
                self._add(_on_disk(stored))
            return stored is not None
        self._add(_Entry(ids, layers, nbytes, stored=stored, snapshots=kept))
        return True

    def _covers(self, entry_id: int, kept: dict[int, Snapshot] | None, persist: bool) -> bool:
        """Whether the entry makes a new one with snapshots `kept` (None: none needed) redundant."""
        entry = self._entries[entry_id]
        if persist and not entry.stored:
            return False
        return kept is None or entry.snapshots is None or set(kept) <= set(entry.snapshots)

    def evict(self, bytes_wanted: int) -> int:
        """Free at least `bytes_wanted` if entries not in use allow it (memory pressure); returns bytes freed."""
        before = self.stats.bytes_held
        self._evict_until(max(0, before - bytes_wanted))
        return before - self.stats.bytes_held

    def clear(self) -> None:
        """Free every entry no request holds (warmed ones stay findable on disk)."""
        self._evict_until(0)

    def _add(self, entry: _Entry) -> None:
        entry_id = next(self._ids)
        self._entries[entry_id] = entry
        node = self._root
        for depth, token in enumerate(entry.ids):
            node.entries.add(entry_id)
            if depth and entry.resumes_at(depth):
                node.stops.add(entry_id)
            node = node.children.setdefault(token, _Node())
        node.entries.add(entry_id)
        node.stops.add(entry_id)
        self._account(+1, entry.nbytes)

    def _load(self, entry_id: int) -> bool:
        """Bring a disk-only entry's KV into memory within the budget; a bad file drops the entry."""
        entry = self._entries[entry_id]
        assert self.store is not None and entry.stored is not None
        if entry.stored.nbytes > self.stats.budget_bytes:
            return False  # it could never fit: leave the others alone
        loaded = self.store.load(entry.stored)
        if loaded is None:
            self._remove(entry_id)
            return False
        layers, snapshots = loaded
        nbytes = _nbytes(layers) + _snapshot_bytes(snapshots)
        entry.pins += 1  # not evictable while making room for itself
        fits = self._evict_until(self.stats.budget_bytes - nbytes)
        entry.pins -= 1
        if not fits:
            return False
        entry.layers, entry.snapshots, entry.nbytes = layers, snapshots, nbytes
        self._account(0, nbytes)
        return True

    def _deepest(self, ids: Sequence[int]) -> tuple[_Node, int, int]:
        """The deepest trie node along `ids` that some entry can resume from, its depth, and how deep `ids` matched."""
        node, depth = self._root, 0
        best, best_depth = self._root, 0
        for token in ids:
            child = node.children.get(token)
            if child is None:
                break
            node, depth = child, depth + 1
            if node.stops:
                best, best_depth = node, depth
        return best, best_depth, depth

    def _walk(self, ids: tuple[int, ...]) -> _Node | None:
        node = self._root
        for token in ids:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def _prefixes_of(self, ids: tuple[int, ...], kept: dict[int, Snapshot] | None) -> list[int]:
        """Unpinned in-memory entries whose whole token sequence is a prefix of `ids` and that a new entry
        with snapshots `kept` covers (it resumes wherever they could)."""
        found, node = [], self._root
        for depth, token in enumerate(ids):
            node = node.children.get(token)
            if node is None:
                break
            for i in node.entries:
                entry = self._entries[i]
                if len(entry.ids) != depth + 1 or entry.pins or entry.stored:
                    continue
                if kept is None or entry.snapshots is None or set(entry.snapshots) <= set(kept):
                    found.append(i)
        return found

    def _evict_until(self, limit: int) -> bool:
        for entry_id, entry in list(self._entries.items()):
            if self.stats.bytes_held <= limit:
                break
            if entry.pins or entry.layers is None:
                continue
            if entry.stored:  # keep knowing it is on disk (and where it resumes); free the memory
                self._account(0, -entry.nbytes)
                entry.layers, entry.nbytes = None, 0
                entry.snapshots = None if entry.snapshots is None else dict.fromkeys(entry.snapshots)
            else:
                self._remove(entry_id)
            self.stats.evictions += 1
        return self.stats.bytes_held <= limit

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        node = self._root
        node.entries.discard(entry_id)
        for token in entry.ids:
            child = node.children[token]
            child.entries.discard(entry_id)
            child.stops.discard(entry_id)
            if not child.entries:
                del node.children[token]  # nothing else passes below here
                break
            node = child
        self._account(-1, -entry.nbytes)

    def _account(self, entries: int, nbytes: int) -> None:
        self.stats.entries += entries
        self.stats.bytes_held += nbytes


def _hit(entry_id: int, entry: _Entry, ids: Sequence[int], depth: int, shared: int) -> PrefixHit:
    end = min(len(entry.ids), len(ids))
    diverged = depth
    while diverged < end and ids[diverged] == entry.ids[diverged]:
        diverged += 1
    snapshots = entry.snapshots or {}
    return PrefixHit(
        depth,
        diverged if diverged < end else None,
        entry_id,
        entry.layers,
        snapshot=snapshots.get(depth),
        shared=shared,
        snapshots={p: s for p, s in snapshots.items() if p <= depth},
    )


def _snapshots_upto(
    cache: Sequence[Cache], tokens: int, taken: dict[int, Snapshot] | None
) -> dict[int, Snapshot] | None:
    """The snapshots an entry of `tokens` positions keeps (None when every layer can be cut)."""
    if all(c.cuttable for c in cache):
        return None
    kept = {p: s for p, s in (taken or {}).items() if 0 < p <= tokens}
    if all(c.length == tokens for c in cache if not c.cuttable):
        kept[tokens] = snapshot(cache)
    return kept


def _within(kept: dict[int, Snapshot] | None, room: int, most: int | None = None) -> dict[int, Snapshot] | None:
    """`kept` less its earliest snapshots until it fits in `room` bytes and holds at most `most` snapshots
    (the deepest is never dropped)."""
    if kept is None:
        return None
    kept = dict(sorted(kept.items()))
    while len(kept) > 1 and (_snapshot_bytes(kept) > room or (most is not None and len(kept) > most)):
        del kept[next(iter(kept))]
    return kept


def _snapshot_bytes(kept: dict[int, Snapshot] | None) -> int:
    arrays = {id(a): a for s in (kept or {}).values() for state in s if state for a in state if a is not None}
    return sum(a.nbytes for a in arrays.values())


def _on_disk(stored: StoredPrefix) -> _Entry:
    """The entry of a stored prefix whose arrays are not in memory: where it resumes is known."""
    return _Entry(stored.token_ids, None, 0, stored=stored, snapshots=dict.fromkeys(stored.snapshots) or None)


def _copy_prefix(cache: Cache, tokens: int) -> LayerState:
    # A contiguous copy: a slice would keep the request's whole (larger) buffer alive.
    copied = tuple(mx.contiguous(a[..., :tokens, :]) for a in cache.state)
    mx.eval(copied)
    return copied


def _nbytes(layers: list[LayerState | None]) -> int:
    return sum(a.nbytes for state in layers if state for a in state)
