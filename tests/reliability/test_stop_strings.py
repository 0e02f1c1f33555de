"""Stop strings and streamed text: bounded in size, matched in time linear in the text, never stalling the scheduler.

A stop string's length once made matching quadratic (a 1 MB stop string: a minute for 4 tokens, on the thread
every request waits on), and a stream of ids that never completes a character made the detokenizer re-decode a
window that grew forever. Each test generates the attack (sizes, counts, adversarial alphabets, random streams
checked against a brute-force reference) and asserts the refusal or the bound.
"""

from __future__ import annotations

import random
import time

import pytest

from mlxinfer.engine.job import Job
from mlxinfer.engine.text import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    StopMatcher,
    TextStream,
    check_stops,
    truncate_at_stop,
)
from mlxinfer.errors import SamplingError
from mlxinfer.tokenizer import IncrementalDetokenizer
from mlxinfer.tokenizer.detokenizer import MAX_HELD_IDS, REPLACEMENT

SILENT = 256  # ids from here decode to nothing, like special tokens skipped when decoding


def decode_bytes(ids):
    """A byte-level decoder: one id per byte, invalid UTF-8 as U+FFFD, ids >= SILENT add nothing."""
    return bytes(i for i in ids if i < SILENT).decode("utf-8", "replace")


def reference(stops, chunks):
    """Brute force: after each chunk, cut the whole text so far at the earliest stop string in it."""
    text = ""
    for chunk in chunks:
        text += chunk
        hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


def streamed(stops, chunks):
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(c) for c in chunks)
    return out + ("" if matcher.stopped else matcher.flush()), matcher.stopped


# Alphabets that make stop strings occur often: few letters, multi-byte letters, and a stop-like pair.
ALPHABETS = ["ab", "abc", "aé😀", "a", "\n<|/>"]


def random_case(rng: random.Random):
    alphabet = rng.choice(ALPHABETS)
    word = lambda n: "".join(rng.choice(alphabet) for _ in range(n))  # noqa: E731
    stops = [word(rng.randint(0, 8)) for _ in range(rng.randint(1, MAX_STOP_STRINGS))]
    if rng.random() < 0.5:  # stop strings that are prefixes, suffixes or infixes of each other
        base = word(rng.randint(2, 12))
        stops = [base[i:j] for i, j in (sorted(rng.sample(range(len(base) + 1), 2)) for _ in range(len(stops)))]
    text = word(rng.randint(0, 80))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    return stops, chunks


@pytest.mark.parametrize("seed", range(60))
def test_streamed_cut_equals_brute_force_on_random_streams(seed):
    rng = random.Random(seed)
    for _ in range(50):
        stops, chunks = random_case(rng)
        assert streamed(stops, chunks) == reference(stops, chunks), (stops, chunks)
        assert truncate_at_stop("".join(chunks), stops) == reference(stops, ["".join(chunks)])[0], (stops, chunks)


@pytest.mark.parametrize("seed", range(30))
def test_text_stream_over_byte_tokens_equals_brute_force(seed):
    """Ids to text to stop strings: characters split across tokens, silent tokens, stops split across chunks."""
    rng = random.Random(seed)
    for _ in range(30):
        stops, chunks = random_case(rng)
        data = "".join(chunks).encode()
        ids = [i for byte in data for i in ([byte, SILENT] if rng.random() < 0.1 else [byte])]
        stream, out, consumed = TextStream(decode_bytes, stops), [], []
        for token in ids:
            consumed.append(token)
            out.append(stream.add(token))
            if stream.stopped:
                break
        out.append(stream.finish())
        # The brute force, not truncate_at_stop: that runs on the same StopMatcher as TextStream.
        assert ("".join(out), stream.stopped) == reference(stops, [decode_bytes(consumed)]), (stops, chunks)
        assert all(REPLACEMENT not in piece for piece in out)  # never half a character


@pytest.mark.parametrize("length", [1, 2, 17, MAX_STOP_CHARS - 1, MAX_STOP_CHARS])
@pytest.mark.parametrize("count", [1, 2, MAX_STOP_STRINGS])
def test_stop_strings_up_to_the_limits_are_accepted_and_matched(length, count):
    stops = ["a" * (length - 1) + chr(ord("b") + i) for i in range(count)]
    text = "a" * 3 * length + stops[-1] + "tail"
    assert check_stops(stops) == stops
    assert truncate_at_stop(text, stops) == "a" * 3 * length
    assert streamed(stops, list(text)) == reference(stops, list(text))


def stop_lists():
    """Stop lists past a limit, with the field the error must name."""
    for length in (MAX_STOP_CHARS + 1, 1000, 10**5, 10**6):
        for position in (0, MAX_STOP_STRINGS - 1):
            stops = ["x"] * MAX_STOP_STRINGS
            stops[position] = "y" * length
            yield pytest.param(stops, f"stop[{position}] has {length:,} characters", id=f"len{length}-at{position}")
    for count in (MAX_STOP_STRINGS + 1, 100, 10**5):
        yield pytest.param(["s"] * count, f"got {count} strings", id=f"count{count}")
    for bad in (1, None, b"x", 2.5, ["x"], {"x": 1}):
        yield pytest.param(["ok", bad], f"stop[1] is {type(bad).__name__}", id=f"type-{type(bad).__name__}")
    for whole in ("STOP", b"STOP", 7, None, {"a": "b"}):
        yield pytest.param(whole, f"got {type(whole).__name__}", id=f"whole-{type(whole).__name__}")


