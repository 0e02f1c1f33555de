"""What OUT may be, and replacing it safely.

A conversion writes into `.OUT.partial-<pid>` beside OUT, renamed into place at the
end, so a failed or interrupted conversion never leaves a half-written OUT and never
loses the previous one. `--force` replaces only what mlxinfer wrote: an empty folder,
or an earlier conversion (plain files of ours, listed in our manifest). A later run
removes the `.OUT.partial-<pid>` and `.OUT.old-<pid>` folders of dead processes, again
only when they hold nothing but files we write (and the `.DS_Store` and `._NAME` files macOS
adds). Where `.OUT.partial-<pid>` would be too long a name, OUT's name in it is shortened and
hashed. The files themselves: writer.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mlxinfer.display import mib
from mlxinfer.errors import ConversionError
from mlxinfer.untrusted import shown_path

from .writer import TOKENIZER_FILES, os_error, sha256_files, write_json, writing

log = logging.getLogger(__name__)

MANIFEST = "mlxinfer-manifest.json"
MANIFEST_KEYS = frozenset({"mlxinfer_version", "created", "source", "settings", "files"})


def write_manifest(folder: Path, source: str, settings: dict[str, Any], bpw: float, quality: Any,
                   image_half: str | None = None, adapter: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The output's manifest: what made it, from what (an adapter merged in, by its digest), with which settings,
    its quality and its files' hashes."""
    from mlxinfer import __version__

    manifest = {
        "mlxinfer_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        **({"adapter": adapter} if adapter else {}),
        "settings": settings,
        "bits_per_weight": bpw,
        "quality": quality.to_dict() if quality else None,
        "image_half": image_half,  # a vision-language model's tower and projector, where kept (vision_half.py)
        "files": sha256_files(folder),
    }
    write_json(folder / MANIFEST, manifest)
    return manifest


MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists file names and digests: a few KiB in practice
MAX_ENTRIES = 100_000  # files in a folder we would delete; a 1 TB model in 1 GiB shards has ~1000
# Every name a conversion writes; a folder holding anything else is not ours to delete.
OUR_NAMES = re.compile(
    r"model-\d{5,}-of-\d{5,}\.safetensors|shard-\d+\.partial\.safetensors|model\.safetensors\.index\.json|"
    + "|".join(re.escape(name) for name in ("config.json", MANIFEST, *TOKENIZER_FILES)),
    re.ASCII,  # \d is 0-9 only, not every Unicode digit
)
LEFTOVER = re.compile(r"(partial|old)-(\d{1,9})", re.ASCII)  # what follows ".OUT." in our temporary folders
NAME_MAX = 255  # bytes in one path component (Linux, APFS and exFAT alike)
SHORT_STEM_BYTES = 200  # of OUT's name in a temporary folder's name when the whole name would not fit
FINDER_FILE = ".DS_Store"  # macOS Finder's view settings, written into any folder it shows
APPLE_DOUBLE = "._"  # + a file's name: its metadata, on file systems without extended attributes (exFAT, SMB)


class _Foreign(Exception):
    """Why a folder is not ours to replace or delete (never leaves this module)."""


def check_output(out: str | Path, force: bool, sources: Iterable[Path] = ()) -> Path:
    """OUT, resolved, after refusing anything a conversion must not write or replace."""
    given = Path(out).expanduser()
    if "\0" in str(given):
        raise ConversionError(f"{shown_path(given)}: a path cannot contain a NUL byte; pick another -o")
    if os.path.islink(given):  # False, not an error, for a name too long to look up
        raise ConversionError(f"{shown_path(given)}: is a symbolic link; give the folder itself or another -o")
    try:
        out = given.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise ConversionError(f"{shown_path(given)}: cannot resolve this path ({e}); pick another -o") from e
    if out == Path(out.anchor) or out == _home():
        raise ConversionError(
            f"{shown_path(out)}: refusing to write a model over the root or home folder; pick a new -o"
        )
    if len(os.fsencode(out.name)) > NAME_MAX:
        raise ConversionError(
            f"{shown_path(out)}: name too long ({len(os.fsencode(out.name))} bytes; at most {NAME_MAX}); "
            "pick a shorter -o"
        )
    for src in sources:
        check_apart(src, out)
    if os.path.lexists(out):
        check_existing(out, force)
    _check_writable(out.parent)
    return out


