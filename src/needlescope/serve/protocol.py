"""Wire models of the server: OpenAI requests, SGLang ``/generate``, vLLM ``/tokenize``, responses.

Types are strict, as OpenAI's are: an integer field refuses ``true`` and ``1.0``, a number
field refuses ``true``, ``"1"``, NaN and infinities, a boolean refuses ``1``. Request models
accept unknown fields (clients send many vendor extras) and the server logs their names, so a
field that silently does nothing is visible in the log: one line per request model per minute,
naming at most ``UNKNOWN_NAMES_SHOWN`` fields (each cut to ``UNKNOWN_NAME_CHARS`` characters) and
counting the requests since the last line, so a client cannot fill the log with them. Known parameters that would change the
output but are not implemented are declared here and refused when they carry anything but
their neutral value (``REFUSED``); docs/serve.md lists every parameter and what happens to it.
The response models document the OpenAPI schema (and the API fuzz checks every response
against it).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from needlescope.serve.throttle import LogThrottle

__all__ = [
    "ChatMessage",
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerateRequest",
    "GenerateSamplingParams",
    "TokenizeRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "REFUSED",
    "refused_values",
]

log = logging.getLogger("needlescope.serve")
_unknown_fields = LogThrottle(log)
UNKNOWN_NAMES_SHOWN = 8
UNKNOWN_NAME_CHARS = 40

Number = Annotated[float, Strict(), AllowInfNan(False)]
"""A JSON number (an integer is fine), never a boolean, string, NaN or infinity."""
TokenId = StrictInt


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")

    def model_post_init(self, _context: Any) -> None:
        if self.model_extra:
            _unknown_fields.note(
                type(self).__name__, lambda: _unknown_line(type(self).__name__, self.model_extra)
            )


def _unknown_line(model: str, extra: dict) -> str:
    names = sorted(extra)
    shown = [n if len(n) <= UNKNOWN_NAME_CHARS else n[:UNKNOWN_NAME_CHARS] + "..." for n in names]
    more = len(names) - UNKNOWN_NAMES_SHOWN
    listed = ", ".join(repr(n) for n in shown[:UNKNOWN_NAMES_SHOWN]) + (
        f" and {more} more" if more > 0 else ""
    )
    return f"{model}: ignoring unknown fields {listed}"


class TextPart(_Wire):
    type: Literal["text"] = "text"
    text: StrictStr


class ChatMessage(_Wire):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Wire):
    include_usage: StrictBool | None = False


# Parameters that change the output and that this server does not implement: refused (400,
# naming the parameter) unless absent, null, or the value listed (which means "off").
REFUSED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "best_of": (1,),
    "suffix": ("",),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "logits_processors": (),
}


def refused_values(body: BaseModel) -> list[tuple[str, Any]]:
    """(name, value) of every refused parameter ``body`` carries with a non-neutral value."""
    extra = body.model_extra or {}
    out = []
    for name, neutral in REFUSED.items():
        value = getattr(body, name, None) if name in type(body).model_fields else extra.get(name)
        if value is not None and value not in neutral:
            out.append((name, value))
    return out


class _Sampling(_Wire):
    """Fields shared by chat and text completions (OpenAI's, then vLLM's extensions)."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = Field(None, description="any integer; reduced modulo 2**63")
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(None, description="null or 1")
    logit_bias: dict[str, Number] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100]"
    )
    user: StrictStr | None = None
    # vLLM / SGLang extensions, implemented
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = False
    # needlescope's extension: this request's speculative draft depth (null: the server's)
    speculative_num_draft_tokens: StrictInt | None = None
    # declared so the schema names them; refused unless neutral (REFUSED)
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    best_of: StrictInt | None = None
    response_format: dict[str, Any] | None = None


MAX_MESSAGES = 16_384
"""Messages per request. Validating each message object runs on the event loop (about 9 us
each, 0.85 s for 100,000 on a loaded 2-core box, during which /health waits), so the count is
bounded here, before the items are validated; the template's per-message tokens bound it
further against the context (``serve.tokens``)."""


def _count_messages(data: Any) -> Any:
    """Refuse too many messages from the raw list's length, before any item is validated."""
    if (
        isinstance(data, dict)
        and isinstance(data.get("messages"), list)
        and len(data["messages"]) > MAX_MESSAGES
    ):
        raise ValueError(
            f"messages: at most {MAX_MESSAGES} messages per request; got {len(data['messages'])}"
        )
    return data


class ChatCompletionRequest(_Sampling):
    @model_validator(mode="before")
    @classmethod
    def _messages_counted(cls, data: Any) -> Any:
        return _count_messages(data)

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool | None = True  # vLLM extension
    continue_final_message: StrictBool | None = False  # vLLM extension
    tools: list[Any] | None = None
    tool_choice: Any = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]] = Field(
        description="a string, a one-element list of strings, token ids, or a one-element list of token-id lists"
    )
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    prompt_logprobs: StrictInt | None = Field(
        None, description="vLLM: log-probabilities of the prompt tokens"
    )
    suffix: StrictStr | None = None


class GenerateSamplingParams(_Wire):
    max_new_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_new_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = False
    speculative_num_draft_tokens: StrictInt | None = None  # needlescope's: null is the server's
    seed: StrictInt | None = None  # SGLang calls it sampling_seed; both are read
    sampling_seed: StrictInt | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None


class GenerateRequest(_Wire):
    """SGLang's native ``/generate`` (one prompt per request)."""

    text: StrictStr | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: GenerateSamplingParams | None = None
    return_logprob: StrictBool | None = False
    return_indexer_topk: StrictBool | None = False
    indexer_topk_positions: list[StrictInt] | None = Field(
        None, description="positions whose indexer top-k rows to return (default: every fed position)"
    )
    indexer_topk_last: StrictInt | None = Field(None, description="return only the last N rows")
    return_indexer_logits: StrictBool | None = Field(
        False,
        description="with return_indexer_topk: also the logits each returned row's top-k ranked "
        "(meta_info.indexer_logits, base64 little-endian float32 [rows, layers, W], -inf padded)",
    )
    stream: StrictBool | None = False


class TokenizeRequest(_Wire):
    """vLLM's ``/tokenize``: either ``prompt`` or chat ``messages``."""

    @model_validator(mode="before")
    @classmethod
    def _messages_counted(cls, data: Any) -> Any:
        return _count_messages(data)

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_generation_prompt: StrictBool | None = True
    continue_final_message: StrictBool | None = False
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool | None = False


class DetokenizeRequest(_Wire):
    model: StrictStr | None = None
    tokens: list[TokenId]
    skip_special_tokens: StrictBool | None = Field(
        False, description="drop special tokens from the text (vLLM's default keeps them)"
    )


# ---- responses (the OpenAPI schema; extra keys allowed so they stay honest about vendor fields) ----


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class PromptTokensDetails(_Out):
    cached_tokens: int


class BatchUsage(_Out):
    """``usage.needlescope_batch``: the batch the request ran in."""

    mode: str
    prefill_batch: int
    max_running: int
    joined_mid_flight: bool
    joined_beside: int


class SpeculativeUsage(_Out):
    """``usage.needlescope_speculative``: the request's speculative decoding."""

    draft_tokens: int
    verify_steps: int
    proposed: int
    accepted: int
    acceptance_rate: float | None


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    needlescope_batch: BatchUsage | None = None
    needlescope_speculative: SpeculativeUsage | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class ChatMessageOut(_Out):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"]


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"]
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Out):
    prompt: str


class GenerateResponse(_Out):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


class Health(_Out):
    status: Literal["ok"]


class Version(_Out):
    version: str
    server: str
