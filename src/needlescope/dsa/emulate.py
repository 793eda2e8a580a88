"""Run a loaded transformers DeepSeek-V4 model with emulated indexer numerics, and capture it.

``emulate(model, Setting(index_k="fp8_e4m3", index_topk=512))`` swaps, for the duration of
a ``with`` block, the scoring function of every ``DeepseekV4IndexerScorer`` instance (never
transformers' source files), overrides each indexer's ``index_topk`` and applies the setting's
patch. On exit every attribute is restored to what it was on entry, including an instance
``forward`` someone else had installed before.

The emulated score of query t and compressed entry s is

    I(t, s) = sum_h c_w * w[t,h] * c_s * ReLU(Q(Hq[t,h]) . K(Hk[s]))

with ``Q``/``K`` the fake quantisers of ``needlescope.dsa.quant`` applied per vector (one
scale per (token, head) for queries, one per entry for keys), ``H`` the optional 128-point
Hadamard rotation, and the products and head sum taken in ``score_dtype``. SGLang folds
the query scale into the head weights instead of dequantising q; because the scale is
positive the two are the same number (``quant.quantize_query_fp8_per_head``).

Quantising keys at scoring time equals quantising them once at store time, because each
entry's quantiser depends only on that entry: decode steps with a KV cache see the same
keys as a single prefill.

``IndexerCapture`` records, per CSA layer and forward call, the query positions, the
selected entries and (optionally) the full score rows, so that prefill and every decode
step of a generation can be replayed as SGLang's ``indexer_topk`` capture.

A user patch (``Setting.patch``: ``--patch FILE.py``, or a built-in ``fault:NAME`` of
``needlescope.dsa.faults``) is a Python file defining ``apply(model)``; it may return a
zero-argument callable that undoes it, which ``emulate`` calls on exit; one that returns none
is undone by restoring the state it could change (``apply_patch_once``, ``dsa.pristine``). ``wrap_scorers`` is the
helper most patches need. A patch file runs arbitrary Python with the caller's rights; its
module body executes exactly once per process (``load_patch`` caches it by file), however many
times a setting carrying it is applied.

``scores_backend(factory)`` swaps the scoring math for the calls entered inside it: ``factory``
maps (index_k, index_q) to a function with ``lightning_scores``' signature (the Triton kernels:
``needlescope.kernels.scoring.scores_factory``). ``dsa`` never imports the kernels itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from needlescope.dsa.pristine import PristineCopy, copyable, weight_bytes
from needlescope.dsa.quant import get_quantizer, hadamard_128
from needlescope.dsa.reference import NO_ENTRY, lightning_scores, visible_entries
from needlescope.errors import BadInput
from needlescope.setting import REFERENCE, PatchRef, Setting

__all__ = [
    "ACC_DTYPES",
    "apply_patch_once",
    "check_unpatched",
    "patched_for_good",
    "REFERENCE",
    "IndexerCall",
    "IndexerCapture",
    "csa_indexers",
    "emulate",
    "load_patch",
    "scores_backend",
    "scoring_function",
    "wrap_scorers",
]

ACC_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""torch dtype of each ``needlescope.setting.SCORE_DTYPES`` name."""

ScoresFactory = Callable[[str, str], Callable[..., torch.Tensor]]
_BACKEND: ContextVar[ScoresFactory | None] = ContextVar("needlescope_scores_backend", default=None)


@contextmanager
def scores_backend(factory: ScoresFactory | None) -> Iterator[None]:
    """Inside the block, score with ``factory(index_k, index_q)`` instead of ``lightning_scores``
    (None keeps the reference). Read when ``emulate`` is entered and by ``dsa.synthetic``."""
    token = _BACKEND.set(factory)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def scoring_function(index_k: str, index_q: str) -> Callable[..., torch.Tensor]:
    """The scorer in force for these precisions: the backend's, else ``lightning_scores``."""
    factory = _BACKEND.get()
    return lightning_scores if factory is None else factory(index_k, index_q)


@dataclass
class IndexerCall:
    """One indexer forward: batch B, S query rows, L visible-so-far compressed entries."""

    layer: int
    positions: torch.Tensor  # [B, S] absolute query positions
    topk: torch.Tensor  # [B, S, k'] selected entries, -1 padded, k' = min(index_topk, L)
    scores: torch.Tensor | None = None  # [B, S', L] fp32, what topk ranked (keep_scores only)
    k: int | None = None  # the k the indexer's topk call used (None: no topk call seen)
    score_positions: torch.Tensor | None = None  # [B, S'] positions of the score rows when S' < S


