"""Running a prompt into a cache, chunk by chunk, with state snapshots where they are due.

One `Prefill` serves both the single-request generator and the scheduler (which
runs one chunk per turn between decode steps). An `mx.eval` between chunks
bounds activation memory. On a model with layers that cannot be cut back (a
sliding window, a recurrent state) chunks also end at the snapshot positions:
every `snapshot_every` tokens, the end of each chat message (after each
end-of-turn token: an edited or regenerated conversation resumes there), and
the end of the prompt and the position before it (a repeat of the same prompt
resumes there). The prefix cache keeps those snapshots with the entry.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..adapters import BASE, selected
from ..cache import Cache, Snapshot, snapshot
from ..cache.layers import cuttable
from ..models.decoder import DecoderLM
from .images import PromptImages

SNAPSHOT_EVERY = 1024  # tokens between state snapshots of a long prompt
MAX_MESSAGE_MARKS = 64  # message ends snapshotted per prompt: the last ones, where edits happen
MAX_SPACED_SNAPSHOTS = 64  # every-N snapshots per prompt: a longer prompt (or a tiny N) spaces them wider


def message_ends(ids: Sequence[int], end_of_turn: Collection[int]) -> list[int]:
    """Positions just after each end-of-turn token in `ids` (the last MAX_MESSAGE_MARKS of them)."""
    return [i + 1 for i, token in enumerate(ids) if token in end_of_turn][-MAX_MESSAGE_MARKS:]


def snapshot_positions(
    start: int, end: int, every: int, marks: Iterable[int] = (), before_end: bool = True
) -> list[int]:
    """Where to snapshot while prefilling positions [start, end): sorted, each in (start, end].

    At most MAX_SPACED_SNAPSHOTS + MAX_MESSAGE_MARKS + 2, whatever `every` and the prompt length:
    each snapshot ends a prefill chunk and holds memory until the prompt is done."""
    every = max(every, -(-end // MAX_SPACED_SNAPSHOTS))
    due = {end, *range(every, end, every), *marks} | ({end - 1} if before_end else set())
    return sorted(p for p in due if start < p <= end)


@dataclass
class Prefill:
    """`ids` (1-D, the part of a prompt not in `cache` yet) being run into `cache`, which held `base` positions."""

    model: DecoderLM
    cache: list[Cache]
    ids: mx.array
    base: int
    chunk: int
    stops: list[int] = field(default_factory=list)  # positions to snapshot at
    snapshots: dict[int, Snapshot] = field(default_factory=dict)  # position -> state, taken here or inherited
    done: int = 0  # of `ids`
    images: PromptImages | None = None  # the prompt's images (positions from the prompt's start)
    adapter: int = BASE  # the adapter slot the prompt runs with (adapters/rows.py)

    @classmethod
    def start(cls, model: DecoderLM, cache: list[Cache], ids: mx.array, chunk: int,
              every: int = SNAPSHOT_EVERY, marks: Iterable[int] = (),
              inherited: dict[int, Snapshot] | None = None, before_end: bool = True,
              images: PromptImages | None = None, adapter: int = BASE) -> Prefill:  # fmt: skip
        base = cache[0].length
        stage = getattr(model, "stage", None)  # a pipeline rank: the whole model's layers decide, not its own
        whole = cuttable(cache) if stage is None else stage.cuttable
        stops = [] if whole else snapshot_positions(base, base + ids.size, every, marks, before_end)
        if images is not None:  # an image runs whole, in one chunk
            stops = [p for p in stops if not images.inside(p)]
        return cls(model, cache, ids, base, chunk, stops, dict(inherited or {}), images=images, adapter=adapter)

    @property
    def finished(self) -> bool:
        return self.done >= self.ids.size

    @property
    def position(self) -> int:
        """Positions the cache holds once the chunks run so far are evaluated."""
        return self.base + self.done

    def step(self) -> mx.array:
        """Run the next chunk; returns its hidden states, shape (1, chunk, hidden)."""
        stop = next((p for p in self.stops if p > self.position), self.base + self.ids.size)
        end = min(self.done + self.chunk, self.ids.size, stop - self.base)
        placed, shift = None, None
        if self.images is not None:
            end = self.images.chunk_end(self.position, self.base + end) - self.base
            placed = self.images.placed(self.position, self.base + end)
            shift = self.images.rope_shift(self.position) or None
        with selected(self.model, [self.adapter]):
            hidden = self.model.hidden(self.ids[None, self.done : end], self.cache, placed, shift)
        self.done = end
        if getattr(self.model, "stage", None) is not None:
            # A pipeline rank sends its output on and sums the last rank's within the pass's output, which the
            # cache alone does not need: evaluate it, or the next rank waits for a send that never comes.
            mx.eval(hidden)
        if self.position in self.stops:
            self.snapshots[self.position] = snapshot(self.cache)  # evaluates the chunk
        elif not self.finished:
            mx.eval([c.arrays for c in self.cache])
        return hidden

    def run(self) -> mx.array:
        """Every remaining chunk; returns the logits of the prompt's last position, shape (vocab,)."""
        hidden = self.step()
        while not self.finished:
            hidden = self.step()
        # Only the last position's logits are needed: skip the vocab projection for the rest.
        return self.head(hidden[:, -1])[0]

    def head(self, hidden: mx.array) -> mx.array:
        """The logits of the prompt's `hidden` states, with its adapter."""
        with selected(self.model, [self.adapter]):
            return self.model.head(hidden)


def prefill(model: DecoderLM, prompt: mx.array, cache: list[Cache], chunk_tokens: int) -> mx.array:
    """Run `prompt` (1-D ids) into `cache`; returns logits of its last position, shape (vocab,)."""
    return Prefill.start(model, cache, prompt, chunk_tokens).run()
