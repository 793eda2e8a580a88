"""Fix sweep: which indexer precision or index_topk restores needle selection, and up to which length.

The grid is index-key precision × index-query precision (every pair) × ``index_topk`` ×
context length, at one score accumulation dtype. Cases come from
``needlescope.cases.assemble.build_cases`` sized with the model's own chat template, so a
case of length N is exactly the N-token prompt the model sees. For every (case, setting) the
sweep runs ``rank_dump`` at the answer positions (greedy generation when ``generate``; the
last prompt position only otherwise).

Definitions:

* A case is **selected** under a setting when *every* CSA layer whose indexer can see a needle
  entry at the **first answer position** (the last prompt position) has a needle entry in its
  top-k there. A case where no layer can see a needle entry yet (the needle lies in the last,
  unfinished 4-token block, which only the sliding window covers) is **not scored**
  (``unscored``) and left out of the rate's denominator.
* **selection_rate** of a cell (setting, length) = selected cases / scored cases (null when no
  case was scored). ``per_layer`` gives, per CSA layer, the same fraction over the cases where
  that layer could see the needle, plus the median best rank and mean margin_frac there.
* **answer_recall** (only with generation) = cases whose greedy answer contains every expected
  value (``cases.scoring.score_answer``) / cases, with its 95% Wilson interval.
* Fixes are **judged by answer recall** when generating (``judged_by``), by selection otherwise.
  A setting **restores** to length L when its judged rate is >= ``target_rate`` at L and at every
  shorter tested length (null rates do not break the run); ``selection_restored_to`` is the same
  for selection. ``cheapest`` is the cheapest setting whose judged rate at ``target_length`` is
  >= ``target_rate`` while the indexer still selects there: a setting whose top-k holds every
  compressed entry at that length (``k_used >= length // 4``) restores recall by reading
  everything, a **capacity workaround**, listed under ``workarounds`` and never named the fix.
* Under a ``patch`` (a planted or deployed fault) every row carries it: the verdict opens by
  saying so, and a setting that restores recall under it is a workaround while the patch stays.
* **Cost order** (cheapest first): smaller ``index_topk``, then fewer key + query bits
  (fp4_e2m1 4 < fp8_e4m3 = fp8_e4m3_block128 8 < bf16 = fp16 16 < fp32 32), then fewer key
  bits.
* The **baseline** is the cheapest precision pair at the smallest index_topk of the grid; the
  verdict names, per axis, how far each other precision pair (at the baseline index_topk) and
  each other index_topk (at the baseline precision) restores recall (selection beside it).
* The patch is applied exactly once per setting and model instance (``run_sweep``'s docstring).
  ``k_used`` is the k the indexer's topk calls used; a rank taken from the scores that topk
  ranked and a selection that disagree (rank <= k, not selected) are counted in
  ``rank_inconsistent``.

``sweep.json`` schema (``SWEEP_SCHEMA``): see docs/dsa_rankdump.md, "sweep.json schema"; the
keys ``judged_by``, ``settings[].ci95_at_target``, ``selection_restored_to``,
``selection_rate_at_target``, ``cells[].answer_recall_ci95``, ``k_used``, ``rank_inconsistent``,
``runs[].k_used`` and ``runs[].layers[].rank_consistent`` are written by this version.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from needlescope.analysis.curve import longest_passing
from needlescope.analysis.stats import wilson_interval
from needlescope.cases.assemble import CaseSpec, build_cases
from needlescope.cases.needles import VALUE_DIGITS
from needlescope.dsa.emulate import (
    IndexerCapture,
    apply_patch_once,
    emulate,
    patched_for_good,
)
from needlescope.dsa.prompt import render_prompt
from needlescope.dsa.random_layer import (
    RANDOM_LAYER,
    RandomLayerConfig,
    make_context,
    random_indexer,
    score_needle,
)
from needlescope.dsa.rankdump import DEFAULT_MAX_NEW_TOKENS, rank_dump
from needlescope.dsa.sweep_report import (
    SWEEP_SCHEMA,
    fmt_setting,
    patch_lines,
    render_sweep_md,
    validate_sweep,
    workaround_lines,
)
from needlescope.errors import BadInput
from needlescope.progress import Progress, no_progress
from needlescope.setting import PRECISIONS, PatchRef, Setting, check_precision, check_score_dtype

__all__ = [
    "SWEEP_SCHEMA",
    "SweepConfig",
    "setting_cost",
    "restored_to",
    "cheapest_setting",
    "summarize_runs",
    "run_sweep",
    "run_random_layer_sweep",
    "assemble_sweep",
    "validate_sweep",
    "render_sweep_md",
]


def _key(s: Setting) -> tuple[str, str, int]:
    """(index_k, index_q, index_topk): what varies across the grid; cells and runs are keyed by it."""
    return (s.index_k, s.index_q, s.index_topk)


@dataclass(frozen=True)
class SweepConfig:
    """The sweep grid. ``target_length=None`` means the longest length."""

    index_topk: tuple[int, ...]
    lengths: tuple[int, ...] = (256, 1024)
    index_k: tuple[str, ...] = ("fp32",)
    index_q: tuple[str, ...] = ("fp32",)
    score_dtype: str = "fp32"
    kind: str = "multiturn"
    depths: tuple[float, ...] = (50.0,)
    trials: int = 1
    seed: int = 0
    target_length: int | None = None
    target_rate: float = 0.9
    generate: bool = True
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    value_digits: int = VALUE_DIGITS
    patch: PatchRef | None = None
    """Applied to every grid point (a spec string is resolved; the file is not executed here)."""

    def __post_init__(self) -> None:
        for name in ("index_k", "index_q", "index_topk", "lengths"):
            vals = getattr(self, name)
            if not vals:
                raise BadInput(f"{name} is empty; give at least one value")
            if len(set(vals)) != len(vals):
                raise BadInput(f"{name} contains duplicates: {list(vals)}")
        for name in self.index_k:
            check_precision(name, "key precision (index_k)")
        for name in self.index_q:
            check_precision(name, "query precision (index_q)")
        check_score_dtype(self.score_dtype)
        if isinstance(self.patch, str):
            object.__setattr__(self, "patch", PatchRef.resolve(self.patch))
        bad = [k for k in self.index_topk if isinstance(k, bool) or not isinstance(k, int) or k < 1]
        if bad:
            raise BadInput(f"index_topk values must be positive integers, got {bad}")
        if self.target_length is not None and self.target_length not in self.lengths:
            raise BadInput(
                f"target length {self.target_length} is not one of the swept lengths {list(self.lengths)}"
            )
        if not 0.0 < self.target_rate <= 1.0:
            raise BadInput(f"target rate must be in (0, 1], got {self.target_rate}")
        if self.max_new_tokens < 1:
            raise BadInput(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # CaseSpec validates kind, lengths, depths and trials.
        self.case_spec()

    def case_spec(self) -> CaseSpec:
        return CaseSpec(
            kind=self.kind,
            lengths=self.lengths,
            depths=self.depths,
            trials=self.trials,
            seed=self.seed,
            value_digits=self.value_digits,
        )

    @property
    def target(self) -> int:
        return self.target_length if self.target_length is not None else max(self.lengths)

    def settings(self) -> list[Setting]:
        """Every (index_k, index_q, index_topk) of the grid as a ``Setting`` (with the sweep's
        score dtype and patch), cheapest first."""
        grid = itertools.product(self.index_k, self.index_q, self.index_topk)
        settings = [
            Setting(index_k=k, index_q=q, score_dtype=self.score_dtype, index_topk=topk, patch=self.patch)
            for k, q, topk in grid
        ]
        return sorted(settings, key=setting_cost)


def setting_cost(setting: Setting) -> tuple:
    """Sort key of the cost order: index_topk, then key + query bits, then key bits, then names."""
    k, q, topk = _key(setting)
    return (topk, PRECISIONS[k] + PRECISIONS[q], PRECISIONS[k], k, q)


def restored_to(rates: dict[int, float | None], target_rate: float) -> int | None:
    """Longest length L with rate >= target_rate at L and every shorter length (None rates skipped)."""
    return longest_passing(rates.items(), target_rate)


def cheapest_setting(
    rates_at_target: dict[Setting, float | None], target_rate: float
) -> tuple[Setting, float] | None:
    """The cheapest setting (``setting_cost``) whose rate at the target length reaches target_rate."""
    ok = [(s, r) for s, r in rates_at_target.items() if r is not None and r >= target_rate]
    return min(ok, key=lambda sr: setting_cost(sr[0])) if ok else None


def _first_answer_layers(dump: dict, k_used: int) -> list[dict]:
    """Per CSA layer, the record at the first answer position (last prompt position), if visible.

    ``rank_consistent`` is false when the needle's rank says it is inside the top-``k_used``
    but it was not selected (the ranked scores are not the ones the top-k used).
    """
    first = dump["prompt_tokens"] - 1
    out = []
    for layer in dump["layers"]:
        for p in layer["positions"]:
            if p["query_pos"] == first:
                out.append(
                    {
                        "layer": layer["layer"],
                        "selected": p["selected"],
                        "best_rank": p["best_rank"],
                        "margin_frac": p["margin_frac"],
                        "rank_consistent": p["best_rank"] > k_used or bool(p["selected"]),
                    }
                )
    return out


def summarize_runs(runs: list[dict], layers: list[int], generate: bool) -> list[dict]:
    """Aggregate ``runs`` (see the schema) into cells, one per (setting, length), in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["index_k"], r["index_q"], r["index_topk"], r["length"]), []).append(r)
    cells = []
    for (k, q, topk, length), rs in groups.items():
        scored = [r for r in rs if r["selected"] is not None]
        sel = sum(bool(r["selected"]) for r in scored)
        per_layer = []
        for lid in layers:
            recs = [lay for r in rs for lay in r["layers"] if lay["layer"] == lid]
            n = len(recs)
            per_layer.append(
                {
                    "layer": lid,
                    "n": n,
                    "selected": sum(x["selected"] for x in recs),
                    "rate": (sum(x["selected"] for x in recs) / n) if n else None,
                    "median_best_rank": float(statistics.median(x["best_rank"] for x in recs)) if n else None,
                    "mean_margin_frac": (sum(x["margin_frac"] for x in recs) / n) if n else None,
                }
            )
        correct = sum(bool(r["answer_correct"]) for r in rs) if generate else None
        ks = [r["k_used"] for r in rs if r.get("k_used") is not None]
        cells.append(
            {
                "index_k": k,
                "index_q": q,
                "index_topk": topk,
                "length": length,
                "cases": len(rs),
                "scored": len(scored),
                "unscored": len(rs) - len(scored),
                "selected": sel,
                "selection_rate": (sel / len(scored)) if scored else None,
                "answers_correct": correct,
                "answer_recall": (correct / len(rs)) if generate and rs else None,
                "answer_recall_ci95": list(wilson_interval(correct, len(rs))) if generate and rs else None,
                "k_used": max(ks) if ks else topk,
                "rank_inconsistent": sum(
                    not lay.get("rank_consistent", True) for r in rs for lay in r["layers"]
                ),
                "per_layer": per_layer,
            }
        )
    return cells


