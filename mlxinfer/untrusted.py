"""Reading and quoting what a model folder or GGUF file holds, without trusting it.

Side files (config.json, tokenizer_config.json, chat templates) are read with a
size limit, as UTF-8 and as strict JSON objects; any failure is one error naming
the file. Values quoted in error messages are shortened and escaped, so a crafted
10 MB tensor name or a string with newlines still gives one short line; paths are
kept whole but escaped. A leaf: imports nothing of mlxinfer but its errors.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import reprlib
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import MlxInferError

# Real config.json files are a few KB; tokenizer_config.json with a 256k-token
# added_tokens_decoder, or a long chat template, stays under a few MB.
MAX_SIDE_FILE_BYTES = 64 << 20


class _Short(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = 60
        self.maxlong = 24
        self.maxlevel = 2

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:  # repr() of a huge int is slow, and refused past 4300 digits
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return super().repr_int(x, level)


_REPR = _Short()


def shown(value: Any) -> str:
    """A short, one-line repr of an untrusted value for an error message."""
    return _REPR.repr(value)


def plain(name: Any) -> str:
    """A tensor or file name as is when short and printable, else its short repr (of any value, too)."""
    return name if isinstance(name, str) and 0 < len(name) <= 120 and name.isprintable() else shown(name)


def shown_path(path: str | Path) -> str:
    """A path whole (the user must recognise it) and as is when printable, else its repr: always one line."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def listed(names: Sequence[str], limit: int = 10) -> str:
    """The first `limit` names, comma-separated, and how many more there are."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(plain(n) for n in names[:limit]) + more


def first_line(error: BaseException) -> str:
    """The gist of an error from native code (tokenizers' Rust errors can span lines), on one short line."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[0][:200]


# The one family of number checks for anything untrusted: JSON and GGUF values, HTTP request fields,
# sampling parameters from Python callers and server settings. numpy scalars count (GGUF readers and
# Python callers hand them in); bools never do (Python's bool is an int, but `true` is neither a size
# nor a token id), and neither does numpy's bool_, which is not a number.


def is_int(value: Any) -> bool:
    """An integer of any size (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A real number (numpy's too) that is finite: not a bool, NaN, an infinity or an int too large for a float."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # 10**400: no usable size, epsilon or parameter either
        return False


class NotRegularFileError(OSError):
    """What read_capped found is a folder, a device or a named pipe: nothing to read as a file."""


class TooLargeError(OSError):
    """The file holds more than read_capped's limit."""


def read_capped(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (NotRegularFileError, TooLargeError, OSError).

    The cap is on what is read, not on the size the file reports: a device (/dev/zero) reports 0 and never ends.
    O_NONBLOCK keeps a named pipe from holding the open until a writer comes; it is refused once open."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFileError("not a regular file")
        if info.st_size > limit:  # a regular file's reported size is refused unread; the cap below holds anyway
            raise TooLargeError(f"more than the {limit} bytes it may have")
        # os.read allocates what it is asked for: ask for the size the file reports (then little more), not the cap.
        chunks, left, ask = [], limit + 1, info.st_size + 1
        while left > 0 and (chunk := os.read(fd, min(left, ask))):
            chunks.append(chunk)
            left -= len(chunk)
            ask = 1 << 16
    finally:
        os.close(fd)
    if left <= 0:
        raise TooLargeError(f"more than the {limit} bytes it may have")
    return b"".join(chunks)


def read_text(path: Path, error: type[MlxInferError], limit: int = MAX_SIDE_FILE_BYTES) -> str:
    """The UTF-8 text of `path`, or `error` naming the file (too large, not a file, unreadable, not UTF-8)."""
    try:
        return read_capped(path, limit).decode("utf-8")
    except TooLargeError:
        raise error(f"{path}: more than the {limit} bytes this file may have; it is not a model file") from None
    except NotRegularFileError:
        raise error(f"{path}: not a regular file; a model's side files are plain files") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}); re-download or re-save the file as UTF-8") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None


def read_json_object(path: Path, error: type[MlxInferError], limit: int = MAX_SIDE_FILE_BYTES) -> dict[str, Any]:
    """`path` parsed as one JSON object, or `error` naming the file."""
    text = read_text(path, error, limit)
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, and integers longer than Python converts
        raise error(f"{path}: not valid JSON ({first_line(e)})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
