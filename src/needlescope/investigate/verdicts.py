"""Verdict rules: from paired measurements to implicated / exonerated / ... (pure, torch-free).

**Paired test.** The same cases run with the suspect present and with it absent (removed from
the candidate, or, when the candidate does not carry it, the reference with and without it).
``b`` = cases wrong with the suspect and right without it, ``c`` = the reverse. The exact
McNemar test on (b, c) (``analysis.stats.mcnemar_exact``) gives ``p``.

Per suspect, in this order:

1. **blocked**: every check it asked for could not run (the reasons are listed).
2. **exonerated** (not in the deployment): a cheap question's answer equals its
   ``means_absent`` value, or the suspect is absent from the candidate and no ablation ran.
   The reason then says what it rests on: the configuration check (its patch is not among
   the candidate's, or the candidate's field values differ from the suspect's) and the cheap
   questions' answers, and that no causal check ran.
3. **implicated**: ``p < ALPHA`` and ``b > c`` (the suspect costs recall, paired).
4. **diverges_no_effect**: not implicated, the paired recall change ``|b - c| / n`` is at most
   ``SMALL_EFFECT``, and adding it alone to the reference moves the final logits at the answer
   position by a relative Frobenius error above ``DIVERGE_REL`` (fp32 CPU runs of identical
   code are bit-identical, so anything above this is a real numerical change): "diverges, no
   recall effect at the lengths tested", both numbers given.
5. **exonerated**: not implicated, the change is at most ``SMALL_EFFECT`` and nothing diverges.
6. **inconclusive**: otherwise (a change larger than ``SMALL_EFFECT`` that the cases cannot
   confirm; run more cases).

**Root cause.** Among implicated suspects present in the candidate, those whose removal keeps
the candidate's ``index_topk`` are root causes (ordered by b - c). A suspect implicated only
through ``index_topk`` (its removal enlarges the top-k) while a root cause exists is
re-labelled **exonerated**: raising ``index_topk`` is then a workaround. When the
uninformative-ranking signature fires and no suspect other than ``index_topk`` is implicated,
there is no root cause among the suspects and ``index_topk`` is **inconclusive** (a workaround
for a functional indexer bug not in the ledger).

**Fixes.** Every replayed configuration is compared with the candidate on the same cases.
It *restores* recall when ``p < ALPHA`` and the fix wins more discordant cases than it loses.
A restoring fix is a **root-cause fix** when it removes a root-cause suspect and keeps the
deployment ``index_topk``; otherwise a **workaround** (the suspect stays; its cost is stated).
A fix that does not restore has **no effect**.

**Live endpoint** (``live_verdict``; the comparison is ``investigate.live``). Nothing can be
ablated, so the causal measurement is the suspect's emulation in the reference (at the live
``index_topk``) on the live token ids, compared with the live indexer capture over the failing
cases. ``failures``: (case, CSA layer) pairs where the live selects fewer needle entries at the
analysed row than the baseline (the reference at the live ``index_topk``); ``reproduced``: those
where the emulation selects no more than the live; ``gap_closed`` = (J_emulation - J_baseline) /
(1 - J_baseline), J the mean Jaccard overlap with the live selection over the compared rows.

1. **inconclusive** when ``failures < MIN_FAILURES``: the live capture keeps the needle where
   the baseline does, so the failure is not (mainly) in the selection and emulating a suspect's
   selection cannot decide.
2. **implicated** when ``reproduced / failures >= REPRODUCE`` and ``gap_closed >= GAP_CLOSED``:
   the emulation drops the needle where the live does *and* selects like the live (an emulation
   that merely selects badly in its own way closes little of the Jaccard gap).
3. **exonerated** when ``reproduced / failures <= KEEPS``: the emulation keeps the needle
   where the live loses it.
4. **inconclusive** otherwise (a partial reproduction), with the numbers.
"""

from __future__ import annotations

from needlescope.analysis.stats import mcnemar_exact
from needlescope.schema import check_schema

__all__ = [
    "ALPHA",
    "SMALL_EFFECT",
    "DIVERGE_REL",
    "VERDICTS",
    "VERDICTS_SCHEMA",
    "paired",
    "restores",
    "suspect_verdict",
    "resolve_root_cause",
    "classify_fix",
    "live_verdict",
    "LIVE_THRESHOLDS",
    "evidence",
    "validate_verdicts",
]

