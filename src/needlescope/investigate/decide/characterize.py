"""What kind of bug a divergence no suspect explains is, where it is, and what to run next.

``characterize(evidence, context) -> dict`` is a pure function over measurements (no torch, no
files, no patch names: the evidence records below are all it reads). Its result is
``verdicts.json`` ``characterization`` (schema in docs/investigate.md and
``CHARACTERIZATION_SCHEMA``):

* ``classes``: the classes whose rule fires, strongest (most specific) first, from
  ``VOCABULARY``; ``["none"]`` when no recall is lost; ``["undecided"]`` when none fires, and
  then ``undecided`` says what would decide it;
* ``where``: the first divergent module and its family (in-process) or the first departing
  CSA layer and whether the evidence puts the cause upstream or downstream of the selection;
* ``evidence``: per class the numbers behind it with their nulls (its ``rule`` in words);
* ``next``: the cheapest experiment that tells the remaining classes apart (or confirms the
  first), a ``needlescope ...`` command built from ``context``.

The rules, in the order they rank (a specific pattern explains a generic one: a selection
shifted by one slot is also near-random against the reference, so ``misaddressed`` ranks
before ``ranking_uninformative``); thresholds in ``RULES``, docs/signatures.md for the public
bug classes each one points at (``length_residue`` ranks before ``decode_only``: a boundary bug
shows on whichever path's length hits the residue, and the teacher-forced pass runs the prompt
plus the answer tokens while the decode pass prefills the prompt alone):

``state_dependent``    every failing case rerun alone (same ids, greedy) predicts another token than
                       it answered: state kept across requests (a cache slot, a buffer) or the batch
``outside_selection``  recall lost at a dense length (every entry selected: entries <= top-k),
                       exact one-sided McNemar p < 0.05; or every compared selection agrees with
                       the reference's (normalized overlap >= 0.8 on every path: up to the
                       candidate's own rounding) while the answers differ
``length_residue``     the losses concentrate on one residue class of the length modulo the
                       compression ratio (one-sided Fisher exact p < 0.05 against the other
                       classes, and those lose at most 10% of their cases)
``decode_only``        every prefill selection agrees with the reference's (normalized overlap
                       >= 0.8), a decode one departs (Jaccard 0.2 below its prefill's)
``misaddressed``       a constant shift or a page permutation of the candidate's selection
                       agrees with the reference's as a healthy selection does (normalized
                       overlap >= 0.8, the ``agree`` tolerance for the candidate's own rounding;
                       Jaccard 0.1 above the plain one's)
``needle_excluded``    in the first CSA layer that sees the needle, the candidate keeps at most half
                       the needle entries the reference keeps while the rest of the selection
                       agrees (Jaccard without the needle >= 0.7: the rest loses under 18%)
``positional_bias``    >= 60% of the candidate's selection in one quarter of the context (of the
                       most it can hold; first or last), at least 30 points more than the reference's
``ranking_uninformative``  overlap near chance: (J - J0) / (1 - J0) <= 0.15 (J0: hypergeometric)
``graded``             partial overlap (0.15 < (J - J0) / (1 - J0) < 0.95) and a loss that grows
                       with length: the longest selective length loses (net of gains), the
                       shortest loses at most half its rate (net losses per case), so strictly less

"Recall lost only at longer lengths" (issue 37) is read as a trend over the selective lengths,
not as a zero at the shortest one: a bug whose damage grows with the number of visible entries
(a window, a precision that runs out) starts to lose at a length of its own, and whether the
user's shortest length lies below it depends on the table (the same bug loses nothing at 512
tokens, some at 1K and more at 2K: a 512/1K table's shortest row is clean, a 1K/2K table's is
not). "The shortest loses at most half the longest's rate" holds in both tables and still tells
``graded`` from a loss flat in length.
"""

from __future__ import annotations

import math
from dataclasses import replace

from needlescope.investigate.decide.characterize_inputs import (
    Context,
    Evidence,
    LayerSelection,
    LengthCell,
    Localized,
)
from needlescope.investigate.decide.characterize_text import summary_line
from needlescope.investigate.decide.localization import DEPARTS
from needlescope.investigate.decide.next_step import missing_experiments, next_command
from needlescope.investigate.decide.verdicts import paired

