"""Verdict rules: from paired measurements to implicated / exonerated / ... (pure, torch-free).

**Paired test.** The same cases run with the suspect present and with it absent (removed from
the candidate, or, when the candidate does not carry it, the reference with and without it).
``b`` = cases wrong with the suspect and right without it, ``c`` = the reverse. The exact
McNemar test on (b, c) (``analysis.stats.mcnemar_exact``) gives ``p``.

Per suspect, in this order (``p`` is the Holm-adjusted p across the run's ablations when the
decision supplies it, ``holm_adjust`` in ``causal.decide``):

1. **blocked**: every check it asked for could not run (the reasons are listed).
2. **exonerated** (not in the deployment): a cheap question's answer equals its
   ``means_absent`` value, or the suspect is absent from the candidate and no ablation ran.
   The reason then says what it rests on: the configuration check (its patch is not among
   the candidate's, or the candidate's field values differ from the suspect's) and the cheap
   questions' answers, and that no causal check ran.
3. **implicated**: present in the candidate, ``p < ALPHA`` and ``b > c`` (removing it restores
   recall, paired). A suspect **absent** from the candidate is never implicated: when adding it
   alone to the reference costs recall it is exonerated as not deployed, with that measurement.
   ``c > b`` with ``p < ALPHA`` (it helps) is exonerated too.
4. **diverges_no_effect**: not implicated, the paired recall change ``|b - c| / n`` is at most
   ``SMALL_EFFECT``, the ablation had the power to see the symptom (``power_check``: 80% power
   at the strictest Holm level for a cost of the symptom's size or ``BOUND_FLOOR``, whichever is
   larger), and adding it alone to the reference moves the final logits at the answer position
   by a relative Frobenius error above ``DIVERGE_REL`` (fp32 CPU runs of identical code are
   bit-identical, so anything above this is a real numerical change): "diverges, no recall
   effect at the lengths tested", both numbers and the detectable cost given.
5. **exonerated**: as 4 without the divergence; the reason states the detectable cost.
6. **inconclusive**: a small change the ablation lacked the power to exclude ("too few cases to
   exclude a cost of X points", with the cases that would), or a change larger than
   ``SMALL_EFFECT`` that the cases cannot confirm.

**Necessity and sufficiency** (``investigate.measure.causal``). A present suspect is also added alone
to the reference at the deployment ``index_topk``: ``sufficient`` when that costs recall
(Holm-adjusted in its own family). Implicated and sufficient: a **root cause**; implicated, not
sufficient: a **co-factor** (stays implicated; the reason names what it interacts with: the
other implicated suspects). A capacity change (``index_topk``) is a root cause only when
sufficient on its own; otherwise it is a workaround for whatever it interacts with.

**Root cause.** Among implicated suspects present in the candidate, the root causes (non-capacity
first, by b - c; every one is listed in ``root_causes``). A capacity suspect implicated but not
sufficient while a root cause exists is re-labelled **exonerated** ("workaround, not the
cause"). When the uninformative-ranking signature fires and no suspect other than an
insufficient (or unmeasured) ``index_topk`` is implicated, there is no root cause among the
suspects and ``index_topk`` is **inconclusive** (a workaround for a functional indexer bug not
in the ledger). Without a sufficiency measurement (the live route) capacity is a root cause
only when nothing else is implicated.

**Fixes.** Every replayed configuration is compared with the candidate on the same cases.
It *restores* recall when ``p < ALPHA`` and the fix wins more discordant cases than it loses.
A restoring fix is a **root-cause fix** when it removes a root-cause suspect and keeps the
deployment ``index_topk``; otherwise a **workaround** (the suspect stays; its cost is stated).
A fix that does not restore has **no effect**.

**Live endpoint** (``live_verdict``; the comparison is ``investigate.measure.live``). Nothing can be
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

from dataclasses import dataclass

from needlescope.analysis.significance import holm, mcnemar_power
from needlescope.analysis.stats import mcnemar_exact
from needlescope.investigate.decide.schema import VERDICTS_SCHEMA
from needlescope.schema import check_schema

__all__ = [
    "ALPHA",
    "SMALL_EFFECT",
    "DIVERGE_REL",
    "VERDICTS",
    "VERDICTS_SCHEMA",
    "POWER",
    "BOUND_FLOOR",
    "paired",
    "restores",
    "detectable_cost",
    "cases_needed",
    "power_check",
    "holm_adjust",
    "residual_verdict",
    "suspect_verdict",
    "resolve_root_cause",
    "Role",
    "ROLES",
    "classify_fix",
    "fix_label",
    "live_verdict",
    "gap_closed",
    "live_verdict_paths",
    "PATHS",
    "LIVE_THRESHOLDS",
    "evidence",
    "validate_verdicts",
]

ALPHA = 0.05
SMALL_EFFECT = 0.10
POWER = 0.8
"""A negative verdict needs this power to detect the bound below (``power_check``)."""
BOUND_FLOOR = 0.5
"""The smallest recall cost a negative verdict must be able to detect when the symptom is smaller:
half the cases (a 20-36-case run detects about 30-45 points with 80% power)."""
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


def restores(pair: dict, p: float | None = None) -> bool:
    """The run without the suspect (or with the fix) wins significantly: ``p`` (default the
    pair's own, else its Holm-adjusted value) below ``ALPHA`` and ``b > c``."""
    return (pair["p"] if p is None else p) < ALPHA and pair["b"] > pair["c"]


def holm_adjust(pairs: list[dict | None]) -> list[float | None]:
    """Holm-adjusted p-values of the pairs (None stays None): each suspect's ablation is one
    test among the run's."""
    idx = [i for i, x in enumerate(pairs) if x is not None]
    adj = holm([pairs[i]["p"] for i in idx])
    out: list[float | None] = [None] * len(pairs)
    for i, a in zip(idx, adj):
        out[i] = a
    return out


def detectable_cost(n: int, alpha: float) -> float | None:
    """The smallest recall cost (a fraction of the cases, in steps of 0.01) the exact McNemar
    test detects with ``POWER`` at ``n`` pairs and level ``alpha``, assuming the cost shows as
    cases lost and none gained (``mcnemar_power``); None when even losing every case would not."""
    for pct in range(1, 101):
        if mcnemar_power(n, pct / 100, alpha) >= POWER:
            return pct / 100
    return None


def cases_needed(cost: float, alpha: float, limit: int = 100_000) -> int | None:
    """The smallest number of pairs at which a cost of ``cost`` is detected with ``POWER``."""
    lo = 1
    while lo <= limit and mcnemar_power(lo, cost, alpha) < POWER:
        lo = lo * 2
    if lo > limit:
        return None
    hi, lo = lo, lo // 2 + 1 if lo > 1 else 1
    while lo < hi:  # power grows with n (one-sided losses): bisect
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if mcnemar_power(mid, cost, alpha) < POWER else (lo, mid)
    return hi


def power_check(n: int, tests: int, symptom_loss: float) -> dict:
    """What a negative verdict of one of ``tests`` Holm-corrected ablations at ``n`` pairs rests on.

    ``detectable_cost``: the cost found with ``POWER`` at the strictest Holm level ``ALPHA /
    tests``; ``bound``: the cost it must be able to detect, the symptom's paired recall loss or
    ``BOUND_FLOOR`` when that is larger; ``enough``: detectable_cost <= bound; ``cases_needed``:
    the pairs that would detect ``bound``."""
    alpha = ALPHA / max(1, tests)
    mde = detectable_cost(n, alpha)
    bound = round(max(symptom_loss, BOUND_FLOOR), 4)
    return {
        "alpha": alpha,
        "power": POWER,
        "detectable_cost": mde,
        "bound": bound,
        "enough": mde is not None and mde <= bound,
        "cases_needed": cases_needed(bound, alpha),
    }


def _power_text(pw: dict) -> str:
    if pw["detectable_cost"] is None:
        return f"this run cannot detect any cost with {pw['power']:.0%} power (level {pw['alpha']:.3g})"
    return (
        f"this run detects a cost of {pw['detectable_cost'] * 100:.0f} points with {pw['power']:.0%} power "
        f"(level {pw['alpha']:.3g})"
    )


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
    p_adjusted: float | None = None,
    power: dict | None = None,
) -> tuple[str, str]:
    """(verdict, reason) for one suspect by rules 1-6 of the module docstring.

    ``presence``: what the configuration check found (``differences.presence_check``);
    ``questions``: the cheap questions' answers in one line. An exoneration without a causal
    measurement says what it rests on: both, and that no causal check ran. ``p_adjusted``: the
    pair's Holm-adjusted p (default: its own p); ``power``: ``power_check`` of the pair, which a
    negative verdict states and needs (``enough``), else it is ``inconclusive``."""
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
    p = pair["p"] if p_adjusted is None else p_adjusted
    how = "removing it from the candidate" if present else "adding it alone to the reference"
    holm_txt = "" if p_adjusted is None else f", Holm-adjusted p={p_adjusted:.3g}"
    counts = (
        f"{how}: recall {pair['recall_with']:.2f} with it vs {pair['recall_without']:.2f} without, "
        f"paired n={pair['n']}, b={pair['b']} c={pair['c']}, exact McNemar p={pair['p']:.3g}{holm_txt}"
    )
    if restores(pair, p):
        if present:
            return "implicated", counts
        return "exonerated", (
            f"not in the deployment ({presence}), so it cannot cause the candidate's loss; {counts}: "
            "it would cost recall if deployed"
        )
    if p < ALPHA and pair["c"] > pair["b"]:
        return "exonerated", f"{counts}: with it recall is better (c > b), so it does not cause the loss"
    if pair["n"] and abs(pair["b"] - pair["c"]) / pair["n"] <= SMALL_EFFECT:
        if power is not None and not power["enough"]:
            need = power["cases_needed"]
            return "inconclusive", (
                f"inconclusive: too few cases to exclude a cost of {power['bound'] * 100:.0f} points "
                f"({_power_text(power)}; {need if need is not None else 'more than 100000'} cases would); {counts}"
            )
        stated = f"; {_power_text(power)}" if power is not None else ""
        if divergence is not None and divergence > DIVERGE_REL:
            return "diverges_no_effect", (
                f"diverges, no recall effect at the lengths tested: final-logit relative error "
                f"{divergence:.3g} (> {DIVERGE_REL:g}) when added alone to the reference; {counts}{stated}"
            )
        return "exonerated", counts + stated
    return (
        "inconclusive",
        f"{counts}; the change exceeds {SMALL_EFFECT:.2f} but is not significant: run more cases",
    )


