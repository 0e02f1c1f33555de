"""An image fetched from a web address, for a server started with `--image-urls` (off by default: a request could
otherwise make the server reach any address its machine can, and wait on it).

Bounded before and while reading: http and https only, at most MAX_REDIRECTS hops (each checked the same way), the
whole exchange within `timeout_s`, the body within the image byte limit (a Content-Length past it is refused
unread; a body that runs past it is cut off at the limit).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from ..errors import ImageError
from ..untrusted import shown

MAX_REDIRECTS = 3
FETCH_TIMEOUT_S = 10.0
_CHUNK = 1 << 16


class _Redirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        if urlsplit(newurl).scheme not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, "redirected away from http(s)", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_Redirects)


def fetch_image(url: str, where: str, max_bytes: int, timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
    """The bytes at `url` (http or https), or an ImageError naming `where` and what went wrong."""
    if urlsplit(url).scheme not in ("http", "https"):
        raise ImageError(f"{where}: only http and https image addresses are fetched, got {shown(url[:80])}")
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": "mlxinfer", "Accept": "image/*"})
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise ImageError(f"{where}: the image at that address is more than {_size(max_bytes)}")
            chunks, size = [], 0
            while chunk := response.read(_CHUNK):
                chunks.append(chunk)
                size += len(chunk)
                if size > max_bytes:
                    raise ImageError(f"{where}: the image at that address is more than {_size(max_bytes)}")
                if time.monotonic() > deadline:
                    raise ImageError(f"{where}: fetching the image took more than {timeout_s:g} s")
            return b"".join(chunks)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:
        raise ImageError(f"{where}: fetching the image failed (HTTP {e.code}: {e.msg})") from None
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or type(e).__name__
        raise ImageError(f"{where}: fetching the image failed ({str(reason)[:120]})") from None


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes:,} bytes"
