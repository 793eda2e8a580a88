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
    if "@" in parts.netloc:
        # Credentials in the URL would travel into every log line, report and results store that
        # names the target (an API key never may); the message shows the URL without them.
        host = parts.netloc.rpartition("@")[2]
        raise BadInput(
            f"--base-url {parts._replace(netloc='***@' + host).geturl()!r} carries credentials "
            "(user:password@); pass the key with --api-key (or NEEDLESCOPE_API_KEY) and the URL "
            f"without them, e.g. {parts.scheme}://{host}/v1"
        )
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BadInput(f"--base-url {raw!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8000/v1")
    base = raw.rstrip("/")
    endpoint = next((e for e in _ENDPOINTS if base.endswith(e)), None)
    if endpoint is not None:  # every route would be appended to it: /v1/chat/completions/v1/models
        raise BadInput(
            f"--base-url {raw!r} names an endpoint ({endpoint}); pass the server's root or its /v1, "
            f"e.g. {base[: -len(endpoint)]}/v1"
        )
    root = base[: -len("/v1")] if base.endswith("/v1") else base
    return root, root + "/v1"


_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/generate")


def check_api_key(api_key: str | None) -> str | None:
    """``api_key`` if it can travel in an ``Authorization`` header: printable ASCII without spaces
    (HTTP clients refuse anything else: a non-ASCII key cannot be encoded, a newline would end the
    header). BadInput otherwise, without echoing the key."""
    if api_key is not None and not all("!" <= c <= "~" for c in api_key):
        at, bad = next((i, c) for i, c in enumerate(api_key) if not "!" <= c <= "~")
        what = "a non-ASCII character" if not bad.isascii() else "a space or control character (a newline?)"
        raise BadInput(
            f"--api-key (or NEEDLESCOPE_API_KEY) holds {what} at position {at + 1}; an API key must be "
            "printable ASCII without spaces, as an HTTP Authorization header requires"
        )
    return api_key


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header every request to the target carries when a key is set (chat, tokenize, provenance).

    The key only ever travels in this header; it is never put in results, logs or messages.
    BadInput for a key no header can carry (``check_api_key``).
    """
    return {"Authorization": f"Bearer {check_api_key(api_key)}"} if api_key else {}


REDACTED = "[api key redacted]"
"""What stands for the API key where a server echoed it (``targets.bounded`` takes it out of every
answer body it reads, so it never reaches results, logs or messages)."""


@cache
def tls_context() -> SSLContext:
    """One verifying TLS context for every client of the process.

    Building one reads the CA bundle (about 26 ms); a chat target keeps one client per request
    slot, so a context per client cost seconds of CPU per target at high concurrency.
    """
    return httpx.create_ssl_context()
