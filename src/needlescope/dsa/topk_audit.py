"""Audit an engine's top-k selections against the exact top-k of the logits it ranked.

Pure functions over numpy arrays (no torch, no I/O). One *row* is one query's logits ``x[0..L)``
and the engine's selection ``sel[0..k)`` (entry indices, any negative value = an empty slot).

Definitions (``docs/topk_audit.md`` states them for users):

* **Candidates** of a row: the columns ``j < length`` whose value is not ``-inf`` and not NaN
  (``-inf`` is the padding and causal mask every engine uses). ``+inf`` is a candidate that ranks
  above every finite value. ``k_eff = min(k, candidates)``.
* **Reference top-k** (``reference_topk``): candidates ordered by value, compared exactly in
  float64 (every float32/fp16/bf16 logit converts exactly), larger first; equal values by
  ascending column (the tie rule). The first ``k_eff`` of that order.
* **Cut-off value** ``v_k``: the value of the ``k_eff``-th entry of that order. Ties at the
  cut-off make any choice among the tied entries correct, so the judgement is tie-robust:
  ``above`` = candidates with value > ``v_k`` (all must be selected), ``ties`` = candidates
  equal to ``v_k``, of which ``tie_slots = k_eff - above`` must be selected.
* **Wrongly kept**: selection slots that are not a valid choice: invalid slots (column out of
  range or not a candidate, or a repeated column) + selected candidates below ``v_k`` + selected
  ties beyond ``tie_slots``.
* **Wrongly dropped**: unselected ``above`` entries + tie slots left unfilled
  (``max(0, tie_slots - selected ties)``). A row is **exact** when both counts are 0.
* **Selected-value recall**: ``sum_{j in S} (x_j - m) / sum_{j in T} (x_j - m)`` with ``S`` the
  distinct valid candidates selected, ``T`` the reference top-k and ``m`` the row's lowest
  candidate value (the shift keeps the ratio in [0, 1] for negative logits: 1 when the selected
  values are the true top-k values, 0 when everything selected sits at the row's floor). For the
  sums only, ``+inf`` counts as the row's largest finite candidate. When the denominator is 0
  (every top-k value equals ``m``) the recall is ``|S| / k_eff``; a row with ``k_eff = 0`` has
  recall 1. Recall 1.0 does not imply exact (dropping an entry worth ``m`` costs nothing);
  exactness comes from the counts.
* **Overlap**: ``(k_eff - wrongly dropped) / k_eff``, the share of the true top-k slots the
  selection filled correctly (1 when ``k_eff = 0``). Selected-value recall weighs each miss by
  how much value it lost, overlap counts misses: a crowded cut-off bin of near-equal logits can
  lose a third of the entries at a recall of 0.97.
* **Cut-off bin**: ``ties_at_cutoff`` candidates share ``v_k`` exactly, ``cutoff_bin_count``
  share its radix bin: the top ``bin_bits`` bits of the order-preserving uint32 key of the
  float32 value (the first histogram pass of a radix top-k). A crowded bin is where dropping
  kernels fail (a candidate buffer that overflows).
* **Nothing to audit is never exact.** A row with no candidate (every column in use ``-inf`` or
  NaN, or a length of 0), a selection of width k = 0, and a row with NaN logits among its
  columns in use (``nan_logits``: the indexer computed garbage, whatever was selected) are not
  exact, whatever the counts say: an empty comparison proves nothing about the kernel. (The
  report counts a row with no candidate that selected nothing as *empty*: not audited, since an
  early query row of a real capture sees no entry yet; a capture of empty rows only is flagged.)
"""

from __future__ import annotations

import numpy as np

__all__ = ["AUDIT_COLUMNS", "DEFAULT_BIN_BITS", "TIE_RULE", "audit_rows", "float32_key", "reference_topk"]

DEFAULT_BIN_BITS = 11
"""2,048 bins: the width of a common first radix pass over float32 keys."""

TIE_RULE = "value descending, compared in float64; equal values by ascending column; any choice among ties at the cut-off is exact"

AUDIT_COLUMNS = (
    "candidates",
    "k_eff",
    "selected_valid",
    "wrongly_kept",
    "wrongly_dropped",
    "invalid_selected",
    "recall",
    "overlap",
    "kth_value",
    "ties_at_cutoff",
    "tie_slots",
    "cutoff_bin_count",
    "nan_logits",
    "exact",
)
"""Keys of ``audit_rows``' result, each an array [R]."""

