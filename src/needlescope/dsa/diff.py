"""Differential localization: run a reference and a candidate model on one prompt, find where they part.

The reference and the candidate are the same weights loaded twice. The reference runs with
fp32 indexer numerics (``Setting(index_topk=candidate.index_topk)``: ``index_topk`` is a
selection setting, not a precision, so both sides select the same number of entries); the
candidate runs under ``emulate(candidate, setting)`` (its numerics and its patch). Forward hooks on every
sub-module record the module's first output tensor (the output itself, or the first tensor
of a tuple or of a ``ModelOutput``) and every floating-point tensor among its inputs
(positional and keyword, looking two levels into tuples, lists and dicts). Rows are listed
in the order the hooks fire in the reference run: a module fires when it *returns*, so
children come before their parent and every module after the modules that produced its
inputs. A module called several times per forward (rotary embeddings) gets one row per
call, ``name[call 2]`` and so on. Two extra probes per decoder layer measure the
hyper-connection residual streams ``[B, S, hc_mult, hidden]``:
``model.layers.N.hc_streams_in`` (recorded when the layer starts) and the decoder layer's
own row ``model.layers.N`` (its output, the streams leaving it).

Error measures (all norm-wise, over the whole tensor, in float64):

* ``rel_err = ||cand - ref|| / ||ref||`` for floating outputs (entries equal in both, such
  as matching ``-inf``, count as zero difference; 0/0 is 0, x/0 is inf);
* for a ``DeepseekV4Indexer`` (its output is the top-k index tensor) ``rel_err = 1 - recall``:
  the fraction of the reference's selected entries the candidate did not select, averaged
  over query rows with at least one selection;
* for any other integer output, the fraction of elements that differ.

``expected_rel_err``, what the candidate's precision explains, is a *local* rule: a module
is expected to pass on the error it receives and add at most the rounding of the numerics
it computes in::

    expected = max(growth * in_err, floor)

* ``in_err``: the largest ``rel_err`` among the module's floating inputs (candidate vs
  reference inputs, measured at the module). An error that arrives is never blamed on the
  module it arrives at, only amplification beyond ``growth`` (default 4) is.
* ``floor`` for ordinary modules: ``growth * u`` with ``u`` the unit roundoff of the
  output dtype (fp32 2**-24, bf16 2**-8, fp16 2**-11).
* ``floor`` for an indexer scorer (the one op the emulated numerics change):
  ``growth * (eps_q + eps_k + u_acc)``, where ``eps_q`` and ``eps_k`` are the *measured*
  norm-wise quantisation errors of this call's own queries and keys under the candidate's
  quantisers (after the Hadamard rotation when it applies) and ``u_acc`` is the unit
  roundoff of the score dtype. So fp4 keys may move the scores by up to about 4x their
  own rounding error without being flagged, while a patched scorer running at fp32
  numerics is flagged as soon as it differs.
* ``floor`` for an indexer's selection: the fraction of reference selections that score
  noise of the scorer's ``expected_rel_err`` could swap. Per query row t with
  ``v_t > k`` visible entries, ``delta_t = expected(scorer) * max_s |I_ref(t, s)|``; a selected
  entry is at risk when its reference score is within ``2 delta_t`` of the best unselected
  one, an unselected entry is a contender when within ``2 delta_t`` of the k-th score; the
  row can lose at most ``min(at_risk, contenders)`` of its k selections. The floor is the
  mean of that fraction over rows.

``exceeds = rel_err > expected_rel_err``, except that a module one of whose own sub-modules
already exceeds is not flagged again (its ``inner_divergent`` names that sub-module, the more
precise location; a decoder layer is never blamed for its attention's divergence).
``first_divergent_module`` is the first exceeding row in forward order, or null. The streams-in probes only measure (their ``in_err`` is their
own error), so they never exceed. A discrete choice downstream of a clean input (an
attention reading a different top-k set, a router picking another expert) shows as an
exceeding module: its output moved more than its input error and its own rounding explain.
That is the event this command localises.

Per CSA layer: ``topk_overlap`` is the mean over all query positions (rows with at least one
reference selection) of |cand ∩ ref| / |ref| over valid (non -1) entries, and the needle's
best rank (``rankdump.needle_rank_stats``: 1 + non-needle visible entries scoring >= the
best needle entry) in the reference and the candidate scores at the last prompt position
(the query that produces the first answer token). A rank is null when no needle entry is
visible there yet.

``diff.json`` schema (``DIFF_SCHEMA``; keys beyond these may be added)::

    {"modules": [{"module": str, "kind": "module" | "indexer_selection" | "hc_streams_in"
                  | "hc_streams_out", "type": str, "rel_err": float, "in_err": float,
                  "expected_rel_err": float, "exceeds": bool,
                  "inner_divergent": str | null}, ...],                  # forward order
     "first_divergent_module": str | null,
     "layers": [{"layer": int, "index_topk": int, "topk_overlap": float,
                 "positions_changed": int, "positions": int,
                 "needle_entries": [int], "needle_rank_reference": int | null,
                 "needle_rank_candidate": int | null,
                 "needle_selected_reference": bool | null, "needle_selected_candidate": bool | null}],
     "numerics": {"index_k": str, "index_q": str, "score_dtype": str, "index_topk": int | null,
                  "hadamard": bool | null},
     "reference_numerics": {...same keys...},
     "patch": str | null, "prompt_tokens": int, "needle_token_span": [int, int] | null,
     "query_pos": int, "growth": float,
     "unmatched": {"reference_only": [str], "candidate_only": [str]}}

Non-finite numbers are written as JSON strings ``"inf"`` / ``"nan"`` by ``diff_to_json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from needlescope.dsa.emulate import ACC_DTYPES, IndexerCapture, csa_indexers, emulate
from needlescope.dsa.prompt import covering_entries
from needlescope.dsa.quant import get_quantizer, hadamard_128
from needlescope.dsa.rankdump import needle_rank_stats, selected_in
from needlescope.dsa.reference import visible_entries
from needlescope.schema import check_schema
from needlescope.setting import Setting

__all__ = [
    "DEFAULT_GROWTH",
    "DIFF_SCHEMA",
    "unit_roundoff",
    "rel_err",
    "selection_recall",
    "swappable_fraction",
    "localize",
    "diff_to_json",
    "render_diff_md",
    "validate_diff",
]

DEFAULT_GROWTH = 4.0
_SCORER = "DeepseekV4IndexerScorer"
_INDEXER = "DeepseekV4Indexer"
_DECODER = "DeepseekV4DecoderLayer"

DIFF_SCHEMA: dict = {
    "type": "object",
    "required": ["modules", "first_divergent_module", "layers", "numerics", "patch", "prompt_tokens"],
    "properties": {
        "modules": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["module", "rel_err", "expected_rel_err", "exceeds"],
                "properties": {
                    "module": {"type": "string"},
                    "kind": {"type": "string"},
                    "type": {"type": "string"},
                    "rel_err": {"type": ["number", "string"]},
                    "in_err": {"type": ["number", "string"]},
                    "expected_rel_err": {"type": ["number", "string"]},
                    "exceeds": {"type": "boolean"},
                },
            },
        },
        "first_divergent_module": {"type": ["string", "null"]},
        "layers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["layer", "topk_overlap", "needle_rank_reference", "needle_rank_candidate"],
                "properties": {
                    "layer": {"type": "integer"},
                    "topk_overlap": {"type": "number"},
                    "needle_rank_reference": {"type": ["integer", "null"]},
                    "needle_rank_candidate": {"type": ["integer", "null"]},
                },
            },
        },
        "numerics": {"type": "object"},
        "patch": {"type": ["string", "null"]},
        "prompt_tokens": {"type": "integer"},
    },
}
"""JSON-Schema-style description of ``diff.json``."""

_UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff (half the machine epsilon) of a floating dtype; 0 for others."""
    return _UNIT_ROUNDOFF.get(dtype, 0.0)


