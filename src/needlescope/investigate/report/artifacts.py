"""What an investigation's artifacts say beyond the verdicts: machine-independent paths and the
indexer's non-finite scores.

* ``relativize(obj, prefixes)``: every string of a JSON object with each absolute prefix replaced
  (the ledger's directory by nothing, so patch files and env files read as the ledger names them;
  the checkpoint's directory by the checkpoint's name). ``verdicts.json``, ``investigation.json``,
  ``state.json`` and the reports rendered from them carry no absolute path of the machine.
* ``nonfinite_summary(inv)``: the non-finite indexer scores of every measured configuration
  (``measure`` records count them per CSA layer over the visible entries of every query row:
  ``-inf`` is a legitimate masked score and ranks last; NaN and ``+inf`` are findings), as
  ``verdicts.json`` ``nonfinite_scores``: ``{"counts": {config: {layer: {"neg_inf", "nan",
  "pos_inf"}}}, "findings": [{"config", "case_id", "layer", "position", "nan", "pos_inf"}]}``.
"""

from __future__ import annotations

from needlescope.investigate.decide.verdicts import validate_verdicts
from needlescope.paths import atomic_write_json

__all__ = ["relativize", "nonfinite_summary", "write_verdicts", "NONFINITE_KEYS"]

NONFINITE_KEYS = ("neg_inf", "nan", "pos_inf")


def relativize(obj, prefixes: dict[str, str]):
    """``obj`` with every string's absolute ``prefixes`` (longest first) replaced by their values."""
    order = sorted(prefixes.items(), key=lambda kv: -len(kv[0]))

    def fix(x):
        if isinstance(x, str):
            for old, new in order:
                if old in x:
                    x = x.replace(old, new)
            return x
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fix(v) for v in x]
        return x

    return fix(obj)


def nonfinite_summary(inv) -> dict:
    """Non-finite score counts per configuration and CSA layer, and the NaN / +inf findings."""
    counts: dict[str, dict] = {}
    findings = []
    for name in inv.configs:
        for r in inv.state.records(name):
            for layer, c in (r.get("nonfinite") or {}).items():
                agg = counts.setdefault(name, {}).setdefault(layer, dict.fromkeys(NONFINITE_KEYS, 0))
                for k in NONFINITE_KEYS:
                    agg[k] += c[k]
                if c["nan"] or c["pos_inf"]:
                    findings.append(
                        {
                            "config": name,
                            "case_id": r["case_id"],
                            "layer": int(layer),
                            "position": c.get("first_position"),
                            "nan": c["nan"],
                            "pos_inf": c["pos_inf"],
                        }
                    )
    return {"counts": counts, "findings": findings}


def write_verdicts(inv, symptom: dict, root, sig: dict, suspects_out: list[dict], **extra) -> dict:
    """Build, validate and write ``verdicts.json``; returns it. ``extra``: the keys beyond the
    suspects (``differences``, ``residual``, ``localization``, ...; defaults when not given)."""
    ids = {s["id"] for s in suspects_out}
    diffs = [
        d.to_json(next((s["verdict"] for s in suspects_out if s["id"] == d.suspect), None)) for d in inv.diffs
    ]
    verdicts = {
        "symptom": symptom,
        "root_cause": root,
        "root_causes": [
            s["id"] for s in suspects_out if s["verdict"] == "implicated" and s.get("role") == "root cause"
        ],
        "signature": sig,
        "suspects": [
            {
                "id": s["id"],
                "tier": s["tier"],
                "verdict": s["verdict"],
                "reason": s["reason"],
                "evidence": inv.state.evidence(s["id"]),
                **{
                    k: s.get(k)
                    for k in ("auto", "role", "necessary", "sufficient", "p_holm", "power", "live_paths")
                },
            }
            for s in suspects_out
        ],
        "differences": diffs,
        "unaccounted_differences": [d for d in diffs if not d["covered_by"] and (d["suspect"] in ids)],
        "residual": None,
        "localization": None,
        "rank_paths": None,
        "nonfinite_scores": {"counts": {}, "findings": []},
        "multiplicity": {
            "method": "holm",
            "tests": sum(s.get("pair") is not None for s in suspects_out),
            "alpha": 0.05,
        },
        **extra,
    }
    if root is not None and root not in verdicts["root_causes"]:
        verdicts["root_causes"].insert(0, root)
    verdicts = relativize(verdicts, inv.path_map())
    validate_verdicts(verdicts)
    for s in suspects_out:
        inv.state.set_status(s["id"], s["verdict"], s["reason"])
    atomic_write_json(inv.out / "verdicts.json", verdicts)
    return verdicts