_CHUNK_ELEMENTS = 1 << 22  # rows are audited in chunks of about this many logits (memory bound)


def float32_key(values: np.ndarray) -> np.ndarray:
    """uint32 keys ordering like the float32 values (NaN aside): flip all bits of negatives, the sign of the rest."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))


def _candidates(values: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """Bool [R, L]: column j < length, value neither -inf nor NaN."""
    cand = ~np.isnan(values) & (values != -np.inf)
    if lengths is not None:
        cand &= np.arange(values.shape[1])[None, :] < np.asarray(lengths).reshape(-1, 1)
    return cand


def reference_topk(values: np.ndarray, k: int, lengths: np.ndarray | None = None) -> np.ndarray:
    """int64 [R, k]: the exact top-k columns of each row by the tie rule (``TIE_RULE``), -1 padded.

    values: [R, L] logits (any float dtype; compared in float64); lengths: [R] columns in use
    per row (None: all). Rows with fewer than k candidates are padded with -1.
    """
    x = np.asarray(values, dtype=np.float64)
    order, cand = _order(x, lengths)
    k_eff = np.minimum(cand.sum(axis=1), k)
    out = np.full((x.shape[0], k), -1, dtype=np.int64)
    width = min(k, x.shape[1])
    out[:, :width] = order[:, :width]
    out[np.arange(k)[None, :] >= k_eff[:, None]] = -1
    return out


def _order(x: np.ndarray, lengths: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(columns [R, L] in reference order, non-candidates last; candidate mask [R, L])."""
    cand = _candidates(x, lengths)
    # A stable ascending sort of -x keeps equal values in column order: the tie rule.
    key = np.where(cand, -x, np.inf)
    return np.argsort(key, axis=1, kind="stable"), cand