def reads_everything(k_used: int, length: int) -> bool:
    """Whether a top-``k_used`` holds every compressed entry (one per 4 tokens) of ``length``
    tokens: selection is trivial, and restoring recall that way is a capacity workaround."""
    return k_used >= length // 4


def _verdict(
    cfg: SweepConfig, settings: list[dict], cheapest, baseline: Setting, metric: str, workarounds: list[dict]
) -> list[str]:
    """Verdict lines, judged by ``metric`` (answer recall with generation), selection beside it:
    the patch every row carries first, then each axis, the cheapest setting that still selects,
    and the capacity workarounds."""
    by = {(s["index_k"], s["index_q"], s["index_topk"]): s for s in settings}
    base = _key(baseline)
    bk, bq, btopk = base
    what = "answer recall" if metric == "answer_recall" else "selection"
    lines = patch_lines(None if cfg.patch is None else cfg.patch.spec)

    def reach(s: dict) -> str:
        judged = f"to {s['restored_to']} tokens" if s["restored_to"] is not None else "at no tested length"
        if metric != "answer_recall":
            return judged
        sel = s["selection_restored_to"]
        return f"{judged} (selection {f'to {sel} tokens' if sel is not None else 'at no tested length'})"

    base_reach = by[base]["restored_to"]

    def vs_base(s: dict) -> str:
        r = s["restored_to"]
        if r is not None and (base_reach is None or r > base_reach):
            return ""
        return " (no further than the baseline)"

    lines.append(f"baseline {fmt_setting(bk, bq, btopk)} keeps {what} {reach(by[base])}")
    for k, q in itertools.product(cfg.index_k, cfg.index_q):
        if (k, q) != (bk, bq):
            s = by[(k, q, btopk)]
            lines.append(f"{fmt_setting(k, q)} (index_topk {btopk}) restores {what} {reach(s)}{vs_base(s)}")
    for topk in sorted(cfg.index_topk):
        if topk != btopk:
            s = by[(bk, bq, topk)]
            lines.append(f"index_topk {topk} ({fmt_setting(bk, bq)}) restores {what} {reach(s)}{vs_base(s)}")
    target = cfg.target
    under = " under the patch" if cfg.patch is not None else ""
    if cheapest is None:
        still = " while the indexer still selects" if workarounds else ""
        lines.append(
            f"no setting in the grid reaches {what} {cfg.target_rate:g} at {target} tokens{under}{still}"
        )
    else:
        (k, q, topk), rate = _key(cheapest[0]), cheapest[1]
        s = by[(k, q, topk)]
        detail = f"{what} {rate:.2f}"
        if s["ci95_at_target"] is not None:
            lo, hi = s["ci95_at_target"]
            detail += f" [95% CI {lo:.2f}-{hi:.2f}]"
        if metric == "answer_recall" and s["selection_rate_at_target"] is not None:
            detail += f", selection {s['selection_rate_at_target']:.2f}"
        lines.append(
            f"cheapest setting restoring {what} at {target} tokens{under} ({what} >= {cfg.target_rate:g}): "
            f"{fmt_setting(k, q, topk)} ({detail})"
        )
        r = s["restored_to"]
        if r is None or r < target:
            lines.append(
                f"note: {fmt_setting(k, q, topk)} falls below {cfg.target_rate:g} at a shorter length "
                f"(unbroken only to {r if r is not None else 'no tested length'}); check the table"
            )
    return lines + workaround_lines(workarounds, target, what)


