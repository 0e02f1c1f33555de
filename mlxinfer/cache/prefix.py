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
disk. Entries found there at start-up join the trie with their KV still on
disk; a hit loads it, and evicting one only drops the loaded copy.

A disk load happens on the thread that looks the prefix up (the scheduler's,
so every running stream waits for it): it is I/O-bound, reading the file once
in chunks (hashed as it goes, only the first time that very file is loaded)
into arrays of at most the prefix cache's byte budget. A lookup tries at most
MAX_LOADS_PER_LOOKUP files: if they are all bad (each is quarantined), the
prompt is prefilled and later lookups try the next ones.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .kv import Cache
from .store import PrefixStore, StoredPrefix

LayerState = tuple[mx.array, ...]  # a cache's `state`: arrays with positions on axis 2
MAX_LOADS_PER_LOOKUP = 4  # disk files one lookup may try: bad ones beyond it wait for later lookups


@dataclass
class PrefixHit:
    """What a lookup found: the first `tokens` positions of a cached entry."""

    tokens: int
    diverged_at: int | None  # where the prompt left the best entry; None if the entry ended first
    entry_id: int
    layers: list[LayerState]

    def restore(self, caches: list[Cache]) -> list[Cache]:
        """`caches` (empty, of the kind the entry was made with) starting from the reused positions."""
        for cache, state in zip(caches, self.layers):
            cache.load_state(tuple(a[..., : self.tokens, :] for a in state))
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
    layers: list[LayerState] | None  # None: on disk only
    nbytes: int  # bytes held in memory
    pins: int = 0
    stored: StoredPrefix | None = None


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    entries: set[int] = field(default_factory=set)  # entries whose ids pass through this node


class PrefixCache:
    """Longest-prefix reuse of KV state under a byte budget."""

    def __init__(self, budget_bytes: int, store: PrefixStore | None = None):
        self._root = _Node()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._ids = itertools.count()
        self.stats = PrefixCacheStats(budget_bytes=max(0, int(budget_bytes)))
        self.store = store
        for stored in store.scan() if store else []:
            self._add(_Entry(stored.token_ids, None, 0, stored=stored))

    @property
    def budget_bytes(self) -> int:
        return self.stats.budget_bytes

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget, evicting at once if it shrank."""
        self.stats.budget_bytes = max(0, int(budget_bytes))
        self._evict_until(self.stats.budget_bytes)

    def lookup(self, ids: Sequence[int], reuse_all: bool = False) -> PrefixHit | None:
        """The longest cached prefix of `ids`; pins its entry.

        A prompt's last token is always left to prefill (its logits start decoding)
        unless `reuse_all`, for warming a prefix that may already be cached whole."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(ids)
        loads = 0
        while True:  # a bad file on disk drops its entry: then the next best, up to MAX_LOADS_PER_LOOKUP files
            node, depth = self._deepest(ids if reuse_all else ids[:-1])
            if depth == 0 or not node.entries:
                return None
            entry_id = max(node.entries, key=lambda i: self._entries[i].layers is not None)  # in memory first
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
        diverged = depth if depth < min(len(entry.ids), len(ids)) and ids[depth] != entry.ids[depth] else None
        return PrefixHit(depth, diverged, entry_id, entry.layers)

    def release(self, hit: PrefixHit | None) -> None:
        """The request that looked `hit` up is done with it."""
        entry = self._entries.get(hit.entry_id) if hit else None
        if entry is not None:
            entry.pins -= 1

    def insert(self, ids: Sequence[int], cache: Sequence[Cache], persist: bool = False) -> bool:
        """Keep the KV of `ids` (the first len(ids) positions of `cache`); False if it cannot fit.

        `persist` also writes it to the store, where it outlives this process."""
        ids = tuple(ids)
        if not ids or any(c.length < len(ids) for c in cache):
            return False
        node = self._walk(ids)
        covering = [i for i in node.entries if self._entries[i].stored or not persist] if node else []
        if covering:  # an entry already covers all of ids
            self._entries.move_to_end(max(covering))
            return True
        # Sized from shapes, before copying anything or folding the entries it would replace.
        nbytes = sum(a.nbytes // a.shape[2] * len(ids) for c in cache for a in c.state)
        if nbytes > self.stats.budget_bytes:
            return False
        layers = [_copy_prefix(c, len(ids)) for c in cache]
        stored = None
        if persist and self.store is not None:
            stored = StoredPrefix(self.store.save(ids, layers), ids, nbytes)
        for entry_id in self._prefixes_of(ids):
            self._remove(entry_id)
        if not self._evict_until(self.stats.budget_bytes - nbytes):  # others in use: keep it on disk only
            if stored:
                self._add(_Entry(ids, None, 0, stored=stored))
            return stored is not None
        self._add(_Entry(ids, layers, nbytes, stored=stored))
        return True

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
        for token in entry.ids:
            node.entries.add(entry_id)
            node = node.children.setdefault(token, _Node())
        node.entries.add(entry_id)
        self._account(+1, entry.nbytes)

    def _load(self, entry_id: int) -> bool:
        """Bring a disk-only entry's KV into memory within the budget; a bad file drops the entry."""
        entry = self._entries[entry_id]
        assert self.store is not None and entry.stored is not None
        if entry.stored.nbytes > self.stats.budget_bytes:
            return False  # it could never fit: leave the others alone
        layers = self.store.load(entry.stored)
        if layers is None:
            self._remove(entry_id)
            return False
        nbytes = _nbytes(layers)
        entry.pins += 1  # not evictable while making room for itself
        fits = self._evict_until(self.stats.budget_bytes - nbytes)
        entry.pins -= 1
        if not fits:
            return False
        entry.layers, entry.nbytes = layers, nbytes
        self._account(0, nbytes)
        return True

    def _deepest(self, ids: Sequence[int]) -> tuple[_Node, int]:
        """The trie node of the longest cached prefix of `ids`, and its depth."""
        node, depth = self._root, 0
        for token in ids:
            child = node.children.get(token)
            if child is None:
                break
            node, depth = child, depth + 1
        return node, depth

    def _walk(self, ids: tuple[int, ...]) -> _Node | None:
        node = self._root
        for token in ids:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def _prefixes_of(self, ids: tuple[int, ...]) -> list[int]:
        """Unpinned entries whose whole token sequence is a prefix of `ids`."""
        found, node = [], self._root
        for depth, token in enumerate(ids):
            node = node.children.get(token)
            if node is None:
                break
            found += [
                i
                for i in node.entries
                if len(self._entries[i].ids) == depth + 1 and not self._entries[i].pins and not self._entries[i].stored
            ]
        return found

    def _evict_until(self, limit: int) -> bool:
        for entry_id, entry in list(self._entries.items()):
            if self.stats.bytes_held <= limit:
                break
            if entry.pins or entry.layers is None:
                continue
            if entry.stored:  # keep knowing it is on disk; free the memory
                self._account(0, -entry.nbytes)
                entry.layers, entry.nbytes = None, 0
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
            if not child.entries:
                del node.children[token]  # nothing else passes below here
                break
            node = child
        self._account(-1, -entry.nbytes)

    def _account(self, entries: int, nbytes: int) -> None:
        self.stats.entries += entries
        self.stats.bytes_held += nbytes


def _copy_prefix(cache: Cache, tokens: int) -> LayerState:
    # A contiguous copy: a slice would keep the request's whole (larger) buffer alive.
    copied = tuple(mx.contiguous(a[..., :tokens, :]) for a in cache.state)
    mx.eval(copied)
    return copied


def _nbytes(layers: list[LayerState]) -> int:
    return sum(a.nbytes for state in layers for a in state)