def rel_err(cand: torch.Tensor, ref: torch.Tensor) -> float:
    """||cand - ref|| / ||ref|| in float64 over whole tensors of one shape.

    Equal entries (also equal infinities) contribute zero difference; a finite/non-finite
    mismatch or a shape mismatch gives inf. Non-finite reference entries are left out of
    ||ref||. Integer tensors: the fraction of differing elements.
    """
    if cand.shape != ref.shape:
        return math.inf
    if ref.numel() == 0:
        return 0.0
    if not (ref.is_floating_point() or ref.is_complex()):
        return float((cand.to(ref.device) != ref).double().mean())
    a, b = cand.detach().to(ref.device).double(), ref.detach().double()
    same = a == b
    if bool((~same & ~(torch.isfinite(a) & torch.isfinite(b))).any()):
        return math.inf
    diff = torch.where(same, torch.zeros_like(a), a - b)
    num = float(diff.norm())
    den = float(torch.where(torch.isfinite(b), b, torch.zeros_like(b)).norm())
    if num == 0.0:
        return 0.0
    return num / den if den > 0 else math.inf


def selection_recall(cand: torch.Tensor, ref: torch.Tensor) -> tuple[float, int, int]:
    """Top-k set recall of ``ref`` by ``cand``: (mean recall, rows changed, rows counted).

    cand, ref: [N, k] (or [..., k], flattened to rows) entry indices, -1 = no entry. Rows
    where ``ref`` has no valid entry are skipped. Recall of a row = |cand ∩ ref| / |ref|;
    a row is changed when the two valid sets differ. Memory O(N * L), L = largest index + 1.
    """
    r = ref.reshape(-1, ref.shape[-1]).long()
    c = cand.reshape(-1, cand.shape[-1]).long().to(r.device)
    if r.shape[0] != c.shape[0]:
        raise ValueError(f"cand has {c.shape[0]} rows, ref has {r.shape[0]}")
    L = int(max(int(r.max()) if r.numel() else -1, int(c.max()) if c.numel() else -1)) + 1
    mask_r, mask_c = _membership(r, L), _membership(c, L)  # [N, L]
    n_ref = mask_r.sum(-1)  # [N]
    rows = n_ref > 0
    if not bool(rows.any()):
        return 1.0, 0, 0
    both = (mask_r & mask_c).sum(-1)  # [N]
    recall = both[rows].double() / n_ref[rows].double()
    changed = (mask_r != mask_c).any(-1) & rows
    return float(recall.mean()), int(changed.sum()), int(rows.sum())