def _partners(s: dict, implicated: list[dict]) -> str:
    others = [x["id"] for x in implicated if x["id"] != s["id"]]
    return ", ".join(others) if others else "a difference no suspect reproduces on its own (see the residual)"


ROLES = ("root cause", "co-factor", "workaround")
"""What an implicated (or capacity) suspect is to the loss; None for every other suspect."""


@dataclass(frozen=True)
class Role:
    """A suspect's role (``ROLES``) and the verdict and reason it ends with: the causal verdict
    and reason of ``suspect_verdict`` extended by what the role adds (a co-factor's partners, a
    workaround's cause). A new value: the causal verdict it was decided from is never changed."""

    role: str
    verdict: str
    reason: str


def _role(s: dict) -> str:
    """A co-factor is necessary but, measured, not sufficient (``sufficient`` False); a capacity
    change is a root cause only when sufficient."""
    suff = s.get("sufficient")
    if suff is False or (s["changes_topk"] and suff is not True and s.get("sufficiency") is not None):
        return "co-factor"
    return "root cause"


def resolve_root_cause(suspects: list[dict], signature_fires: bool) -> tuple[str | None, dict[str, Role]]:
    """The root-cause rule over decided ``suspects`` (each with ``verdict``, ``reason``,
    ``present``, ``changes_topk``, ``pair`` and optionally ``sufficient``; none is changed):
    (the root cause's id or None, suspect id -> its ``Role``). Every root cause has role "root
    cause" (the first, largest b - c, non-capacity first, is returned); a co-factor stays
    ``implicated`` with a reason naming what it interacts with; a capacity co-factor beside a
    root cause is a workaround (``exonerated``), and one beside the uninformative-ranking
    signature a workaround left ``inconclusive``."""
    implicated = [s for s in suspects if s["verdict"] == "implicated" and s["present"]]
    role = {s["id"]: _role(s) for s in implicated}
    roles = {s["id"]: Role(role[s["id"]], s["verdict"], s["reason"]) for s in implicated}
    gain = lambda s: -(s["pair"]["b"] - s["pair"]["c"])  # noqa: E731
    roots = sorted(
        (s for s in implicated if role[s["id"]] == "root cause"), key=lambda s: (s["changes_topk"], gain(s))
    )
    functional = [s for s in roots if not s["changes_topk"]]
    capacity = [s for s in implicated if s["changes_topk"] and s not in functional]
    for s in implicated:
        if role[s["id"]] == "co-factor" and not s["changes_topk"]:
            roles[s["id"]] = Role(
                "co-factor",
                "implicated",
                f"co-factor: {s['reason']}; necessary but not sufficient: it restores recall when removed and "
                f"costs nothing added alone to the reference, so it interacts with {_partners(s, implicated)}",
            )
    if functional:
        for s in capacity:
            if s.get("sufficient") is True:
                continue  # a capacity change that costs recall on its own is a root cause too
            roles[s["id"]] = Role(
                "workaround",
                "exonerated",
                f"workaround, not the cause: {s['reason']}; the larger index_topk restores recall only while "
                f"{functional[0]['id']} stays (removing {functional[0]['id']} restores it at the deployment index_topk)",
            )
        return functional[0]["id"], roles
    if capacity and signature_fires and all(s.get("sufficient") is not True for s in capacity):
        for s in capacity:
            roles[s["id"]] = Role(
                "workaround",
                "inconclusive",
                f"{s['reason']}; but the needle's ranking is uninformative and the collapse tracks "
                "compress_ratio x index_topk: a larger index_topk is a workaround for a functional indexer "
                "bug that no suspect in the ledger reproduces",
            )
        return None, roles
    for s in capacity:
        if role[s["id"]] == "co-factor":
            roles[s["id"]] = Role(
                "co-factor",
                "implicated",
                f"co-factor: {s['reason']}; necessary but not sufficient: the deployment index_topk alone costs "
                f"nothing at the lengths tested, so it is a workaround for {_partners(s, implicated)}",
            )
    return (roots[0]["id"] if roots else None), roles