@pytest.mark.parametrize("entry", ["check_stops", "StopMatcher", "truncate_at_stop", "Job"])
@pytest.mark.parametrize("stops, detail", list(stop_lists()))
def test_stop_lists_past_the_limits_are_refused_by_every_entry_point(entry, stops, detail):
    call = {
        "check_stops": lambda: check_stops(stops),
        "StopMatcher": lambda: StopMatcher(stops),
        "truncate_at_stop": lambda: truncate_at_stop("text", stops),
        "Job": lambda: Job([1, 2], lambda event: None, stop=stops),
    }[entry]
    with pytest.raises(SamplingError) as error:
        call()
    message = str(error.value)
    assert message.startswith("stop ")  # the server reports the field from the first word
    assert f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters" in message
    assert detail in message
    assert len(message) < 200 and "\n" not in message  # one line, never the input repeated


def adversarial_stops(length: int):
    """MAX_STOP_STRINGS stops that a stream of 'a' keeps almost matching: the old matcher's worst case."""
    return ["a" * (length - 1 - i) + chr(ord("b") + i) for i in range(MAX_STOP_STRINGS)]


class CountingList(list):
    reads = 0

    def __getitem__(self, index):
        CountingList.reads += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("length", [2, 16, MAX_STOP_CHARS])
@pytest.mark.parametrize("chunk", ["a", "aaaa", "a" * 37, "a" * 5 + "z"])
def test_matching_work_is_linear_in_the_text(length, chunk):
    """Counted, not timed: fallbacks in the automaton never exceed the characters fed."""
    matcher = StopMatcher(adversarial_stops(length))
    CountingList.reads = 0
    matcher._automaton.fail = CountingList(matcher._automaton.fail)
    fed = 0
    for _ in range(2000):
        matcher.feed(chunk)
        fed += len(chunk)
    assert not matcher.stopped
    assert CountingList.reads <= fed
    assert len(matcher._pending) < length  # the hold-back is bounded by the stop strings, not the stream


@pytest.mark.parametrize("chunk", ["a", "aaaa", "a" * 16])
def test_ten_thousand_tokens_against_the_longest_stops_take_well_under_a_second(chunk):
    # The old matcher spent O(length^2) per token here: minutes. Now about 20 ms; the bound leaves 50x slack.
    matcher = StopMatcher(adversarial_stops(MAX_STOP_CHARS))
    start = time.perf_counter()
    for _ in range(10_000):
        matcher.feed(chunk)
    assert time.perf_counter() - start < 1.0
    assert not matcher.stopped


def test_truncating_a_long_text_at_adversarial_stops_is_linear():
    text = "a" * 1_000_000
    start = time.perf_counter()
    assert truncate_at_stop(text, adversarial_stops(MAX_STOP_CHARS)) == text
    assert time.perf_counter() - start < 5.0  # about 0.1 s here: 50x slack for a busy machine


def test_nothing_after_a_stop_leaks_out_of_the_stream():
    stream = TextStream(decode_bytes, ["b"])
    pieces = [stream.add(i) for i in b"ab"] + [stream.add(0xF0)]
    assert stream.stopped and "".join(pieces) == "a"
    assert stream.finish() == ""  # the held incomplete character comes after the stop


HOSTILE_IDS = {
    "continuation bytes": [0x80],
    "lead bytes": [0xF0],
    "two-byte leads": [0xC3],
    "real U+FFFD characters": list(REPLACEMENT.encode()),
    "silent ids": [SILENT],
    "lead then silent": [0xE2, SILENT, SILENT],
}


@pytest.mark.parametrize("n", [100, 5000])
@pytest.mark.parametrize("name", list(HOSTILE_IDS))
def test_detokenizer_work_stays_linear_on_ids_that_never_complete_a_character(name, n):
    decoded = []
    detok = IncrementalDetokenizer(lambda ids: decoded.append(len(ids)) or decode_bytes(ids))
    pattern = HOSTILE_IDS[name]
    pieces = [detok.add(pattern[i % len(pattern)]) for i in range(n)]
    assert sum(decoded) <= n * 4 * (MAX_HELD_IDS + 1)  # was about n^2: each step re-decoded everything held
    # Output is not stalled forever: every MAX_HELD_IDS ids, what they decode to comes out.
    emitted = "".join(pieces)
    assert emitted.replace(REPLACEMENT, "") == ""
    if name != "silent ids":
        assert len(emitted) >= n // (MAX_HELD_IDS * len(pattern)) - 1


@pytest.mark.parametrize("garbage", [0, 1, MAX_HELD_IDS, 1000])
def test_text_after_invalid_bytes_still_comes_out_whole(garbage):
    text = "añ€😀 ok"
    detok = IncrementalDetokenizer(decode_bytes)
    pieces = [detok.add(0x80) for _ in range(garbage)] + [detok.add(b) for b in text.encode()] + [detok.flush()]
    assert "".join(pieces).endswith(text)
    assert "".join(pieces).count(REPLACEMENT) <= garbage
