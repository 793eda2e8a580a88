"""The model runner: one worker thread owns the model and decodes batches with a KV cache.

Scheduling (why it looks like this):

- **Static batches of equal prompt length.** The engine takes the oldest waiting request and
  every other waiting request with the same prompt length (up to ``max_running_requests``),
  prefills them as one ``[B, P]`` batch and decodes them in lock-step, one token per step for
  the whole batch. Rows that finish are dropped from the cache with ``reorder_cache``.
  Equal lengths mean equal positions, so no padding and no attention mask are needed. That
  matters for DeepSeek-V4: its compressors pool fixed windows of absolute positions
  (``entry_count * compress_rate``) and keep per-layer running state (buffer, overlap,
  compressed entries) that is shared by the whole batch, so left padding would shift every
  window and ragged rows cannot share one cache. The probe sends token-exact prompts, so the
  requests of one length cell batch together. New requests wait for the batch in flight
  (no continuous batching: a late row would need its own compressor state). A batch also
  stays within ``max_prefill_tokens`` (batch x prompt length), because eager attention's
  prefill memory grows with batch x length^2.
- **No prefix cache.** ``cached_tokens`` is reported as 0, honestly. Reusing a prompt's cache
  would mean prefilling the rest of the next prompt as a second chunk, and for the
  transformers DeepSeek-V4 implementation a chunked prefill does not reproduce a one-pass
  prefill (logit differences of order 1e-2 measured on a random organism; see docs/serve.md).
  A reference server must answer exactly what a single pass answers.
- **Indexer capture** (``/generate`` with ``return_indexer_topk``) runs such a request alone
  (batch key ``None``), with the ``IndexerCapture`` that is attached for the server's lifetime
  recording prefill and every decode step.

Only the worker thread touches the model and its own copy of the tokenizer; the HTTP loop
encodes prompts with the other copy. Results go back through ``GenRequest.emit``, which hands
events to the request's asyncio queue on the loop thread.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
import random
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from needlescope import __version__
from needlescope.dsa.checkpoint import load_bundle
from needlescope.dsa.emulate import IndexerCapture, emulate
from needlescope.errors import BadInput
from needlescope.serve.admission import Admission
from needlescope.serve.config import ServeConfig
from needlescope.serve.metrics import ServeMetrics
from needlescope.serve.protocol import ApiError
from needlescope.setting import REFERENCE, Setting

__all__ = ["SamplingParams", "TokenOut", "Delta", "Final", "GenRequest", "Engine", "encode_indexer_topk"]

log = logging.getLogger("needlescope.serve")

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, already validated (``Engine.sampling``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs; 0: the chosen token's; n: also the n most likely tokens."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class TokenOut:
    """One generated token: id, its text piece, and its log-probability (when asked for)."""

    id: int
    text: str
    logprob: float | None = None
    top: list[tuple[int, str, float]] | None = None


@dataclass
class Delta:
    """Streamed progress: newly visible text and the tokens generated since the last delta."""

    text: str
    tokens: list[TokenOut]


@dataclass
class Final:
    finish_reason: str
    text: str
    output_ids: list[int]
    tokens: list[TokenOut]
    prompt_tokens: int
    matched_stop: str | int | None = None
    indexer_topk: str | None = None
    indexer_topk_shape: tuple[int, int, int] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


class GenRequest:
    """A request travelling from the HTTP loop to the engine thread and back."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = False,
        capture: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.rid = uuid.uuid4().hex
        self.prompt_ids = prompt_ids
        self.params = params
        self.stream = stream
        self.capture = capture
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.admitted_at = time.monotonic()

    def emit(self, event: Delta | Final | ApiError) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


def encode_indexer_topk(topk: torch.Tensor) -> str:
    """SGLang's encoding: base64 of the little-endian int32 bytes of ``topk`` [N, layers, k]."""
    return base64.b64encode(np.ascontiguousarray(topk.numpy().astype("<i4")).tobytes()).decode("ascii")


@dataclass
class _Row:
    """Decode state of one request inside a batch."""

    req: GenRequest
    gen: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    tokens: list[TokenOut] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of text already streamed
    unsent_tokens: list[TokenOut] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None


