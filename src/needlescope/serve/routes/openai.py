"""OpenAI routes: ``/v1/models`` (list and retrieve), ``/v1/chat/completions``, ``/v1/completions``.

Chat and text completions differ in how the prompt is given and how the answer is rendered;
both go through ``Serving.respond``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from needlescope.serve.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    refused_values,
)
from needlescope.serve.requests import GenRequest
from needlescope.serve.routes.errors import ApiError, Names, SafeJSONRoute, engine_errors
from needlescope.serve.routes.generation import ChatRenderer, CompletionRenderer, Serving
from needlescope.serve.routes.responses import GENERATION_RESPONSES, JSON_ERRORS

__all__ = ["openai_router"]


def _refuse_unsupported(body) -> None:
    """400 for ``n`` other than 1 and for any parameter this server does not implement."""
    if body.n not in (None, 1):
        raise ApiError(400, f"n={body.n} is not supported; send n=1 (one choice per request)", param="n")
    for name, value in refused_values(body):
        raise ApiError(400, f"{name}={value!r} is not supported by this server", param=name)


def _sampling_kwargs(body) -> dict:
    """The engine's sampling arguments from the fields chat and completions share."""
    return dict(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias,
        draft_tokens=body.speculative_num_draft_tokens,
    )


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def openai_router(serving: Serving) -> APIRouter:
    router = APIRouter(route_class=SafeJSONRoute)
    _add_model_routes(router, serving)
    _add_generation_routes(router, serving)
    return router


def _add_model_routes(router: APIRouter, serving: Serving) -> None:
    engine = serving.engine

    def card() -> dict:
        return {
            "id": serving.name,
            "object": "model",
            "created": int(engine.started_at),
            "owned_by": "needlescope",
            "root": str(engine.path) if engine.cfg.expose_paths else serving.name,
            "max_model_len": engine.context_length,
        }

    @router.get("/v1/models", response_model=ModelList, responses=JSON_ERRORS)
    async def models():
        return {"object": "list", "data": [card()]}

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=JSON_ERRORS)
    async def model(model_id: str):
        serving.check_model(model_id)
        return card()


def _add_generation_routes(router: APIRouter, serving: Serving) -> None:
    engine = serving.engine

    @router.post("/v1/chat/completions", response_model=ChatCompletion, responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        serving.check_model(body.model)
        _refuse_unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        use_mct = body.max_completion_tokens is not None
        names = Names(
            {
                "prompt": "messages",
                "max_tokens": "max_completion_tokens" if use_mct else "max_tokens",
                "logprobs": "top_logprobs",  # chat's logprobs is a switch; the count is top_logprobs
            }
        )
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        add_prompt = body.add_generation_prompt is not False
        with engine_errors(names):
            ids = await engine.tokens.chat_ids(messages, add_prompt, bool(body.continue_final_message))
            params = engine.sampling(
                len(ids),
                max_tokens=body.max_completion_tokens if use_mct else body.max_tokens,
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                **_sampling_kwargs(body),
            )
        req = GenRequest(ids, params, stream=bool(body.stream))
        renderer = ChatRenderer(logprobs=bool(body.logprobs))
        return await serving.respond(request, req, renderer, names, _include_usage(body))

    @router.post("/v1/completions", response_model=Completion, responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        serving.check_model(body.model)
        _refuse_unsupported(body)
        echo = bool(body.echo)
        if echo and body.stream:
            raise ApiError(400, "echo is not supported with stream=true", param="echo")
        names = Names({"prompt": "prompt"})
        prompt = _one_prompt(body.prompt)
        with engine_errors(names):
            if isinstance(prompt, str):
                ids = await engine.tokens.text_ids(prompt)
            else:
                ids = prompt
                engine.tokens.check_ids(ids)
            scored = body.prompt_logprobs if body.prompt_logprobs is not None else None
            if echo and body.logprobs is not None:
                scored = max(scored or 0, body.logprobs)
            params = engine.sampling(
                len(ids),
                max_tokens=body.max_tokens,
                default_max_tokens=16,  # OpenAI's default for completions
                allow_zero_tokens=echo,
                logprobs=body.logprobs,
                prompt_logprobs=scored,
                **_sampling_kwargs(body),
            )
            echo_text = None
            if echo:
                echo_text = prompt if isinstance(prompt, str) else await engine.tokens.decode(ids)
        req = GenRequest(ids, params, stream=bool(body.stream))
        renderer = CompletionRenderer(
            logprobs=body.logprobs, echo_text=echo_text, prompt_logprobs=body.prompt_logprobs is not None
        )
        return await serving.respond(request, req, renderer, names, _include_usage(body))


def _one_prompt(prompt: str | list) -> str | list[int]:
    """The single prompt in ``prompt``: a string, a one-element list of strings, token ids, or a
    one-element list of token-id lists (lm-eval's ``local-completions`` sends ``[[ids]]``)."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(
                400, "batched prompts are not supported; send one prompt per request", param="prompt"
            )
        return prompt[0]
    return list(prompt)