__all__ = [
    "FAMILIES",
    "RULES",
    "VOCABULARY",
    "Context",
    "Evidence",
    "LayerSelection",
    "LengthCell",
    "Localized",
    "characterize",
    "nothing_to_explain",
    "family_of",
    "jaccard_chance",
    "fisher_greater",
]

VOCABULARY = (
    "state_dependent",
    "outside_selection",
    "length_residue",
    "decode_only",
    "misaddressed",
    "needle_excluded",
    "positional_bias",
    "ranking_uninformative",
    "graded",
    "none",
    "undecided",
)

RULES = {
    "alpha": 0.05,
    "same_selection": DEPARTS,  # Jaccard at or above: the selection is the reference's (one threshold)
    "agree": 0.8,  # normalized overlap at or above: agrees up to rounding (the candidate's fp8 keys)
    "decode_drop": 0.2,  # decode_only: the decode overlap this far below the prefill's
    "moved_gain": 0.1,  # ... and beats the plain Jaccard by at least this
    "needle_kept_at_most": 0.5,  # of the needle entries the reference keeps, in the first CSA layer
    "rest_agrees": 0.7,
    "end_share": 0.6,  # of the selection in one quarter (uniform: 25%)
    "end_excess": 0.3,
    "near_chance": 0.15,  # normalized overlap (J - J0) / (1 - J0)
    "partial_high": 0.95,
    "graded_shortest_share": 0.5,  # the shortest selective length's net loss rate, of the longest's
    "other_residues_lose_at_most": 0.1,
}

FAMILIES = (
    "indexer scorer",
    "index-key cache/compressor",
    "top-k",
    "attention",
    "MoE router",
    "norm/other",
)


def jaccard_chance(visible: int, k_cand: int, k_ref: int) -> float:
    """E[|A n B| / |A u B|] for A a uniformly random ``k_cand``-subset of ``visible`` entries and
    B a fixed ``k_ref``-subset (exact: the intersection is hypergeometric)."""
    if visible <= 0 or k_cand <= 0 or k_ref <= 0:
        return 0.0
    k_cand, k_ref = min(k_cand, visible), min(k_ref, visible)
    total = math.comb(visible, k_cand)
    lo, hi = max(0, k_cand + k_ref - visible), min(k_cand, k_ref)
    return sum(
        math.comb(k_ref, x) * math.comb(visible - k_ref, k_cand - x) / total * x / (k_cand + k_ref - x)
        for x in range(lo, hi + 1)
    )


def family_of(module: str | None, module_type: str | None) -> str:
    """The family of a localized module, from its class and dotted name."""
    t, m = module_type or "", module or ""
    base = m.split("[call ")[0]
    if "Scorer" in t or base.endswith((".scorer", ".indexer.rotary_emb")):  # q/k RoPE feeds the score
        return "indexer scorer"
    if "Indexer" in t or "Compressor" in t or ".compressor" in m:
        return "index-key cache/compressor"
    if "topk" in m.lower():
        return "top-k"
    if "Router" in t or m.endswith(".gate"):
        return "MoE router"
    if "Attention" in t or ".self_attn" in m:
        return "attention"
    return "norm/other"


def _mcnemar_lower(lost: int, gained: int) -> float:
    """One-sided exact McNemar p for more losses than gains."""
    n = lost + gained
    return sum(math.comb(n, i) for i in range(lost, n + 1)) / 2**n if n else 1.0


def fisher_greater(a: int, n1: int, c: int, n2: int) -> float:
    """One-sided Fisher exact p that group 1 (a of n1) loses more often than group 2 (c of n2)."""
    m, total = a + c, n1 + n2
    denom = math.comb(total, m)
    return sum(math.comb(n1, x) * math.comb(n2, m - x) for x in range(a, min(n1, m) + 1)) / denom


def _normalized(overlap: float, chance: float) -> float:
    """(J - J0) / (1 - J0): 0 at chance, 1 for the same selection."""
    return (overlap - chance) / (1 - chance) if chance < 1 else 1.0


def _kappa(sel: LayerSelection) -> float:
    return _normalized(sel.overlap, sel.chance)


def _agrees(sel: LayerSelection) -> bool:
    """The selection is the reference's, up to the candidate's own rounding."""
    return sel.overlap >= RULES["same_selection"] or _kappa(sel) >= RULES["agree"]