ALPHA = 0.05
SMALL_EFFECT = 0.10
DIVERGE_REL = 1e-5
MIN_FAILURES = 3
REPRODUCE = 0.8
KEEPS = 0.2
GAP_CLOSED = 0.5
LIVE_THRESHOLDS = {
    "min_failures": MIN_FAILURES,
    "reproduce": REPRODUCE,
    "keeps": KEEPS,
    "gap_closed": GAP_CLOSED,
}
VERDICTS = ("implicated", "exonerated", "inconclusive", "blocked", "diverges_no_effect")

_EVIDENCE = {
    "type": "object",
    "required": ["check", "metric", "value", "threshold"],
    "properties": {
        "check": {"type": "string"},
        "metric": {"type": "string"},
        "value": {"type": ["number", "string"]},
        "threshold": {"type": ["number", "null"]},
    },
}
VERDICTS_SCHEMA: dict = {
    "type": "object",
    "required": ["symptom", "root_cause", "signature", "suspects"],
    "properties": {
        "symptom": {"type": "object"},
        "root_cause": {"type": ["string", "null"]},
        "signature": {
            "type": "object",
            "required": ["uninformative_ranking", "layers", "collapse_vs_topk"],
            "properties": {
                "uninformative_ranking": {"type": "boolean"},
                "layers": {"type": "array"},
                "collapse_vs_topk": {"type": "array"},
            },
        },
        "suspects": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "tier", "verdict", "reason", "evidence"],
                "properties": {
                    "id": {"type": "string"},
                    "tier": {"type": "integer"},
                    "verdict": {"type": "string"},
                    "reason": {"type": "string"},
                    "evidence": {"type": "array", "items": _EVIDENCE},
                },
            },
        },
    },
}
"""``verdicts.json``, as issue 16 gives it (checked by ``validate_verdicts``)."""


def evidence(check: str, metric: str, value, threshold: float | None = None) -> dict:
    """One evidence record; a non-finite or non-numeric value is kept as text."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        value = str(value)
    elif value != value or value in (float("inf"), float("-inf")):
        value = str(value)
    return {"check": check, "metric": metric, "value": value, "threshold": threshold}


def paired(with_suspect: dict[str, bool], without: dict[str, bool]) -> dict:
    """Paired comparison over the cases both runs scored: {n, b, c, p, recall_with, recall_without}."""
    ids = sorted(set(with_suspect) & set(without))
    b = sum(1 for i in ids if not with_suspect[i] and without[i])
    c = sum(1 for i in ids if with_suspect[i] and not without[i])
    n = len(ids)
    return {
        "n": n,
        "b": b,
        "c": c,
        "p": mcnemar_exact(b, c),
        "recall_with": sum(with_suspect[i] for i in ids) / n if n else float("nan"),
        "recall_without": sum(without[i] for i in ids) / n if n else float("nan"),
    }


def restores(pair: dict) -> bool:
    """The run without the suspect (or with the fix) wins significantly."""
    return pair["p"] < ALPHA and pair["b"] > pair["c"]


def suspect_verdict(
    *,
    present: bool,
    pair: dict | None,
    divergence: float | None,
    absent_by_question: str | None,
    blocked: list[str],
    ran_checks: int,
    presence: str = "",
    questions: str = "",
) -> tuple[str, str]:
    """(verdict, reason) for one suspect by rules 1-6 of the module docstring.

    ``presence``: what the configuration check found (``runner.presence_check``);
    ``questions``: the cheap questions' answers in one line. An exoneration without a causal
    measurement says what it rests on: both, and that no causal check ran."""
    if ran_checks == 0 and blocked:
        return "blocked", "; ".join(blocked)
    asked = f"; cheap questions: {questions}" if questions else "; no cheap question asked"
    if absent_by_question is not None:
        return "exonerated", f"not in the deployment: {absent_by_question} ({presence}{asked})"
    if pair is None:
        if not present:
            return (
                "exonerated",
                f"not present in the candidate ({presence}){asked}; no causal check asked for, so none ran",
            )
        return "inconclusive", "present in the candidate, but no causal check ran" + (
            f" ({'; '.join(blocked)})" if blocked else ""
        )
    how = "removing it from the candidate" if present else "adding it alone to the reference"
    counts = (
        f"{how}: recall {pair['recall_with']:.2f} with it vs {pair['recall_without']:.2f} without, "
        f"paired n={pair['n']}, b={pair['b']} c={pair['c']}, exact McNemar p={pair['p']:.3g}"
    )
    if restores(pair):
        return "implicated", counts
    if pair["n"] and abs(pair["b"] - pair["c"]) / pair["n"] <= SMALL_EFFECT:
        if divergence is not None and divergence > DIVERGE_REL:
            return "diverges_no_effect", (
                f"diverges, no recall effect at the lengths tested: final-logit relative error "
                f"{divergence:.3g} (> {DIVERGE_REL:g}) when added alone to the reference; {counts}"
            )
        return "exonerated", counts
    return (
        "inconclusive",
        f"{counts}; the change exceeds {SMALL_EFFECT:.2f} but is not significant: run more cases",
    )


def resolve_root_cause(suspects: list[dict], signature_fires: bool) -> str | None:
    """Apply the root-cause rule in place on ``suspects`` (each with ``verdict``, ``present``,
    ``changes_topk``, ``pair``); returns the root cause's id or None."""
    implicated = [s for s in suspects if s["verdict"] == "implicated" and s["present"]]
    roots = sorted(
        (s for s in implicated if not s["changes_topk"]), key=lambda s: -(s["pair"]["b"] - s["pair"]["c"])
    )
    capacity = [s for s in implicated if s["changes_topk"]]
    if roots:
        for s in capacity:
            s["verdict"] = "exonerated"
            s["reason"] = (
                f"workaround, not the cause: {s['reason']}; the larger index_topk restores recall only while "
                f"{roots[0]['id']} stays (removing {roots[0]['id']} restores it at the deployment index_topk)"
            )
        return roots[0]["id"]
    if capacity and signature_fires:
        for s in capacity:
            s["verdict"] = "inconclusive"
            s["reason"] = (
                f"{s['reason']}; but the needle's ranking is uninformative and the collapse tracks "
                "compress_ratio x index_topk: a larger index_topk is a workaround for a functional indexer "
                "bug that no suspect in the ledger reproduces"
            )
        return None
    return capacity[0]["id"] if capacity else None


