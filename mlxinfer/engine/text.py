"""From generated ids to text: streaming deltas, stop strings, final text."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ..cache import PrefixCache
from ..errors import SamplingError
from ..models.decoder import DecoderLM
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .generate import GenerationRequest, generate_ids
from .stats import GenerationStats

MAX_STOP_STRINGS = 16


class StopMatcher:
    """Cuts a text stream at the first stop string, holding back possible starts of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to emit now."""
        buffer = self._pending + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._pending = True, ""
            return buffer[: min(hits)]
        hold = max((n for s in self.stops for n in range(1, len(s)) if buffer.endswith(s[:n])), default=0)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text


class TextStream:
    """Token ids in, text out: never half a character, never part of a stop string."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self._detok = IncrementalDetokenizer(decode)
        self._matcher = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        """A stop string was seen: the text ends before it, and generation should end."""
        return self._matcher.stopped

    def add(self, token: int) -> str:
        return self._matcher.feed(self._detok.add(token))

    def finish(self) -> str:
        """The text held back at the end of the stream (incomplete characters, possible stop starts)."""
        tail = self._matcher.feed(self._detok.flush())
        return tail + ("" if self._matcher.stopped else self._matcher.flush())


def check_stops(stop: Sequence[str]) -> list[str]:
    """`stop` as a list, or a SamplingError saying what is allowed."""
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stop):
        raise SamplingError(f"stop must be at most {MAX_STOP_STRINGS} strings, got {stop!r}")
    return list(stop)


def truncate_at_stop(text: str, stops: Sequence[str]) -> str:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(hits)] if hits else text


@dataclass
class TextGeneration:
    """One generation's stream of text; `ids`, `stats` fill in as it runs."""

    model: DecoderLM
    tokenizer: Tokenizer
    request: GenerationRequest
    stop: Sequence[str] = ()
    prefix_cache: PrefixCache | None = None
    ids: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)

    started: bool = False

    def __post_init__(self) -> None:
        check_stops(self.stop)

    def deltas(self) -> Iterator[str]:
        """Yield text as it is produced: never half a character, never part of a stop string."""
        if self.started:
            raise SamplingError("this generation was already consumed; start a new one")
        self.started = True
        stream = TextStream(self.tokenizer.decode, self.stop)
        for token in generate_ids(self.model, self.request, self.stats, self.prefix_cache):
            self.ids.append(token)
            text = stream.add(token)
            if text:
                yield text
            if stream.stopped:
                self.stats.finish_reason = "stop"
                return
        tail = stream.finish()
        if stream.stopped:
            self.stats.finish_reason = "stop"
        if tail:
            yield tail

    def __iter__(self) -> Iterator[str]:
        return self.deltas()

    def text(self) -> str:
        """The whole text, decoded at once from the generated ids (after `deltas` ran)."""
        return truncate_at_stop(self.tokenizer.decode(self.ids), self.stop)