def _model_runs(
    model,
    tokenizer,
    cfg: SweepConfig,
    progress: Progress,
    reload: Callable[[], torch.nn.Module] | None,
) -> tuple[list[dict], set[int]]:
    """(runs, CSA layer ids seen) of the grid on a model: one ``rank_dump`` per (setting, case)."""

    def count_tokens(messages: list[dict]) -> int:
        return len(render_prompt(tokenizer, messages).input_ids)

    cases = build_cases(cfg.case_spec(), count_tokens)
    grid = cfg.settings()
    total = len(cases) * len(grid)
    runs: list[dict] = []
    layers: set[int] = set()
    for i, setting in enumerate(grid):
        if i > 0 and patched_for_good(model):
            if reload is None:
                raise BadInput(
                    f"patch {str(cfg.patch)!r} returned no undo, so each setting needs a fresh model; "
                    "give run_sweep a reload callable (the CLI does)"
                )
            model = reload()
        capture = IndexerCapture(keep_scores=True)
        with torch.no_grad(), emulate(model, setting.numerics_only, capture=capture):
            undo = apply_patch_once(model, cfg.patch) if cfg.patch is not None else None
            try:
                for case in cases:
                    dump = rank_dump(
                        model,
                        tokenizer,
                        case.messages,
                        needle=case.needle,
                        setting=setting,
                        query_positions=None if cfg.generate else [count_tokens(case.messages) - 1],
                        max_new_tokens=cfg.max_new_tokens,
                        expected=case.expected if cfg.generate else None,
                        label=case.case_id,
                        capture=capture,
                    )
                    layers.update(layer["layer"] for layer in dump["layers"])
                    k_used = capture.k_used()
                    recs = _first_answer_layers(dump, k_used if k_used is not None else setting.index_topk)
                    runs.append(
                        {
                            **_run_head(case.case_id, case.length, case.depth, case.trial, setting),
                            "prompt_tokens": dump["prompt_tokens"],
                            "k_used": k_used,
                            "selected": all(r["selected"] for r in recs) if recs else None,
                            "layers": recs,
                            "answer": dump["generated_text"] if cfg.generate else None,
                            "answer_correct": dump["answer_correct"] if cfg.generate else None,
                        }
                    )
                    progress("sweep", len(runs), total, "")
            finally:
                if undo is not None:
                    undo()
    return runs, layers


