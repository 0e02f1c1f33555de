"""`mlxinfer pull`: check a Hub checkpoint before its weights come, then download it resumably.

plan_pull() reads only the file list, config.json and the shards' headers, and refuses what mlxinfer could
not load (pickle-only repositories, unknown families, garbage headers); plan_download() does the same for a
download that stays in the cache, what `convert ORG/NAME` reads: pull and convert share this one cache.
download() writes each file as `<name>.part` under cache_dir()/downloads/<org>--<name>/<commit>/ (one folder per
commit: a resume never mixes two commits' files), copied from the Hugging Face cache when another tool put it
there, else fetched by huggingface_hub's http_get into that .part, resumed with a Range request; it checks the size
and the Hub's sha256 (LFS files) or git blob id (the others) and renames it into place. finish() moves the finished
folder into the models folder in one rename, after checking that the target is a folder directly in the models
folder named after the repo.
Nothing below cache_dir()/downloads is opened, written, moved or deleted through a link (local_files.py), and every
request keeps to the rules of transport.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..disk import write_error
from ..display import mib
from ..errors import HubError
from ..library import models_dir
from ..memory import MemoryPlan, machine_memory, plan_memory
from ..models import ModelConfig, normalize_config
from ..models.dtype import choose_compute_dtype
from ..models.footprint import config_footprint
from ..paths import cache_dir
from ..untrusted import listed, shown_path
from .cached_copies import hf_cache_file, open_regular
from .local_files import open_own, own_file, own_folder, remove_own_folder
from .repo import Listing, RemoteFile, Silent, asking, check_repo_id, fetch_config, fetch_header, http_get, list_files

# Side files a model folder needs (config, tokenizer, chat template); weights are *.safetensors only.
SIDE_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.json", "chat_template.jinja",
})  # fmt: skip
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_SHARDS = 1000
CHUNK_BYTES = 1 << 20
UNCHECKED_REFETCH_BYTES = 1 << 20  # a leftover smaller than this with no hash listed is downloaded again
RECHECK_BYTES = 16 << 20  # a finished file this small with a hash listed is hashed again on a resume
_COMMIT = re.compile(r"[0-9a-f]{40}")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullPlan:
    """Everything known before the first weight byte is downloaded."""

    listing: Listing
    files: tuple[RemoteFile, ...]  # what will be downloaded
    config: ModelConfig
    parameters: int
    folder: Path  # the download folder, in the cache
    target: Path | None = None  # where the finished model goes; None: it stays in the cache (plan_download)
    force: bool = False

    @property
    def repo_id(self) -> str:
        return self.listing.repo_id

    @property
    def family(self) -> str:
        return f"{self.config.model_type} ({'verified' if self.config.verified else 'fallback: mlx-lm code'})"

    @property
    def download_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def remaining_bytes(self) -> int:
        """Bytes still to download: a finished file counts nothing, a .part what it lacks."""
        return sum(f.size - _have(self.folder, f) for f in self.files)


def downloads_root() -> Path:
    """Where every download folder is: the one folder there that may be a link (to another disk, say)."""
    return cache_dir() / "downloads"


def download_dir(repo_id: str, commit: str | None = None) -> Path:
    """The repository's download folder in the cache, or (with `commit`) that commit's folder in it."""
    folder = downloads_root() / check_repo_id(repo_id).replace("/", "--")
    return folder / commit if commit is not None else folder


def plan_pull(repo_id: str, revision: str = "main", target: Path | None = None, force: bool = False) -> PullPlan:
    """Check `repo_id` at `revision` without downloading weights; refuse what mlxinfer could not load.

    Example:
        >>> plan = plan_pull("HuggingFaceTB/SmolLM2-135M-Instruct")
        >>> plan.family, plan.parameters, plan.download_bytes
    """
    check_repo_id(repo_id)  # before any path is made of it: "ORG/." would name the models folder itself
    if target is not None:
        check_place(target, repo_id)
    plan = plan_download(repo_id, revision)
    target = target or models_dir() / repo_id.split("/")[1]
    check_place(target, repo_id)
    check_target(target, force)
    return dataclasses.replace(plan, target=target, force=force)


def plan_download(repo_id: str, revision: str = "main") -> PullPlan:
    """Check `repo_id` at `revision` like plan_pull, for a download that stays in the cache (no target folder):
    what `mlxinfer convert ORG/NAME` converts from, and what a later pull of that commit finds already there."""
    listing = list_files(check_repo_id(repo_id), revision)
    shards = [f for f in listing.files if f.name.endswith(".safetensors")]
    if not shards:
        pickles = [f.name for f in listing.files if f.name.endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise HubError(
                f"{repo_id}: has only pickle checkpoints ({listed(pickles)}); pickle checkpoints are never loaded "
                "(they can run code): pick a repository with *.safetensors weights"
            )
        raise HubError(f"{repo_id}: has no *.safetensors weights; a GGUF file: download it, `mlxinfer ls --add` it")
    if len(shards) > MAX_SHARDS:
        raise HubError(f"{repo_id}: lists {len(shards)} safetensors files, more than {MAX_SHARDS}; refused")
    if not any(f.name == "config.json" for f in listing.files):
        raise HubError(f"{repo_id}: has no config.json; it is not a checkpoint mlxinfer can load")
    config = normalize_config(fetch_config(listing), f"{repo_id}/config.json")  # unloadable families stop here
    parameters = sum(fetch_header(listing, shard).parameters for shard in shards)
    wanted = tuple(f for f in listing.files if _wanted(f.name))
    return PullPlan(listing, wanted, config, parameters, download_dir(repo_id, listing.commit))


def check_place(target: Path, repo_id: str) -> None:
    """Refuse a target that is not directly in the models folder and named NAME or NAME-<bits>bit (for ORG/NAME):
    it may be deleted (--force), so it must never be the models folder itself, a parent of it or anything else."""
    name = check_repo_id(repo_id).split("/")[1]
    named = target.name == name or re.fullmatch(rf"{re.escape(name)}-[0-9]{{1,2}}bit", target.name) is not None
    if target.parent != models_dir() or not named or target.name in (".", ".."):
        raise HubError(
            f"{shown_path(target)}: not a folder named {name} (or {name}-<bits>bit) directly in the models folder "
            f"{shown_path(models_dir())}; refused"
        )


def check_target(target: Path, force: bool) -> None:
    if os.path.lexists(target) and not force:
        raise HubError(f"{shown_path(target)} exists; pass --force to replace it, or `mlxinfer rm {target.name}` first")


def check_disk(plan: PullPlan, extra_bytes: int = 0) -> None:
    """Refuse, before anything is written, when the download (plus `extra_bytes`: a conversion's output) cannot
    fit on the disk of the download folder."""
    need = plan.remaining_bytes() + extra_bytes
    where = _existing(plan.folder)
    try:
        free = shutil.disk_usage(where).free
    except OSError as e:
        raise HubError(f"{shown_path(where)}: cannot read its free space ({e.strerror or e})") from None
    if need > free:
        raise HubError(
            f"{plan.repo_id}: needs {mib(need)} on {shown_path(where)} but {mib(free)} is free; free some space "
            "or set MLXINFER_CACHE_DIR to a folder on a larger disk"
        )


def download(plan: PullPlan, progress: bool = True, report: Callable[[int, int], None] | None = None) -> Path:
    """Download every file of `plan` into its folder (resuming .part files); returns the folder. `report(done,
    total)` hears the bytes as they come (the server's /api/pull streams them)."""
    try:
        _own_download_folder(plan.folder, create=True)
    except OSError as e:
        raise HubError(f"{shown_path(plan.folder)}: {write_error(e, 'set MLXINFER_CACHE_DIR elsewhere')}") from None
    _drop_stale(plan)
    bar_class = tqdm if report is None else _reporting(report)
    with bar_class(
        total=plan.remaining_bytes(), unit="B", unit_scale=True, unit_divisor=1024, desc=plan.repo_id,
        file=sys.stderr, disable=not progress, dynamic_ncols=True,
    ) as bar:  # fmt: skip
        for remote in plan.files:
            _fetch(plan.listing, remote, plan.folder, bar)
    return plan.folder


def _reporting(report: Callable[[int, int], None]) -> type:
    """A bar that also tells `report` the bytes done and the total (counted here: a disabled tqdm counts none)."""

    class Reporting(tqdm):
        done = 0

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            report(self.done, int(self.total or 0))
            return super().update(n)

    return Reporting


def finish(plan: PullPlan, folder: Path | None = None) -> Path:
    """Move the finished download (or `folder`) to plan.target in one rename (a copy then a rename across disks)."""
    folder = folder or plan.folder
    if plan.target is None:
        raise HubError(f"{plan.repo_id}: a download planned to stay in the cache has no target; use plan_pull")
    _own_download_folder(folder)  # a link there is refused, never moved
    missing = [f.name for f in plan.files if own_file(folder / f.name) is None]
    if missing:
        raise HubError(f"{plan.repo_id}: {listed(missing)} not downloaded yet; run the same pull again")
    check_place(plan.target, plan.repo_id)  # checked again right before anything is deleted or replaced
    check_target(plan.target, plan.force)
    try:
        plan.target.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(plan.target):  # --force
            _delete(plan.target)
        try:
            os.replace(folder, plan.target)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            staging = plan.target.with_name(f".{plan.target.name}.pulling")
            _delete(staging) if os.path.lexists(staging) else None
            shutil.copytree(folder, staging, symlinks=True)  # a link planted meanwhile is copied, not followed
            os.replace(staging, plan.target)
            remove_own_folder(folder)
    except OSError as e:
        raise HubError(f"{shown_path(plan.target)}: {write_error(e, 'set MLXINFER_MODELS_DIR elsewhere')}") from None
    with contextlib.suppress(OSError):  # the repository's download folder, once no commit is left in it
        plan.folder.parent.rmdir()
    return plan.target


def estimated_plan(plan: PullPlan, bits: int | None = None, context: int | None = None) -> MemoryPlan:
    """The memory plan of the model once loaded, from its config and parameter count (nothing is built):
    weights in the compute dtype, or `bits` plus a 16-bit scale and bias per group of 64."""
    footprint = config_footprint(plan.config, choose_compute_dtype().size, parameters=plan.parameters, bits=bits)
    return plan_memory(machine_memory(), footprint, context or footprint.max_positions or 4096)


# -- one file --------------------------------------------------------------------------------


def _wanted(name: str) -> bool:
    return name in SIDE_FILES or name.endswith((".safetensors", ".safetensors.index.json"))


def _unchecked(remote: RemoteFile) -> bool:
    """A small file the Hub lists no hash for: a leftover of it is never trusted, it is downloaded again."""
    return remote.sha256 is None and remote.blob_id is None and remote.size < UNCHECKED_REFETCH_BYTES


def _have(folder: Path, remote: RemoteFile) -> int:
    if _unchecked(remote):
        return 0
    for path, done in ((folder / remote.name, True), (folder / f"{remote.name}.part", False)):
        with contextlib.suppress(OSError):
            info = path.lstat()  # an estimate: a link or odd file counts nothing (download() refuses it)
            size = info.st_size if stat.S_ISREG(info.st_mode) else 0
            if done and size == remote.size:
                return size
            if not done and size <= remote.size:
                return size
    return 0


def _fetch(listing: Listing, remote: RemoteFile, folder: Path, bar: tqdm) -> None:
    final, part = folder / remote.name, folder / f"{remote.name}.part"
    done = own_file(final)  # a link (or another odd file) under either name is refused, never followed
    if not _unchecked(remote) and done is not None and done.st_size == remote.size:
        if remote.size > RECHECK_BYTES or _matches(remote, final):  # a large one was checked before its rename
            return
        bar.total += remote.size  # remaining_bytes counted it as here
        bar.refresh()
    partial = own_file(part)
    have = partial.st_size if partial is not None else 0
    if have > remote.size or _unchecked(remote):  # not this file's start, or not to be trusted: begin again
        have = 0
    if have < remote.size or partial is None:
        if have == 0 and _copied_from_hf_cache(listing, remote, part, bar):
            os.replace(part, final)  # its size and hash were checked as for a download
            return
        _transfer(listing, remote, part, have, bar)
    _verify(listing, remote, part)
    os.replace(part, final)


def _copied_from_hf_cache(listing: Listing, remote: RemoteFile, part: Path, bar: tqdm) -> bool:
    """Whether the Hugging Face cache held `remote` (put there by another tool) and `part` is now a copy of it
    with the size and hash the Hub lists. A file the Hub lists no hash for is never taken from there, and a copy
    that cannot be read or differs is downloaded instead."""
    copy = hf_cache_file(listing, remote) if remote.sha256 or remote.blob_id else None
    if copy is None:
        return False
    done = 0
    with _open(part, "wb", remote.name) as out:
        try:
            with open_regular(copy) as f:
                while done < remote.size and (chunk := f.read(min(CHUNK_BYTES, remote.size - done))):
                    _write(out, chunk, part)
                    done += len(chunk)
                    bar.update(len(chunk))
        except OSError as e:  # the file is downloaded instead
            log.warning("%s: cannot read it (%s); downloading it", shown_path(copy), e.strerror or e)
    if done == remote.size:
        if _matches(remote, part):
            return True
        log.warning(
            "%s/%s: the Hugging Face cache's copy differs from the Hub's; downloading it", listing.repo_id, remote.name
        )
    bar.total += done  # counted as here, now to download
    bar.refresh()
    return False


def _transfer(listing: Listing, remote: RemoteFile, part: Path, have: int, bar: tqdm) -> None:
    """Append the rest of `remote` to `part` (from byte `have`); a server that ignores Range restarts the file.
    The network, a stall or malformed HTTP stops the pull with what came kept in `part`, to resume."""
    with _open(part, "ab" if have else "wb", f"{listing.repo_id}/{remote.name}") as out:
        sink = _Sink(out, part, f"{listing.repo_id}/{remote.name}", remote.size)

        def stopped(reason: str) -> str:
            return (
                f"the download stopped at {sink.tell()} of {remote.size} bytes ({reason}); "
                "run the same `mlxinfer pull` again to resume it"
            )

        with asking(sink.source, None, stopped=stopped):
            http_get(listing, remote, sink, have, _progress_into(bar, have))


class _Sink:
    """The .part file as huggingface_hub's http_get writes it: never past the listed size, a disk error in one
    line (http_get rewinds and truncates it when a server ignores Range)."""

    def __init__(self, out: Any, part: Path, source: str, size: int):
        self._out, self._part, self.source, self._size = out, part, source, size

    def write(self, chunk: bytes) -> None:
        if self._out.tell() + len(chunk) > self._size:
            raise HubError(f"{self.source}: the server sent more than the {self._size} bytes it lists; refused")
        _write(self._out, chunk, self._part)

    def tell(self) -> int:
        return self._out.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._out.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        return self._out.truncate(size)


def _progress_into(bar: tqdm, have: int) -> type:
    """A tqdm stand-in for http_get that adds to the pull's one bar; a restarted file (a server that ignored
    Range: http_get starts it again from `initial` 0) adds what it had to the bar's total."""

    class Into(Silent):
        def __init__(self, *args: Any, initial: int = 0, **kwargs: Any):
            if initial < have:
                bar.total += have - initial
                bar.refresh()

        def update(self, count: int) -> None:
            bar.update(count)

    return Into


@contextlib.contextmanager
def _open(part: Path, mode: str, source: str) -> Any:
    try:
        f = open_own(part, mode)
    except OSError as e:
        raise HubError(f"{shown_path(part)}: {write_error(e, 'set MLXINFER_CACHE_DIR elsewhere')}") from None
    with f:
        yield f


def _write(out: Any, chunk: bytes, part: Path) -> None:
    try:
        out.write(chunk)
    except OSError as e:
        raise HubError(f"{shown_path(part)}: {write_error(e, 'set MLXINFER_CACHE_DIR elsewhere')}") from None


def _verify(listing: Listing, remote: RemoteFile, part: Path) -> None:
    """The size the Hub lists and its sha256 (LFS files) or git blob id (the others); a mismatch deletes the
    .part (it cannot resume)."""
    source = f"{listing.repo_id}/{remote.name}"
    info = own_file(part)
    size = info.st_size if info is not None else 0
    if size != remote.size:
        part.unlink()
        raise HubError(f"{source}: downloaded {size} bytes but the Hub lists {remote.size}; run the pull again")
    if not _matches(remote, part):
        part.unlink()
        kind = "sha256" if remote.sha256 is not None else "git blob id"
        raise HubError(f"{source}: its {kind} differs from the Hub's; the damaged download was deleted, pull again")


def _matches(remote: RemoteFile, path: Path) -> bool:
    """Whether `path` hashes to the sha256 or git blob id the Hub lists (True when it lists neither)."""
    if remote.sha256 is not None:
        digest, expected = hashlib.sha256(), remote.sha256
    elif remote.blob_id is not None:
        digest, expected = hashlib.sha1(usedforsecurity=False), remote.blob_id
        digest.update(b"blob %d\0" % remote.size)
    else:
        return True
    try:
        with open_own(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
    except OSError as e:
        raise HubError(f"{shown_path(path)}: cannot be read ({e.strerror or e})") from None
    return digest.hexdigest() == expected


def _drop_stale(plan: PullPlan) -> None:
    """Delete the repository's downloads of other commits (a resume never continues them): only folders named
    like a commit, directly in the repository's download folder."""
    parent = plan.folder.parent  # checked by own_folder: not a link
    try:
        with os.scandir(parent) as entries:
            stale = [Path(e.path) for e in entries if e.name != plan.folder.name and _COMMIT.fullmatch(e.name)]
    except OSError:
        return
    for path in stale:
        remove_own_folder(path)  # a link named like a commit is left alone


def _own_download_folder(folder: Path, create: bool = False) -> Path | None:
    """`folder` if it and each folder between it and downloads_root() is a folder, not a link (made if `create`)."""
    root = downloads_root()
    if not folder.is_relative_to(root):  # a folder handed to finish(): only it is checked
        return own_folder(folder.parent, (folder.name,), create)
    return own_folder(root, folder.relative_to(root).parts, create)


def _existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _delete(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
