"""Per CSA layer: the candidate's and reference's selections compared as sets
(``selection_error``: mean over rows of |A Δ B| / |A ∪ B|, so additions count as drops do;
``topk_overlap = 1 - selection_error``; ``positions_changed`` = rows whose set changed), and
the needle's rank at the last prompt position **in the scores the top-k call actually
ranked** (``IndexerCapture`` keeps them): 1 + non-needle entries with a finite score >= the
best needle entry's; ``k`` is the k that call used. ``rank_consistent`` checks that a rank
<= k means selected.
"""

from __future__ import annotations

import math

import torch

from needlescope.dsa.emulate import IndexerCapture
from needlescope.dsa.module_replay import selection_error
from needlescope.dsa.rankdump import selected_in
from needlescope.dsa.reference import visible_entries


def needle_rank(scores: torch.Tensor, needle_entries: list[int]) -> int | None:
    """1 + non-needle entries with a finite score >= the best needle entry's (None: no needle entry scored).

    scores: [L] the row the top-k call ranked (entries it could not pick are -inf).
    """
    ne = [e for e in needle_entries if e < scores.shape[0] and math.isfinite(float(scores[e]))]
    if not ne:
        return None
    best = scores[ne].max()
    others = torch.ones_like(scores, dtype=torch.bool)
    others[ne] = False
    return 1 + int((torch.isfinite(scores) & others & (scores >= best)).sum())


def _needle_side(cap: IndexerCapture, layer: int, query_pos: int, entries: list[int], ratio: int):
    """(rank, selected, visible needle entries, k) of one run at ``query_pos``."""
    visible = visible_entries(query_pos, ratio)
    ne = [e for e in entries if e < visible]
    calls = [c for c in cap.calls if c.layer == layer]
    k = max((c.k for c in calls if c.k is not None), default=None)
    positions, rows = cap.score_rows(layer)
    hits = (positions == query_pos).nonzero()
    if not ne or len(hits) == 0:
        return None, None, ne, k
    i = int(hits[0])
    width = max(int(c.topk.shape[-1]) for c in calls)
    pos, topk = cap.rows(layer, width)
    sel = selected_in(topk[int((pos == query_pos).nonzero()[0])], ne)
    return needle_rank(rows[i], ne), sel, ne, k


def layer_rows(layers, ref_cap, cand_cap, entries, query_pos, ratio, topk_by_layer) -> list[dict]:
    """One ``diff.json`` ``layers`` row per CSA layer (module docstring), from both runs' captures."""
    out = []
    for layer in layers:
        width = max(int(c.topk.shape[-1]) for c in ref_cap.calls + cand_cap.calls if c.layer == layer)
        _, ref_topk = ref_cap.rows(layer, width)
        _, cand_topk = cand_cap.rows(layer, width)
        err, changed, counted = selection_error(cand_topk, ref_topk)
        rr, rs, ne, k_ref = _needle_side(ref_cap, layer, query_pos, entries, ratio)
        cr, cs, _, k_cand = _needle_side(cand_cap, layer, query_pos, entries, ratio)
        consistent = all(
            rank is None or k is None or rank > k or bool(sel)
            for rank, sel, k in ((rr, rs, k_ref), (cr, cs, k_cand))
        )
        out.append(
            {
                "layer": layer,
                "index_topk": topk_by_layer[layer],
                "k_reference": k_ref,
                "k_candidate": k_cand,
                "topk_overlap": 1.0 - err,
                "selection_error": err,
                "positions_changed": changed,
                "positions": counted,
                "needle_entries": ne,
                "needle_rank_reference": rr,
                "needle_rank_candidate": cr,
                "needle_selected_reference": rs,
                "needle_selected_candidate": cs,
                "rank_consistent": consistent,
            }
        )
    return out
