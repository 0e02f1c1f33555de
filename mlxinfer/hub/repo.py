"""What a Hugging Face Hub repository holds, asked through huggingface_hub and trusted for nothing.

huggingface_hub makes the requests: the file listing (HfApi.model_info with files_metadata), config.json (http_get)
and each safetensors shard's header (HfApi.parse_safetensors_file_metadata). Each runs inside transport.bounded()
with a size limit, and what comes back is checked here as if a stranger wrote it: every file name before it can
become a path, every size and hash, and each header with the local reader's rules (formats.safetensors_header).
HF_ENDPOINT is read at each call (huggingface_hub reads it once, at import); HF_TOKEN and the stored token are
huggingface_hub's to send.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptFileError, HubError
from ..formats.safetensors_header import MAX_HEADER_BYTES, check_tensors
from ..untrusted import first_line, is_int, plain, shown
from .transport import Rules, Unanswered, bounded, install, reason_of

MAX_LISTING_BYTES = 16 << 20  # a listing of 10,000 files is ~2 MB
MAX_FILES = 10_000
MAX_NAME_CHARS = 255
MAX_CONFIG_BYTES = 4 << 20
MAX_FILE_BYTES = 1 << 42  # 4 TiB: a larger size in a listing is garbage, not a shard
# One part of a Hub id (the Hub's rules): 1-96 of [A-Za-z0-9._-], not starting or ending with "-" or ".", and
# never "--" or ".." (so never ".", "..", a hidden name or one that huggingface_hub's cache folder names split).
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._\-]{0,94}[A-Za-z0-9_])?")
_REVISION = re.compile(r"[A-Za-z0-9_.\-/]{1,200}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIT_OID = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class RemoteFile:
    name: str  # checked: no path separators, no "..", printable
    size: int
    sha256: str | None  # the LFS sha256 the Hub lists for large files
    blob_id: str | None = None  # the git blob id (sha1 of b"blob <size>\0" + content) of a file not in LFS


@dataclass(frozen=True)
class Listing:
    repo_id: str
    commit: str  # the revision's commit: every file is fetched from it, so a push meanwhile changes nothing
    files: tuple[RemoteFile, ...]  # every top-level file of the repository


def endpoint() -> str:
    """HF_ENDPOINT (else the Hub), checked first: huggingface_hub fails at import on one it cannot parse."""
    value = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    try:
        parts = urllib.parse.urlsplit(value)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # a bad port or IPv6 address
        usable = False
    if not usable:
        raise HubError(f"HF_ENDPOINT={plain(value)}: not an http(s) URL; fix it, or unset it for the Hugging Face Hub")
    return value


def check_repo_id(repo_id: str) -> str:
    """`repo_id` if it is a Hub model id ORG/NAME whose NAME can be a folder name (never ".", ".." or hidden)."""
    parts = repo_id.split("/") if isinstance(repo_id, str) else []
    if len(parts) != 2 or not all(_is_repo_part(part) for part in parts):
        raise HubError(f"{plain(repo_id)}: not a Hub model id; expected ORG/NAME, e.g. HuggingFaceTB/SmolLM2-135M")
    return repo_id


def _is_repo_part(part: str) -> bool:
    return bool(_REPO_PART.fullmatch(part)) and "--" not in part and ".." not in part


def check_revision(revision: str) -> str:
    if not _REVISION.fullmatch(revision) or ".." in revision:
        raise HubError(f"--revision {plain(revision)}: not a branch, tag or commit name")
    return revision


def list_files(repo_id: str, revision: str) -> Listing:
    """The repository's files with their sizes (and LFS sha256) at `revision`; a hostile name is refused."""
    check_repo_id(repo_id)
    with asking(f"the file list of {repo_id}", MAX_LISTING_BYTES, malformed="not a listing of files"):
        info = hf_api().model_info(repo_id, revision=check_revision(revision), files_metadata=True)
    siblings, commit = info.siblings, info.sha
    if not isinstance(siblings, list) or len(siblings) > MAX_FILES:
        raise HubError(f"{repo_id}: the Hub's file list has no 'siblings' list of at most {MAX_FILES} files")
    if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise HubError(f"{repo_id}: the Hub's file list has no commit 'sha' (got {shown(commit)})")
    files = tuple(_remote_file(repo_id, entry) for entry in siblings)
    return Listing(repo_id, commit, tuple(f for f in files if "/" not in f.name))


def _remote_file(repo_id: str, entry: Any) -> RemoteFile:
    """One of huggingface_hub's RepoSibling entries, checked: it builds them from the listing unchecked."""
    name = getattr(entry, "rfilename", None)
    if not isinstance(name, str) or not _is_safe_name(name):
        raise HubError(f"{repo_id}: the Hub lists a file named {shown(name)}, which is not a safe file name; refused")
    size, lfs = entry.size, entry.lfs
    if not is_int(size) or not 0 <= size <= MAX_FILE_BYTES:
        raise HubError(f"{repo_id}/{name}: the Hub lists size {shown(size)}; expected a byte count")
    sha = lfs.sha256 if lfs is not None else None
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise HubError(f"{repo_id}/{name}: the Hub lists sha256 {shown(sha)}; expected 64 hex digits")
    blob = None
    if lfs is None:  # an LFS file's blob id is its pointer's, not its content's
        blob = entry.blob_id
        if blob is not None and not (isinstance(blob, str) and _GIT_OID.fullmatch(blob)):
            raise HubError(f"{repo_id}/{name}: the Hub lists blob id {shown(blob)}; expected 40 hex digits")
    return RemoteFile(name, int(size), sha, blob)