def root_causes(suspects: list[dict]) -> list[str]:
    """Every suspect ``resolve_root_cause`` left as a root cause (implicated, role "root cause")."""
    return [s["id"] for s in suspects if s["verdict"] == "implicated" and s.get("role") == "root cause"]


def residual_verdict(pair: dict, removed: list[str]) -> dict:
    """The residual: the candidate with every implicated suspect in ``removed`` taken out,
    paired against the reference (``pair``: with = the residual candidate, without = the
    reference). It still loses when the exact test says so (``restores``)."""
    loses = restores(pair)
    what = (
        "the candidate without " + ", ".join(removed)
        if removed
        else "the whole candidate (no suspect implicated)"
    )
    text = (
        f"unexplained residual: recall {pair['recall_with']:.2f} vs {pair['recall_without']:.2f} (reference), "
        f"{what}; paired n={pair['n']}, b={pair['b']} c={pair['c']}, exact McNemar p={pair['p']:.3g}"
        if loses
        else f"no residual: {what} recalls {pair['recall_with']:.2f} vs the reference's "
        f"{pair['recall_without']:.2f} (b={pair['b']} c={pair['c']}, p={pair['p']:.3g})"
    )
    return {"removed": list(removed), "pair": pair, "loses": loses, "text": text}


def classify_fix(pair: dict, *, removes: str | None, root_cause, keeps_topk: bool) -> str:
    """ "root-cause fix" | "workaround" | "no effect" (module docstring, "Fixes"). ``root_cause``:
    an id, None or a collection of root-cause ids."""
    if not restores(pair):
        return "no effect"
    roots = {root_cause} if isinstance(root_cause, str) else set(root_cause or ())
    if removes is not None and removes in roots and keeps_topk:
        return "root-cause fix"
    return "workaround"


