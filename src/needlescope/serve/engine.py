"""The model runner: one worker thread owns the model and decodes batches with a KV cache.

Scheduling (why it looks like this):

- **Cohorts of equal prompt length.** The engine takes the oldest waiting request and every
  other waiting request with the same prompt length (up to the room left under
  ``max_running_requests``), prefills them as one ``[B, P]`` batch and decodes them in
  lock-step, one token per step for the whole cohort. Rows that finish are dropped from the
  cache with ``reorder_cache`` at once. Equal lengths mean equal positions, so no padding and
  no attention mask are needed. That matters for DeepSeek-V4: its compressors pool fixed
  windows of absolute positions (``entry_count * compress_rate``) and keep per-layer running
  state (buffer, overlap, compressed entries) that is shared by the cache's rows, so left
  padding would shift every window and ragged rows cannot share one cache. The probe sends
  token-exact prompts, so the requests of one length cell batch together. A cohort also stays
  within ``max_prefill_tokens`` (batch x prompt length), because eager attention's prefill
  memory grows with batch x length^2.
- **Continuous batching (on unless ``continuous_batching`` is off).** Between two decode steps
  the worker takes the next waiting batch while others decode: it becomes a cohort of its own
  (its own KV, compressor and indexer state, so nothing is shared with a row at another
  position), and every decode step runs each cohort once. Off: a batch runs to its end before
  the next is taken. Each row's arithmetic is what a static batch of its prefill group runs,
  so answers do not depend on the mode. ``BatchInfo`` records the batch a request ran in.
- **Speculative decoding (``speculative_num_draft_tokens`` > 0, or a request's own).** A row
  decodes in a cohort of one (rows accepting different numbers of drafts leave equal
  positions); each step drafts by prompt lookup, verifies the pending token and the drafts in
  one forward, and rolls the state back to the kept tokens (``serve.speculative``).
- **Prefix cache (off unless ``prefix_cache_mib`` > 0).** A prompt is prefilled in two chunks,
  up to a block boundary and the rest, and the state at the boundary is kept (``serve.prefix_cache``
  has the boundary rule); a later prompt that starts with a kept prefix continues from a copy of
  it and reports those tokens as ``cached_tokens``. A chunked prefill matches a one-pass prefill
  to ~2e-5 in the logits on the organism, not bit for bit, so a reference server leaves it off by
  default. Batches form only among requests that hit the same kept prefix (or none). Requests
  for prompt logprobs or an indexer capture need every prompt position computed, so they never
  use it.
- **Indexer capture** (``/generate`` with ``return_indexer_topk``) runs such a request alone
  (batch key ``None``; it waits for the running requests and none joins it), with the
  ``IndexerCapture`` that is attached for the server's lifetime recording prefill and every
  decode step; it decodes without drafts.

- **Failures stay with their request.** Sampling, rendering and capture run per row inside
  their own ``try``: a row that fails gets its own ``GenerationFailed`` and leaves the batch,
  its neighbours carry on. Only a forward pass that raises (a fault of the model, not of any
  request: every value was validated before admission) fails the rows of its cohort.
- **Prompt logprobs** (``echo``, ``prompt_logprobs``) need the logits of every prompt position,
  so such requests batch only with each other and their prefill keeps all logits.

Only the worker thread touches the model and its own copy of the tokenizer; the HTTP side
encodes prompts with the other copy (``serve.tokens``, on its own thread). Results go back
through ``GenRequest.emit``, which hands events to the request's asyncio queue on the loop
thread. The engine raises and emits engine errors (``serve.errors``); it knows nothing of HTTP.
"""

from __future__ import annotations

