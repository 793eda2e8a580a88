"""Async client for SGLang's native ``/generate`` with indexer top-k capture.

Request (SGLang native API)::

    POST {root}/generate
    {"input_ids": [int, ...] | "text": str,
     "sampling_params": {"max_new_tokens": n, "temperature": 0},
     "return_indexer_topk": true}

Response: ``{"text": str, "meta_info": {"prompt_tokens": int, "completion_tokens": int,
"indexer_topk": base64 int32, ...}}`` (a one-element list of that object is accepted too).
The capture only exists when the server was started with ``--enable-return-indexer-topk``,
which SGLang allows only with attention-TP size 1 (TP1, or DP attention).

``server_info()`` reads ``/get_server_info`` (``/server_info`` on newer builds) and looks,
anywhere in the returned JSON, for ``index_topk`` and ``num_indexer_layers`` (SGLang does
not promise these keys; the CLI's ``--index-topk`` / ``--num-layers`` override them).

Errors: connection problems and 5xx -> ``TransportFailure``; a non-JSON or wrongly shaped
answer, or a 4xx -> ``ProtocolViolation``; a missing ``indexer_topk`` -> ``ProtocolViolation``
saying how to start the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from needlescope.errors import BadInput, ProtocolViolation, TransportFailure
from needlescope.targets.bounded import AsyncBoundedTransport
from needlescope.targets.endpoints import auth_headers, check_api_key

__all__ = ["GenerateResult", "SGLangTarget", "find_key", "MISSING_TOPK_HINT"]

CAPTURE_MAX_BYTES = 512 * 1024 * 1024
"""The largest capture answer read from SGLang (bytes): top-k indices of every layer and token."""

MISSING_TOPK_HINT = (
    "the server's meta_info has no 'indexer_topk': start SGLang with --enable-return-indexer-topk "
    "(it needs attention-TP size 1: --tp 1, or --enable-dp-attention) and use a build with DeepSeek-V4 "
    "indexer capture"
)


@dataclass
class GenerateResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    indexer_topk: str  # base64 int32, (prompt_tokens + completion_tokens - 1, layers, k)
    meta_info: dict
    output_ids: list[int] | None = None  # the generated token ids, when the server returns them


def find_key(obj: Any, key: str) -> Any:
    """The first value stored under ``key`` anywhere in nested dicts/lists (breadth-first), else None."""
    queue = [obj]
    while queue:
        nxt = []
        for o in queue:
            if isinstance(o, dict):
                if key in o and o[key] is not None:
                    return o[key]
                nxt.extend(o.values())
            elif isinstance(o, list):
                nxt.extend(o)
        queue = nxt
    return None


def _root(url: str) -> str:
    raw = (url or "").strip().rstrip("/")
    if not raw.startswith(("http://", "https://")):
        raise BadInput(f"--sglang {url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:30000")
    return raw[: -len("/v1")] if raw.endswith("/v1") else raw


class SGLangTarget:
    """One SGLang server (root URL, with or without a trailing ``/v1``)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ):
        self.root = _root(url)
        self.timeout = timeout
        # A capture answer holds top-k indices for every layer and token: far over the chat cap.
        # ``api_key``: a server started with --api-key answers 401 to every route but /health.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout),
            headers=auth_headers(check_api_key(api_key)),
            transport=AsyncBoundedTransport(timeout, transport, max_bytes=CAPTURE_MAX_BYTES),
        )

    async def _request(self, method: str, path: str, payload: dict | None = None) -> httpx.Response:
        url = self.root + path
        try:
            return await self._client.request(method, url, json=payload)
        except httpx.TimeoutException as e:
            raise TransportFailure(f"{url}: timed out after {self.timeout}s ({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise TransportFailure(f"{url}: {type(e).__name__}: {e}; is the SGLang server running?") from e

    @staticmethod
    def _json(resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError as e:
            raise ProtocolViolation(f"{resp.request.url} answered invalid JSON: {resp.text[:200]!r}") from e

    async def server_info(self) -> dict | None:
        """The server-info JSON, or None when neither endpoint exists (404/405)."""
        for path in ("/get_server_info", "/server_info"):
            resp = await self._request("GET", path)
            if resp.status_code in (404, 405):
                continue
            if resp.status_code >= 500:
                raise TransportFailure(
                    f"{self.root}{path} answered HTTP {resp.status_code}: {resp.text[:200]}"
                )
            if resp.status_code != 200:
                raise ProtocolViolation(
                    f"{self.root}{path} answered HTTP {resp.status_code}: {resp.text[:200]}"
                )
            body = self._json(resp)
            if not isinstance(body, dict):
                raise ProtocolViolation(f"{self.root}{path} did not return a JSON object")
            return body
        return None

    async def generate(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        max_new_tokens: int,
        return_indexer_topk: bool = True,
    ) -> GenerateResult:
        """Greedy generation; returns text, token counts and the raw base64 capture."""
        if (input_ids is None) == (text is None):
            raise ValueError("give exactly one of input_ids or text")
        payload: dict[str, Any] = {
            "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0},
            "return_indexer_topk": bool(return_indexer_topk),
        }
        if input_ids is not None:
            payload["input_ids"] = [int(i) for i in input_ids]
        else:
            payload["text"] = text
        resp = await self._request("POST", "/generate", payload)
        url = self.root + "/generate"
        if resp.status_code >= 500:
            raise TransportFailure(f"{url} answered HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code != 200:
            hint = ""
            if "indexer_topk" in resp.text:
                hint = f"; {MISSING_TOPK_HINT}"
            raise ProtocolViolation(f"{url} answered HTTP {resp.status_code}: {resp.text[:300]}{hint}")
        body = self._json(resp)
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, dict):
            raise ProtocolViolation(f"{url} did not return a JSON object: {str(body)[:200]}")
        meta = body.get("meta_info")
        if not isinstance(meta, dict):
            raise ProtocolViolation(f"{url} answered without a meta_info object: {str(body)[:200]}")
        ptok, ctok = meta.get("prompt_tokens"), meta.get("completion_tokens")
        if not isinstance(ptok, int) or not isinstance(ctok, int):
            raise ProtocolViolation(f"{url} meta_info lacks integer prompt_tokens/completion_tokens: {meta}")
        topk = meta.get("indexer_topk")
        if topk is None:
            raise ProtocolViolation(f"{url}: {MISSING_TOPK_HINT}")
        if not isinstance(topk, str):
            raise ProtocolViolation(
                f"{url} meta_info.indexer_topk is a {type(topk).__name__}, not a base64 string"
            )
        text_out = body.get("text")
        if not isinstance(text_out, str):
            raise ProtocolViolation(f"{url} answered without a 'text' string")
        out_ids = body.get("output_ids")
        if not (isinstance(out_ids, list) and all(isinstance(i, int) for i in out_ids)):
            out_ids = None
        return GenerateResult(
            text=text_out,
            prompt_tokens=ptok,
            completion_tokens=ctok,
            indexer_topk=topk,
            meta_info=meta,
            output_ids=out_ids,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> SGLangTarget:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