def _departing(ev: Evidence) -> list[LayerSelection]:
    """The (layer, path) selections that are not the reference's: mixed evidence (one path or
    layer departing, another agreeing) is decided from these, never averaged with the rest."""
    return [s for s in ev.layers if s.overlap < RULES["same_selection"]]


def _first_departing(ev: Evidence, path: str | None = None) -> LayerSelection | None:
    dep = sorted(
        (s for s in _departing(ev) if path in (None, s.path)), key=lambda s: (s.layer, s.path != "prefill")
    )
    return dep[0] if dep else None


def _rule_outside(ev: Evidence, ctx: Context) -> dict | None:
    dense = [c for c in ev.cells if c.entries <= ctx.topk]
    for c in dense:
        p = _mcnemar_lower(c.lost, c.gained)
        if c.lost > c.gained and p < RULES["alpha"]:
            return {
                "rule": f"recall lost where every entry is selected (entries {c.entries} <= top-k {ctx.topk})",
                "length": c.length,
                "lost": c.lost,
                "gained": c.gained,
                "n": c.n,
                "p": p,
                "null": "no loss where the selection is dense (exact McNemar, one-sided)",
            }
    if ev.answers_differ and ev.layers and all(_kappa(s) >= RULES["agree"] for s in ev.layers):
        worst = min(ev.layers, key=lambda s: s.overlap)
        return {
            "rule": "every selection equals the reference's while the answers differ",
            "min_overlap": worst.overlap,
            "layers": sorted({s.layer for s in ev.layers}),
            "paths": sorted({s.path for s in ev.layers}),
            "null": f"a selection bug moves some selection below normalized overlap {RULES['agree']}",
        }
    return None


def _decode_only_layers(ev: Evidence) -> list[LayerSelection]:
    """The decode selections that depart (Jaccard ``decode_drop`` below their prefill's) in a
    layer whose prefill selection agrees with the reference's, by layer."""
    pre = {s.layer: s for s in ev.layers if s.path == "prefill"}
    return [
        s
        for s in sorted(ev.layers, key=lambda s: s.layer)
        if s.path == "decode"
        and s.layer in pre
        and _agrees(pre[s.layer])
        and not _agrees(s)
        and s.overlap <= pre[s.layer].overlap - RULES["decode_drop"]
    ]


def _rule_decode_only(ev: Evidence, ctx: Context) -> dict | None:
    # The first departing layer decides (mixed evidence, issue 53): when its prefill agrees and its
    # decode departs, the bug is on the decode path there, whatever a later layer's prefill does.
    first = _first_departing(ev)
    gone = _decode_only_layers(ev)
    if first is None or not gone or gone[0].layer != first.layer:
        return None
    g = gone[0]
    pre = next(s for s in ev.layers if s.layer == g.layer and s.path == "prefill")
    return {
        "rule": "prefill selections agree with the reference's, decode selections depart",
        "prefill_overlap": pre.overlap,
        "decode_layer": g.layer,
        "decode_overlap": g.overlap,
        "chance": g.chance,
        "layer": g.layer,
        "path": "decode",
        "null": f"the decode path selects as the prefill does (within {RULES['decode_drop']} Jaccard)",
    }


def _rule_residue(ev: Evidence, ctx: Context) -> dict | None:
    cells = [c for c in ev.cells if c.entries > ctx.topk]
    by: dict[int, list[int]] = {}
    for c in cells:
        n_lost = by.setdefault(c.length % ctx.ratio, [0, 0])
        n_lost[0] += c.n
        n_lost[1] += c.lost
    if len(by) < 2:
        return None
    r, (n1, a) = max(by.items(), key=lambda kv: kv[1][1] / max(kv[1][0], 1))
    n2 = sum(v[0] for k, v in by.items() if k != r)
    c2 = sum(v[1] for k, v in by.items() if k != r)
    p = fisher_greater(a, n1, c2, n2)
    if p >= RULES["alpha"] or c2 > RULES["other_residues_lose_at_most"] * n2:
        return None
    return {
        "rule": f"losses concentrate on length = {r} mod {ctx.ratio}",
        "residue": r,
        "ratio": ctx.ratio,
        "lost_in_class": [a, n1],
        "lost_elsewhere": [c2, n2],
        "p": p,
        "null": "every residue class loses alike (Fisher exact, one-sided)",
    }


