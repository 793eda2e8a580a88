"""SGLang's ``/generate`` and vLLM's tokenizer routes (``/tokenize``, ``/detokenize``,
``/tokenizer_info``; the first two also under ``/v1``)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from needlescope.serve.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    GenerateResponse,
    GenerateSamplingParams,
    TokenizeRequest,
    TokenizeResponse,
)
from needlescope.serve.requests import GenRequest, TopkRows
from needlescope.serve.routes.errors import ApiError, Names, SafeJSONRoute, engine_errors
from needlescope.serve.routes.generation import Serving, extensions
from needlescope.serve.routes.responses import GENERATION_RESPONSES, JSON_ERRORS

__all__ = ["native_router"]

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
_REFUSED_SAMPLING = ("frequency_penalty", "presence_penalty")


def native_router(serving: Serving) -> APIRouter:
    router = APIRouter(route_class=SafeJSONRoute)
    _add_generate(router, serving)
    _add_tokenizer_routes(router, serving)
    return router


def _capture_rows(body: GenerateRequest) -> TopkRows | None:
    """The indexer top-k rows a ``/generate`` asks for, or None; capture options need the switch."""
    if body.return_indexer_topk:
        positions = body.indexer_topk_positions
        return TopkRows(
            positions=None if positions is None else tuple(positions),
            last=body.indexer_topk_last,
            logits=bool(body.return_indexer_logits),
        )
    if (
        body.indexer_topk_positions is not None
        or body.indexer_topk_last is not None
        or body.return_indexer_logits
    ):
        raise ApiError(
            400,
            "indexer_topk_positions/indexer_topk_last/return_indexer_logits need return_indexer_topk=true",
            param="return_indexer_topk",
        )
    return None


def _check_generate(body: GenerateRequest) -> GenerateSamplingParams:
    """Refuse what ``/generate`` does not serve; return its sampling parameters."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", param="text")
    if body.stream:
        raise ApiError(400, "stream=true is not supported on /generate; use /v1/completions", param="stream")
    sp = body.sampling_params or GenerateSamplingParams()
    for name in _REFUSED_SAMPLING:
        if getattr(sp, name) not in (None, 0):
            raise ApiError(400, f"{name} is not supported by this server", param=f"sampling_params.{name}")
    return sp


def _generate_names(body: GenerateRequest, sp: GenerateSamplingParams) -> Names:
    """SGLang's spelling of each engine parameter, so errors name the field the caller sent."""
    seed_name = "sampling_seed" if sp.sampling_seed is not None else "seed"
    return Names(
        {
            "prompt": "text" if body.text is not None else "input_ids",
            "max_tokens": "sampling_params.max_new_tokens",
            "min_tokens": "sampling_params.min_new_tokens",
            "seed": f"sampling_params.{seed_name}",
            "logprobs": "return_logprob",
            "return_indexer_topk": "return_indexer_topk",
            "indexer_topk_positions": "indexer_topk_positions",
            "indexer_topk_last": "indexer_topk_last",
            "return_indexer_logits": "return_indexer_logits",
        },
        prefix="sampling_params.",
    )


def _generate_meta(body: GenerateRequest, req: GenRequest, final) -> dict:
    """SGLang's ``meta_info`` of a finished request."""
    if final.finish_reason == "length":
        reason: dict = {"type": "length", "length": final.completion_tokens}
    else:
        reason = {"type": final.finish_reason, "matched": final.matched_stop}
    meta: dict = {
        "id": req.rid,
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "cached_tokens": final.cached_tokens,
        **extensions(final),
        "finish_reason": reason,
        "e2e_latency": time.monotonic() - req.admitted_at,
    }
    if body.return_logprob:
        meta["output_token_logprobs"] = [[t.logprob, t.id, None] for t in final.tokens]
    if final.indexer_topk is not None:
        meta["indexer_topk"] = final.indexer_topk
        meta["indexer_topk_shape"] = list(final.indexer_topk_shape)
        if final.indexer_topk_positions is not None:
            meta["indexer_topk_positions"] = final.indexer_topk_positions
        if final.indexer_logits is not None:
            meta["indexer_logits"] = final.indexer_logits
            meta["indexer_logits_shape"] = list(final.indexer_logits_shape)
    return meta


def _add_generate(router: APIRouter, serving: Serving) -> None:
    engine = serving.engine
    tokens = engine.tokens

    @router.post("/generate", response_model=GenerateResponse, responses=GENERATION_RESPONSES)
    async def generate(body: GenerateRequest, request: Request):
        sp = _check_generate(body)
        rows = _capture_rows(body)
        names = _generate_names(body, sp)
        with engine_errors(names):
            if body.text is not None:
                ids = await tokens.text_ids(body.text)
            else:
                ids = list(body.input_ids)
                tokens.check_ids(ids)
            params = engine.sampling(
                len(ids),
                max_tokens=sp.max_new_tokens,
                default_max_tokens=SGLANG_DEFAULT_MAX_NEW_TOKENS,
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=sp.top_k,
                min_p=sp.min_p,
                seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
                stop=sp.stop,
                stop_token_ids=sp.stop_token_ids,
                ignore_eos=sp.ignore_eos,
                min_tokens=sp.min_new_tokens,
                repetition_penalty=sp.repetition_penalty,
                logprobs=0 if body.return_logprob else None,
                draft_tokens=sp.speculative_num_draft_tokens,
            )
            if rows is not None:
                engine.check_capture(rows, len(ids), params)
        req = GenRequest(ids, params, capture=rows)
        serving.admit(req, names)
        final = await serving.wait_final(req, request, names)
        return {
            "text": final.text,
            "output_ids": final.output_ids,
            "meta_info": _generate_meta(body, req, final),
        }


def _add_tokenizer_routes(router: APIRouter, serving: Serving) -> None:
    engine = serving.engine
    tokens = engine.tokens

    @router.post("/tokenize", response_model=TokenizeResponse, responses=JSON_ERRORS)
    @router.post("/v1/tokenize", response_model=TokenizeResponse, responses=JSON_ERRORS)
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        with engine_errors(Names({"prompt": "messages" if body.messages is not None else "prompt"})):
            if body.messages is not None:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                ids = await tokens.chat_ids(
                    messages, body.add_generation_prompt is not False, bool(body.continue_final_message)
                )
            else:
                add = True if body.add_special_tokens is None else body.add_special_tokens
                ids = await tokens.text_ids(body.prompt, add_special_tokens=add)
        out: dict = {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await tokens.token_strs(ids)
        return out

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=JSON_ERRORS)
    @router.post("/v1/detokenize", response_model=DetokenizeResponse, responses=JSON_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        with engine_errors(Names({"prompt": "tokens"})):
            return {"prompt": await tokens.decode(body.tokens, bool(body.skip_special_tokens))}

    @router.get("/tokenizer_info", responses=JSON_ERRORS)
    async def tokenizer_info():
        """vLLM's: the tokenizer's class, special tokens and chat template (lm-eval's remote tokenizer)."""
        tok = tokens.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template,
            "model_max_length": engine.context_length,
            "vocab_size": tokens.vocab_size,
        }