def fix_label(fix: dict) -> str:
    """A replayed fix's label as the report shows it: its ``label_kind`` when the fix restores
    recall; else what the paired test says in words with its numbers: "not significant (p=0.062,
    n=18)" (a lift the cases cannot confirm is not "no effect"), or "worse (p=..., n=...)" when
    the fix significantly loses cases."""
    if fix["label_kind"] != "no effect":
        return fix["label_kind"]
    p = fix["pair"]
    word = "worse" if p["p"] < ALPHA and p["c"] > p["b"] else "not significant"
    return f"{word} (p={p['p']:.2g}, n={p['n']})"


def gap_closed(cmp: dict) -> float:
    """(J_emulation - J_baseline) / (1 - J_baseline): how much of the baseline's disagreement
    with the live selection the emulation explains (1 = identical to the live selection)."""
    je, jb = cmp["jaccard_emulation"], cmp["jaccard_baseline"]
    return (je - jb) / (1 - jb) if jb < 1 else float("nan")


def live_verdict(cmp: dict) -> tuple[str, str]:
    """(verdict, reason) of a live emulation's comparison (keys of ``live.summarise``); rules
    in the module docstring, "Live endpoint"."""
    f, r = cmp["failures"], cmp["reproduced"]
    if cmp["cases"] == 0:  # not "the failure is not in the selection", nor Jaccards of no rows (nan)
        return (
            "inconclusive",
            "no case failed on the live endpoint: no failure for its emulation to reproduce",
        )
    je, jb = cmp["jaccard_emulation"], cmp["jaccard_baseline"]
    gap = gap_closed(cmp)
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


