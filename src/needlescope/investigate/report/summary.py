"""The summary box at the top of DIAGNOSIS: what a reader acts on, read from the verdict data.

Four lines: the symptom in one line; the root cause with its decisive measurement, or
"unexplained" (also when an unexplained residual loss or differences no suspect covers remain),
or, with a ``characterization``, what kind of bug it is and the command to run next ("nothing to
explain" when no recall is lost);
the recommended fix with its measured effect; what not to do (workarounds, and suspects that
move the logits but not recall). Reads the run's ``Findings`` only.
"""

from __future__ import annotations

from needlescope.investigate.decide.findings import Findings, Suspect
from needlescope.report.diagnosis import recall_fall_line

__all__ = ["summary_box", "shown_verdict", "COST_ORDER"]

COST_ORDER = {"config": 0, "kernel": 1, "harness": 2}
"""Cheapest kind of fix first: a setting, then a kernel, then the harness."""


def shown_verdict(s: Suspect) -> str:
    """A suspect's verdict as the report shows it: a workaround is named one, whatever its
    verdict (a larger top-k that restores recall while the cause stays is not exonerated, nor
    the cause); an implicated suspect shows its role (root cause, co-factor) when it has one."""
    if s.role == "workaround":
        return "workaround"
    if s.verdict == "implicated" and s.role:
        return f"implicated ({s.role})"
    return s.verdict


def _pair_text(p: dict) -> str:
    return (
        f"recall {p['recall_with']:.2f} -> {p['recall_without']:.2f} on {p['n']} paired cases "
        f"(b={p['b']}, c={p['c']}, exact McNemar p={p['p']:.2g})"
    )


def _symptom(findings: Findings) -> str:
    sy = findings.symptom
    if findings.route == "dump":
        return "the candidate is an engine tensor dump of one request: no candidate recall; see where the divergence starts"
    if not sy["recall_candidate"]:
        return f"no candidate recall was measured ({sy['cases']} cases planned)"
    line = recall_fall_line(sy["recall_reference"], sy["recall_candidate"])
    errors = sy.get("errors") or 0
    if errors:
        # the candidate's recall rests on the answered cases only: say so in the box itself
        return (
            f"{line} ({sy['cases'] - errors} of {sy['cases']} {sy['kind']} cases answered; {errors} live "
            "request(s) failed, recorded as errors, not scored: rerun to send them again)"
        )
    return f"{line} ({sy['cases']} {sy['kind']} cases)"


def _roots(findings: Findings) -> list[str]:
    return list(findings.root_causes)


_SETTLED = ("implicated", "exonerated", "diverges_no_effect")


def _unexplained(findings: Findings) -> list[str]:
    """Why (part of) the loss is unexplained: a residual that still loses, differences no ledger
    suspect names whose automatic suspect was not settled, suspects left inconclusive."""
    out = []
    residual = findings.residual
    if residual and residual.get("loses"):
        out.append(residual.get("text") or "the candidate without its implicated suspects still loses recall")
    diffs = [d for d in findings.unaccounted_differences if d.get("verdict") not in _SETTLED]
    if diffs:
        names = ", ".join(f"`{d['name']}` ({d.get('verdict') or 'not tested'})" for d in diffs[:5])
        more = " ..." if len(diffs) > 5 else ""
        out.append(
            f"{len(diffs)} difference(s) from the reference that no ledger suspect names: {names}{more}"
        )
    open_ = [
        s.id for s in findings.suspects if s.verdict == "inconclusive" and shown_verdict(s) != "workaround"
    ]
    if open_:
        out.append(f"inconclusive: {', '.join(open_)}")
    return out


def _lost(findings: Findings) -> bool:
    sy = findings.symptom
    ref, cand = sy["recall_reference"], sy["recall_candidate"]
    return any(n in cand and cand[n] < ref[n] for n in ref)