def classify_fix(pair: dict, *, removes: str | None, root_cause: str | None, keeps_topk: bool) -> str:
    """ "root-cause fix" | "workaround" | "no effect" (module docstring, "Fixes")."""
    if not restores(pair):
        return "no effect"
    if removes is not None and removes == root_cause and keeps_topk:
        return "root-cause fix"
    return "workaround"


def live_verdict(cmp: dict) -> tuple[str, str]:
    """(verdict, reason) of a live emulation's comparison (keys of ``live.summarise``); rules
    in the module docstring, "Live endpoint"."""
    f, r = cmp["failures"], cmp["reproduced"]
    je, jb = cmp["jaccard_emulation"], cmp["jaccard_baseline"]
    gap = (je - jb) / (1 - jb) if jb < 1 else float("nan")
    counts = (
        f"over {cmp['cases']} failing case(s): the live capture drops needle entries the baseline selects in "
        f"{f} (case, layer) pair(s), the emulation reproduces {r}; needle entries selected at the analysed rows "
        f"live {cmp['needle_live']}, emulation {cmp['needle_emulation']}, baseline {cmp['needle_baseline']} "
        f"of {cmp['needle_visible']}; mean Jaccard with the live selection: emulation {je:.3f}, baseline "
        f"{jb:.3f} (gap closed {gap:.2f})"
    )
    if f < MIN_FAILURES:
        return "inconclusive", (
            f"fewer than {MIN_FAILURES} selection failures in the live capture: the failure is not (mainly) in "
            f"the indexer's selection, so its emulation cannot decide; {counts}"
        )
    if r >= REPRODUCE * f and gap >= GAP_CLOSED:
        return "implicated", f"its emulation reproduces the live selection failure: {counts}"
    if r <= KEEPS * f:
        return "exonerated", f"its emulation keeps the needle where the live loses it: {counts}"
    return (
        "inconclusive",
        f"a partial reproduction (needs >= {REPRODUCE:.0%} and gap closed >= {GAP_CLOSED}): {counts}",
    )


def validate_verdicts(obj: dict) -> None:
    """ValueError unless ``obj`` follows ``VERDICTS_SCHEMA`` and uses only known verdict words."""
    check_schema(obj, VERDICTS_SCHEMA, "verdicts")
    for i, s in enumerate(obj["suspects"]):
        if s["verdict"] not in VERDICTS:
            raise ValueError(f"verdicts.suspects[{i}].verdict: {s['verdict']!r} is not one of {VERDICTS}")
    ids = {s["id"] for s in obj["suspects"]}
    if obj["root_cause"] is not None and obj["root_cause"] not in ids:
        raise ValueError(f"verdicts.root_cause {obj['root_cause']!r} names no suspect")