def _rule_misaddressed(ev: Evidence, ctx: Context) -> dict | None:
    for s in sorted(_departing(ev), key=lambda s: s.layer):
        moved = max(s.shift_overlap or 0.0, s.permutation_overlap or 0.0)
        # The live route's reference runs at the reference's precision, not the server's, so even
        # the right selection agrees only up to rounding: a 0.9 Jaccard bar missed a shifted key
        # cache there at 1K/2K (shift overlap 0.80-0.85, chance 0.105; issue 37's GPU table).
        if _normalized(moved, s.chance) >= RULES["agree"] and moved - s.overlap >= RULES["moved_gain"]:
            how = (
                "a page permutation" if (s.permutation_overlap or 0) >= (s.shift_overlap or 0) else "a shift"
            )
            return {
                "rule": f"the selection is the reference's under {how}",
                "layer": s.layer,
                "path": s.path,
                "overlap": s.overlap,
                "shift": s.shift,
                "shift_overlap": s.shift_overlap,
                "permutation_overlap": s.permutation_overlap,
                "chance": s.chance,
                "normalized": _normalized(moved, s.chance),
                "null": f"no shift or page permutation reaches normalized overlap {RULES['agree']}",
            }
    return None


def _rule_needle_excluded(ev: Evidence, ctx: Context) -> dict | None:
    # The first CSA layer that sees the needle decides: a later layer's inputs already carry
    # what the first one's changed selection did to the hidden states.
    seeing = [s for s in ev.layers if s.needle_reference > 0 and s.overlap_without_needle is not None]
    if not seeing:
        return None
    first = [s for s in seeing if s.layer == min(x.layer for x in seeing)]
    ref = sum(s.needle_reference for s in first)
    cand = sum(s.needle_candidate for s in first)
    rest = min(s.overlap_without_needle for s in first)
    if cand > RULES["needle_kept_at_most"] * ref or rest < RULES["rest_agrees"]:
        return None
    return {
        "rule": "the needle is dropped while the rest of the selection agrees",
        "layer": first[0].layer,
        "needle_reference": ref,
        "needle_candidate": cand,
        "needle_visible": sum(s.needle_visible for s in first),
        "overlap_without_needle": rest,
        "null": f"the candidate keeps > {RULES['needle_kept_at_most']:.0%} of the reference's needle entries",
    }


def _rule_positional(ev: Evidence, ctx: Context) -> dict | None:
    for s in sorted(_departing(ev), key=lambda s: s.layer):
        for end, share in (("last", s.tail_share), ("first", s.head_share)):
            if share is None:
                continue
            cand, ref = share
            if cand >= RULES["end_share"] and cand - ref >= RULES["end_excess"]:
                return {
                    "rule": f"the selection concentrates in the {end} quarter of the context",
                    "layer": s.layer,
                    "share_candidate": cand,
                    "share_reference": ref,
                    "null": "a selection spread like the reference's",
                }
    return None


def _rule_uninformative(ev: Evidence, ctx: Context) -> dict | None:
    first = _first_departing(ev)
    if first is None:
        return None
    # the first departing layer's path nearest chance: one path just above the bar, the other
    # below it, is a ranking at chance on the path below (issue 53's mixed evidence)
    first = min((s for s in _departing(ev) if s.layer == first.layer), key=_kappa)
    if _kappa(first) > RULES["near_chance"]:
        return None
    return {
        "rule": "the selection's overlap with the reference is near chance",
        "layer": first.layer,
        "path": first.path,
        "overlap": first.overlap,
        "chance": first.chance,
        "normalized": _kappa(first),
        "rows": first.rows,
        "null": "J0, the exact expected Jaccard of a random selection of as many entries",
    }


