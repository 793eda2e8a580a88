"""The live route's decisions: selections compared with the live capture, and each suspect's
verdict decided once from its measured record (``measure.live.LiveRoute.measure_suspect``).

Comparison (per failing case, CSA layer and compared row; ``compare_rows``): the Jaccard overlap
of the selected entry sets, emulation vs live and baseline vs live; and at the analysed row, the
needle entries each selected. A **selection failure** is a (case, layer) where the live selects
fewer needle entries than the baseline; the emulation **reproduces** it when it selects no more
needle entries than the live there. ``summarise`` pools the comparisons; ``verdicts.live_verdict_paths``
holds the thresholds.
"""

from __future__ import annotations

from needlescope.analysis.stats import jaccard
from needlescope.investigate.decide.verdicts import LIVE_THRESHOLDS, evidence, gap_closed, live_verdict_paths

__all__ = ["compare_rows", "summarise", "decide_live", "live_root_cause"]


def compare_rows(live: dict, emulated: dict, baseline: dict, needle: dict) -> dict:
    """Compare selections of one failing case. Each of ``live``, ``emulated``, ``baseline``
    maps a CSA layer (str) to its rows (lists of selected entries, the last one the analysed
    row); ``needle`` maps the layer to the needle entries visible at the analysed row.

    Returns {"jaccard_emulation": [float], "jaccard_baseline": [float], "points": [{"layer",
    "needle_visible", "live", "emulation", "baseline"}]} (needle entries selected per layer)."""
    out: dict = {"jaccard_emulation": [], "jaccard_baseline": [], "points": []}
    for layer, rows in live.items():
        for i, row in enumerate(rows):
            out["jaccard_emulation"].append(jaccard(emulated[layer][i], row))
            out["jaccard_baseline"].append(jaccard(baseline[layer][i], row))
        ne = set(needle.get(layer, []))
        if ne:
            out["points"].append(
                {
                    "layer": int(layer),
                    "needle_visible": len(ne),
                    "live": len(ne & set(rows[-1])),
                    "emulation": len(ne & set(emulated[layer][-1])),
                    "baseline": len(ne & set(baseline[layer][-1])),
                }
            )
    return out


def summarise(comparisons: list[dict]) -> dict:
    """Pool ``compare_rows`` results over the failing cases into the numbers the verdict uses."""
    je = [x for c in comparisons for x in c["jaccard_emulation"]]
    jb = [x for c in comparisons for x in c["jaccard_baseline"]]
    pts = [p for c in comparisons for p in c["points"]]
    fails = [p for p in pts if p["live"] < p["baseline"]]
    return {
        "cases": len(comparisons),
        "rows": len(je),
        "jaccard_emulation": sum(je) / len(je) if je else float("nan"),
        "jaccard_baseline": sum(jb) / len(jb) if jb else float("nan"),
        "failures": len(fails),
        "reproduced": sum(1 for p in fails if p["emulation"] <= p["live"]),
        "needle_visible": sum(p["needle_visible"] for p in pts),
        "needle_live": sum(p["live"] for p in pts),
        "needle_emulation": sum(p["emulation"] for p in pts),
        "needle_baseline": sum(p["baseline"] for p in pts),
    }


def _decision(m: dict) -> tuple[str, str, bool | None]:
    """(verdict, reason, present) of a live suspect that was not emulated."""
    questions = m["questions"] or "none asked"
    if m["untestable"]:
        return (
            "blocked",
            "not testable against a live endpoint: no emulation reproduces this difference",
            True,
        )
    if m["absent_by_question"] is not None:
        return (
            "exonerated",
            f"not in the deployment: {m['absent_by_question']} (cheap questions: {questions})",
            False,
        )
    if not m["asked"]:
        reason = (
            "no live_emulation check asked for; a live endpoint cannot be ablated and the cheap "
            f"questions alone do not decide (cheap questions: {questions})"
        )
        return "inconclusive", reason, None
    return "blocked", f"live_emulation: {m['blocked']}", None


def decide_live(m: dict) -> dict:
    """One live suspect's decided record from its measured record ``m`` (``cmps``: the
    prefill and decode comparisons when it was emulated). The emulation's evidence, which names
    the deciding path, is the record's ``decision_evidence``."""
    ident = {k: m[k] for k in ("id", "tier", "hypothesis", "maps_to", "changes_topk", "auto")}
    empty = {"pair": None, "divergence": None, "sufficiency": None}
    if m["cmps"] is None:
        verdict, reason, present = _decision(m)
        return {**ident, "verdict": verdict, "reason": reason, **empty, "present": present}
    verdict, reason, decided_by = live_verdict_paths(m["cmps"])
    return {
        **ident,
        "verdict": verdict,
        "reason": reason,
        **empty,
        "present": None,
        "live": m["cmps"][decided_by],
        "live_paths": {**m["cmps"], "decided_by": decided_by},
        "decision_evidence": live_evidence(m["emulated"], m["cmps"], decided_by),
    }


def live_root_cause(decided: list[dict]) -> str | None:
    """The implicated suspect whose emulation closes the most of the Jaccard gap (None if none)."""
    implicated = sorted(
        (s for s in decided if s["verdict"] == "implicated"), key=lambda s: -gap_closed(s["live"])
    )
    return implicated[0]["id"] if implicated else None


def live_evidence(label: str, cmps: dict[str, dict], decided_by: str) -> list[dict]:
    """Evidence records of a suspect's live emulation: the deciding path's numbers, then both paths'."""
    cmp, t = cmps[decided_by], LIVE_THRESHOLDS
    return [
        evidence("live_emulation", f"emulated: `{label}`; failing cases compared", cmp["cases"]),
        evidence(
            "live_emulation",
            "selection failures (live selects fewer needle entries than the baseline)",
            cmp["failures"],
            t["min_failures"],
        ),
        evidence(
            "live_emulation", "failures the emulation reproduces (fraction)", _frac(cmp), t["reproduce"]
        ),
        evidence("live_emulation", "Jaccard emulation vs live (mean over rows)", cmp["jaccard_emulation"]),
        evidence("live_emulation", "Jaccard baseline vs live (mean over rows)", cmp["jaccard_baseline"]),
        evidence(
            "live_emulation",
            "share of the baseline's Jaccard gap the emulation closes",
            gap_closed(cmp),
            t["gap_closed"],
        ),
        evidence(
            "live_emulation",
            f"needle entries selected at the analysed rows, of {cmp['needle_visible']} visible: live",
            cmp["needle_live"],
        ),
        evidence("live_emulation", "needle entries selected: emulation", cmp["needle_emulation"]),
        evidence("live_emulation", "needle entries selected: baseline", cmp["needle_baseline"]),
        evidence("live_emulation", "path whose comparison decides (prefill | decode)", decided_by),
        *(
            evidence("live_emulation", f"{path} path: failures the emulation reproduces (fraction)", _frac(c))
            for path, c in cmps.items()
        ),
        *(
            evidence("live_emulation", f"{path} path: Jaccard emulation vs live", c["jaccard_emulation"])
            for path, c in cmps.items()
        ),
    ]


def _frac(cmp: dict) -> float:
    return cmp["reproduced"] / cmp["failures"] if cmp["failures"] else float("nan")
