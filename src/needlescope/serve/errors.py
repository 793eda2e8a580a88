"""Engine errors: what can go wrong with a generation request, in the engine's own terms.

The engine and its helpers (tokenising, sampling validation, admission) raise these; they
know nothing of HTTP. ``serve.routes.errors`` is the one layer that maps each to an
OpenAI-style HTTP error (status, ``type``, ``code``, and the request's own parameter name).

``field`` names use the engine's vocabulary (``max_tokens``, ``prompt``, ``seed``, ...); the
route that built the request renames them to what its client sent (``max_completion_tokens``,
``messages``, ``sampling_params.sampling_seed``, ...).
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "BadValue",
    "ContextOverflow",
    "Overloaded",
    "ShuttingDown",
    "GenerationFailed",
]


class EngineError(Exception):
    """Base of every error the engine reports about one request."""


class BadValue(EngineError):
    """A request value the engine cannot honour; ``detail`` reads after the field name
    ("must be at least 1; got -1")."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field} {detail}")
        self.field = field
        self.detail = detail


class ContextOverflow(EngineError):
    """The prompt (plus the asked completion) does not fit the model's context."""

    def __init__(
        self,
        context_length: int,
        prompt_tokens: int | None,
        max_tokens: int | None,
        *,
        chars: int = 0,
        messages: int = 0,
        per_message: int = 0,
    ):
        self.context_length = context_length
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        if messages:  # refused from its number of messages, before rendering
            msg = (
                f"This model's maximum context length is {context_length} tokens. However, your prompt has "
                f"{messages} messages, and the chat template adds at least {per_message} tokens to each "
                f"({messages * per_message} tokens). Please send fewer messages."
            )
        elif prompt_tokens is None:  # refused from its length in characters, before tokenising
            msg = (
                f"This model's maximum context length is {context_length} tokens. However, your prompt has "
                f"{chars} characters, more than any {context_length}-token text of this tokenizer can hold. "
                "Please reduce the length of the prompt."
            )
        elif max_tokens is None:  # the prompt alone fills the context: no room for one token
            msg = (
                f"This model's maximum context length is {context_length} tokens. However, your prompt has "
                f"{prompt_tokens} tokens, which leaves no room for the completion (at most "
                f"{context_length - 1} prompt tokens). Please reduce the length of the prompt."
            )
        else:
            msg = (
                f"This model's maximum context length is {context_length} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt and {max_tokens} for "
                "the completion). Please reduce the length of the prompt or the completion."
            )
        super().__init__(msg)


class Overloaded(EngineError):
    """The waiting queue (or the tokenizer's) is full; the request was not admitted.
    ``retry_after_s``: when a retry is likely to be admitted (the measured queue wait)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDown(EngineError):
    """The server is stopping; the request will not run."""


class GenerationFailed(EngineError):
    """The model or the sampler raised while this request ran (a server fault, not the client's)."""
