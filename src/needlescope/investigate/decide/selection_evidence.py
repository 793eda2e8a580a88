"""``characterize.LayerSelection`` from selected entries: pure Python over sets of ints.

``layer_selection(layer, path, rows)`` takes, for one CSA layer on one path, the analysed query
rows as ``Row`` (the candidate's and the reference's selected entries, the entries visible, the
needle's entries) and computes what the characterization's rules read:

* the mean Jaccard overlap and its chance null J0 (``characterize.jaccard_chance``);
* needle entries visible, selected by each, and the Jaccard over the non-needle entries;
* the best constant shift d != 0 (|d| <= ``MAX_SHIFT``) of the candidate's entries and its
  Jaccard (a key cache read one slot off selects the reference's entries plus d);
* the best Jaccard under a page permutation (``PAGE`` entries a page: pages matched one to one
  by their selected offsets), the misaddressing of a page table;
* the share of each selection in the first and the last quarter of the visible entries, out of
  the most that quarter can hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from needlescope.analysis.stats import jaccard
from needlescope.investigate.decide.characterize import LayerSelection, jaccard_chance

__all__ = ["MAX_SHIFT", "PAGE", "Row", "layer_selection"]

MAX_SHIFT = 8
PAGE = 64


@dataclass(frozen=True)
class Row:
    candidate: frozenset[int]
    reference: frozenset[int]
    visible: int
    needle: frozenset[int] = frozenset()


def _best_shift(rows: list[Row]) -> tuple[int | None, float | None]:
    best: tuple[int | None, float | None] = (None, None)
    for d in range(-MAX_SHIFT, MAX_SHIFT + 1):
        if d == 0:
            continue
        j = sum(jaccard({e - d for e in r.candidate}, r.reference) for r in rows) / len(rows)
        if best[1] is None or j > best[1]:
            best = (d, j)
    return best


def _by_page(entries: frozenset[int]) -> dict[int, frozenset[int]]:
    pages: dict[int, set[int]] = {}
    for e in entries:
        pages.setdefault(e // PAGE, set()).add(e % PAGE)
    return {p: frozenset(o) for p, o in pages.items()}


def _permutation_overlap(row: Row) -> float:
    """Jaccard after matching the candidate's pages to the reference's by identical offsets."""
    ref_pages = list(_by_page(row.reference).values())
    matched = 0
    for offsets in _by_page(row.candidate).values():
        if offsets in ref_pages:
            ref_pages.remove(offsets)
            matched += len(offsets)
    union = len(row.candidate) + len(row.reference) - matched
    return matched / union if union else 1.0


def _share(entries: frozenset[int], visible: int, end: str) -> float:
    """The selection's share in one quarter of the visible entries, out of the most that quarter
    can hold (a top-k of half the entries puts at most half of itself in a quarter)."""
    if not entries or visible <= 0:
        return 0.0
    cut = visible / 4
    quarter = [e for e in range(visible) if (e >= visible - cut if end == "tail" else e < cut)]
    inside = [e for e in entries if (e >= visible - cut if end == "tail" else e < cut)]
    return len(inside) / max(1, min(len(entries), len(quarter)))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def layer_selection(layer: int, path: str, rows: list[Row]) -> LayerSelection:
    """The comparison of one layer's selections on one path (``rows`` not empty)."""
    if not rows:
        raise ValueError("layer_selection needs at least one row")
    rest = [jaccard(r.candidate - r.needle, r.reference - r.needle) for r in rows]
    shift, shift_overlap = _best_shift(rows)
    return LayerSelection(
        layer=layer,
        path=path,
        rows=len(rows),
        overlap=_mean([jaccard(r.candidate, r.reference) for r in rows]),
        chance=_mean([jaccard_chance(r.visible, len(r.candidate), len(r.reference)) for r in rows]),
        needle_visible=sum(len(r.needle) for r in rows),
        needle_reference=sum(len(r.reference & r.needle) for r in rows),
        needle_candidate=sum(len(r.candidate & r.needle) for r in rows),
        overlap_without_needle=_mean(rest),
        shift=shift,
        shift_overlap=shift_overlap,
        permutation_overlap=_mean([_permutation_overlap(r) for r in rows]),
        head_share=(
            _mean([_share(r.candidate, r.visible, "head") for r in rows]),
            _mean([_share(r.reference, r.visible, "head") for r in rows]),
        ),
        tail_share=(
            _mean([_share(r.candidate, r.visible, "tail") for r in rows]),
            _mean([_share(r.reference, r.visible, "tail") for r in rows]),
        ),
    )