def _run_head(case_id: str, length: int, depth: float, trial: int, setting: Setting) -> dict:
    k, q, topk = _key(setting)
    return {
        "case_id": case_id,
        "length": length,
        "depth": depth,
        "trial": trial,
        "index_k": k,
        "index_q": q,
        "index_topk": topk,
    }


def run_sweep(
    model,
    tokenizer,
    cfg: SweepConfig,
    *,
    model_label: str = "",
    progress: Progress = no_progress,
    reload: Callable[[], torch.nn.Module] | None = None,
) -> dict:
    """Run the sweep grid on ``model``; returns a dict following ``SWEEP_SCHEMA``.

    The patch (``cfg.patch``) is applied exactly once per setting and model instance, and
    every case of the setting runs on that one patched model. A patch that returns its undo
    is undone after the setting and the model is reused; one that returns no undo leaves the
    model changed, so the next setting runs on a fresh model from ``reload()`` (BadInput when
    no ``reload`` is given). ``progress("sweep", done, total, "")`` is called after each (case, setting) run.
    """
    runs, layers = _model_runs(model, tokenizer, cfg, progress, reload)
    return assemble_sweep(cfg, runs, sorted(layers), model_label)


def run_random_layer_sweep(
    cfg: SweepConfig,
    layer_cfg: RandomLayerConfig,
    *,
    device: str = "cpu",
    progress: Progress = no_progress,
) -> dict:
    """The sweep grid on one random full-size indexer layer (``dsa.random_layer``), no checkpoint.

    Cases are (length, depth, trial) contexts of exactly ``length`` tokens, the query at the last
    position; each context is drawn once (seeded from ``cfg.seed``) and scored under every
    setting, so settings differ only in numerics. ``generate`` must be off (a layer has no
    answers): cells are judged by needle selection. ``cfg.patch`` is applied once per setting to
    the layer module (as ``run_sweep`` does to a model); the layer is rebuilt after a patch that
    gave no undo. The one CSA layer is layer 0; ``runs[].layers[0]`` holds its rank and margin.
    """
    if cfg.generate:
        raise BadInput("a random indexer layer has no answers to generate; sweep it with generate off")
    grid = cfg.settings()
    cases = [
        (length, depth, trial)
        for length in cfg.lengths
        for depth in cfg.depths
        for trial in range(cfg.trials)
    ]
    total = len(cases) * len(grid)
    layer = random_indexer(layer_cfg, device, seed=cfg.seed)
    by_setting: dict[Setting, list[dict]] = {s: [] for s in grid}
    done = 0
    for ci, (length, depth, trial) in enumerate(cases):
        ctx = make_context(layer, layer_cfg, length, depth, seed=cfg.seed * 1_000_003 + ci + 1)
        for setting in grid:
            if patched_for_good(layer):
                layer = random_indexer(layer_cfg, device, seed=cfg.seed)
            with torch.no_grad(), emulate(layer, setting.numerics_only):
                undo = apply_patch_once(layer, cfg.patch) if cfg.patch is not None else None
                try:
                    stats, selected = score_needle(layer, ctx, setting.index_topk)
                finally:
                    if undo is not None:
                        undo()
            case_id = f"random-{length}-d{depth:g}-t{trial}"
            by_setting[setting].append(
                {
                    **_run_head(case_id, length, float(depth), trial, setting),
                    "prompt_tokens": length,
                    "k_used": stats.k,
                    "needle_entry": ctx.needle_entry,
                    "selected": selected,
                    "layers": [
                        {
                            "layer": 0,
                            "selected": selected,
                            "best_rank": stats.best_rank,
                            "margin_frac": stats.margin_frac,
                            "rank_consistent": stats.best_rank > stats.k or selected,
                        }
                    ],
                    "answer": None,
                    "answer_correct": None,
                }
            )
            done += 1
            progress("sweep", done, total, "")
    runs = [r for s in grid for r in by_setting[s]]
    label = f"{RANDOM_LAYER} (seed {cfg.seed}, needle strength {layer_cfg.strength:g})"
    return {**assemble_sweep(cfg, runs, [0], label), "kind": "planted key"}


