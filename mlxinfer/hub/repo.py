"""What a Hugging Face Hub repository holds, asked over plain HTTP and trusted for nothing.

The file listing (`/api/models/{repo}/revision/{rev}?blobs=true`), config.json and each safetensors shard's
header (two Range requests) are read with a size limit each, and within the time limits of transport.py; every
file name is checked before it can become a path. HF_ENDPOINT and HF_TOKEN are honoured like huggingface_hub does.
huggingface_hub's own readers are not used here: HfApi.model_info reads a listing whole (no size limit) and builds
objects from it unchecked, and parse_safetensors_file_metadata asks for bytes=0-100000 and reads a whole shard from
a server that ignores Range.
"""

from __future__ import annotations

import json
import os
import re
import struct
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptFileError, HubError
from ..formats.safetensors_header import MAX_HEADER_BYTES, check_tensors, parse_json
from ..untrusted import first_line, is_int, plain, shown
from .transport import NETWORK_ERRORS, open_url, reason_of

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
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


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
    url = f"{endpoint()}/api/models/{check_repo_id(repo_id)}/revision/{_quote(check_revision(revision))}?blobs=true"
    body = read(url, MAX_LISTING_BYTES, what=f"the file list of {repo_id}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise HubError(f"{repo_id}: the Hub's file list is not JSON; check HF_ENDPOINT ({endpoint()})") from None
    siblings = data.get("siblings") if isinstance(data, dict) else None
    commit = data.get("sha") if isinstance(data, dict) else None
    if not isinstance(siblings, list) or len(siblings) > MAX_FILES:
        raise HubError(f"{repo_id}: the Hub's file list has no 'siblings' list of at most {MAX_FILES} files")
    if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise HubError(f"{repo_id}: the Hub's file list has no commit 'sha' (got {shown(commit)})")
    files = tuple(_remote_file(repo_id, entry) for entry in siblings)
    return Listing(repo_id, commit, tuple(f for f in files if "/" not in f.name))


def _remote_file(repo_id: str, entry: Any) -> RemoteFile:
    name = entry.get("rfilename") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not _is_safe_name(name):
        raise HubError(f"{repo_id}: the Hub lists a file named {shown(name)}, which is not a safe file name; refused")
    size, lfs = entry.get("size"), entry.get("lfs")
    if not is_int(size) or not 0 <= size <= MAX_FILE_BYTES:
        raise HubError(f"{repo_id}/{name}: the Hub lists size {shown(size)}; expected a byte count")
    sha = lfs.get("sha256") if isinstance(lfs, dict) else None
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise HubError(f"{repo_id}/{name}: the Hub lists sha256 {shown(sha)}; expected 64 hex digits")
    blob = None
    if lfs is None:  # an LFS file's blobId is its pointer's, not its content's
        blob = entry.get("blobId", entry.get("oid"))
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
    return f"{endpoint()}/{repo_id}/resolve/{commit}/{_quote(name)}"


def fetch_config(listing: Listing) -> dict[str, Any]:
    """config.json of the listed commit, as a JSON object."""
    url = file_url(listing.repo_id, listing.commit, "config.json")
    body = read(url, MAX_CONFIG_BYTES, what=f"{listing.repo_id}/config.json")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise HubError(f"{listing.repo_id}/config.json: not a JSON object; the repository is not a model checkpoint")
    return value


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
    """A safetensors shard's header, read with two Range requests and checked like a local file's header."""
    source = f"{listing.repo_id}/{shard.name}"
    url = file_url(listing.repo_id, listing.commit, shard.name)
    prefix = read(url, 8, what=source, byte_range=(0, 7))
    if len(prefix) != 8:
        raise HubError(f"{source}: {len(prefix)} bytes is too short for a safetensors file; refused")
    (length,) = struct.unpack("<Q", prefix)
    if not 2 <= length <= min(MAX_HEADER_BYTES, shard.size - 8):
        raise HubError(
            f"{source}: header length {length} does not fit the file ({shard.size} bytes); not safetensors, refused"
        )
    raw = read(url, length, what=source, byte_range=(8, 8 + length - 1))
    try:
        header = parse_json(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
        header.pop("__metadata__", None)
        tensors = check_tensors(source, header, shard.size - 8 - length)
    except CorruptFileError as e:
        raise HubError(f"{e}; refused before downloading any weights") from None
    except (ValueError, RecursionError, UnicodeDecodeError):
        raise HubError(f"{source}: the header is not a JSON object; not safetensors, refused") from None
    return ShardHeader(shard.name, {name: (t.dtype, t.shape) for name, t in tensors.items()})


def request(url: str, byte_range: tuple[int, int | None] | None = None) -> urllib.request.Request:
    """A GET for `url`, with HF_TOKEN (never sent on to a redirect's host) and a Range header if asked."""
    try:
        req = urllib.request.Request(url, headers={"User-Agent": "mlxinfer"})
    except ValueError as e:  # a malformed HF_ENDPOINT
        raise HubError(f"{plain(url)}: not a URL ({first_line(e)}); check HF_ENDPOINT") from None
    if byte_range is not None:
        start, end = byte_range
        req.add_header("Range", f"bytes={start}-{'' if end is None else end}")
    if os.environ.get("HF_TOKEN"):
        req.add_unredirected_header("Authorization", f"Bearer {os.environ['HF_TOKEN']}")
    return req


def read(url: str, limit: int, what: str, byte_range: tuple[int, int] | None = None) -> bytes:
    """The body of a GET, at most `limit` bytes (more is refused); an HTTP or network error names `what`."""
    req = request(url, byte_range)
    try:
        with open_url(req) as response:
            if byte_range is not None and response.status == 200:  # Range ignored: read only the part asked for
                start, end = byte_range
                body = response.read(end + 1)[start:]
                return body
            body = response.read(limit + 1)
    except urllib.error.HTTPError as e:
        raise HubError(f"{what}: the Hub answered HTTP {e.code}{_advice(e.code)}") from None
    except NETWORK_ERRORS as e:
        raise HubError(
            f"{what}: no usable answer from {endpoint()} ({reason_of(e)}); check HF_ENDPOINT or retry later"
        ) from None
    if len(body) > limit:
        raise HubError(f"{what}: more than {limit} bytes; refused")
    return body


def _advice(code: int) -> str:
    if code in (401, 403):
        return " (a gated or private repository: set HF_TOKEN to a token that may read it)"
    if code == 404:
        return " (no such repository, revision or file: check the id and --revision)"
    return ""


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="/")
