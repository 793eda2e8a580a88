"""DIAGNOSIS sections for what the ledger did not name: uncovered differences, the residual,
where the divergence starts, non-finite scores and the multiplicity note (blocks as in
``investigate.report.diagnosis``; every section reads ``verdicts.json`` keys only)."""

from __future__ import annotations

__all__ = [
    "differences_blocks",
    "residual_blocks",
    "localization_blocks",
    "nonfinite_blocks",
    "multiplicity_text",
]


def differences_blocks(v: dict) -> list[tuple]:
    """ "Differences the ledger did not name": empty when every difference is covered."""
    diffs = v.get("unaccounted_differences") or []
    if not diffs:
        return []
    verdict = {s["id"]: s for s in v["suspects"]}
    rows = []
    for d in diffs:
        s = verdict.get(d["suspect"], {})
        rows.append(
            [
                d["kind"],
                f"`{d['name']}`",
                d["reference"] if d["reference"] is not None else "-",
                d["candidate"] if d["candidate"] is not None else "-",
                d["suspect"],
                s.get("verdict", "-") + (f" ({s['role']})" if s.get("role") else ""),
            ]
        )
    untested = [d["name"] for d in diffs if not d["testable"]]
    text = (
        f"The candidate differs from the reference in {len(diffs)} way(s) no ledger suspect covers. Each became "
        "an automatic suspect, removed from the candidate and added alone to the reference on the same cases."
    )
    if untested:
        text += " Not testable in-process (blocked): " + ", ".join(f"`{n}`" for n in untested) + "."
    return [
        ("h", 2, "Differences the ledger did not name"),
        ("p", text),
        ("table", ["kind", "difference", "reference", "candidate", "automatic suspect", "verdict"], rows),
    ]


def residual_blocks(v: dict) -> list[tuple]:
    r = v.get("residual")
    if not r:
        return []
    p = r["pair"]
    rows = [
        [
            "; ".join(r["removed"]) or "nothing (no suspect implicated)",
            f"`{r['config']}`",
            f"{p['recall_with']:.2f} vs {p['recall_without']:.2f}",
            f"n={p['n']} b={p['b']} c={p['c']} p={p['p']:.3g}",
            "**unexplained residual**" if r["loses"] else "none",
        ]
    ]
    head = ["removed", "residual candidate", "recall (residual vs reference)", "paired test", "residual"]
    text = (
        "The root cause is incomplete: " + r["text"] + "." if r["loses"] and r["removed"] else r["text"] + "."
    )
    return [("h", 2, "Residual"), ("table", head, rows), ("p", text)]


def localization_blocks(v: dict) -> list[tuple]:
    loc = v.get("localization")
    if not loc:
        return []
    rows = [
        [
            p["path"],
            "yes" if p["diverges"] else "no",
            f"`{p['first_divergent_module']}`" if p["first_divergent_module"] else "-",
            p["module_type"] or "-",
            "-" if p["layer"] is None else p["layer"],
            _num(p["own_err"]),
            _num(p["own_budget"]),
            "-" if p["first_departing_layer"] is None else p["first_departing_layer"],
        ]
        for p in loc["paths"]
    ]
    head = [
        "path",
        "diverges",
        "first module",
        "class",
        "layer",
        "own error",
        "budget",
        "first CSA layer departing",
    ]
    lrows = [
        [
            p["path"],
            ly["layer"],
            "-" if ly["topk_overlap"] is None else f"{ly['topk_overlap']:.3f}",
            f"{_kept(ly['needle_kept_reference'])} / {_kept(ly['needle_kept_candidate'])}",
        ]
        for p in loc["paths"]
        for ly in p["layers"]
    ]
    if loc["case_id"] == "dump":  # the dump route (investigate.measure.dump): one request, no answer
        text = (
            f"The engine's tensor dump ({loc['config']}) against the reference on the same token ids: "
            f"**{loc['summary']}**. Reproduce: `{loc['command']}` (every tensor in `localize/compare_dump.md`)."
        )
    else:
        text = (
            f"Case `{loc['case_id']}` under {loc.get('target', 'the residual candidate')} `{loc['config']}`, at its first wrong answer token "
            f"(answer token {loc['analysed_token']}, query position {loc['query_pos']}): **{loc['summary']}**. "
            f"Reproduce the prefill step: `{loc['command']}`."
        )
    return [
        ("h", 2, "Where the divergence starts"),
        ("p", text),
        ("table", head, rows),
        ("table", ["path", "CSA layer", "top-k overlap", "needle kept: reference / candidate"], lrows),
    ]


def _kept(x) -> str:
    return "-" if x is None else ("yes" if x else "no")


def _num(x) -> str:
    return "-" if x is None else (x if isinstance(x, str) else f"{x:.3g}")


def nonfinite_blocks(v: dict) -> list[tuple]:
    nf = v.get("nonfinite_scores") or {}
    counts = nf.get("counts") or {}
    if not counts:
        return []
    rows = [
        [cfg, layer, c["neg_inf"], c["nan"], c["pos_inf"]]
        for cfg, layers in counts.items()
        for layer, c in sorted(layers.items(), key=lambda kv: int(kv[0]))
    ]
    b = [
        ("h", 2, "Non-finite indexer scores"),
        (
            "p",
            "Counted over the visible entries of every query row of every case. -inf is a masked score (it ranks "
            "last); NaN and +inf are findings: an indexer should never produce them.",
        ),
        ("table", ["configuration", "CSA layer", "-inf", "NaN", "+inf"], rows),
    ]
    finds = nf.get("findings") or []
    if finds:
        frows = [
            [f["config"], f["case_id"], f["layer"], f["position"], f["nan"], f["pos_inf"]] for f in finds[:20]
        ]
        b.append(("table", ["configuration", "case", "CSA layer", "first position", "NaN", "+inf"], frows))
        if len(finds) > 20:
            b.append(("p", f"... and {len(finds) - 20} more (verdicts.json nonfinite_scores.findings)."))
    return b


def multiplicity_text(v: dict) -> str:
    m = v.get("multiplicity") or {}
    if not m.get("tests"):
        return ""
    return (
        f"Verdicts rest on Holm-adjusted p-values across the {m['tests']} ablation test(s) of this run "
        f"(level {m['alpha']:g}); sufficiency tests are adjusted in their own family. A negative verdict states "
        "the recall cost its ablation would detect with 80% power at the strictest Holm level, and is "
        "inconclusive when that exceeds the symptom (or 50 points when the symptom is smaller)."
    )