def _setting_rows(cfg: SweepConfig, grid: list[Setting], by_cell: dict, metric: str) -> list[dict]:
    """``settings[]`` of sweep.json: per setting, how far its judged rate and its selection hold."""
    target = cfg.target
    rows = []
    for rank, s in enumerate(grid):
        rates = {length: by_cell[(*_key(s), length)][metric] for length in cfg.lengths}
        sel = {length: by_cell[(*_key(s), length)]["selection_rate"] for length in cfg.lengths}
        rows.append(
            {
                "index_k": s.index_k,
                "index_q": s.index_q,
                "index_topk": s.index_topk,
                "cost_rank": rank,
                "restored_to": restored_to(rates, cfg.target_rate),
                "rate_at_target": rates[target],
                "ci95_at_target": by_cell[(*_key(s), target)]["answer_recall_ci95"],
                "selection_restored_to": restored_to(sel, cfg.target_rate),
                "selection_rate_at_target": sel[target],
            }
        )
    return rows


def assemble_sweep(cfg: SweepConfig, runs: list[dict], layers: list[int], model_label: str) -> dict:
    """The ``sweep.json`` object (``SWEEP_SCHEMA``) of ``runs`` over ``cfg``'s grid."""
    cells = summarize_runs(runs, layers, cfg.generate)
    metric = "answer_recall" if cfg.generate else "selection_rate"
    by_cell = {(c["index_k"], c["index_q"], c["index_topk"], c["length"]): c for c in cells}
    grid = cfg.settings()
    target = cfg.target
    settings = _setting_rows(cfg, grid, by_cell, metric)
    at_target = {s: by_cell[(*_key(s), target)] for s in grid}
    trivial = {s for s, c in at_target.items() if reads_everything(c["k_used"], target)}
    cheapest = cheapest_setting(
        {s: c[metric] for s, c in at_target.items() if s not in trivial}, cfg.target_rate
    )
    workarounds = [
        {
            "index_k": s.index_k,
            "index_q": s.index_q,
            "index_topk": s.index_topk,
            "rate": c[metric],
            "k_used": c["k_used"],
        }
        for s, c in at_target.items()
        if s in trivial and c[metric] is not None and c[metric] >= cfg.target_rate
    ]
    precisions = sorted(
        itertools.product(cfg.index_k, cfg.index_q),
        key=lambda kq: (PRECISIONS[kq[0]] + PRECISIONS[kq[1]], PRECISIONS[kq[0]], kq),
    )
    bk, bq = precisions[0]
    baseline = Setting(bk, bq, cfg.score_dtype, min(cfg.index_topk), patch=cfg.patch)
    return {
        "model": model_label,
        "kind": cfg.kind,
        "lengths": list(cfg.lengths),
        "depths": [float(x) for x in cfg.depths],
        "trials": cfg.trials,
        "seed": cfg.seed,
        "value_digits": cfg.value_digits,
        "score_dtype": cfg.score_dtype,
        "target_length": target,
        "target_rate": cfg.target_rate,
        "generate": cfg.generate,
        "judged_by": metric,
        "patch": None if cfg.patch is None else cfg.patch.spec,
        "settings": settings,
        "cells": cells,
        "runs": runs,
        "cheapest": (
            None
            if cheapest is None
            else {
                "index_k": cheapest[0].index_k,
                "index_q": cheapest[0].index_q,
                "index_topk": cheapest[0].index_topk,
                "rate": cheapest[1],
            }
        ),
        "workarounds": workarounds,
        "baseline": {"index_k": bk, "index_q": bq, "index_topk": baseline.index_topk},
        "verdict": _verdict(cfg, settings, cheapest, baseline, metric, workarounds),
    }
