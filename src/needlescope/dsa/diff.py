"""Differential localization: run a reference and a candidate model on one prompt, find where they part.

The reference and the candidate are the same weights loaded twice. The reference runs with
fp32 indexer numerics (``Setting(index_topk=candidate.index_topk)``: ``index_topk`` is a
selection setting, not a precision); the candidate runs under ``emulate(candidate, setting)``. ``needlescope.dsa.module_replay.Recorder`` records every module call of both runs
(what its caller passed in, what its forward saw, its whole output, the call it ran inside).
Rows are listed in the order calls return in the reference run (children before their
parent); a module called several times gets ``name[call 2]``, ...; each decoder layer adds a
probe ``model.layers.N.hc_streams_in`` of the streams entering it.

**The budget rule: a module answers for its own code, measured from its own inputs.** For
every module call the reference module is replayed on the *candidate's* inputs, with every
module it calls stubbed to return the candidate's recorded output (``replay.replay_own``).

* ``own_err`` = the larger of (a) the candidate's output against the replay's and (b) the
  largest error between what the candidate's code and the reference code handed to a callee.
  Error that first appears between a module's inputs and its callees' inputs (keys roped or
  quantised in the indexer's plain code) or after its last callee (masking, scaling or
  buffering of the scores before the top-k) is therefore the module's own; error that
  arrives through its inputs or callees never is.
* ``own_budget``, what the module's configured numerics explain: ``4 u`` of its output dtype
  (fp32 ``2**-24``); for an indexer scorer under emulated numerics, ``margin x`` the move of
  the reference scorer when its queries and keys get noise of the size of this call's measured
  quantisation errors ``eps_q``, ``eps_k``, plus ``margin x u_acc``; for a module of reduced
  precision ``p`` (detected: every value of a candidate output tensor round-trips exactly
  through ``p`` while the replay's does not, or the inputs its forward saw were rounded to
  ``p`` by its own pre-hooks; or declared with ``allow``), ``margin x u_p`` plus, when its
  inputs are rounded, ``margin x`` its move under input noise of relative size ``u_p``.
  ``p`` is bf16 (``2**-8``) when values round-trip through it, else fp16 (``2**-11``).

**The calibrated propagation budget.** ``rel_err`` (candidate against reference output) is
compared with ``expected_rel_err``: ``margin x`` how far the reference module's output moves
when each of its floating inputs gets Gaussian noise of the size of the error that input
actually carries (``replay.calibrate``: an empirical condition number, ``draws`` seeded
draws, ``margin`` 4 by default), and at least ``4 u``. Only modules whose output error
exceeds ``margin x in_err`` are calibrated (the amplifiers: routers near ties, attention
reading a changed selection, Sinkhorn mixing); for the others ``expected_rel_err`` is
``max(margin x in_err, 4 u)``. A fixed ``growth`` replaces every calibration (``growth x in_err``, the
scorer's ``growth x (eps_q + eps_k + u_acc)``, ``growth x u_p`` per rounding). For an
indexer the propagation budget is also at least the fraction of selections that score noise
of the scorer's budget could swap (``swappable_fraction``).

**Verdicts** (``verdict``), in this order:

* ``"diverges"``: ``own_err > own_budget``; the module's own code moved its output (or its
  callees' inputs) more than its numerics explain. ``exceeds`` is true exactly here.
* ``"reduced precision, within its rounding"``: own error above ``4 u`` but within the
  budget of a detected or declared reduced precision.
* ``"within precision"``: an indexer scorer whose own error the emulated numerics explain.
* ``"explained"``: its own code reproduces the candidate from the candidate's inputs and
  callee outputs, yet its output moved more than ``expected_rel_err``: the movement comes
  from justified changes upstream (an attention reading a top-k set that changed within
  precision, a router flipping a near tie).
* ``"ok"``: within its propagation budget. Probes (``hc_streams_in``) get ``"probe"``.

``first_divergent_module`` is the first ``"diverges"`` row, or null, and then ``summary``
says ``"no module diverges beyond what its precision explains"``. ``inner_divergent`` names
the first diverging module inside a row (informational: a parent is judged by its own code).

Per CSA layer, the selections and the needle's rank: ``needlescope.dsa.diff_layers``.

``diff.json``, its schema (``DIFF_SCHEMA``) and ``diff.md`` are written by ``needlescope.dsa.diff_md``.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping

import torch

from needlescope.dsa.diff_layers import layer_rows
from needlescope.dsa.diff_md import DIFF_SCHEMA, diff_to_json, render_diff_md, validate_diff
from needlescope.dsa.diff_rope import rope_tables
from needlescope.dsa.diff_rounding import (
    PRECISION_DTYPES,
    Rounding,
    reduced_precision,
    rounding_move,
    unit_roundoff,
)
from needlescope.dsa.diff_steps import judged_in_steps
from needlescope.dsa.emulate import (
    ACC_DTYPES,
    IndexerCapture,
    check_unpatched,
    csa_indexers,
    emulate,
    patches_applied,
)
from needlescope.dsa.module_replay import (
    INDEXER,
    Call,
    Recorder,
    calibrate,
    membership,
    rel_err,
    replay_own,
    selection_error,
)
from needlescope.dsa.passes import check_chunk
from needlescope.dsa.prompt import covering_entries
from needlescope.dsa.quant import get_quantizer, hadamard_128
from needlescope.dsa.reference import visible_entries
from needlescope.dsa.streaming import is_streamed
from needlescope.errors import BadInput
from needlescope.progress import Progress, no_progress
from needlescope.setting import Setting

__all__ = [
    "DEFAULT_MARGIN",
    "DEFAULT_DRAWS",
    "DIFF_SCHEMA",
    "PRECISION_DTYPES",
    "NO_DIVERGENCE",
    "unit_roundoff",
    "rel_err",
    "selection_error",
    "selection_recall",
    "swappable_fraction",
    "parse_allow",
    "localize",
    "validate_diff",
    "diff_to_json",
    "render_diff_md",
]

DEFAULT_MARGIN = 4.0
DEFAULT_DRAWS = 2
FLOOR_FACTOR = 4.0
NO_DIVERGENCE = "no module diverges beyond what its precision explains"
_SCORER = "DeepseekV4IndexerScorer"


def selection_recall(cand: torch.Tensor, ref: torch.Tensor) -> tuple[float, int, int]:
    """Top-k set recall of ``ref`` by ``cand``: (mean recall, rows changed, rows counted).

    cand, ref: [N, k] entry indices, -1 = no entry. Rows where ``ref`` has no valid entry are
    skipped. Recall counts drops only; ``selection_error`` counts additions too.
    """
    r = ref.reshape(-1, ref.shape[-1]).long()
    c = cand.reshape(-1, cand.shape[-1]).long().to(r.device)
    if r.shape[0] != c.shape[0]:
        raise ValueError(f"cand has {c.shape[0]} rows, ref has {r.shape[0]}")
    L = int(max(int(r.max()) if r.numel() else -1, int(c.max()) if c.numel() else -1)) + 1
    mask_r, mask_c = membership(r, L), membership(c, L)  # [N, L]
    n_ref = mask_r.sum(-1)
    rows = n_ref > 0
    if not bool(rows.any()):
        return 1.0, 0, 0
    recall = (mask_r & mask_c).sum(-1)[rows].double() / n_ref[rows].double()
    changed = (mask_r != mask_c).any(-1) & rows
    return float(recall.mean()), int(changed.sum()), int(rows.sum())


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


def parse_allow(specs) -> dict[str, str]:
    """``["model.layers.*.attn_hc=bf16", ...]`` -> {pattern: precision}; BadInput on a bad entry."""
    out: dict[str, str] = {}
    for spec in specs or ():
        pattern, sep, prec = str(spec).partition("=")
        if not sep or not pattern or prec not in PRECISION_DTYPES:
            raise BadInput(
                f"--allow {spec!r} is not PATTERN=PRECISION; PRECISION is one of {', '.join(PRECISION_DTYPES)}, "
                "e.g. --allow 'model.layers.*.attn_hc=bf16'"
            )
        out[pattern] = prec
    return out


# ---------------------------------------------------------------------------- judging one call


def _quant_error(x: torch.Tensor, name: str, rotate: bool) -> float:
    x32 = x.detach().float()
    if rotate:
        x32 = hadamard_128(x32)
    return rel_err(get_quantizer(name)(x32), x32)


def _base(key: str) -> str:
    return key.rsplit("[call ", 1)[0] if key.endswith("]") else key


class _Judge:
    """Budgets and verdicts for the calls of one reference/candidate pair."""

    def __init__(
        self, reference, numerics: Setting, growth, margin: float, draws: int, allow: dict[str, str]
    ):
        self.reference, self.numerics, self.growth = reference, numerics, growth
        self.margin, self.draws, self.allow = margin, draws, allow

    def _calibrated(self, ref: Call, sizes: list[float], selection: bool = False) -> float:
        return calibrate(self.reference, ref, sizes, draws=self.draws, selection=selection)

    def own(self, ref: Call, cand: Call, callees: list[Call], floor: float) -> dict:
        """own_err, own_budget, precision and the own part of the verdict of one module call."""
        is_indexer = ref.type == INDEXER
        handed: list = []
        out_err, in_err, replayed = replay_own(
            self.reference, cand, callees, selection=is_indexer, handed=handed
        )
        own_err = max(out_err, in_err)
        declared = next(
            (p for pat, p in self.allow.items() if fnmatch.fnmatchcase(_base(ref.key), pat)), None
        )
        rounding = Rounding(declared, True) if declared is not None else None
        if own_err > floor:  # only then can a reduced precision matter (dsa.diff_rounding)
            rounding = reduced_precision(
                self.reference,
                cand,
                callees,
                (out_err, replayed, handed, own_err),
                declared,
                floor,
                is_indexer,
            )
        budget, label = floor, None
        n = self.numerics
        emulated = (n.index_k, n.index_q, n.score_dtype) != ("fp32", "fp32", "fp32")
        if ref.type == _SCORER and emulated and len(cand.inputs) >= 2:
            q, k = cand.inputs[0], cand.inputs[1]
            rotate = self.numerics.rotates and q.shape[-1] == 128
            eps_q, eps_k = (
                _quant_error(q, self.numerics.index_q, rotate),
                _quant_error(k, self.numerics.index_k, rotate),
            )
            u_acc = unit_roundoff(ACC_DTYPES[self.numerics.score_dtype])
            if self.growth is not None:
                budget = max(floor, self.growth * (eps_q + eps_k + u_acc))
            else:
                moved = self._calibrated(ref, [eps_q, eps_k] + [0.0] * (len(ref.inputs) - 2))
                budget = max(floor, self.margin * (moved + u_acc))
            label = "within precision"
        precision = None if rounding is None else rounding.precision
        if rounding is not None:
            u_p = unit_roundoff(PRECISION_DTYPES[precision])
            if self.growth is not None:
                p_budget = self.growth * u_p * (2 if rounding.inputs or rounding.sites else 1)
            elif rounding.sites:  # rounded in between: the replay's move under noise at those sites
                moved = rounding_move(
                    self.reference, cand, callees, rounding.sites, u_p, draws=self.draws, selection=is_indexer
                )
                p_budget = self.margin * (u_p + moved)
            else:
                moved = self._calibrated(ref, [u_p] * len(ref.inputs), is_indexer) if rounding.inputs else 0.0
                p_budget = self.margin * (u_p + moved)
            budget = max(budget, p_budget)
            label = "reduced precision, within its rounding"
        if own_err > budget:
            verdict = "diverges"
        elif own_err > floor and label is not None:
            verdict = label
        else:
            verdict = None  # decided by the propagation budget
        return {"own_err": own_err, "own_budget": budget, "precision": precision, "verdict": verdict}

    def expected(self, ref: Call, cand: Call, err: float, floor: float) -> tuple[float, float, bool]:
        """(in_err, expected_rel_err, calibrated) of one call: the propagation budget."""
        pairs = list(zip(cand.inputs, ref.inputs))
        sizes = [rel_err(c, r) for c, r in pairs]
        in_err = max(sizes, default=0.0) if len(cand.inputs) == len(ref.inputs) else math.inf
        if in_err == 0.0 or not math.isfinite(in_err):
            return in_err, max(floor, in_err), False
        if self.growth is not None:
            return in_err, max(floor, self.growth * in_err), False
        if err <= self.margin * in_err:  # within the fixed rule: no need to pay for a calibration
            return in_err, max(floor, self.margin * in_err), False
        moved = self._calibrated(ref, sizes, ref.type == INDEXER)
        return in_err, max(floor, self.margin * moved), True


def _selection_floor(ref: Call, scorer: Call | None, scorer_budget: float, ratio: int) -> float:
    """Fraction of the reference's selections that score noise of the scorer's budget could swap."""
    if scorer is None or scorer.out is None or scorer_budget <= 0:
        return 0.0
    s = scorer.out.reshape(-1, scorer.out.shape[-1]).float()  # [N, L]
    positions = ref.args[2] if len(ref.args) > 2 else ref.kwargs.get("position_ids")
    if positions is None:
        return 0.0
    vis = visible_entries(positions.reshape(-1).long(), ratio).to(s.device).clamp_max(s.shape[-1])
    ar = torch.arange(s.shape[-1], device=s.device).view(1, -1)
    scale = s.masked_fill(ar >= vis.view(-1, 1), 0.0).abs().amax(-1)
    k = int(ref.out.shape[-1]) if ref.out is not None else 1
    return swappable_fraction(s, vis, k, scorer_budget * scale)


def _compare(
    ref_rows: list[Call], cand_rows: list[Call], judge: _Judge, ratio: int, progress: Progress
) -> tuple[list[dict], dict]:
    cand_by_key = {r.key: r for r in cand_rows}
    ref_by_key = {r.key: r for r in ref_rows}
    callees: dict[str, list[Call]] = {}
    for r in cand_rows:
        if r.parent is not None and r.kind != "hc_streams_in":
            callees.setdefault(r.parent, []).append(r)
    out: list[dict] = []
    budget_of: dict[str, float] = {}
    for i, ref in enumerate(ref_rows):
        progress("modules", i, len(ref_rows), ref.key)
        cand = cand_by_key.get(ref.key)
        if cand is None:
            continue
        is_indexer = ref.kind == "indexer_selection"
        if ref.out is None or cand.out is None:
            err = 0.0 if ref.out is None and cand.out is None else math.inf
        elif is_indexer:
            err = selection_error(cand.out, ref.out)[0]
        else:
            err = rel_err(cand.out, ref.out)
        # Integer outputs (selections) are compared exactly; what their module hands its
        # callees is floating, so it gets the fp32 floor.
        dtype = ref.out.dtype if ref.out is not None and ref.out.is_floating_point() else torch.float32
        floor = FLOOR_FACTOR * unit_roundoff(dtype)
        row = {"module": ref.key, "kind": ref.kind, "type": ref.type, "rel_err": err}
        if ref.kind == "hc_streams_in":
            row.update(in_err=err, expected_rel_err=err, calibrated=False, own_err=None, own_budget=None)
            row.update(precision=None, verdict="probe")
            out.append(row)
            continue
        own = judge.own(ref, cand, callees.get(cand.key, []), floor)
        budget_of[ref.key] = own["own_budget"]
        in_err, expected, calibrated = judge.expected(ref, cand, err, floor)
        if is_indexer:
            scorer_key = _child_key(ref.key, "scorer")
            sel = _selection_floor(ref, ref_by_key.get(scorer_key), budget_of.get(scorer_key, 0.0), ratio)
            expected = max(expected, sel)
        verdict = own.pop("verdict") or ("explained" if err > expected else "ok")
        row.update(in_err=in_err, expected_rel_err=expected, calibrated=calibrated, **own, verdict=verdict)
        if is_indexer and (rope := rope_tables(judge.reference, cand, callees.get(cand.key, []))):
            row["rope"] = rope
        out.append(row)
    for row in out:
        row["exceeds"] = row["verdict"] == "diverges"
    _inner_divergent(out)
    ref_keys = set(ref_by_key)
    unmatched = {
        "reference_only": [r.key for r in ref_rows if r.key not in cand_by_key],
        "candidate_only": [r.key for r in cand_rows if r.key not in ref_keys],
    }
    return out, unmatched


def _inner_divergent(rows: list[dict]) -> None:
    """Name, on each row, the first diverging module inside it (rows are in return order)."""
    flagged: list[str] = []
    for row in rows:
        prefix = _base(row["module"]) + "."
        row["inner_divergent"] = next((f for f in flagged if f.startswith(prefix)), None)
        if row["exceeds"]:
            flagged.append(row["module"])


def _child_key(key: str, child: str) -> str:
    # "a.b.indexer[call 2]" -> "a.b.indexer.scorer[call 2]"
    if key.endswith("]") and "[call " in key:
        base, call = key.rsplit("[call ", 1)
        return f"{base}.{child}[call {call}"
    return f"{key}.{child}"


def _checked_args(input_ids, growth, margin, draws, allow, chunk) -> dict[str, str]:
    """``allow`` as a dict, once ``localize``'s arguments are checked (ValueError or BadInput)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got shape {tuple(input_ids.shape)}")
    if growth is not None and not growth >= 1.0:
        raise BadInput(f"growth must be >= 1, got {growth}")
    if not margin >= 1.0 or draws < 1:
        raise BadInput(f"margin must be >= 1 and draws >= 1, got {margin} and {draws}")
    allow = dict(allow or {})
    parse_allow([f"{k}={v}" for k, v in allow.items()])
    check_chunk(chunk)
    return allow