def _rule_graded(ev: Evidence, ctx: Context) -> dict | None:
    first = _first_departing(ev)
    cells = sorted((c for c in ev.cells if c.entries > ctx.topk and c.n), key=lambda c: c.length)
    if first is None or len({c.length for c in cells}) < 2:
        return None
    k = _kappa(first)
    shortest, longest = cells[0], cells[-1]
    short_net, long_net = _net_lost(shortest), _net_lost(longest)
    if not (RULES["near_chance"] < k < RULES["partial_high"]) or long_net == 0:
        return None
    # the rates cross-multiplied: 1 of 3 against 2 of 3 is exactly half, no rounding either way
    if short_net * longest.n > RULES["graded_shortest_share"] * long_net * shortest.n:
        return None
    return {
        "rule": "a partial loss of overlap; the recall lost grows with length",
        "layer": first.layer,
        "overlap": first.overlap,
        "chance": first.chance,
        "normalized": k,
        "shortest": [shortest.length, shortest.lost, shortest.n],
        "longest": [longest.length, longest.lost, longest.n],
        "shortest_rate": short_net / shortest.n,
        "longest_rate": long_net / longest.n,
        "null": (
            f"the shortest selective length loses more than {RULES['graded_shortest_share']:.0%} "
            "of the longest's rate, or the longest loses nothing"
        ),
    }


def _net_lost(cell: LengthCell) -> int:
    """Cases lost net of those gained (0 when it gains as many as it loses)."""
    return max(0, cell.lost - cell.gained)


def _rule_state(ev: Evidence, ctx: Context) -> dict | None:
    if not ev.rerun or ev.not_reproduced < ev.rerun:
        return None
    return {
        "rule": "every failing case rerun alone (the same ids, greedy) predicts another token than it "
        "answered: the failure depends on what ran before it or beside it",
        "failing_cases_rerun": ev.rerun,
        "not_reproduced": ev.not_reproduced,
        "null": "a failure that reproduces when its case runs alone",
    }


_ORDERED = (
    ("state_dependent", _rule_state),  # first: the other rules read the selections of a rerun
    ("outside_selection", _rule_outside),
    ("length_residue", _rule_residue),  # before decode_only: a boundary bug shows on whichever
    ("decode_only", _rule_decode_only),  # path's length hits the residue (decode: the prompt alone)
    ("misaddressed", _rule_misaddressed),
    ("needle_excluded", _rule_needle_excluded),
    ("positional_bias", _rule_positional),
    ("ranking_uninformative", _rule_uninformative),
    ("graded", _rule_graded),
)


_CONFIRM = {
    "state_dependent": "localize",
    "outside_selection": "localize",
    "decode_only": "paths",
    "length_residue": "residue",
    "misaddressed": "localize",
    "needle_excluded": "localize",
    "positional_bias": "localize",
    "ranking_uninformative": "localize",
    "graded": "localize",
}


def _where(ev: Evidence, ctx: Context, classes: list[str]) -> dict:
    first = _first_departing(ev, "decode" if classes[0] == "decode_only" else None)
    outside = "outside_selection" in classes
    where: dict = {
        "route": ctx.route,
        "first_departing_layer": first.layer if first else None,
        "path": first.path if first else None,
        "cause": "upstream or downstream of the selection" if outside else "in the selection",
    }
    diverging = [loc for loc in ev.localized if loc.module is not None]
    if diverging:
        loc = sorted(diverging, key=lambda loc: loc.path != "prefill")[0]
        where.update(
            module=loc.module,
            module_type=loc.module_type,
            layer=loc.layer,
            family=family_of(loc.module, loc.module_type),
            localized_path=loc.path,
            finding=loc.finding,
        )
    return where


def _agreement(ev: Evidence, found: dict) -> dict:
    """Which (layer, path) selections agree with the reference's and which depart, beside a class
    decided from the ones that depart (mixed evidence: the report says which agree)."""
    if not ev.layers or "layer" not in found:
        return {}
    name = lambda s: f"layer {s.layer} {s.path}"  # noqa: E731
    return {
        "decided_by": f"layer {found['layer']} {found.get('path') or 'prefill'}",
        "agree": [name(s) for s in ev.layers if _agrees(s)],
        "depart": [name(s) for s in ev.layers if not _agrees(s)],
    }


_SELECTION_RULES = ("misaddressed", "needle_excluded", "positional_bias", "ranking_uninformative", "graded")