def check_apart(src: Path, out: Path) -> None:
    """Refuse OUT equal to, inside or around the source: replacing OUT must never touch the source."""
    src = src.resolve()
    if out == src:
        raise ConversionError(f"{shown_path(out)}: is the source itself; pick another -o")
    if src in out.parents:
        raise ConversionError(
            f"{shown_path(out)}: the output may not be inside the source {shown_path(src)}; pick another -o"
        )
    if out in src.parents:
        raise ConversionError(
            f"{shown_path(out)}: contains the source {shown_path(src)}; pick an output outside it with -o"
        )


def check_existing(out: Path, force: bool) -> None:
    """OUT exists: only an empty folder or an earlier conversion may be replaced, and only with force."""
    try:
        _check_replaceable(out)
    except _Foreign as e:
        raise ConversionError(
            f"{shown_path(out)}: already exists and {e}; --force replaces only an empty folder or an earlier "
            "mlxinfer conversion: pick a new -o"
        ) from None
    except OSError as e:
        raise ConversionError(
            f"{shown_path(out)}: already exists and cannot be read ({e.strerror}); pick a new -o"
        ) from e
    if not force:
        raise ConversionError(f"{shown_path(out)}: already exists; pass --force to replace it")


def _check_replaceable(out: Path) -> None:
    if not stat.S_ISDIR(os.lstat(out).st_mode):
        raise _Foreign("is not a folder")
    listing = _without_mac_metadata(_listing(out))
    if not listing:
        return
    if listing.get(MANIFEST) is not True:
        raise _Foreign(f"has no {MANIFEST}, so mlxinfer did not write it")
    listed = _manifest_files(out / MANIFEST) | {MANIFEST}
    stray = _stray(listing, lambda name: name in listed and OUR_NAMES.fullmatch(name) is not None)
    if stray:
        raise _Foreign(f"holds {stray!r}, which is not part of the earlier conversion")


def _manifest_files(path: Path) -> set[str]:
    """The file names an earlier conversion's manifest lists; _Foreign when it is not our manifest."""
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise _Foreign(f"its {MANIFEST} is larger than {mib(MAX_MANIFEST_BYTES, 0)}, so mlxinfer did not write it")
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):  # bad JSON or UTF-8; nesting deep enough to exhaust the stack
        raise _Foreign(f"its {MANIFEST} is not valid JSON") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(files, dict) and MANIFEST_KEYS <= manifest.keys()):
        raise _Foreign(f"its {MANIFEST} is not one mlxinfer wrote")
    return set(files)


def _check_writable(folder: Path) -> None:
    existing = next(p for p in (folder, *folder.parents) if os.path.lexists(p))  # the root always exists
    if not existing.is_dir():
        raise ConversionError(f"{shown_path(existing)}: is not a folder, so the output cannot be created in it")
    if not os.access(existing, os.W_OK | os.X_OK):
        statvfs = getattr(os, "statvfs", None)  # absent on Windows
        readonly = statvfs is not None and statvfs(existing).f_flag & os.ST_RDONLY
        code = errno.EROFS if readonly else errno.EACCES
        raise os_error(OSError(code, os.strerror(code)), existing)


def check_space(folder: Path, needed: int) -> None:
    """Refuse before writing when the file system cannot hold the expected output."""
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ConversionError(
            f"{shown_path(folder.parent)}: the output needs about {_size(needed)} but only {_size(free)} are free; "
            "free some space or pick another -o"
        )


def _size(n: int) -> str:
    return mib(n) if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def _home() -> Path | None:
    try:
        return Path.home().resolve()
    except (OSError, RuntimeError, KeyError):  # no HOME and no password entry
        return None


# --- folders we wrote --------------------------------------------------------------------------


def _listing(folder: Path | int) -> dict[str, bool]:
    """Name -> is a plain file (not a link, folder or device), for at most MAX_ENTRIES entries."""
    listing = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            if len(listing) == MAX_ENTRIES:
                raise _Foreign(f"holds more than {MAX_ENTRIES} entries")
            listing[entry.name] = entry.is_file(follow_symlinks=False)
    return listing


def _is_mac_metadata(name: str, plain: bool) -> bool:
    """A plain `.DS_Store` or `._NAME` (NAME one of ours) that macOS adds to a folder it shows or copies."""
    ours = name.startswith(APPLE_DOUBLE) and OUR_NAMES.fullmatch(name[len(APPLE_DOUBLE) :]) is not None
    return plain and (name == FINDER_FILE or ours)


def _without_mac_metadata(listing: dict[str, bool]) -> dict[str, bool]:
    return {name: plain for name, plain in listing.items() if not _is_mac_metadata(name, plain)}


