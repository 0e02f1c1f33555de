"""From generated ids to text: streaming deltas, stop strings, final text."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from ..errors import SamplingError
from ..tokenizer import IncrementalDetokenizer

MAX_STOP_STRINGS = 16
# Per stop string: text that may begin one is held back from the stream, and the matcher's table grows with it.
# Real stop strings are a few words.
MAX_STOP_CHARS = 256


class _StopAutomaton:
    """Aho-Corasick automaton of the stop strings: one step per character of text, however long or alike they are.

    A state is the longest end of the text so far that begins some stop string; `depth` is its length
    (what must be held back) and `match` the length of the longest stop string it ends with (0: none)."""

    def __init__(self, stops: Sequence[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.fail, self.depth, self.match = [0], [0], [0]
        for stop in stops:
            self._add(stop)
        self._link()

    def _add(self, stop: str) -> None:
        state = 0
        for char in stop:
            if char not in self.goto[state]:
                self.goto[state][char] = len(self.goto)
                self.goto.append({})
                self.fail.append(0)
                self.depth.append(self.depth[state] + 1)
                self.match.append(0)
            state = self.goto[state][char]
        self.match[state] = len(stop)

    def _link(self) -> None:
        # Breadth first, so a state's fallback (a shorter state) is complete before the state itself.
        queue = deque(self.goto[0].values())
        while queue:
            state = queue.popleft()
            for char, child in self.goto[state].items():
                self.fail[child] = self.step(self.fail[state], char) if state else 0
                self.match[child] = self.match[child] or self.match[self.fail[child]]
                queue.append(child)

    def step(self, state: int, char: str) -> int:
        # Each fallback shortens the state and each character lengthens it by at most one: linear overall.
        while char not in self.goto[state] and state:
            state = self.fail[state]
        return self.goto[state].get(char, 0)


class StopMatcher:
    """Cuts a text stream at the first stop string, holding back possible starts of one.

    Each character fed advances the automaton once, and what is held back (under MAX_STOP_CHARS
    characters) is known from its state: a feed costs its text plus that held-back text, never more."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in check_stops(stops) if s]
        self._automaton = _StopAutomaton(self.stops)
        self._state = 0
        self._pending = ""
        self.stopped = False
        self.matched = ""  # the stop string the text stopped at

    def feed(self, text: str) -> str:
        """Text that is safe to emit now ("" once a stop string was seen)."""
        if self.stopped:
            return ""
        buffer = self._pending + text
        found = self._earliest_stop(text, len(buffer) - len(text))
        if found is not None:
            start, length = found
            self.stopped, self._pending, self.matched = True, "", buffer[start : start + length]
            return buffer[:start]
        hold = self._automaton.depth[self._state]
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _earliest_stop(self, text: str, offset: int) -> tuple[int, int] | None:
        """Advance over `text` (at `offset` in the buffer); where the earliest-starting stop string begins and its
        length, or None."""
        automaton, state, earliest = self._automaton, self._state, None
        for end, char in enumerate(text, offset + 1):
            state = automaton.step(state, char)
            if automaton.match[state]:
                length = automaton.match[state]  # the longest stop string ending here starts first
                if earliest is None or end - length < earliest[0]:
                    earliest = (end - length, length)
            if earliest is not None and end - automaton.depth[state] >= earliest[0]:
                break  # no stop string still in progress began before the one found
        self._state = state
        return earliest


class TextStream:
    """Token ids in, text out: never half a character, never part of a stop string."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self._detok = IncrementalDetokenizer(decode)
        self._matcher = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        """A stop string was seen: the text ends before it, and generation should end."""
        return self._matcher.stopped

    @property
    def stop_string(self) -> str:
        """The stop string the text stopped at ("" if none)."""
        return self._matcher.matched

    def add(self, token: int) -> str:
        return self._matcher.feed(self._detok.add(token))

    def finish(self) -> str:
        """The text held back at the end of the stream (incomplete characters, possible stop starts)."""
        tail = self._matcher.feed(self._detok.flush())
        return tail + ("" if self._matcher.stopped else self._matcher.flush())


def check_stops(stop: Sequence[str]) -> list[str]:
    """`stop` as a list, or a SamplingError saying what is allowed (without repeating the input)."""
    rule = f"stop must be a list of at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each"
    if isinstance(stop, (str, bytes)) or not isinstance(stop, Sequence):
        raise SamplingError(f"{rule}; got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise SamplingError(f"{rule}; got {len(stop)} strings")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise SamplingError(f"{rule}; stop[{i}] is {type(s).__name__}")
        if len(s) > MAX_STOP_CHARS:
            raise SamplingError(f"{rule}; stop[{i}] has {len(s):,} characters")
    return list(stop)


def truncate_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the earliest stop string in it (in one linear pass)."""
    matcher = StopMatcher(stops)
    return matcher.feed(text) + matcher.flush()