class Engine:
    """Loads the model, applies the numerics for its lifetime, and runs the worker thread."""

    def __init__(self, cfg: ServeConfig, metrics: ServeMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or ServeMetrics()
        torch.set_num_threads(cfg.threads)
        self.model, self.tokenizer, self.path = load_bundle(cfg.model, device=cfg.device)
        self._decoder = copy.deepcopy(self.tokenizer)  # the worker thread's own copy
        mcfg = self.model.config
        self.architecture = type(self.model).__name__
        self.is_v4 = getattr(mcfg, "model_type", None) == "deepseek_v4"
        self._stack = ExitStack()
        self.capture: IndexerCapture | None = None
        self.csa_layers: list[int] = []
        self.numerics: Setting | None = None
        self.index_topk = 0
        if self.is_v4:
            self.numerics = cfg.setting or REFERENCE
            self.capture = IndexerCapture()
            self.csa_layers = self._stack.enter_context(
                emulate(self.model, self.numerics, capture=self.capture)
            )
            self.index_topk = self.numerics.index_topk or int(mcfg.index_topk)
        elif cfg.setting is not None:
            raise BadInput(
                f"{str(self.path)!r} is a {getattr(mcfg, 'model_type', '?')!r} checkpoint with no lightning "
                "indexer; --index-k, --index-q, --score-dtype, --index-topk and --patch need a DeepSeek-V4 model"
            )
        self.context_length = int(
            getattr(mcfg, "max_position_embeddings", 0) or self.tokenizer.model_max_length
        )
        eos = mcfg.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.admission: Admission[GenRequest] = Admission(
            cfg.max_running_requests, cfg.max_queued_requests, self.metrics
        )
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="needlescope-engine", daemon=True)
        self.started_at = time.time()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stopping = True
        for req in self.admission.close():
            req.emit(ApiError(503, "the server is shutting down", type="server_error", code="shutting_down"))
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._stack.close()

    # ---- what the HTTP layer asks ------------------------------------------------------------

    def info(self) -> dict:
        """The facts ``/get_server_info`` reports besides the config."""
        n = self.numerics
        return {
            "model": self.cfg.model_name,
            "model_path": str(self.path),
            "architecture": self.architecture,
            "index_k": n.index_k if n else "none",
            "index_q": n.index_q if n else "none",
            "score_dtype": n.score_dtype if n else "none",
            "index_topk": self.index_topk,
            "checkpoint_index_topk": int(getattr(self.model.config, "index_topk", 0) or 0),
            "csa_layers": self.csa_layers,
            "num_indexer_layers": len(self.csa_layers),
            "patch": n.patch.spec if n and n.patch else None,
            "max_queued_requests": self.cfg.max_queued_requests,
            "max_running_requests": self.cfg.max_running_requests,
            "max_new_tokens": self.cfg.max_new_tokens,
            "max_prefill_tokens": self.cfg.max_prefill_tokens,
            "context_length": self.context_length,
            "enable_return_indexer_topk": self.is_v4,
            "prefix_cache": False,
            "batching": "static batches of equal prompt length",
            "needlescope_version": __version__,
            "torch_version": torch.__version__,
            "transformers_version": _transformers_version(),
            "device": self.cfg.device,
            "threads": self.cfg.threads,
        }

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered with the checkpoint's chat template (HTTP loop thread)."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises TemplateError (e.g. unknown role) and friends
            raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        return self.text_ids(text, add_special_tokens=False)

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = len(self.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ApiError(400, f"token ids out of range 0..{vocab - 1}: {bad[:8]}", param=param)

    def sampling(
        self,
        prompt_len: int,
        *,
        max_tokens: int | None,
        max_tokens_param: str = "max_tokens",
        default_max_tokens: int | None = None,
        prompt_param: str = "messages",
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        stop: str | list[str] | None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
    ) -> SamplingParams:
        """Validate request settings against the model and server; ApiError(400) names the field.

        ``max_tokens=None`` means ``default_max_tokens`` (or ``--max-new-tokens``), clamped to the
        room left in the context; a given ``max_tokens`` that does not fit is an error.
        """
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(
                400, f"{max_tokens_param} must be at least 1; got {max_tokens}", param=max_tokens_param
            )
        if prompt_len < 1:
            raise ApiError(400, "the prompt is empty", param=prompt_param)
        ctx = self.context_length
        if prompt_len >= ctx or (max_tokens is not None and prompt_len + max_tokens > ctx):
            asked = "" if max_tokens is None else f" and {max_tokens} for the completion"
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the prompt{asked}). "
                "Please reduce the length of the prompt or the completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        cap = self.cfg.max_new_tokens
        if max_tokens is not None and max_tokens > cap:
            raise ApiError(
                400,
                f"{max_tokens_param}={max_tokens} exceeds this server's --max-new-tokens {cap}",
                param=max_tokens_param,
            )
        temperature = 1.0 if temperature is None else float(temperature)
        if not 0.0 <= temperature <= 2.0:
            raise ApiError(400, f"temperature must be in [0, 2]; got {temperature}", param="temperature")
        top_p = 1.0 if top_p is None else float(top_p)
        if not 0.0 < top_p <= 1.0:
            raise ApiError(400, f"top_p must be in (0, 1]; got {top_p}", param="top_p")
        top_k = 0 if top_k is None or top_k == -1 else int(top_k)
        if top_k < 0:
            raise ApiError(400, f"top_k must be -1, 0 or positive; got {top_k}", param="top_k")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ApiError(400, f"stop must be up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(
                400, f"top logprobs must be in 0..{MAX_TOP_LOGPROBS}; got {logprobs}", param="logprobs"
            )
        return SamplingParams(
            max_new_tokens=min(max_tokens or default_max_tokens or cap, cap, ctx - prompt_len),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stops,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        )

    def submit(self, req: GenRequest) -> None:
        """Admit ``req`` (raises ``Overloaded`` when the queue is full)."""
        self.admission.submit(req)

    def cancel(self, req: GenRequest) -> None:
        req.cancelled = True
        if self.admission.withdraw(req):
            log.info("request %s withdrawn before it ran", req.rid)

    # ---- worker thread -----------------------------------------------------------------------

    @staticmethod
    def _batch_key(req: GenRequest):
        return None if req.capture else len(req.prompt_ids)

    def _loop(self) -> None:
        while not self._stopping:
            batch = self.admission.take_batch(
                self._batch_key, limit=lambda r: self.cfg.max_prefill_tokens // len(r.prompt_ids), timeout=0.5
            )
            if not batch:
                continue
            done: set[str] = set()
            try:
                self._run_batch(batch, done)
            except Exception as exc:  # a failing forward must not take the server down
                log.exception("batch of %d failed", len(batch))
                for req in batch:
                    if req.rid not in done:
                        req.emit(
                            ApiError(
                                500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error"
                            )
                        )
            finally:
                self.admission.finish(len(batch) - len(done))
                if self.capture is not None:
                    self.capture.clear()

    def _new_row(self, req: GenRequest) -> _Row:
        gen = None
        if not req.params.greedy:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(req.params.seed if req.params.seed is not None else random.getrandbits(63))
        return _Row(req=req, gen=gen)

    def _forward(self, ids: torch.Tensor, start: int, cache: DynamicCache) -> torch.Tensor:
        B, S = ids.shape
        pos = torch.arange(start, start + S, device=ids.device).unsqueeze(0).expand(B, -1)
        out = self.model(
            input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1].float().cpu()  # [B, V]

    @torch.inference_mode()
    def _run_batch(self, batch: list[GenRequest], done: set[str]) -> None:
        rows = []
        for req in batch:
            if req.cancelled:
                done.add(req.rid)
                self.admission.finish(1)
            else:
                rows.append(self._new_row(req))
        if not rows:
            return
        capture = rows[0].req.capture
        P = len(rows[0].req.prompt_ids)
        if self.capture is not None:
            self.capture.clear()
        device = self.cfg.device
        ids = torch.tensor([r.req.prompt_ids for r in rows], dtype=torch.long, device=device)
        cache = DynamicCache(config=self.model.config)
        self.metrics.batch_size.observe(len(rows))
        self.metrics.prompt_tokens.inc(len(rows) * P)
        logits = self._forward(ids, 0, cache)
        step = P
        while True:
            if self.capture is not None and not capture:
                self.capture.clear()
            keep = []
            for i, row in enumerate(rows):
                self._advance(row, logits[i])
                if row.finish_reason is None and not row.req.cancelled:
                    keep.append(i)
                    continue
                if not row.req.cancelled:
                    row.req.emit(self._final(row, capture))
                done.add(row.req.rid)
                self.admission.finish(1)
                self.metrics.e2e.observe(time.monotonic() - row.req.admitted_at)
            if not keep:
                return
            if len(keep) < len(rows):
                cache.reorder_cache(torch.tensor(keep, dtype=torch.long, device=device))
                rows = [rows[i] for i in keep]
            nxt = torch.tensor([[r.output_ids[-1]] for r in rows], dtype=torch.long, device=device)
            logits = self._forward(nxt, step, cache)
            step += 1

    def _sample(self, logits: torch.Tensor, row: _Row) -> int:
        p = row.req.params
        if p.greedy:
            return int(torch.argmax(logits))
        x = logits / p.temperature
        if p.top_k:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # drop a token when the mass before it already reaches top_p (keeps at least one)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            x = x.scatter(0, order[drop], float("-inf"))
        return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=row.gen))

    def _advance(self, row: _Row, logits: torch.Tensor) -> None:
        """Sample one token for ``row``, update its text, check stops, stream a delta."""
        req, p = row.req, row.req.params
        tok = self._sample(logits, row)
        if not row.output_ids:
            self.metrics.ttft.observe(time.monotonic() - req.admitted_at)
        row.output_ids.append(tok)
        self.metrics.generation_tokens.inc()
        text = self._decoder.decode(row.output_ids, skip_special_tokens=True)
        piece = text[len(row.text) :] if text.startswith(row.text) else text
        out = TokenOut(id=tok, text=piece)
        if p.logprobs is not None:
            lp = torch.log_softmax(logits, dim=-1)
            out.logprob = float(lp[tok])
            if p.logprobs:
                top = torch.topk(lp, p.logprobs)
                out.top = [
                    (int(i), self._piece(row, int(i)), float(v)) for v, i in zip(top.values, top.indices)
                ]
        row.tokens.append(out)
        row.unsent_tokens.append(out)
        row.text = text
        visible = len(text)
        if not p.ignore_eos and tok in self.eos_ids:
            row.finish_reason, row.matched_stop = "stop", tok
        else:
            cut = _find_stop(text, p.stop, start=max(0, row.sent - max((len(s) for s in p.stop), default=0)))
            if cut is not None:
                visible, row.matched_stop = cut
                row.text = text[:visible]
                row.finish_reason = "stop"
            elif len(row.output_ids) >= p.max_new_tokens:
                row.finish_reason = "length"
            else:
                visible = len(text) - _held_back(text, p.stop)
        if req.stream and (visible > row.sent or row.finish_reason is not None):
            req.emit(Delta(text=row.text[row.sent : visible], tokens=row.unsent_tokens))
            row.sent = visible
            row.unsent_tokens = []

    def _piece(self, row: _Row, tok: int) -> str:
        """Text of ``tok`` as the next token after the row's previous one (keeps leading spaces)."""
        if len(row.output_ids) < 2:
            return self._decoder.decode([tok], skip_special_tokens=False)
        prev = row.output_ids[-2]
        before = self._decoder.decode([prev], skip_special_tokens=False)
        both = self._decoder.decode([prev, tok], skip_special_tokens=False)
        return both[len(before) :] if both.startswith(before) else both

    def _final(self, row: _Row, capture: bool) -> Final:
        final = Final(
            finish_reason=row.finish_reason or "abort",
            text=row.text,
            output_ids=list(row.output_ids),
            tokens=row.tokens,
            prompt_tokens=len(row.req.prompt_ids),
            matched_stop=row.matched_stop,
        )
        if capture and self.capture is not None:
            topk = self._indexer_topk(final.prompt_tokens + final.completion_tokens - 1)
            final.indexer_topk = encode_indexer_topk(topk)
            final.indexer_topk_shape = tuple(topk.shape)
        return final

    def _indexer_topk(self, n_rows: int) -> torch.Tensor:
        """[n_rows, CSA layers, index_topk] int32 top-k of every fed position, -1 padded."""
        layers = []
        for layer in self.csa_layers:
            positions, topk = self.capture.rows(layer, self.index_topk)
            if positions.tolist() != list(range(n_rows)):
                raise RuntimeError(
                    f"indexer capture of layer {layer} covers positions {positions[:3].tolist()}..."
                    f"{positions[-3:].tolist()} ({len(positions)} rows), expected 0..{n_rows - 1}"
                )
            layers.append(topk)
        return torch.stack(layers, dim=1).to(torch.int32)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """(cut position, stop string) of the earliest stop string in ``text[start:]``."""
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could begin a stop string (not streamed yet)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
