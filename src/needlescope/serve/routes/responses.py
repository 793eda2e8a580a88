"""The error and streaming responses each route documents in the OpenAPI schema."""

from __future__ import annotations

from needlescope.serve.protocol import ErrorResponse

__all__ = ["JSON_ERRORS", "GENERATION_RESPONSES"]


def _err(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


JSON_ERRORS: dict = {
    400: _err("bad request: malformed JSON, a failed validation, an unsupported or out-of-range parameter"),
    401: _err("missing or wrong API key (when the server has one)"),
    404: _err("unknown model"),
    413: _err("request body over --max-body-bytes"),
}

GENERATION_RESPONSES: dict = {
    **JSON_ERRORS,
    200: {
        "description": "the answer; with stream=true, server-sent events of chunks",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    500: _err("the model or the sampler failed on this request"),
    503: _err("the waiting queue is full (with Retry-After) or the server is shutting down"),
}