def localize(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    setting: Setting,
    needle_span: tuple[int, int] | None = None,
    growth: float | None = None,
    margin: float = DEFAULT_MARGIN,
    draws: int = DEFAULT_DRAWS,
    allow: Mapping[str, str] | None = None,
    reference_setting: Setting | None = None,
    extra_patches: tuple = (),
    progress: Progress = no_progress,
    chunk: int | None = None,
) -> dict:
    """Run both models on ``input_ids`` [1, T] and return the ``diff.json`` object (module docstring).
    ``progress`` hears of the two forward passes, then of each module compared.

    ``reference`` and ``candidate`` must be two separately loaded copies of the same
    checkpoint; the candidate is patched (once) while the run lasts. ``growth`` replaces the
    calibration by a fixed factor; ``allow`` maps module-name patterns (fnmatch) to a reduced
    precision the module is declared to run at. Cost: two forwards, one replay (about one
    forward), and per amplifying module ``draws`` forwards of that module. ``extra_patches``:
    model-level patch files the candidate also carries (applied after ``setting``).
    ``chunk``: run both models layer-major through their KV caches in chunks of this many tokens
    and judge each (layer, chunk) step's calls before the next (``dsa.diff_steps``); models
    loaded by ``dsa.streaming`` always run that way (one chunk when None).
    """
    allow = _checked_args(input_ids, growth, margin, draws, allow, chunk)
    check_unpatched(candidate)
    numerics = setting
    ref_num = reference_setting or Setting(index_topk=setting.index_topk)
    T = int(input_ids.shape[1])
    ref_cap, cand_cap = IndexerCapture(keep_scores=True), IndexerCapture(keep_scores=True)
    ratio = csa_indexers(reference)[0][1].compress_rate
    topk_by_layer = {layer: int(idx.index_topk) for layer, idx in csa_indexers(reference)}
    judge = _Judge(reference, numerics, growth, margin, draws, allow)
    with torch.no_grad():
        if chunk is None and not (is_streamed(reference) or is_streamed(candidate)):
            modules, unmatched, layers = _one_pass(
                reference,
                candidate,
                input_ids,
                judge,
                ratio,
                ref_num,
                (ref_cap, cand_cap),
                extra_patches,
                progress,
            )
        else:
            ref_cap.score_from = cand_cap.score_from = T - 1  # the needle's rank is read there only
            modules, unmatched, layers = _in_steps(
                reference, candidate, input_ids, judge, ratio, ref_num, setting, (ref_cap, cand_cap),
                extra_patches, progress, chunk,
            )  # fmt: skip
    first = next((m["module"] for m in modules if m["exceeds"]), None)
    rope = [m.pop("rope") for m in modules if "rope" in m]
    query_pos = T - 1
    entries = covering_entries(needle_span, ratio) if needle_span is not None else []
    return {
        "modules": modules,
        "first_divergent_module": first,
        "summary": _summary(first, rope),
        "rope": rope,
        "layers": layer_rows(layers, ref_cap, cand_cap, entries, query_pos, ratio, topk_by_layer),
        "numerics": numerics.numerics_json(),
        "reference_numerics": ref_num.numerics_json(),
        "patch": None if setting.patch is None else setting.patch.spec,
        "extra_patches": [str(p) for p in extra_patches],
        "prompt_tokens": T,
        "needle_token_span": None if needle_span is None else [int(needle_span[0]), int(needle_span[1])],
        "query_pos": query_pos,
        "growth": growth,
        "margin": margin,
        "draws": draws,
        "allow": allow,
        "unmatched": unmatched,
    }