def _is_safe_name(name: str) -> bool:
    """A relative path of plain parts: no "..", ".", empty part, backslash, drive or control character."""
    parts = name.split("/")
    return (
        0 < len(name) <= 4 * MAX_NAME_CHARS
        and name.isprintable()
        and "\\" not in name
        and ":" not in name
        and all(part not in ("", ".", "..") and len(part) <= MAX_NAME_CHARS for part in parts)
    )


def file_url(repo_id: str, commit: str, name: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint())


def hf_api() -> Any:
    """huggingface_hub's client for the endpoint HF_ENDPOINT names now."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), library_name="mlxinfer")


def fetch_config(listing: Listing) -> dict[str, Any]:
    """config.json of the listed commit, as a JSON object."""
    what = f"{listing.repo_id}/config.json"
    listed = next(f for f in listing.files if f.name == "config.json")
    if listed.size > MAX_CONFIG_BYTES:
        raise HubError(f"{what}: the Hub lists {listed.size} bytes, more than {MAX_CONFIG_BYTES}; refused")
    body = io.BytesIO()
    with asking(what, MAX_CONFIG_BYTES):
        http_get(listing, listed, body)
    try:
        value = json.loads(body.getvalue())
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise HubError(f"{what}: not a JSON object; the repository is not a model checkpoint")
    return value


def http_get(listing: Listing, remote: RemoteFile, out: Any, have: int = 0, progress: Any = None) -> None:
    """huggingface_hub's http_get of `remote` at the listed commit into `out` (from byte `have`: a Range request;
    a server that ignores it restarts the file), no bar of its own unless `progress` is a tqdm class."""
    from huggingface_hub.file_download import http_get as get
    from huggingface_hub.utils import build_hf_headers

    url = file_url(listing.repo_id, listing.commit, remote.name)
    headers = build_hf_headers(library_name="mlxinfer")
    get(url, out, resume_size=have, headers=headers, expected_size=remote.size, tqdm_class=progress or Silent)


@dataclass(frozen=True)
class ShardHeader:
    name: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # tensor -> (dtype, shape)

    @property
    def parameters(self) -> int:
        total = 0
        for _, shape in self.tensors.values():
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total


def fetch_header(listing: Listing, shard: RemoteFile) -> ShardHeader:
    """A safetensors shard's header (huggingface_hub reads it with Range requests), checked like a local file's."""
    from huggingface_hub.errors import SafetensorsParsingError

    source = f"{listing.repo_id}/{shard.name}"
    try:
        with asking(source, 8 + MAX_HEADER_BYTES, malformed="not safetensors"):
            parsed = hf_api().parse_safetensors_file_metadata(listing.repo_id, shard.name, revision=listing.commit)
    except SafetensorsParsingError as e:
        raise HubError(f"{source}: {plain(first_line(e))}; not safetensors, refused") from None
    header = {
        name: {"dtype": t.dtype, "shape": t.shape, "data_offsets": list(t.data_offsets)}
        for name, t in (parsed.tensors or {}).items()
    }
    try:
        # The header's own length is not returned: the data is at most the file less the length and "{}".
        tensors = check_tensors(source, header, shard.size - 8 - 2)
    except CorruptFileError as e:
        raise HubError(f"{e}; refused before downloading any weights") from None
    return ShardHeader(shard.name, {name: (t.dtype, t.shape) for name, t in tensors.items()})


@contextlib.contextmanager
def asking(
    what: str, limit: int | None, malformed: str = "malformed", stopped: Callable[[str], str] | None = None
) -> Iterator[Rules]:
    """Run huggingface_hub's request(s) inside transport.bounded(limit); any failure becomes one HubError naming
    `what`: an HTTP status with advice, an answer huggingface_hub cannot read, or no usable answer (the network, a
    stall, malformed HTTP, a short body), which `stopped(reason)` words if given."""
    endpoint()  # before huggingface_hub is imported
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    install()
    # The endpoint's scheme, not the first request's: whatever asks first, an https Hub is never left for http.
    with bounded(limit, urllib.parse.urlsplit(endpoint()).scheme) as rules:
        try:
            yield rules
        except HfHubHTTPError as e:
            code = e.response.status_code if e.response is not None else None
            if rules.failure is None:
                raise HubError(f"{what}: the Hub answered HTTP {code}{_advice(code)}") from None
        except OfflineModeIsEnabled:
            raise HubError(f"{what}: HF_HUB_OFFLINE is set; unset it to reach the Hub") from None
        except Unanswered as e:
            rules.failure = rules.failure or e
        except OSError:  # http_get found fewer bytes than the listed size, the connection closed cleanly
            rules.failure = rules.failure or Unanswered("the answer ended before the size the Hub lists")
        except (KeyError, TypeError, AttributeError, ValueError, RecursionError) as e:
            if rules.failure is None:
                raise HubError(
                    f"{what}: the Hub's answer is {malformed} ({plain(first_line(e))}); check HF_ENDPOINT"
                ) from None
        if rules.failure is not None:
            reason = reason_of(rules.failure)
            if stopped is not None:
                raise HubError(f"{what}: {stopped(reason)}") from None
            raise HubError(
                f"{what}: no usable answer from {endpoint()} ({reason}); check HF_ENDPOINT or retry later"
            ) from None


class Silent:
    """A tqdm stand-in that shows nothing: huggingface_hub's http_get draws a bar of its own otherwise."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __enter__(self) -> Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, count: int) -> None:
        pass


def _advice(code: int | None) -> str:
    if code in (401, 403):
        return " (a gated or private repository: set HF_TOKEN to a token that may read it)"
    if code == 404:
        return " (no such repository, revision or file: check the id and --revision)"
    return ""
