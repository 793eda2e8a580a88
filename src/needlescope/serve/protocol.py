"""Wire models of the server: OpenAI requests, SGLang ``/generate``, vLLM ``/tokenize``, errors.

Request models accept unknown fields (clients send many vendor extras) but the server logs
their names, so a field that silently does nothing is visible in the log. Every error
leaves as the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ApiError",
    "error_body",
    "ChatMessage",
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerateRequest",
    "GenerateSamplingParams",
    "TokenizeRequest",
    "DetokenizeRequest",
    "StreamOptions",
]

log = logging.getLogger("needlescope.serve")


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_extras(self):
        if self.model_extra:
            log.warning("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self


class TextPart(_Wire):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Wire):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Wire):
    include_usage: bool = False


class _Sampling(_Wire):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM/SGLang extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False  # vLLM/SGLang extension


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extension


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool = False


class GenerateSamplingParams(_Wire):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    seed: int | None = None  # SGLang calls it sampling_seed; both are read
    sampling_seed: int | None = None


class GenerateRequest(_Wire):
    """SGLang's native ``/generate`` (one prompt per request)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_indexer_topk: bool = False
    return_logprob: bool = False
    stream: bool = False


class TokenizeRequest(_Wire):
    """vLLM's ``/tokenize``: either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Wire):
    model: str | None = None
    tokens: list[int]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)