def _summary(first: str | None, rope: list[dict]) -> str:
    said = NO_DIVERGENCE if first is None else f"first divergent module: {first}"
    return f"{said}; {rope[0]['finding']} ({rope[0]['module']})" if rope else said


def _in_steps(
    reference, candidate, input_ids, judge: _Judge, ratio: int, ref_num, setting, captures, extra_patches,
    progress, chunk,
):  # fmt: skip
    """(modules, unmatched, CSA layers): both models layer-major in chunks (``dsa.diff_steps``),
    each (layer, chunk) step's calls judged before the next step runs."""
    modules, unmatched = [], {"reference_only": [], "candidate_only": []}

    def judge_step(ref_rows, cand_rows) -> None:
        rows, missing = _compare(ref_rows, cand_rows, judge, ratio, no_progress)
        modules.extend(rows)
        for side, keys in missing.items():
            unmatched[side] += keys

    layers = judged_in_steps(
        reference, candidate, input_ids, chunk=chunk, reference_setting=ref_num, setting=setting,
        extra_patches=extra_patches, captures=captures, judge_step=judge_step, progress=progress,
    )  # fmt: skip
    return modules, unmatched, layers


def _one_pass(
    reference, candidate, input_ids, judge: _Judge, ratio: int, ref_num, captures, extra_patches, progress
):
    """(modules, unmatched, CSA layers): both models over the whole prompt in one forward each,
    every call recorded, then every call judged."""
    ref_cap, cand_cap = captures
    with emulate(reference, ref_num, capture=ref_cap) as layers, Recorder(reference) as rec_ref:
        progress("forward passes", 0, 2, "reference")
        reference(input_ids=input_ids.to(_device(reference)), use_cache=False)
    with (
        emulate(candidate, judge.numerics, capture=cand_cap),
        patches_applied(candidate, extra_patches),
        Recorder(candidate) as rec_cand,
    ):
        progress("forward passes", 1, 2, "candidate")
        candidate(input_ids=input_ids.to(_device(candidate)), use_cache=False)
        progress("forward passes", 2, 2, "")
    # Replays and calibrations run the reference with the scorer it was recorded with.
    with emulate(reference, ref_num, capture=IndexerCapture(keep_scores=True)):
        modules, unmatched = _compare(rec_ref.rows, rec_cand.rows, judge, ratio, progress)
        progress("modules", len(rec_ref.rows), len(rec_ref.rows), "")
    return modules, unmatched, layers


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
