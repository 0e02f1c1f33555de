"""Grammars tried first in a child process, where a crash or a runaway cannot take this process down.

llguidance compiles in native code: some inputs overflow its stack (a segmentation fault ends
the whole server) or run for minutes, and neither can be interrupted from Python. So every
grammar not seen before is compiled once in a child (`child_check.py`) under a deadline and
CPU/memory caps; only what compiled there is compiled here. The child is killed when the
request's client leaves (`cancelled_by`) or the server stops (`end_compiles`). Verdicts are
remembered by grammar text, so a grammar costs one child (about 0.1 s) once per process.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path

from ..errors import GrammarError, ShutdownError

# Work one grammar may demand, whatever its text: llguidance's fuel and sizes, well under its defaults' worst case.
LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=100_000, max_grammar_size=200_000)
COMPILE_TIMEOUT_S = 5.0  # one child's grammars; real ones take milliseconds, the largest the bounds admit about 1 s
CHILD_MEMORY_BYTES = 4 << 30  # address space (where the system enforces it: Linux)
KNOWN_VERDICTS = 512  # grammar texts remembered (least recently used go first)
POLL_S = 0.05  # how often a waiting compile looks at its client and at the server
_CHILD = Path(__file__).with_name("child_check.py")

_known: OrderedDict[str, str | None] = OrderedDict()  # grammar text -> None (compiles) or why not
_known_lock = threading.Lock()
_running: dict[subprocess.Popen, str | None] = {}  # child -> why it was ended (None: still wanted)
_running_lock = threading.Lock()
_cancel: ContextVar[threading.Event | None] = ContextVar("mlxinfer_grammar_cancel", default=None)


@contextlib.contextmanager
def cancelled_by(event: threading.Event) -> Iterator[None]:
    """Compiles started in this context (and in worker threads it is copied to) stop once `event` is set."""
    token = _cancel.set(event)
    try:
        yield
    finally:
        _cancel.reset(token)


def end_compiles(reason: str) -> None:
    """Kill every child compiling now; their callers get a ShutdownError saying `reason`."""
    with _running_lock:
        for child in _running:
            _running[child] = reason
            with contextlib.suppress(OSError):
                child.kill()


def check_in_child(grammars: Sequence[str], where: str = "grammar") -> list[str | None]:
    """For each grammar text: None if llguidance compiles it (under LIMITS), else why not in one line.

    Warnings are left to the caller's own compile (they depend on the tokenizer, which the child has not).
    Raises GrammarError when the child crashes or overruns (naming which), ShutdownError when the compile
    was stopped."""
    with _known_lock:
        missing = [text for text in dict.fromkeys(grammars) if text not in _known]
    if missing:
        verdicts = _run_child(missing, where)
        with _known_lock:
            for text, verdict in zip(missing, verdicts):
                _known[text] = verdict
                _known.move_to_end(text)
            while len(_known) > KNOWN_VERDICTS:
                _known.popitem(last=False)
    with _known_lock:
        return [_known[text] if text in _known else None for text in grammars]


def _run_child(grammars: list[str], where: str) -> list[str | None]:
    request = {"grammars": grammars, "limits": LIMITS, "cpu_s": int(COMPILE_TIMEOUT_S) + 1}
    request["memory_bytes"] = CHILD_MEMORY_BYTES
    # The request goes in as a file, not a pipe: a pipe would need feeding while we poll, and communicate()
    # drops input left unsent when a timed-out call is retried (CPython registers stdin only when given input,
    # which a retry may not repeat): a busy machine then left the child waiting for its stdin until the deadline.
    with tempfile.TemporaryFile() as request_file:
        request_file.write(json.dumps(request).encode())
        request_file.seek(0)
        # Started under the lock: an end_compiles() between the start and the record would miss this child.
        with _running_lock:
            child = subprocess.Popen(
                [sys.executable, "-I", str(_CHILD)],
                stdin=request_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,  # a Rust panic's backtrace: the verdict says what failed
            )
            _running[child] = None
    try:
        out = _wait(child, where)
    finally:
        with _running_lock:
            ended = _running.pop(child)
    if ended is not None:
        raise ShutdownError(f"compiling the {where} was stopped: {ended}")
    return _verdicts(out, child.returncode, len(grammars), where)


def _wait(child: subprocess.Popen, where: str) -> bytes:
    """The child's output once it exits; killed at the deadline or when the caller's client leaves."""
    deadline, cancel = time.monotonic() + COMPILE_TIMEOUT_S, _cancel.get()
    while True:
        try:
            out, _ = child.communicate(timeout=POLL_S)
            return out
        except subprocess.TimeoutExpired:
            pass
        if cancel is not None and cancel.is_set():
            _kill(child)
            raise GrammarError(f"compiling the {where} was stopped: the client left")
        if time.monotonic() > deadline:
            _kill(child)
            raise GrammarError(
                f"{where} did not compile within {COMPILE_TIMEOUT_S:g} s; simplify it "
                "(fewer patterns, alternatives or nested schemas)"
            )


def _kill(child: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        child.kill()
    child.communicate()


def _verdicts(out: bytes, status: int, count: int, where: str) -> list[str | None]:
    if status < 0:  # a signal: SIGSEGV is the compiler's stack overflowing; SIGXCPU its CPU cap
        name = _signal_name(-status)
        raise GrammarError(
            f"{where} crashed the grammar compiler ({name}); simplify it (fewer keys, definitions or $refs)"
        )
    try:
        verdicts = json.loads(out)["verdicts"]
    except (ValueError, KeyError, TypeError):
        raise GrammarError(
            f"{where} could not be compiled (the grammar compiler exited with status {status})"
        ) from None
    if not isinstance(verdicts, list) or len(verdicts) != count:
        raise GrammarError(f"{where}: the grammar compiler gave no verdict")
    return [first_line(messages) if failed else None for failed, messages in verdicts]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a number this platform has no name for
        return f"signal {number}"


def first_line(messages: Sequence[str]) -> str:
    """llguidance's messages as one line of at most 300 characters."""
    text = " ".join(" ".join(str(m).split()) for m in messages)  # llguidance errors span lines with a caret diagram
    return text if len(text) <= 300 else text[:300] + "..."