PATHS = ("prefill", "decode")
"""The two ways a white-box comparison runs token ids: teacher-forced, and a server's (the prompt
prefilled into the cache, then one token per forward)."""


def live_verdict_paths(cmps: dict[str, dict]) -> tuple[str, str, str]:
    """(verdict, reason, deciding path) of a live emulation run on both paths: ``cmps`` maps
    ``prefill`` and ``decode`` to their comparisons. The teacher-forced verdict stands unless only
    the decode-path emulation reproduces the live failure (the server decodes: a bug of its decode
    path is reproduced only there), which implicates the suspect as "decode-path only"."""
    pv, pr = live_verdict(cmps["prefill"])
    dv, dr = live_verdict(cmps["decode"])
    if dv == "implicated" and pv != "implicated":
        return (
            dv,
            f"decode-path only: its teacher-forced emulation is {pv}; on the decode path {dr}",
            "decode",
        )
    d = cmps["decode"]
    return (
        pv,
        f"{pr}; on the decode path: {dv} ({d['reproduced']} of {d['failures']} reproduced, mean Jaccard "
        f"emulation {d['jaccard_emulation']:.3f} vs baseline {d['jaccard_baseline']:.3f})",
        "prefill",
    )


def validate_verdicts(obj: dict) -> None:
    """ValueError unless ``obj`` follows ``VERDICTS_SCHEMA`` and uses only known verdict words."""
    check_schema(obj, VERDICTS_SCHEMA, "verdicts")
    for i, s in enumerate(obj["suspects"]):
        if s["verdict"] not in VERDICTS:
            raise ValueError(f"verdicts.suspects[{i}].verdict: {s['verdict']!r} is not one of {VERDICTS}")
    ids = {s["id"] for s in obj["suspects"]}
    for root in [obj["root_cause"], *obj["root_causes"]]:
        if root is not None and root not in ids:
            raise ValueError(f"verdicts.root_cause {root!r} names no suspect")