def _root_cause(findings: Findings) -> str:
    parts = []
    for rid in _roots(findings):
        s = findings.suspect(rid)
        measured = f": removing it, {_pair_text(s.pair)}" if s.pair else ""
        where = f"`{s.maps_to}`; " if s.maps_to else ""
        parts.append(f"**{rid}** ({where}{s.hypothesis}){measured}")
    co = [x.id for x in findings.suspects if x.role == "co-factor"]
    if co:
        parts.append(f"co-factor(s) {', '.join(co)}: necessary, not sufficient on their own")
    ch = findings.characterization
    # a named serving state is something to explain even when the symptom (alone, cold) lost nothing
    state = bool(ch) and ch["classes"][0] == "state_dependent"
    if not parts and not state and (not _lost(findings) or (ch and ch["classes"] == ["none"])):
        return "nothing to explain: the candidate loses no recall against the reference at the tested lengths"
    unexplained = _unexplained(findings)
    if not parts and ch:
        return f"{ch['text']}: next, `{ch['next']}`" if ch.get("next") else ch["text"]
    if not parts:
        why = "; ".join(unexplained) if unexplained else "no suspect in the ledger is implicated"
        return f"**unexplained**: {why}"
    text = "; ".join(parts)
    if ch and ch["classes"][0] not in ("none", "undecided"):
        text += f"; what kind of bug: {ch['classes'][0]} ({ch['evidence'][ch['classes'][0]]['rule']}), next `{ch['next']}`"
    if unexplained:
        text += "; **partly unexplained**: " + "; ".join(unexplained)
    return text


def _fix_text(f: dict, k0: int | None) -> str:
    what = f"remove {f['removes']}" if f.get("removes") else f"`{f['label']}`"
    cost = (
        "at the deployment's index_topk"
        if f.get("keeps_topk")
        else f"index_topk {k0} -> {f['index_topk']}"
        + (f" ({f['index_topk'] / k0:g}x the entries each query reads)" if k0 else "")
    )
    return f"{what} (setting `{f['label']}`): {_pair_text(f['pair'])}, {cost}"


def _fixes(findings: Findings, kind: str) -> list[dict]:
    return sorted(
        (f for f in findings.fixes if f.get("label_kind") == kind),
        key=lambda f: (COST_ORDER.get(f.get("changes"), 9), f["name"]),
    )


def _recommended(findings: Findings) -> str:
    root = _fixes(findings, "root-cause fix")
    if root:
        return _fix_text(root[0], findings.candidate_topk)
    if findings.route == "live":
        return "none measured: a live endpoint cannot be ablated; remove the root cause in the deployment and probe again"
    if findings.route == "dump":
        return "none measured: a tensor dump cannot be ablated; fix the module the localization names, dump again and compare"
    if findings.route == "blackbox":
        return "none measured: an endpoint read from outside cannot be ablated; the class says where to look"
    roots = _roots(findings)
    if roots:
        return f"remove {', '.join(roots)} (no fix without it was replayed)"
    return "none found: no replayed fix removes a cause"


def _workaround_text(f: dict, k0: int | None, roots: list[str]) -> str:
    what = f"raising index_topk ({k0} -> {f['index_topk']})" if not f.get("keeps_topk") else f"`{f['label']}`"
    cause = f"while {', '.join(roots)} stays" if roots else "while the cause stays"
    cost = (
        f", at {f['index_topk'] / k0:g}x the entries each query reads"
        if k0 and not f.get("keeps_topk")
        else ""
    )
    return f"{what} is a workaround: {_pair_text(f['pair'])} {cause}{cost}"


def _do_not(findings: Findings) -> str:
    roots = _roots(findings)
    k0 = findings.candidate_topk
    items = [_workaround_text(f, k0, roots) for f in _fixes(findings, "workaround")]
    named = {f.get("removes") for f in _fixes(findings, "workaround")}
    shown = [s for s in findings.suspects if shown_verdict(s) == "workaround" and s.id not in named]
    items += [f"{s.id} is a workaround, not the cause" for s in shown]
    chase = [s.id for s in findings.suspects if s.verdict == "diverges_no_effect"]
    if chase:
        items.append(f"do not chase {', '.join(chase)}: each moves the logits but costs no recall")
    return "; ".join(items) if items else "-"


def summary_box(findings: Findings) -> tuple:
    """The ``("box", ...)`` block of DIAGNOSIS's summary (``report.blocks``)."""
    return (
        "box",
        "Summary",
        [
            ("Symptom", _symptom(findings)),
            ("Root cause", _root_cause(findings)),
            ("Recommended fix", _recommended(findings)),
            ("Not a fix", _do_not(findings)),
        ],
    )