def audit_rows(
    logits: np.ndarray,
    selected: np.ndarray,
    lengths: np.ndarray | None = None,
    *,
    bin_bits: int = DEFAULT_BIN_BITS,
) -> dict[str, np.ndarray]:
    """Per-row audit of ``selected`` [R, k] (int, negative = empty slot) against ``logits`` [R, L].

    lengths: [R] columns in use per row (None: every column). Returns ``AUDIT_COLUMNS`` -> array
    [R] (``recall``, ``overlap`` and ``kth_value`` float64, NaN ``kth_value`` when k_eff is 0; ``exact``
    bool; the rest int64). Definitions in the module docstring. ValueError on mismatched shapes.
    """
    x = np.asarray(logits)
    sel = np.asarray(selected)
    if x.ndim != 2 or sel.ndim != 2 or x.shape[0] != sel.shape[0]:
        raise ValueError(
            f"logits must be [R, L] and selected [R, k] with the same R; got {x.shape}, {sel.shape}"
        )
    if lengths is not None and np.asarray(lengths).shape != (x.shape[0],):
        raise ValueError(f"lengths must be [R] = [{x.shape[0]}], got {np.asarray(lengths).shape}")
    if not 1 <= bin_bits <= 32:
        raise ValueError(f"bin_bits must be in 1..32, got {bin_bits}")
    if x.shape[1] == 0:  # no columns at all: one -inf column, never a candidate, keeps the indexing simple
        x = np.full((x.shape[0], 1), -np.inf)
    step = max(1, _CHUNK_ELEMENTS // x.shape[1])
    parts = []
    for lo in range(0, x.shape[0], step):
        part_len = None if lengths is None else np.asarray(lengths)[lo : lo + step]
        parts.append(_audit_chunk(x[lo : lo + step], sel[lo : lo + step], part_len, bin_bits))
    if not parts:
        return {name: np.zeros(0) for name in AUDIT_COLUMNS}
    return {name: np.concatenate([p[name] for p in parts]) for name in AUDIT_COLUMNS}


def _selected_mask(sel: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bool [R, L] distinct valid candidates selected, int [R] invalid slots incl. repeats)."""
    R, L = cand.shape
    used = sel >= 0
    in_range = used & (sel < L)
    cols = np.where(in_range, sel, 0)
    valid = in_range & cand[np.arange(R)[:, None], cols]
    mask = np.zeros((R, L), dtype=bool)
    rows = np.broadcast_to(np.arange(R)[:, None], sel.shape)
    mask[rows[valid], cols[valid]] = True
    invalid = used.sum(axis=1) - mask.sum(axis=1)  # out of range, non-candidates and repeats
    return mask, invalid


def _audit_chunk(logits: np.ndarray, sel: np.ndarray, lengths, bin_bits: int) -> dict[str, np.ndarray]:
    """``audit_rows`` over rows [R, L >= 1] that fit in memory at once."""
    x = np.asarray(logits, dtype=np.float64)  # exact for float32 / fp16 / bf16 inputs
    R, L = x.shape
    k = sel.shape[1]
    order, cand = _order(x, lengths)
    n_cand = cand.sum(axis=1)
    k_eff = np.minimum(n_cand, k)
    has = k_eff > 0
    kth_col = order[np.arange(R), np.maximum(k_eff - 1, 0)]
    v_k = np.where(has, x[np.arange(R), kth_col], np.nan)
    above = cand & (x > v_k[:, None])
    ties = cand & (x == v_k[:, None])
    tie_slots = k_eff - above.sum(axis=1)
    chosen, invalid = _selected_mask(sel.astype(np.int64), cand)
    sel_above = (chosen & above).sum(axis=1)
    sel_ties = (chosen & ties).sum(axis=1)
    sel_below = (chosen & cand & ~above & ~ties).sum(axis=1)
    kept = invalid + sel_below + np.maximum(0, sel_ties - tie_slots)
    dropped = (above.sum(axis=1) - sel_above) + np.maximum(0, tie_slots - sel_ties)
    in_top = np.arange(L)[None, :] < k_eff[:, None]
    top_mask = np.zeros_like(cand)
    np.put_along_axis(top_mask, order, in_top, axis=1)
    # Non-candidates get key 0.0: they never count, whatever their bin.
    bins = float32_key(np.where(cand, x, 0.0)) >> np.uint32(32 - bin_bits)
    kth_bin = bins[np.arange(R), kth_col]
    in_use = (
        np.ones_like(cand) if lengths is None else np.arange(L)[None, :] < np.asarray(lengths).reshape(-1, 1)
    )
    nan_logits = (np.isnan(x) & in_use).sum(axis=1)
    return {
        "candidates": n_cand.astype(np.int64),
        "k_eff": k_eff.astype(np.int64),
        "selected_valid": chosen.sum(axis=1).astype(np.int64),
        "wrongly_kept": kept.astype(np.int64),
        "wrongly_dropped": dropped.astype(np.int64),
        "invalid_selected": invalid.astype(np.int64),
        "recall": _recall(x, cand, chosen, top_mask, k_eff),
        "overlap": np.where(has, (k_eff - dropped) / np.maximum(k_eff, 1), 1.0),
        "kth_value": v_k,
        "ties_at_cutoff": np.where(has, ties.sum(axis=1), 0).astype(np.int64),
        "tie_slots": np.where(has, tie_slots, 0).astype(np.int64),
        "cutoff_bin_count": np.where(has, (cand & (bins == kth_bin[:, None])).sum(axis=1), 0).astype(
            np.int64
        ),
        "nan_logits": nan_logits.astype(np.int64),
        # Nothing to select (no candidate, k = 0) or NaN logits: never exact (module docstring).
        "exact": (kept == 0) & (dropped == 0) & (n_cand > 0) & (k > 0) & (nan_logits == 0),
    }


def _recall(x, cand, chosen, top_mask, k_eff) -> np.ndarray:
    """float64 [R] selected-value recall (module docstring), shifted by each row's lowest candidate."""
    finite = cand & np.isfinite(x)
    top_finite = np.where(finite, x, -np.inf).max(axis=1, initial=-np.inf)
    low = np.where(cand, x, np.inf).min(axis=1, initial=np.inf)
    low = np.where(np.isfinite(low), low, np.where(np.isfinite(top_finite), top_finite, 0.0))
    top_finite = np.where(np.isfinite(top_finite), top_finite, low)
    worth = np.where(finite, x, np.where(cand, top_finite[:, None], 0.0)) - low[:, None]
    num = np.where(chosen, worth, 0.0).sum(axis=1)
    den = np.where(top_mask, worth, 0.0).sum(axis=1)
    by_count = np.where(k_eff > 0, chosen.sum(axis=1) / np.maximum(k_eff, 1), 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), by_count)