def _membership(idx: torch.Tensor, L: int) -> torch.Tensor:
    """Bool [N, L]: entry l is among row n's indices (-1 ignored). idx: [N, k]."""
    out = torch.zeros(idx.shape[0], L + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(1, torch.where(idx >= 0, idx, torch.full_like(idx, L)), True)
    return out[:, :L]


def swappable_fraction(scores: torch.Tensor, visible: torch.Tensor, k: int, delta: torch.Tensor) -> float:
    """Mean over rows of the fraction of top-k selections that score noise ``delta`` could swap out.

    scores: [N, L] reference scores (entries >= visible[n] ignored); visible: [N]; k >= 1;
    delta: [N] per-row bound on |score error|. Rows with visible <= k select every entry
    and lose nothing. A row loses at most min(at_risk, contenders) selections, where
    at_risk = selected entries within 2*delta of the best unselected score and contenders =
    unselected entries within 2*delta of the k-th score.
    """
    N, L = scores.shape
    vis = visible.to(scores.device).long().clamp(0, L)  # [N]
    if k >= L:
        return 0.0
    ar = torch.arange(L, device=scores.device).view(1, L)
    s = scores.double().masked_fill(ar >= vis.view(N, 1), float("-inf"))
    row = s.sort(dim=-1, descending=True).values  # [N, L]
    kth, nxt = row[:, k - 1 : k], row[:, k : k + 1]  # [N, 1]
    d2 = 2.0 * delta.to(scores.device).double().view(N, 1)
    at_risk = (row[:, :k] <= nxt + d2).sum(-1)  # [N]
    contenders = ((row[:, k:] >= kth - d2) & (ar[:, k:] < vis.view(N, 1))).sum(-1)  # [N]
    frac = torch.minimum(at_risk, contenders).double() / k
    active = vis > k
    return float(frac[active].mean()) if bool(active.any()) else 0.0


# ---------------------------------------------------------------------------- recording


def _float_tensors(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _float_tensors(x, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _float_tensors(obj[key], depth + 1)


def _first_tensor(out) -> torch.Tensor | None:
    """The output itself, or the first tensor of a tuple/list or of a ``ModelOutput``-style mapping."""
    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    return next((x for x in items if isinstance(x, torch.Tensor)), None)


@dataclass
class _Row:
    key: str
    kind: str
    type: str
    out: torch.Tensor | None
    inputs: list[torch.Tensor] = field(default_factory=list)
    positions: torch.Tensor | None = None  # [B, S], indexers only


class _Recorder:
    """Forward hooks on every named sub-module of a model; rows in hook-firing order."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.rows: list[_Row] = []
        self._calls: dict[str, int] = {}
        self._handles: list = []

    def _key(self, name: str) -> str:
        n = self._calls.get(name, 0) + 1
        self._calls[name] = n
        return name if n == 1 else f"{name}[call {n}]"

    def _post(self, name: str, mod: torch.nn.Module):
        tname = type(mod).__name__

        def hook(module, args, kwargs, output):
            out = _first_tensor(output)
            kind = "module"
            if tname == _INDEXER:
                kind = "indexer_selection"
            elif tname == _DECODER:
                kind = "hc_streams_out"
            row = _Row(
                key=self._key(name),
                kind=kind,
                type=tname,
                out=None if out is None else out.detach(),
                inputs=[t.detach() for t in _float_tensors((args, kwargs))],
            )
            if tname == _INDEXER:
                pos = args[2] if len(args) > 2 else kwargs["position_ids"]
                row.positions = pos.detach()
            self.rows.append(row)

        return hook

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            key = self._key(f"{name}.hc_streams_in")
            self.rows.append(_Row(key=key, kind="hc_streams_in", type="streams", out=hs.detach(), inputs=[]))

        return hook

    def __enter__(self) -> _Recorder:
        for name, mod in self.model.named_modules():
            if not name:
                continue
            if type(mod).__name__ == _DECODER:
                self._handles.append(mod.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post(name, mod), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ---------------------------------------------------------------------------- comparison


def _quant_error(x: torch.Tensor, name: str, rotate: bool) -> float:
    x32 = x.detach().float()
    if rotate:
        x32 = hadamard_128(x32)
    return rel_err(get_quantizer(name)(x32), x32)


def _visible(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    return visible_entries(positions.reshape(-1).long(), ratio)  # [N]


def _compare(
    ref_rows: list[_Row],
    cand_rows: list[_Row],
    numerics: Setting,
    growth: float,
    ratio: int,
    topk_of: dict[str, int],
) -> tuple[list[dict], dict]:
    cand_by_key = {r.key: r for r in cand_rows}
    ref_by_key = {r.key: r for r in ref_rows}
    out: list[dict] = []
    expected_of: dict[str, float] = {}
    for ref in ref_rows:
        cand = cand_by_key.get(ref.key)
        if cand is None:
            continue
        if ref.kind == "indexer_selection" and ref.out is not None and cand.out is not None:
            recall, _, _ = selection_recall(cand.out, ref.out)
            err = 1.0 - recall
        elif ref.out is None or cand.out is None:
            err = 0.0 if ref.out is None and cand.out is None else math.inf
        else:
            err = rel_err(cand.out, ref.out)
        pairs = list(zip(cand.inputs, ref.inputs))
        in_err = max((rel_err(c, r) for c, r in pairs), default=0.0)
        if len(cand.inputs) != len(ref.inputs):
            in_err = math.inf
        if ref.kind == "hc_streams_in":
            in_err = err
        u = unit_roundoff(ref.out.dtype) if ref.out is not None else 0.0
        floor = growth * u
        if ref.type == _SCORER and len(cand.inputs) >= 2:
            q, k = cand.inputs[0], cand.inputs[1]
            rotate = numerics.rotates and q.shape[-1] == 128
            eps = _quant_error(q, numerics.index_q, rotate) + _quant_error(k, numerics.index_k, rotate)
            floor = growth * (eps + unit_roundoff(ACC_DTYPES[numerics.score_dtype]))
        elif ref.kind == "indexer_selection":
            scorer_key = _child_key(ref.key, "scorer")
            scorer_exp = expected_of.get(scorer_key, 0.0)
            ref_scorer = ref_by_key.get(scorer_key)
            if ref_scorer is not None and ref_scorer.out is not None and ref.positions is not None:
                s = ref_scorer.out.reshape(-1, ref_scorer.out.shape[-1]).float()  # [N, L]
                vis = _visible(ref.positions.to(s.device), ratio).clamp_max(s.shape[-1])
                ar = torch.arange(s.shape[-1], device=s.device).view(1, -1)
                scale = s.masked_fill(ar >= vis.view(-1, 1), 0.0).abs().amax(-1)  # [N]
                k = topk_of.get(ref.key, ref.out.shape[-1])
                floor = swappable_fraction(s, vis, k, scorer_exp * scale)
            else:
                floor = 0.0
        expected = max(growth * in_err, floor)
        expected_of[ref.key] = expected
        out.append(
            {
                "module": ref.key,
                "kind": ref.kind,
                "type": ref.type,
                "rel_err": err,
                "in_err": in_err,
                "expected_rel_err": expected,
                "exceeds": bool(err > expected),
            }
        )
    _defer_to_descendants(out)
    ref_keys = {r.key for r in ref_rows}
    unmatched = {
        "reference_only": [r.key for r in ref_rows if r.key not in cand_by_key],
        "candidate_only": [r.key for r in cand_rows if r.key not in ref_keys],
    }
    return out, unmatched


def _base(key: str) -> str:
    return key.rsplit("[call ", 1)[0] if key.endswith("]") else key


def _defer_to_descendants(rows: list[dict]) -> None:
    """Unflag a module whose own sub-modules already exceeded: they are the more precise location."""
    flagged: list[str] = []
    for row in rows:
        row["inner_divergent"] = None
        if not row["exceeds"]:
            continue
        prefix = _base(row["module"]) + "."
        inner = next((f for f in flagged if f.startswith(prefix)), None)
        flagged.append(row["module"])
        if inner is not None:
            row["exceeds"] = False
            row["inner_divergent"] = inner


def _child_key(key: str, child: str) -> str:
    # "a.b.indexer[call 2]" -> "a.b.indexer.scorer[call 2]"
    if key.endswith("]") and "[call " in key:
        base, call = key.rsplit("[call ", 1)
        return f"{base}.{child}[call {call}"
    return f"{key}.{child}"


def _needle_rank(capture: IndexerCapture, layer: int, query_pos: int, entries: list[int], k: int, ratio: int):
    positions, scores = capture.score_rows(layer)
    hits = (positions == query_pos).nonzero()
    if len(hits) == 0:
        return None, None, []
    i = int(hits[0])
    visible = visible_entries(query_pos, ratio)
    ne = [e for e in entries if e < visible]
    if not ne or visible < 1:
        return None, None, ne
    stats = needle_rank_stats(scores[i], visible, ne, k)
    pos, topk = capture.rows(layer, k)
    sel = selected_in(topk[int((pos == query_pos).nonzero()[0])], ne)
    return stats.best_rank, sel, ne


def localize(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    setting: Setting,
    needle_span: tuple[int, int] | None = None,
    growth: float = DEFAULT_GROWTH,
    reference_setting: Setting | None = None,
) -> dict:
    """Run both models on ``input_ids`` [1, T] and return the ``diff.json`` object (module docstring).

    ``reference`` and ``candidate`` must be two separately loaded copies of the same
    checkpoint (the candidate may be patched in place while the context is open).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got shape {tuple(input_ids.shape)}")
    if not growth >= 1.0:
        raise ValueError(f"growth must be >= 1, got {growth}")
    numerics = setting
    ref_num = reference_setting or Setting(index_topk=setting.index_topk)
    T = int(input_ids.shape[1])
    ref_cap, cand_cap = IndexerCapture(keep_scores=True), IndexerCapture(keep_scores=True)
    ratio = csa_indexers(reference)[0][1].compress_rate
    with torch.no_grad():
        with emulate(reference, ref_num, capture=ref_cap) as layers, _Recorder(reference) as rec_ref:
            topk_by_layer = {layer: int(idx.index_topk) for layer, idx in csa_indexers(reference)}
            topk_of = {
                name: int(mod.index_topk)
                for name, mod in reference.named_modules()
                if type(mod).__name__ == _INDEXER
            }
            reference(input_ids=input_ids.to(_device(reference)), use_cache=False)
        with emulate(candidate, setting, capture=cand_cap), _Recorder(candidate) as rec_cand:
            cand_topk_by_layer = {layer: int(idx.index_topk) for layer, idx in csa_indexers(candidate)}
            candidate(input_ids=input_ids.to(_device(candidate)), use_cache=False)
    modules, unmatched = _compare(rec_ref.rows, rec_cand.rows, numerics, growth, ratio, topk_of)
    first = next((m["module"] for m in modules if m["exceeds"]), None)

    query_pos = T - 1
    entries = covering_entries(needle_span, ratio) if needle_span is not None else []
    layer_rows = []
    for layer in layers:
        k, k_cand = topk_by_layer[layer], cand_topk_by_layer.get(layer, topk_by_layer[layer])
        _, ref_topk = ref_cap.rows(layer, k)
        _, cand_topk = cand_cap.rows(layer, k_cand)
        recall, changed, counted = selection_recall(cand_topk, ref_topk)
        row = {
            "layer": layer,
            "index_topk": k,
            "topk_overlap": recall,
            "positions_changed": changed,
            "positions": counted,
            "needle_entries": [],
            "needle_rank_reference": None,
            "needle_rank_candidate": None,
            "needle_selected_reference": None,
            "needle_selected_candidate": None,
        }
        if entries:
            rr, rs, ne = _needle_rank(ref_cap, layer, query_pos, entries, k, ratio)
            cr, cs, _ = _needle_rank(cand_cap, layer, query_pos, entries, k_cand, ratio)
            row.update(
                needle_entries=ne,
                needle_rank_reference=rr,
                needle_rank_candidate=cr,
                needle_selected_reference=rs,
                needle_selected_candidate=cs,
            )
        layer_rows.append(row)
    return {
        "modules": modules,
        "first_divergent_module": first,
        "layers": layer_rows,
        "numerics": numerics.numerics_json(),
        "reference_numerics": ref_num.numerics_json(),
        "patch": None if setting.patch is None else setting.patch.spec,
        "prompt_tokens": T,
        "needle_token_span": None if needle_span is None else [int(needle_span[0]), int(needle_span[1])],
        "query_pos": query_pos,
        "growth": growth,
        "unmatched": unmatched,
    }


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# ---------------------------------------------------------------------------- output


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def validate_diff(obj: dict) -> None:
    """Raise ValueError unless ``obj`` (as ``localize`` returns it) follows DIFF_SCHEMA."""
    check_schema(obj, DIFF_SCHEMA, "diff")


def diff_to_json(obj: dict) -> str:
    """``diff.json`` text: strict JSON, non-finite floats written as strings."""
    return json.dumps(_finite(obj), indent=2, allow_nan=False)


def _fmt(x) -> str:
    if isinstance(x, str):
        return x
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)


def render_diff_md(obj: dict, *, top: int = 15) -> str:
    """Markdown summary: verdict, per-layer indexer table, the first exceeding modules, largest errors."""
    num = obj["numerics"]
    lines = [
        "# Differential localization",
        "",
        f"Candidate numerics: keys `{num['index_k']}`, queries `{num['index_q']}`, scores `{num['score_dtype']}`, "
        f"index_topk `{num['index_topk'] if num['index_topk'] is not None else 'checkpoint'}`; "
        f"patch: `{obj['patch'] or 'none'}`. Prompt: {obj['prompt_tokens']} tokens; growth factor {obj['growth']}.",
        "",
    ]
    first = obj["first_divergent_module"]
    if first is None:
        lines.append("**No module diverges beyond what its precision explains.**")
    else:
        m = next(m for m in obj["modules"] if m["module"] == first)
        lines.append(
            f"**First divergent module: `{first}`** ({m['type']}): rel_err {_fmt(m['rel_err'])} vs expected "
            f"{_fmt(m['expected_rel_err'])} (input error {_fmt(m['in_err'])})."
        )
    lines += [
        "",
        "## Indexer per CSA layer",
        "",
        "| layer | index_topk | top-k overlap | positions changed | needle rank (ref) | needle rank (cand) | selected (ref / cand) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in obj["layers"]:
        lines.append(
            f"| {r['layer']} | {r['index_topk']} | {_fmt(r['topk_overlap'])} | {r['positions_changed']}/{r['positions']} "
            f"| {_fmt(r['needle_rank_reference'])} | {_fmt(r['needle_rank_candidate'])} "
            f"| {_fmt(r['needle_selected_reference'])} / {_fmt(r['needle_selected_candidate'])} |"
        )
    exceeding = [m for m in obj["modules"] if m["exceeds"]]
    lines += ["", f"## Exceeding modules ({len(exceeding)} of {len(obj['modules'])}, first {top})", ""]
    lines += _module_table(exceeding[:top])
    worst = sorted(
        (m for m in obj["modules"] if isinstance(m["rel_err"], float)), key=lambda m: -m["rel_err"]
    )[:top]
    lines += ["", f"## Largest relative errors (top {top})", ""]
    lines += _module_table(worst)
    um = obj.get("unmatched", {})
    if um.get("reference_only") or um.get("candidate_only"):
        lines += [
            "",
            f"Unmatched module calls: reference only {um.get('reference_only')}, "
            f"candidate only {um.get('candidate_only')}.",
        ]
    return "\n".join(lines) + "\n"


def _module_table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(none)"]
    out = ["| module | type | rel_err | input err | expected | exceeds |", "|---|---|---|---|---|---|"]
    for m in rows:
        out.append(
            f"| `{m['module']}` | {m['type']} | {_fmt(m['rel_err'])} | {_fmt(m['in_err'])} "
            f"| {_fmt(m['expected_rel_err'])} | {'yes' if m['exceeds'] else 'no'} |"
        )
    return out