import copy
import logging
import random
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from needlescope import __version__
from needlescope.dsa.checkpoint import load_bundle, recorded_value_digits
from needlescope.dsa.emulate import IndexerCapture, emulate
from needlescope.dsa.loading import placement_of
from needlescope.dsa.reference import visible_entries
from needlescope.errors import BadInput
from needlescope.serve.admission import Admission
from needlescope.serve.answers import Answers, Row, encode_indexer_topk
from needlescope.serve.config import ServeConfig
from needlescope.serve.errors import BadValue, GenerationFailed, ShuttingDown
from needlescope.serve.metrics import ServeMetrics
from needlescope.serve.prefix_cache import PrefixCache, cache_block
from needlescope.serve.requests import (
    BatchInfo,
    Final,
    GenRequest,
    SpecInfo,
    TopkRows,
)
from needlescope.serve.sampling import SamplingParams, make_sampling
from needlescope.serve.speculative import StateLog, propose, rollback
from needlescope.serve.tokens import Tokens
from needlescope.setting import REFERENCE, Setting

__all__ = ["Engine", "encode_indexer_topk"]

log = logging.getLogger("needlescope.serve")


@dataclass
class _Cohort:
    """Requests decoding in lock-step through one batched cache: the rows prefilled together
    (equal prompt lengths, so equal positions), or one row when speculative decoding makes the
    positions diverge."""

    rows: list[Row]
    cache: DynamicCache
    step: int  # the position the next fed token takes
    logits: torch.Tensor | None  # [rows, V] next-token logits; None: the last sampled token is unfed
    capture: TopkRows | None
    speculative: bool = False


def _row_state(cache: DynamicCache, row: int, rows: int) -> DynamicCache:
    """A private copy of row ``row`` of a batched cache of ``rows`` rows."""
    state = copy.deepcopy(cache)
    if rows > 1:
        state.reorder_cache(torch.tensor([row], dtype=torch.long))
    return state