def _stray(listing: dict[str, bool], allowed: Any) -> str | None:
    """The first entry that is not a plain file with an allowed name."""
    return next((name for name, plain in listing.items() if not plain or not allowed(name)), None)


def remove_ours(folder: Path) -> None:
    """Delete a folder of plain files with our names, never following a symlink; _Foreign otherwise."""
    by_fd = os.scandir in os.supports_fd and os.unlink in os.supports_dir_fd
    if not by_fd:  # no *at() calls (Windows): check by path
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise _Foreign("is not a folder")
        _unlink_ours(folder, lambda name: os.unlink(folder / name))
        os.rmdir(folder)
        return
    # Opened once without following links, so a folder swapped for a symlink after the check is not entered.
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        _unlink_ours(fd, lambda name: os.unlink(name, dir_fd=fd))
    finally:
        os.close(fd)
    os.rmdir(folder)


def _unlink_ours(folder: Path | int, unlink: Any) -> None:
    listing = _listing(folder)
    stray = _stray(_without_mac_metadata(listing), lambda name: OUR_NAMES.fullmatch(name) is not None)
    if stray:
        raise _Foreign(f"holds {stray!r}, which mlxinfer does not write")
    for name in listing:
        unlink(name)


def discard(folder: Path) -> bool:
    """remove_ours, logging instead of raising: used while another error or a success is being reported."""
    try:
        remove_ours(folder)
    except (_Foreign, OSError) as e:
        log.warning("left %s in place: %s", shown_path(folder), e)
        return False
    return True


def remove_stale(out: Path) -> None:
    """Remove `.OUT.partial-PID` and `.OUT.old-PID` folders that dead conversions left behind."""
    prefixes = {f".{out.name}.", f".{_short_stem(out.name)}."}  # a long OUT name's leftovers use the short form

    def leftover(name: str) -> re.Match | None:
        return next((m for p in prefixes if name.startswith(p) and (m := LEFTOVER.fullmatch(name[len(p) :]))), None)

    with os.scandir(out.parent) as entries:
        leftovers = [(e.name, leftover(e.name)) for e in entries]
    for name, match in leftovers:
        if match is None or _alive(int(match[2])):
            continue
        path = out.parent / name
        if match[1] == "old" and not os.path.lexists(out):
            # Killed between the two renames of a replace: this is the previous OUT; the user decides.
            log.warning("%s holds the previous %s; rename it back or delete it", shown_path(path), shown_path(out))
            continue
        if discard(path):
            log.warning("removed %s left by an interrupted conversion", shown_path(path))


def temporary_name(out_name: str, kind: str) -> str:
    """`.OUT.partial-PID` or `.OUT.old-PID`; with a shortened OUT where the whole would exceed NAME_MAX."""
    name = f".{out_name}.{kind}-{os.getpid()}"
    if len(os.fsencode(name)) <= NAME_MAX:
        return name
    return f".{_short_stem(out_name)}.{kind}-{os.getpid()}"


def _short_stem(out_name: str) -> str:
    """The first SHORT_STEM_BYTES of OUT's name (whole characters) and a hash of all of it."""
    stem = out_name
    while len(os.fsencode(stem)) > SHORT_STEM_BYTES:
        stem = stem[:-1]
    return f"{stem}~{hashlib.sha256(os.fsencode(out_name)).hexdigest()[:12]}"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a previous run of ours that reused our pid
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


class AtomicFolder:
    """A temporary folder that becomes `out` on commit() and vanishes otherwise."""

    def __init__(self, out: Path, force: bool):
        self.out, self.force = out, force
        check_output(out, force)  # again: OUT may have changed since the plan was made
        with writing(out.parent):
            out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(out)
        self.path = out.parent / temporary_name(out.name, "partial")
        with writing(self.path):
            self.path.mkdir()

    def commit(self) -> None:
        """Rename the finished folder to OUT, keeping the previous OUT until the new one is in place."""
        old = None
        if os.path.lexists(self.out):
            check_existing(self.out, self.force)  # it may have changed while we converted
            old = self.out.parent / temporary_name(self.out.name, "old")
            with writing(self.out):
                os.replace(self.out, old)
        try:
            with writing(self.out):
                os.replace(self.path, self.out)
        except BaseException:
            if old is not None:
                self._restore(old)
            raise
        if old is not None:
            discard(old)

    def _restore(self, old: Path) -> None:
        try:
            os.replace(old, self.out)
        except OSError as e:
            where = shown_path(self.out), shown_path(old)
            log.warning("the previous %s is at %s (could not move it back: %s)", *where, e)

    def abort(self) -> None:
        discard(self.path)