def _two_sites(ev: Evidence, ctx: Context) -> dict | None:
    """{class: evidence} of two independent bugs, or None: a layer whose decode departs while its
    prefill agrees (a decode-path bug there) and another layer whose prefill departs while its
    decode agrees (a bug the decode path does not share), each classed from its own layer's
    selections; its evidence names its ``layer`` and ``path``. A prefill departure at a layer
    after the decode-path bug's counts even when its decode departs too (``_downstream_decode``)."""
    dec = _decode_only_layers(ev)
    twin = {(s.layer, s.path): s for s in ev.layers}
    pre = [
        s
        for s in ev.layers
        if s.path == "prefill"
        and not _agrees(s)
        and (s.layer, "decode") in twin
        and (_agrees(twin[(s.layer, "decode")]) or _downstream_decode(ev, s, dec))
    ]
    if not dec or not pre or dec[0].layer == pre[0].layer:
        return None
    one = _rule_decode_only(replace(ev, layers=(twin[(dec[0].layer, "prefill")], dec[0])), ctx)
    only = replace(ev, layers=(pre[0],), answers_differ=False)
    rules = dict(_ORDERED)
    other = next(((c, f) for c in _SELECTION_RULES if (f := rules[c](only, ctx)) is not None), None)
    if one is None or other is None:
        return None
    return {"decode_only": one, other[0]: {**other[1], "layer": pre[0].layer, "path": "prefill"}}


def _downstream_decode(ev: Evidence, pre, dec: list) -> bool:
    """Whether ``pre`` (a departing prefill selection) is its own bug while its layer's decode
    departure is explained by a decode-path bug upstream: ``pre`` lies after the first layer
    whose decode departs while its prefill agrees (that bug changes every later layer's decode
    queries, so their decode selections depart with it), and every prefill selection before
    ``pre`` agrees (the prefill path does not run the decode bug: its departure starts at
    ``pre``). Measured (``tests/planted_bugs/two_bugs_layers.py``, live, 512 tokens): layer 1's
    decode at overlap 0.00 beside its prefill at 1.00, layer 3's prefill at 0.04 and its decode at
    0.78, below the agreement bar."""
    return (
        bool(dec)
        and pre.layer > dec[0].layer
        and all(_agrees(s) for s in ev.layers if s.path == "prefill" and s.layer < pre.layer)
    )


def characterize(ev: Evidence, ctx: Context) -> dict:
    """The characterization of a divergence (module docstring): classes, where, evidence, next."""
    if not ev.recall_lost:
        return {
            "classes": ["none"],
            "where": None,
            "evidence": {
                "none": {
                    "rule": "no recall lost: the candidate loses no more paired cases than it gains",
                    "recall_reference": ev.recall_reference,
                    "recall_candidate": ev.recall_candidate,
                    "null": "a paired loss (more cases lost than gained)",
                }
            },
            "undecided": [],
            "next": None,
            "text": "nothing to explain: no recall lost",
        }
    fired = {name: found for name, rule in _ORDERED if (found := rule(ev, ctx)) is not None}
    two = _two_sites(ev, ctx)
    if two is not None:  # two independent bugs: each site's class first, with its own where
        fired = {**two, **{k: v for k, v in fired.items() if k not in two}}
    classes = list(fired) or ["undecided"]
    missing = missing_experiments(ev, ctx)
    undecided = [why for _, why in missing] if not fired else []
    experiment = missing[0][0] if missing and not fired else _CONFIRM.get(classes[0], "localize")
    result = {
        "classes": classes,
        "where": {**_where(ev, ctx, classes), **_agreement(ev, fired.get(classes[0], {}))},
        "evidence": fired,
        "undecided": undecided,
        "next": next_command(ctx, experiment),
    }
    if two is not None:
        result["sites"] = [
            {
                "class": c,
                "where": {
                    **_where(ev, ctx, [c]),
                    **_agreement(ev, e),
                    "layer": e["layer"],
                    "path": e["path"],
                },
            }
            for c, e in two.items()
        ]
    result["text"] = summary_line(result)
    return result


def nothing_to_explain(ref_records: list[dict], cand_records: list[dict]) -> dict | None:
    """The characterization when the candidate loses no recall (``classes == ["none"]``): it
    loses no more paired cases than it gains; else None."""
    ok = lambda rs: {r["case_id"]: r["correct"] for r in rs if not r.get("error")}  # noqa: E731
    p = paired(ok(cand_records), ok(ref_records))
    if p["b"] > p["c"]:
        return None
    return characterize(
        Evidence(recall_lost=False, recall_reference=p["recall_without"], recall_candidate=p["recall_with"]),
        Context(route="in-process", ratio=4, topk=1),
    )