@dataclass
class IndexerCapture:
    """Collects ``IndexerCall`` records while attached to ``emulate``."""

    keep_scores: bool = False
    score_from: int = 0
    """Keep score rows only for query positions >= this (a 128K-token prompt's full score rows
    are T x T/4 floats per layer; a rank dump needs the answer positions only)."""
    topk_from: int = 0
    """Keep top-k rows (and their ``positions``) only for query positions >= this: a prompt's
    rows are T x index_topk indices per layer, a measurement reads the answer positions'."""
    calls: list[IndexerCall] = field(default_factory=list)
    nonfinite: dict[tuple[int, int], list] = field(default_factory=dict)
    """(layer, batch row) -> [neg_inf, nan, pos_inf, first position with a NaN or +inf (None)]:
    non-finite scores over the visible entries of every query row, counted as each call's scores
    pass (``keep_scores`` only), so that no score row needs keeping to count them."""
    # Scores of the scorer call in flight, per layer, until its indexer returns the top-k.
    _pending: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    # The topk-watching mode of the indexer call in flight, per layer.
    _modes: dict[int, _TopkInput] = field(default_factory=dict, repr=False)

    def layers(self) -> list[int]:
        """The CSA layer indices seen, ascending."""
        return sorted({c.layer for c in self.calls})

    def clear(self) -> None:
        self.calls.clear()
        self._pending.clear()
        self.nonfinite.clear()

    def forget_after(self, n: int) -> None:
        """Drop the calls recorded after the first ``n`` and any pending scores: what replays of
        the captured model's own modules added (``dsa.diff`` judging a chunk)."""
        del self.calls[n:]
        self._pending.clear()

    def k_used(self) -> int | None:
        """The largest k any recorded indexer call passed to its topk (None if none was seen)."""
        ks = [c.k for c in self.calls if c.k is not None]
        return max(ks) if ks else None

    def rows(self, layer: int, width: int, batch_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [N], topk [N, width]) over all calls of ``layer`` in call order, -1 padded.

        Prefill contributes one row per prompt position, each decode step one row.
        """
        pos, rows = [], []
        for c in self.calls:
            if c.layer != layer:
                continue
            t = c.topk[batch_index]  # [S, k']
            pad = torch.full((t.shape[0], width), NO_ENTRY, dtype=torch.long)
            n = min(width, t.shape[1])
            pad[:, :n] = t[:, :n].cpu()
            rows.append(pad)
            pos.append(c.positions[batch_index].cpu())
        if not rows:
            raise ValueError(f"no indexer calls recorded for layer {layer}")
        return torch.cat(pos), torch.cat(rows)

    def score_rows(self, layer: int, batch_index: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(positions [N], per-row fp32 score vectors of growing length L_t) for ``layer``."""
        pos, rows = [], []
        for c in self.calls:
            if c.layer != layer:
                continue
            if c.scores is None:
                raise ValueError("scores were not kept; construct IndexerCapture(keep_scores=True)")
            kept = c.positions if c.score_positions is None else c.score_positions
            pos.append(kept[batch_index].cpu())
            rows.extend(c.scores[batch_index].cpu().unbind(0))
        if not rows:
            raise ValueError(f"no indexer calls recorded for layer {layer}")
        return torch.cat(pos), rows


def csa_indexers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, ``DeepseekV4Indexer``) for every CSA layer of a transformers DeepSeek-V4 model."""
    found = []
    for name, mod in model.named_modules():
        if type(mod).__name__ == "DeepseekV4Indexer":
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else len(found)
            found.append((layer, mod))
    if not found:
        raise BadInput(
            "the model has no DeepseekV4Indexer modules; indexer emulation needs a DeepSeek-V4 model with CSA layers"
        )
    return found


def wrap_scorers(model: torch.nn.Module, wrap: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Replace every CSA indexer scorer's ``forward`` by ``wrap(current_forward)``; returns the undo.

    The building block of fault patches: ``current_forward`` is whatever scores now (the
    emulated numerics inside ``emulate``, else the class's own), with the scorer signature
    ``(q [B,S,H,D], compressed_kv [B,L,D], hidden_states [B,S,hidden]) -> scores [B,S,L]``.
    """
    saved = []
    for _, indexer in csa_indexers(model):
        scorer = indexer.scorer
        saved.append((scorer, scorer.__dict__.get("forward")))
        scorer.forward = wrap(scorer.forward)

    def undo() -> None:
        for scorer, own in saved:
            if own is None:
                scorer.__dict__.pop("forward", None)
            else:
                scorer.forward = own

    return undo