class Engine(Answers):
    """Loads the model, applies the numerics for its lifetime, and runs the worker thread."""

    def __init__(self, cfg: ServeConfig, metrics: ServeMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or ServeMetrics()
        torch.set_num_threads(cfg.threads)
        self.model, self.tokenizer, self.path = load_bundle(
            cfg.model, device=cfg.device, max_memory=cfg.max_memory
        )
        self.device = self.model.get_input_embeddings().weight.device  # where token ids go
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
            from needlescope.kernels.scoring import kernel_backend

            # The scorers that emulate installs keep the backend in force when entering them.
            with kernel_backend(cfg.kernel, self.device, cfg.kernel_fault):
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
        # The tokenizer's queue: room for every request the engine could hold, twice over, so it
        # only bites on a flood (each job is bounded by the context checks before it).
        pending = 2 * (cfg.max_queued_requests + cfg.max_running_requests)
        self.tokens = Tokens(self.tokenizer, self.context_length, max_pending=pending, metrics=self.metrics)
        self.trained_value_digits = recorded_value_digits(self.path)
        self.prefix: PrefixCache | None = None
        if cfg.prefix_cache_mib > 0:
            self.prefix = PrefixCache(cfg.prefix_cache_mib * 2**20, cache_block(mcfg))
        self.admission: Admission[GenRequest] = Admission(
            cfg.max_running_requests, cfg.max_queued_requests, self.metrics
        )
        self._stopping = False
        self._running: tuple[GenRequest, ...] = ()  # the batch in flight (set by the worker thread)
        self._thread = threading.Thread(target=self._loop, name="needlescope-engine", daemon=True)
        self.started_at = time.time()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Stop admitting and answer every waiting request 503 ``shutting_down`` now, while the
        HTTP layer can still send it (SIGTERM); the running batch goes on to its end."""
        for req in self.admission.close():
            req.emit(ShuttingDown("the server is shutting down"))

    def abort_running(self) -> int:
        """Answer every request still running 503 ``shutting_down`` now and cancel it (its batch
        drops it at the next step): at SIGTERM once the grace period is over, so a client gets
        an error while the HTTP layer can still send one. How many were aborted."""
        running = [req for req in self._running if not req.cancelled]
        for req in running:
            req.cancelled = True
            req.emit(ShuttingDown("the server shut down before this request finished"))
        return len(running)

    def close(self) -> None:
        self._stopping = True
        self.drain()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.tokens.close()
        self._stack.close()

    # ---- what the HTTP layer asks ------------------------------------------------------------

    def info(self) -> dict:
        """The facts ``/get_server_info`` reports besides the config."""
        n = self.numerics
        return {
            "model": self.cfg.model_name,
            "model_path": str(self.path) if self.cfg.expose_paths else None,
            "architecture": self.architecture,
            "index_k": n.index_k if n else "none",
            "index_q": n.index_q if n else "none",
            "score_dtype": n.score_dtype if n else "none",
            "index_topk": self.index_topk,
            "checkpoint_index_topk": int(getattr(self.model.config, "index_topk", 0) or 0),
            "csa_layers": self.csa_layers,
            "num_indexer_layers": len(self.csa_layers),
            "patch": self.cfg.patch_shown,
            "trained_value_digits": self.trained_value_digits,
            "max_queued_requests": self.cfg.max_queued_requests,
            "max_running_requests": self.cfg.max_running_requests,
            "max_new_tokens": self.cfg.max_new_tokens,
            "max_prefill_tokens": self.cfg.max_prefill_tokens,
            "max_body_bytes": self.cfg.max_body_bytes,
            "context_length": self.context_length,
            "enable_return_indexer_topk": self.is_v4 and self.cfg.indexer_capture,
            "prefix_cache": self.prefix.info() if self.prefix is not None else False,
            "batching": (
                "continuous: a batch of equal prompt lengths joins the running requests at a decode step"
                if self.cfg.continuous_batching
                else "static batches of equal prompt length"
            ),
            "speculative_num_draft_tokens": self.cfg.speculative_num_draft_tokens,
            "speculative_method": "prompt lookup (n-gram)" if self.cfg.speculative_num_draft_tokens else None,
            "auth": self.cfg.api_key is not None,
            "needlescope_version": __version__,
            "torch_version": torch.__version__,
            "transformers_version": _transformers_version(),
            "device": self.cfg.device,
            "placement": None if placement_of(self.model) is None else placement_of(self.model).report(),
            "prefill_chunk": self.cfg.prefill_chunk,
            "threads": self.cfg.threads,
        }

    def sampling(self, prompt_len: int, **kw) -> SamplingParams:
        """``make_sampling`` against this model's context and vocabulary and the server's cap."""
        return make_sampling(
            prompt_len,
            context_length=self.context_length,
            vocab_size=self.tokens.vocab_size,
            cap=self.cfg.max_new_tokens,
            **kw,
        )

    def check_capture(self, rows: TopkRows, prompt_len: int, params: SamplingParams) -> None:
        """BadValue unless an indexer top-k capture is possible here and its payload is bounded."""
        if not self.is_v4:
            raise BadValue(
                "return_indexer_topk", f"needs a DeepSeek-V4 model; this server runs a {self.architecture}"
            )
        if not self.cfg.indexer_capture:
            raise BadValue(
                "return_indexer_topk", "the indexer capture is off on this server (--no-indexer-capture)"
            )
        max_rows = prompt_len + params.max_new_tokens - 1
        # A row's logits span the entries complete at its position: at most those of the last row.
        rows.check(max_rows, len(self.csa_layers), self.index_topk, max_entries=visible_entries(max_rows - 1))

    def submit(self, req: GenRequest) -> None:
        """Admit ``req`` (raises ``Overloaded`` when the queue is full)."""
        self.admission.submit(req)

    def cancel(self, req: GenRequest) -> None:
        req.cancelled = True
        if self.admission.withdraw(req):
            log.info("request %s withdrawn before it ran", req.rid)

    # ---- worker thread -----------------------------------------------------------------------

    def _cacheable(self, req: GenRequest) -> bool:
        return self.prefix is not None and req.capture is None and req.params.prompt_logprobs is None

    def _batch_key(self, req: GenRequest):
        if req.capture is not None:
            return None
        hit = self.prefix.match(req.prompt_ids) if self._cacheable(req) else None
        return len(req.prompt_ids), req.params.prompt_logprobs is not None, hit

    def _loop(self) -> None:
        cohorts: list[_Cohort] = []
        while cohorts or not self._stopping:  # the running requests go on to their end
            if not self._stopping:
                self._admit(cohorts)
            if not cohorts:
                continue
            self._running = tuple(r.req for c in cohorts for r in c.rows)
            running = len(self._running)
            self.metrics.decode_batch.observe(running)
            for cohort in list(cohorts):
                for row in cohort.rows:
                    row.batch.max_running = max(row.batch.max_running, running)
                try:
                    alive = self._spec_step(cohort) if cohort.speculative else self._step(cohort)
                except Exception as exc:  # a failing forward pass must not take the server down
                    log.exception("batch of %d failed", len(cohort.rows))
                    for row in cohort.rows:
                        self._finish(row, GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}"))
                    alive = False
                if not alive:
                    cohorts.remove(cohort)
            if not cohorts:
                self._running = ()
                if self.capture is not None:
                    self.capture.clear()

    def _admit(self, cohorts: list[_Cohort]) -> None:
        """Start the next batch of waiting requests: when nothing runs (waiting up to 0.5 s for
        one), or, with continuous batching, beside the running ones (not beside a capture, and
        a capture only once nothing runs: it records every forward)."""
        if cohorts and (not self.cfg.continuous_batching or any(c.capture is not None for c in cohorts)):
            return
        batch = self.admission.take_batch(
            self._batch_key,
            limit=lambda r: self.cfg.max_prefill_tokens // len(r.prompt_ids),
            timeout=0 if cohorts else 0.5,
            ready=None if not cohorts else (lambda r: r.capture is None),
        )
        if not batch:
            return
        joined = sum(len(c.rows) for c in cohorts)
        for c in cohorts:
            for row in c.rows:
                row.batch.joined_beside += len(batch)
        rows = [self._new_row(req) for req in batch]
        try:
            started = self._start(rows, joined_mid_flight=joined > 0)
        except Exception as exc:  # a failing prefill fails its own batch only
            log.exception("prefill of a batch of %d failed", len(rows))
            for row in rows:
                self._finish(row, GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}"))
            return
        if joined:
            self.metrics.joined_mid_flight.inc(len(rows))
        cohorts.extend(started)

    def _new_row(self, req: GenRequest) -> Row:
        gen = None
        if not req.params.greedy:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(req.params.seed if req.params.seed is not None else random.getrandbits(63))
        mode = "continuous" if self.cfg.continuous_batching else "static"
        return Row(req=req, gen=gen, batch=BatchInfo(mode), spec=SpecInfo(self._draft_tokens(req)))

    def _draft_tokens(self, req: GenRequest) -> int:
        """The draft depth a request runs with: its own ``speculative_num_draft_tokens``, else the
        server's; a capture (one record per fed position) and a request for prompt logprobs
        decode without drafts."""
        if req.capture is not None or req.params.prompt_logprobs is not None:
            return 0
        own = req.params.draft_tokens
        return self.cfg.speculative_num_draft_tokens if own is None else own

    def _model_call(self, ids: torch.Tensor, start: int, cache: DynamicCache, keep: int = 1) -> torch.Tensor:
        """One forward of ``ids`` [B, S] at positions ``start..``: float32 CPU logits [B, keep or S, V]."""
        B, S = ids.shape
        pos = torch.arange(start, start + S, device=ids.device).unsqueeze(0).expand(B, -1)
        out = self.model(
            input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=keep
        )
        return out.logits.float().cpu()

    def _forward(self, ids: torch.Tensor, start: int, cache: DynamicCache, keep: int = 1) -> torch.Tensor:
        """Logits [B, keep or S, V] (float32, on the CPU) of the last ``keep`` positions (0: all).

        With ``prefill_chunk`` set, a longer ``ids`` runs in chunks through ``cache`` (each chunk
        keeps what the caller asked for of its own positions)."""
        S = ids.shape[1]
        chunk = self.cfg.prefill_chunk
        if chunk is not None and S > chunk:
            parts = []
            for lo in range(0, S, chunk):
                hi = min(lo + chunk, S)
                want = hi - lo if keep == 0 else max(0, min(hi - lo, keep - (S - hi)))
                if want or hi == S:
                    parts.append(self._forward(ids[:, lo:hi], start + lo, cache, keep=want))
                else:
                    self._forward(ids[:, lo:hi], start + lo, cache, keep=1)
            return torch.cat(parts, dim=1)
        return self._model_call(ids, start, cache, keep)

    def _finish(self, row: Row, event: Final | GenerationFailed | None) -> None:
        """Answer ``row`` (unless its client left) and count it out of the running requests (once)."""
        if row.finished:
            return
        row.finished = True
        if event is not None and not row.req.cancelled:
            row.req.emit(event)
        self.admission.finish(1)
        self.metrics.e2e.observe(time.monotonic() - row.req.admitted_at)

    def _isolated(self, row: Row, what: str, fn, *args) -> bool:
        """Run ``fn(*args)`` for one row; on an exception fail that row alone. True if it ran."""
        try:
            fn(*args)
            return True
        except Exception as exc:
            log.exception("request %s failed while %s", row.req.rid, what)
            self._finish(row, GenerationFailed(f"{what} failed: {type(exc).__name__}: {exc}"))
            return False

    @torch.inference_mode()
    def _start(self, rows: list[Row], joined_mid_flight: bool) -> list[_Cohort]:
        """Prefill a batch of new requests (equal prompt lengths, ``_batch_key``): the cohorts
        that decode them (one, or one per row when drafts make their positions diverge)."""
        for row in rows:
            if row.req.cancelled:
                self._finish(row, None)
        rows = [r for r in rows if not r.finished]
        if not rows:
            return []
        capture = rows[0].req.capture
        P = len(rows[0].req.prompt_ids)
        want_prompt = rows[0].req.params.prompt_logprobs is not None
        if self.capture is not None:
            self.capture.clear()
            # Score rows are kept only for a capture that asked for its logits (it runs alone).
            self.capture.keep_scores = capture is not None and capture.logits
            self.capture.score_from = capture.first_row(P) if self.capture.keep_scores else 0
        for row in rows:
            row.batch.prefill_batch = len(rows)
            row.batch.joined_mid_flight = joined_mid_flight
        ids = torch.tensor([r.req.prompt_ids for r in rows], dtype=torch.long, device=self.device)
        self.metrics.batch_size.observe(len(rows))
        self.metrics.prompt_tokens.inc(len(rows) * P)
        cache, start = self._prefill_cached(rows, ids)
        logits = self._forward(ids[:, start:], start, cache, keep=0 if want_prompt else 1)
        if want_prompt:
            kept = [
                i
                for i, r in enumerate(rows)
                if self._isolated(r, "scoring the prompt", self._score_prompt, r, logits[i])
            ]
            if not kept:
                return []
            if len(kept) < len(rows):
                cache.reorder_cache(torch.tensor(kept, dtype=torch.long, device=self.device))
                rows, logits = [rows[i] for i in kept], logits[kept]
        cohort = _Cohort(rows=rows, cache=cache, step=P, logits=logits[:, -1], capture=capture)
        if not rows[0].spec.draft_tokens:
            return [cohort]
        return [
            _Cohort(
                rows=[row],
                cache=_row_state(cache, i, len(rows)),
                step=P,
                logits=cohort.logits[i : i + 1],
                capture=None,
                speculative=True,
            )
            for i, row in enumerate(rows)
        ]

    def _sample(self, row: Row, logits: torch.Tensor, capture: TopkRows | None) -> bool:
        """Sample ``row``'s next token from ``logits`` [V]; answer it if that ended it. True if
        it goes on."""
        if row.req.params.max_new_tokens > 0 and not self._isolated(
            row, "sampling", self._advance, row, logits
        ):
            return False
        return self._settle(row, capture)

    def _settle(self, row: Row, capture: TopkRows | None) -> bool:
        """Answer ``row`` if its last token ended it (or its client left). True if it goes on."""
        if row.req.params.max_new_tokens == 0:
            row.finish_reason = "length"
        if row.finish_reason is None and not row.req.cancelled:
            return True
        if row.req.cancelled:
            self._finish(row, None)
        else:
            self._isolated(row, "rendering the answer", self._answer, row, capture)
        return False

    @torch.inference_mode()
    def _step(self, cohort: _Cohort) -> bool:
        """One decode step of a cohort: sample each row, drop the finished ones, feed the rest.
        False once none is left."""
        if self.capture is not None and cohort.capture is None:
            self.capture.clear()
        keep = [i for i, row in enumerate(cohort.rows) if self._sample(row, cohort.logits[i], cohort.capture)]
        if not keep:
            return False
        if len(keep) < len(cohort.rows):
            cohort.cache.reorder_cache(torch.tensor(keep, dtype=torch.long, device=self.device))
            cohort.rows = [cohort.rows[i] for i in keep]
        nxt = torch.tensor([[r.output_ids[-1]] for r in cohort.rows], dtype=torch.long, device=self.device)
        cohort.logits = self._forward(nxt, cohort.step, cohort.cache)[:, -1]
        cohort.step += 1
        return True

    @torch.inference_mode()
    def _spec_step(self, cohort: _Cohort) -> bool:
        """One speculative step of a one-row cohort: sample the pending token if its logits are
        new, draft by prompt lookup, verify ``[pending, drafts]`` in one forward, accept what
        sampling reproduces and roll the state back to the kept tokens (``serve.speculative``).
        False once the row is done."""
        if self.capture is not None:
            self.capture.clear()
        row = cohort.rows[0]
        if cohort.logits is not None and not self._sample(row, cohort.logits[0], None):
            return False
        left = row.req.params.max_new_tokens - len(row.output_ids)
        drafts = propose(row.req.prompt_ids + row.output_ids, min(row.spec.draft_tokens, left - 1))
        ids = torch.tensor([[row.output_ids[-1], *drafts]], dtype=torch.long, device=self.device)
        if not drafts:
            cohort.logits = self._model_call(ids, cohort.step, cohort.cache)[:, -1]
            cohort.step += 1
            return True
        with StateLog(cohort.cache) as state:
            logits = self._model_call(ids, cohort.step, cohort.cache, keep=0)[0]  # [1 + drafts, V]
        row.spec.record(len(drafts))
        self.metrics.draft_tokens.inc(len(drafts))
        accepted = 0
        while True:
            if not self._isolated(row, "sampling", self._advance, row, logits[accepted]):
                return False
            matched = accepted < len(drafts) and row.output_ids[-1] == drafts[accepted]
            if matched:
                accepted += 1
                row.spec.accepted += 1  # counted before the answer is rendered
                self.metrics.accepted_tokens.inc()
            if not self._settle(row, None):
                return False
            if not matched:
                break
        self._commit(cohort, state, 1 + accepted)
        return True

    def _commit(self, cohort: _Cohort, state: StateLog, kept: int) -> None:
        """Keep the first ``kept`` tokens a verify pass fed: roll the state back to them."""
        rollback(state, kept)
        cohort.step += kept
        cohort.logits = None  # the last sampled token is pending: the next step feeds it

    def _prefill_cached(self, rows: list[Row], ids: torch.Tensor) -> tuple[DynamicCache, int]:
        """A cache holding the prompts' first tokens and where the rest starts: a kept prefix's
        state (every row of a batch hits the same one, ``_batch_key``), then, up to this prompt's
        boundary, a prefill whose state is kept for later prompts. Without a prefix cache: empty, 0."""
        req = rows[0].req
        if not self._cacheable(req):
            return DynamicCache(config=self.model.config), 0
        hit = self.prefix.match(req.prompt_ids)
        if hit is None:
            self.prefix.misses += len(rows)
            cache, start = DynamicCache(config=self.model.config), 0
        else:
            cache, start = self.prefix.take(hit, len(rows)), len(hit)
        for r in rows:
            r.cached_tokens = start
        self.metrics.cached_tokens.inc(start * len(rows))
        cut = self.prefix.cut(len(req.prompt_ids))
        if cut > start:
            self._forward(ids[:, start:cut], start, cache)
            for i, r in enumerate(rows):
                self.prefix.put(tuple(r.req.prompt_ids[:cut]), cache, i, len(rows))
            start = cut
        return cache, start


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
