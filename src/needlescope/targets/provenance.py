"""What the server says about itself, recorded with every run (secrets stripped)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from needlescope.targets.bounded import sync_client

_SECRET_WORDS = ("key", "token", "secret", "password")

# (key under which it is stored, which base URL it hangs off, path)
_ENDPOINTS = (
    ("/get_server_info", "root", "/get_server_info"),
    ("/version", "root", "/version"),
    ("/v1/models", "v1", "/models"),
    ("/props", "root", "/props"),
    ("/health", "root", "/health"),
)


def strip_secrets(value: Any) -> Any:
    """Drop, recursively, every dict key that mentions key/token/secret/password (case-insensitive).

    Deliberately broad: losing e.g. ``max_tokens`` from provenance is acceptable; storing an API key is not.
    """
    if isinstance(value, dict):
        return {
            k: strip_secrets(v)
            for k, v in value.items()
            if not any(w in str(k).lower() for w in _SECRET_WORDS)
        }
    if isinstance(value, list):
        return [strip_secrets(v) for v in value]
    return value


def collect_provenance(
    root: str,
    v1: str,
    *,
    api_key: str | None = None,
    timeout: float = 5.0,
    transport: httpx.BaseTransport | None = None,
) -> dict:
    """GET each known info endpoint; store JSON bodies under their path, and a status for every one.

    Never raises for a missing or failing endpoint: ``{"status": {path: int | "error: ..."}}`` says what happened.
    ``timeout`` bounds the whole collection, not each GET: a broken endpoint costs its time once.
    """
    out: dict[str, Any] = {"root": root, "status": {}}
    bases = {"root": root.rstrip("/"), "v1": v1.rstrip("/")}
    end = time.monotonic() + timeout
    with sync_client(api_key, timeout, transport) as client:
        for key, base, path in _ENDPOINTS:
            left = end - time.monotonic()
            if left <= 0:
                out["status"][key] = f"error: not asked (provenance took its {timeout:g}s)"
                continue
            try:
                resp = client.get(bases[base] + path, timeout=left)
            except httpx.HTTPError as e:
                out["status"][key] = f"error: {type(e).__name__}"
                continue
            out["status"][key] = resp.status_code
            if resp.status_code != 200:
                continue
            try:
                out[key] = strip_secrets(resp.json())
            except ValueError:
                # Some /health endpoints answer plain text; keep a short excerpt.
                out[key] = resp.text[:200]
    return out
