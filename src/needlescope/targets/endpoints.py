"""Base-URL handling: users pass either the server root or its OpenAI ``/v1`` prefix."""

from __future__ import annotations

from functools import cache
from ssl import SSLContext
from urllib.parse import urlsplit

import httpx

from needlescope.errors import BadInput


def normalize_base_url(url: str) -> tuple[str, str]:
    """Return ``(root, v1)`` for ``http://h:p`` or ``http://h:p/v1`` (trailing slashes ignored).

    Native endpoints (``/tokenize``, ``/health``, ``/get_server_info``) live under ``root``;
    OpenAI endpoints under ``v1``.
    """
    raw = (url or "").strip()
    try:
        parts = urlsplit(raw)
        parts.port  # noqa: B018 (reading it validates it: "http://h:99999" raises here)
    except ValueError as exc:
        raise BadInput(
            f"--base-url {raw!r} is not a valid URL ({exc}); pass e.g. http://127.0.0.1:8000/v1"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BadInput(f"--base-url {raw!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8000/v1")
    base = raw.rstrip("/")
    root = base[: -len("/v1")] if base.endswith("/v1") else base
    return root, root + "/v1"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header every request to the target carries when a key is set (chat, tokenize, provenance).

    The key only ever travels in this header; it is never put in results, logs or messages.
    """
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@cache
def tls_context() -> SSLContext:
    """One verifying TLS context for every client of the process.

    Building one reads the CA bundle (about 26 ms); a chat target keeps one client per request
    slot, so a context per client cost seconds of CPU per target at high concurrency.
    """
    return httpx.create_ssl_context()