_LOADED_PATCHES: dict[tuple[str, str], Callable[[torch.nn.Module], object]] = {}


_PATCHED_FOR_GOOD = "_needlescope_patched_for_good"

PRISTINE_COPY_MAX_BYTES = 8 << 30
"""Largest model (parameters and buffers) a patch without an undo runs on by way of a pristine
copy in host memory; a larger one is marked and reloaded by its caller (a copy of a model that
size costs what a load does)."""

_GIVES_UNDO: set[tuple[str, str]] = set()
_NO_UNDO_LOGGED: set[tuple[str, str]] = set()
log = logging.getLogger("needlescope.dsa")


def _failure(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def apply_patch_once(model: torch.nn.Module, patch, *, check: bool = True) -> Callable[[], None] | None:
    """Apply ``patch`` (a PatchRef or path) to ``model``; returns its undo.

    A patch that returns no undo (a monkeypatch replacing a forward and returning nothing)
    would change the model for good, so the model's state is kept first
    (``pristine.PristineCopy``) and its restore is the undo: the configuration runs on a model
    it may change, and the next finds it as loaded. The cost (one copy of the weights per
    application) is logged once per patch. Patches learned to return an undo skip the copy.
    A model larger than ``PRISTINE_COPY_MAX_BYTES``, or streamed (``pristine.copyable``), is not
    copied: it is marked instead
    (``patched_for_good``) and its caller loads a fresh one; ``check`` refuses such a model
    (``check=False``: the caller checked before applying a group of patches).
    """
    if check:
        check_unpatched(model)
    fn = load_patch(patch)
    key = _patch_key(patch)
    kept = None
    if key not in _GIVES_UNDO and copyable(model) and weight_bytes(model) <= PRISTINE_COPY_MAX_BYTES:
        start = time.perf_counter()
        kept = PristineCopy.take(model)
        copy_s = time.perf_counter() - start
    try:
        undo = fn(model)
    except KeyboardInterrupt:
        if kept is not None:
            kept.restore()
        raise
    except BaseException as exc:  # SystemExit or a bare BaseException in a patch must not end serve
        if kept is not None:
            kept.restore()
        raise BadInput(f"patch {str(patch)!r}: apply(model) failed: {_failure(exc)}") from None
    if callable(undo):
        _GIVES_UNDO.add(key)
        return undo
    if kept is not None:
        if key not in _NO_UNDO_LOGGED:
            _NO_UNDO_LOGGED.add(key)
            log.warning(
                "patch %s returned no undo: each application keeps a pristine copy of the model "
                "(%.1f MB, %.2f s) and restores it afterwards",
                patch,
                weight_bytes(model) / 1e6,
                copy_s,
            )
        return kept.restore
    setattr(model, _PATCHED_FOR_GOOD, str(patch))
    return None


def _patch_key(patch) -> tuple[str, str]:
    """(path, content hash) of a patch: a rewritten file is another patch."""
    ref = patch if isinstance(patch, PatchRef) else PatchRef.resolve(patch)
    return str(ref.path), hashlib.sha256(ref.path.read_bytes()).hexdigest()


@contextmanager
def patches_applied(model: torch.nn.Module, patches) -> Iterator[None]:
    """Apply each of ``patches`` (model-level patch files, after any ``emulate``) for the block,
    undone in reverse order on exit (a patch without an undo by its pristine copy: ``apply_patch_once``)."""
    undos = []
    try:
        for p in patches:
            undos.append(apply_patch_once(model, p, check=False))
        yield
    finally:
        for undo in reversed(undos):
            if callable(undo):
                undo()


def patched_for_good(model: torch.nn.Module) -> str | None:
    """The patch without an undo that was applied to ``model``, or None."""
    return getattr(model, _PATCHED_FOR_GOOD, None)


def check_unpatched(model: torch.nn.Module) -> None:
    """BadInput if a patch without an undo was applied to ``model`` (it can no longer be reused)."""
    spec = patched_for_good(model)
    if spec is not None:
        raise BadInput(
            f"this model instance already carries patch {spec!r}, which returned no undo; "
            "load a fresh model for each run (or make apply(model) return its undo)"
        )


def load_patch(patch: PatchRef | str) -> Callable[[torch.nn.Module], object]:
    """The ``apply(model)`` function of a patch file (or a built-in ``fault:NAME``).

    The file's module body executes at most once per process: later calls for the same file
    with the same contents return the same function (a file rewritten in between is a new
    patch). BadInput if the file fails to import or has no callable ``apply``.
    """
    ref = patch if isinstance(patch, PatchRef) else PatchRef.resolve(patch)
    key = str(ref.path)
    cache_key = _patch_key(ref)
    if cache_key in _LOADED_PATCHES:
        return _LOADED_PATCHES[cache_key]
    spec = importlib.util.spec_from_file_location(f"needlescope_patch_{ref.path.stem}", ref.path)
    if spec is None or spec.loader is None:
        raise BadInput(f"patch file {key!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit or a bare BaseException at import must not end serve
        raise BadInput(f"patch file {key!r} failed to import: {_failure(exc)}") from None
    fn = getattr(module, "apply", None)
    if not callable(fn):
        raise BadInput(f"patch file {key!r} does not define a function apply(model)")
    _LOADED_PATCHES[cache_key] = fn
    return fn


def _scorer_forward(scorer: torch.nn.Module, setting: Setting, stash: Callable | None) -> Callable:
    scores_fn = scoring_function(setting.index_k, setting.index_q)
    quant_k = get_quantizer(setting.index_k)
    quant_q = get_quantizer(setting.index_q)
    acc = ACC_DTYPES[setting.score_dtype]

    def forward(q: torch.Tensor, compressed_kv: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # q [B, S, H, D], compressed_kv [B, L, D], hidden_states [B, S, hidden] -> [B, S, L] fp32
        q32, k32 = q.float(), compressed_kv.float()
        if setting.rotates:
            q32, k32 = hadamard_128(q32), hadamard_128(k32)
        w = scorer.weights_proj(hidden_states).float()  # [B, S, H]
        scores = scores_fn(
            quant_q(q32),
            quant_k(k32),
            w,
            scale=scorer.softmax_scale,
            weight_scale=scorer.weights_scaling,
            acc_dtype=acc,
        )
        scores = scores.float()
        if stash is not None:
            stash(scores.detach())
        return scores

    return forward


@contextmanager
def emulate(
    model: torch.nn.Module,
    setting: Setting = REFERENCE,
    *,
    capture: IndexerCapture | None = None,
) -> Iterator[list[int]]:
    """Apply ``setting`` (numerics and its patch, if any) to every CSA indexer of ``model``.

    Yields the CSA layer indices. Everything is undone on exit, also on error.
    """
    indexers = csa_indexers(model)
    check_unpatched(model)
    if setting.patch is not None:
        load_patch(setting.patch)  # fail on a bad patch file before touching the model
    emulated = setting.numerics_only != REFERENCE
    saved: list[tuple[torch.nn.Module, int, Callable | None]] = []
    handles = []
    undo_patch = None
    try:
        for layer, idx in indexers:
            saved.append((idx, idx.index_topk, idx.scorer.__dict__.get("forward")))
            if setting.index_topk is not None:
                idx.index_topk = setting.index_topk
            stash = None
            if capture is not None and capture.keep_scores:
                stash = _stasher(layer, capture)
            if emulated or stash is not None or _BACKEND.get() is not None:
                idx.scorer.forward = _scorer_forward(idx.scorer, setting, stash)
            if capture is not None:
                handles.append(idx.register_forward_pre_hook(_watch_topk(layer, capture)))
                handles.append(
                    idx.register_forward_hook(
                        _capture_hook(layer, capture), with_kwargs=True, always_call=True
                    )
                )
        if setting.patch is not None:
            undo_patch = apply_patch_once(model, setting.patch)
        yield [layer for layer, _ in indexers]
    finally:
        if callable(undo_patch):
            undo_patch()
        for h in handles:
            h.remove()
        for idx, topk, own_forward in saved:
            idx.index_topk = topk
            if own_forward is None:
                idx.scorer.__dict__.pop("forward", None)
            else:
                idx.scorer.forward = own_forward


class _TopkInput(TorchFunctionMode):
    """Records the input and k of the last ``topk`` call made while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: torch.Tensor | None = None
        self.k: int | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            self.scores = args[0]
            self.k = int(args[1] if len(args) > 1 else kwargs["k"])
        return func(*args, **kwargs)


def _watch_topk(layer: int, capture: IndexerCapture) -> Callable:
    def hook(module, args):
        mode = _TopkInput()
        mode.__enter__()
        capture._modes[layer] = mode

    return hook


def _capture_hook(layer: int, capture: IndexerCapture) -> Callable:
    def hook(module, args, kwargs, output):
        mode = capture._modes.pop(layer, None)
        if mode is not None:
            mode.__exit__(None, None, None)
        if output is None:  # the forward raised; always_call only closes the mode
            return
        position_ids = args[2] if len(args) > 2 else kwargs["position_ids"]
        kept = position_ids[0] >= capture.topk_from  # positions are batch-shared
        capture.calls.append(
            IndexerCall(
                layer=layer,
                positions=position_ids[:, kept].detach().cpu(),
                topk=output[:, kept.to(output.device)].detach().cpu(),
                k=None if mode is None else mode.k,
            )
        )
        pending = capture._pending.pop(layer, None)
        scores = None
        if mode is not None and mode.scores is not None and capture.keep_scores:
            scores = mode.scores.detach().float()
        elif pending is not None:
            pos = position_ids.to(pending.device)
            L = pending.shape[-1]
            vis = visible_entries(pos, module.compress_rate)  # [B, S]
            future = torch.arange(L, device=pending.device).view(1, 1, L) >= vis.unsqueeze(-1)
            scores = pending.masked_fill(future, float("-inf"))
        if scores is not None:
            _count_nonfinite(capture, layer, position_ids, scores, module.compress_rate)
            _keep_scores(capture, position_ids, scores)

    return hook


def _count_nonfinite(
    capture: IndexerCapture, layer: int, position_ids, scores: torch.Tensor, ratio: int
) -> None:
    """Add the call's non-finite scores over visible entries to ``capture.nonfinite`` (per batch row)."""
    pos = position_ids.to(scores.device)
    seen = torch.arange(scores.shape[-1], device=scores.device).view(1, 1, -1) < visible_entries(
        pos, ratio
    ).unsqueeze(-1)
    neg = (seen & (scores == float("-inf"))).sum(dim=(1, 2)).tolist()
    nan_mask = seen & torch.isnan(scores)
    pos_mask = seen & (scores == float("inf"))
    nan, inf = nan_mask.sum(dim=(1, 2)).tolist(), pos_mask.sum(dim=(1, 2)).tolist()
    for b in range(scores.shape[0]):
        if neg[b] == nan[b] == inf[b] == 0:
            continue
        c = capture.nonfinite.setdefault((layer, b), [0, 0, 0, None])
        c[0], c[1], c[2] = c[0] + neg[b], c[1] + nan[b], c[2] + inf[b]
        rows = (nan_mask[b] | pos_mask[b]).any(-1).nonzero()
        if c[3] is None and len(rows):
            c[3] = int(position_ids[b][int(rows[0])])


def _keep_scores(capture: IndexerCapture, position_ids: torch.Tensor, scores: torch.Tensor) -> None:
    """Attach the call's score rows at positions >= ``capture.score_from`` (on the CPU)."""
    call = capture.calls[-1]
    if capture.score_from <= 0:
        call.scores = scores.cpu()
        if capture.topk_from > 0:  # the call's positions lost the rows below topk_from
            call.score_positions = position_ids.detach().cpu()
        return
    rows = (position_ids[0] >= capture.score_from).nonzero().flatten()  # positions are batch-shared
    call.scores = scores[:, rows.to(scores.device)].cpu()
    call.score_positions = position_ids[:, rows.to(position_ids.device)].detach().cpu()


def _stasher(layer: int, capture: IndexerCapture) -> Callable[[torch.Tensor], None]:
    def stash(scores: torch.Tensor) -> None:
        capture._pending[layer] = scores

    return stash
