"""The one layer that turns engine errors and malformed requests into OpenAI-style HTTP errors.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}``. Engine errors name
fields in the engine's vocabulary; ``Names`` renames them to what the route's client sent.
Error bodies are encoded as ASCII JSON, so text a client sent (a lone surrogate, say) can
never break the encoding of the answer that refuses it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from needlescope.serve.errors import (
    BadValue,
    ContextOverflow,
    EngineError,
    GenerationFailed,
    Overloaded,
    ShuttingDown,
)

__all__ = [
    "ApiError",
    "AsciiJSONResponse",
    "Names",
    "SafeJSONRoute",
    "error_body",
    "error_response",
    "install",
]

log = logging.getLogger("needlescope.serve")

_SURROGATE = re.compile("[\ud800-\udfff]")


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: any string a client sent can be echoed safely."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ApiError(Exception):
    """An error answered to the client; ``status`` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_response(exc: ApiError) -> AsciiJSONResponse:
    return AsciiJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@dataclass(frozen=True)
class Names:
    """Engine field -> request parameter, for one route: ``renames`` first, else ``prefix + field``."""

    renames: dict[str, str] = field(default_factory=dict)
    prefix: str = ""

    def __call__(self, engine_field: str) -> str:
        return self.renames.get(engine_field, self.prefix + engine_field)


def to_api_error(exc: EngineError, names: Names) -> ApiError:
    if isinstance(exc, BadValue):
        param = names(exc.field)
        return ApiError(400, f"{param} {exc.detail}", param=param)
    if isinstance(exc, ContextOverflow):
        return ApiError(400, str(exc), param=names("prompt"), code="context_length_exceeded")
    if isinstance(exc, Overloaded):
        return ApiError(
            503,
            str(exc),
            type="server_overloaded",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, ShuttingDown):
        return ApiError(503, str(exc), type="server_error", code="shutting_down")
    if isinstance(exc, GenerationFailed):
        return ApiError(500, str(exc), type="server_error")
    return ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error")


@contextmanager
def engine_errors(names: Names) -> Iterator[None]:
    """Raise any engine error inside as the ``ApiError`` it maps to, named for this route."""
    try:
        yield
    except EngineError as exc:
        raise to_api_error(exc, names) from None


def _surrogate_path(obj: Any, path: tuple) -> tuple | None:
    """Location of the first string (or key) in ``obj`` holding a lone UTF-16 surrogate."""
    if isinstance(obj, str):
        return path if _SURROGATE.search(obj) else None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str) and _SURROGATE.search(k):
                return (*path, "<key>")
            found = _surrogate_path(v, (*path, k))
            if found is not None:
                return found
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _surrogate_path(v, (*path, i))
            if found is not None:
                return found
    return None


class _BodyRefused(HTTPException):  # FastAPI re-raises its own HTTPException from body parsing
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(400, message)
        self.param = param
        self.code = code


class _SurrogateRefused(_BodyRefused):
    def __init__(self, param: str) -> None:
        super().__init__(
            f"{param} holds a lone UTF-16 surrogate, which is not valid Unicode; send valid text", param
        )


def _parse_json(raw: bytes) -> Any:
    """``json.loads``, with a clear refusal for the bodies it fails on without a JSONDecodeError
    (which FastAPI would answer only "There was an error parsing the body")."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise  # FastAPI answers it as invalid_json, with the position
    except UnicodeDecodeError as exc:
        raise _BodyRefused(
            f"malformed JSON body: not valid UTF-8 (byte {exc.start})", code="invalid_json"
        ) from None
    except RecursionError:
        raise _BodyRefused("malformed JSON body: nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise _BodyRefused(f"malformed JSON body: {exc}".split(";")[0], code="invalid_json") from None


class _CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = _parse_json(await self.body())
            where = _surrogate_path(body, ())
            if where is not None:
                raise _SurrogateRefused(".".join(str(x) for x in where) or "body")
            self._json = body
        return self._json


_JSON_CONTENT_TYPE = (b"content-type", b"application/json")


def _declared_json(scope: dict) -> dict:
    """``scope``, its body declared JSON (in place: the connection marks this scope later, see
    ``connections.HALF_CLOSED``). FastAPI reads a body as JSON only under a JSON content type,
    and otherwise validates the raw bytes ("Input should be a valid dictionary"); but these
    routes take nothing else, and plain clients send JSON under other types or none (``curl -d``
    sends application/x-www-form-urlencoded, ``requests.post(data=...)`` none)."""
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-type"]
    scope["headers"] = [*headers, _JSON_CONTENT_TYPE]
    return scope


class SafeJSONRoute(APIRoute):
    """A route whose body is read as JSON whatever its declared content type, and refused (400
    naming the field) when any string in it holds a lone surrogate (``"\\ud800"``): valid JSON,
    but not text a tokenizer or encoder can take."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            return await handler(_CheckedRequest(_declared_json(request.scope), request.receive))

        return checked


def install(app: FastAPI) -> None:
    """Exception handlers mapping every error to the OpenAI envelope."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, exc: EngineError):
        return error_response(to_api_error(exc, Names()))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return error_response(ApiError(400, msg, code="invalid_json"))
        parts = [f"{_loc(e) or 'body'}: {e.get('msg')}" for e in errors]
        return error_response(
            ApiError(400, "invalid request: " + "; ".join(parts[:5]), param=_loc(first) or None)
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc, _BodyRefused):
            return error_response(ApiError(400, exc.detail, param=exc.param, code=exc.code))
        code = "not_found" if exc.status_code == 404 else None
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(ApiError(exc.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(
            ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        )


def _loc(error: dict) -> str:
    """Dotted field path of a pydantic error, without ``body`` and union-member tags."""
    parts = []
    for x in error.get("loc", ()):
        if x == "body" or (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS)):
            continue
        parts.append(str(x))
    return ".".join(parts)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}
