"""Where the divergence starts: the one localization rule of every route (pure, torch-free).

Every route measures the same thing per CSA layer: the mean Jaccard overlap of the candidate's
selection with the reference's (``topk_overlap``) and the needle entries each keeps. The routes
differ in what they compare (in-process: the residual candidate teacher-forced and decoded;
live: the server's capture; dump: the engine's dumped top-k), never in how it is judged:

* a CSA layer's selection **departs** when its mean overlap is below ``DEPARTS`` (the candidate's
  own rounding moves a few entries of a few rows; one entry of 64 changed at every row is 0.97);
* the first departing layer (``first_departing``) is where the selection departs;
* in-process, a **module** departs on the decode path when its decode output differs from its own
  teacher-forced output by more than ``FACTOR`` times the reference's difference, and by more than
  ``FLOOR`` (``module_limit``; an indexer's selection has no floor: any change the reference
  does not show departs); the decode path diverges at the first departing module, in call
  order, of the first decode step where any departs (``decode_departure``, from the measured
  differences of every module at every step);
* the path that diverges first (``diverges_first``): the teacher-forced prefill when a module
  there exceeds its budget, else "decode only" when the decode path departs, else "neither";
* the failing case's rank paths (``decide_rank_paths``): the prefill when the candidate's
  selection differs from the reference's already teacher-forced in some CSA layer, else
  "decode only" when it differs on the decode path, else "neither" (``paths_agree``: the
  candidate ranks the needle alike on both paths).

``decide_localization(measured)`` turns a route's measured localization (``measure/``: numbers,
no decided field) into ``verdicts.json``'s ``localization``.
"""

from __future__ import annotations

import re

__all__ = [
    "DEPARTS",
    "FACTOR",
    "FLOOR",
    "decide_localization",
    "decide_rank_paths",
    "decode_departure",
    "first_departing",
    "module_limit",
]

DEPARTS = 0.99
"""A CSA layer's selection departs from the reference's when their mean Jaccard is below this."""
FACTOR = 4.0
"""A module departs on the decode path beyond this many times the reference's own difference."""
FLOOR = 1e-3
"""... and beyond this relative error (the two paths reduce in different orders)."""


def first_departing(layers: list[dict]) -> int | None:
    """The first CSA layer (in ``layers``' order) whose ``topk_overlap`` is below ``DEPARTS``."""
    return next(
        (ly["layer"] for ly in layers if ly["topk_overlap"] is not None and ly["topk_overlap"] < DEPARTS),
        None,
    )


def module_limit(indexer: bool, reference_difference: float) -> float:
    """The difference above which a module's decode output departs from its teacher-forced one,
    given the reference's difference for the same module (module docstring)."""
    return FACTOR * reference_difference if indexer else max(FACTOR * reference_difference, FLOOR)


_INDEXER = "DeepseekV4Indexer"


def decode_departure(path: dict) -> dict:
    """The decided fields of the in-process decode path (``diverges``, ``first_divergent_module``,
    ``module_type``, ``layer``, ``own_err``, ``own_budget``, ``summary``) from its measured
    ``steps``: per decode step, each module's ``err`` and the reference's ``reference_err`` (null:
    none, read as 0); null ``steps``: nothing was decoded (the first answer token is analysed)."""
    none = {"diverges": False, "first_divergent_module": None, "module_type": None, "layer": None}
    if path["steps"] is None:
        summary = (
            "the first answer token is wrong: nothing is decoded before it, the decode path is the prefill"
        )
        return {**none, "own_err": None, "own_budget": None, "summary": summary}
    for step in path["steps"]:
        for m in step["modules"]:
            limit = module_limit(m["type"] == _INDEXER, m["reference_err"] or 0.0)
            if m["err"] > limit:
                layer = re.search(r"layers\.(\d+)\.", m["module"])
                return {
                    "diverges": True,
                    "first_divergent_module": m["module"],
                    "module_type": m["type"],
                    "layer": int(layer.group(1)) if layer else None,
                    "own_err": m["err"],
                    "own_budget": limit,
                    "summary": f"decode step at position {step['position']}: {m['module']} ({m['type']}) departs "
                    f"from its teacher-forced output by {m['err']:.3g} (limit {limit:.3g})",
                }
    summary = (
        "every module's decode output matches its teacher-forced output as closely as the reference's does"
    )
    return {**none, "own_err": None, "own_budget": None, "summary": summary}


_PATH_KEYS = ("path", "diverges", "first_divergent_module", "module_type", "layer", "own_err", "own_budget")


def _path(p: dict) -> dict:
    """A measured path with its first departing layer, in the schema's key order; the decode
    path's departure decided from its measured ``steps`` (a state.json of a run before
    2026-12-08 holds it decided)."""
    if "steps" in p:
        p = {**p, **decode_departure(p)}
    out = {k: p[k] for k in _PATH_KEYS}
    out["first_departing_layer"] = first_departing(p["layers"])
    out.update({k: p[k] for k in ("layers", "summary", "finding") if k in p})
    return out


def _first(paths: list[dict]) -> dict:
    pre = next(p for p in paths if p["path"] == "prefill")
    dec = next((p for p in paths if p["path"] == "decode"), None)
    if pre["diverges"]:
        where, p = "prefill", pre
    elif dec is not None and dec["diverges"]:
        where, p = "decode only", dec
    else:
        return {"diverges_first": "neither", "summary": "no module diverges beyond its budget on either path"}
    summary = f"{p['first_divergent_module']} ({p['module_type']}, layer {p['layer']})"
    if where == "decode only":
        same = all(ly["topk_overlap"] == 1.0 for ly in pre["layers"])
        before = (
            "prefill selections identical"
            if same
            else "the teacher-forced prefill has no module beyond its budget (its selections differ only within the candidate's numerics)"
        )
        summary = f"decode-path only: {before}; first departing module {summary}"
    else:
        summary = (
            f"first module beyond its budget: {summary}, own error {p['own_err']} vs budget {p['own_budget']}"
        )
    return {"diverges_first": where, "summary": summary}


def _in_process(m: dict) -> dict:
    paths = [_path(p) for p in m["paths"]]
    head = {k: m[k] for k in ("case_id", "target", "config", "analysed_token", "query_pos")}
    return {**head, "paths": paths, **_first(paths), "command": m["command"]}


def _live(m: dict) -> dict:
    """The live capture against the reference, one path: the server's own (decode)."""
    first = first_departing(m["layers"])
    summary = (
        f"the live selection departs from the reference's first in CSA layer {first}"
        if first is not None
        else "the live selections match the reference's in every CSA layer"
    )
    path = {
        "path": "decode",
        "diverges": first is not None,
        "first_divergent_module": None,
        "module_type": "DeepseekV4Indexer" if first is not None else None,
        "layer": first,
        "own_err": None,
        "own_budget": None,
        "first_departing_layer": first,
        "layers": m["layers"],
        "summary": summary,
    }
    return {
        "case_id": m["case_id"],
        "target": "the live endpoint",
        "config": "live endpoint",
        "analysed_token": m["analysed_token"],
        "query_pos": m["query_pos"],
        "paths": [path],
        "diverges_first": "decode" if first is not None else "neither",
        "summary": summary + f" (over {m['failing_cases']} failing case(s), the server's own decode path)",
        "command": m["command"],
    }


def _dump(m: dict) -> dict:
    """The dump against the reference: its first tensor beyond its budget (``dsa.compare_dump``)."""
    path = _path(m["path"])
    head = {k: m[k] for k in ("case_id", "target", "config", "analysed_token", "query_pos")}
    return {
        **head,
        "paths": [path],
        "diverges_first": "dump" if path["diverges"] else "neither",
        "summary": m["summary"],
        "command": m["command"],
    }


_ROUTES = {"in-process": _in_process, "live": _live, "dump": _dump}


def decide_localization(measured: dict | None) -> dict | None:
    """``verdicts.json`` ``localization`` from a route's measured localization (``route``: the
    route that measured it; None: nothing was localized)."""
    if measured is None:
        return None
    return _ROUTES[measured["route"]](measured)


def _rank_paths_first(layers: list[dict], analysed_token: int) -> dict:
    """``diverges_first``, ``paths_agree`` and the summary of ``rank_paths`` (``decide_rank_paths``)."""
    pre = [ly["layer"] for ly in layers if not ly["prefill_same_as_reference"]]
    dec = [ly["layer"] for ly in layers if not ly["decode_same_as_reference"]]
    moved = [ly for ly in layers if ly["prefill"] != ly["decode"]]
    ranks = "; ".join(
        f"layer {ly['layer']}: best rank {ly['prefill']['best_rank']} (prefill) vs {ly['decode']['best_rank']} (decode)"
        for ly in moved
        if ly["prefill"] is not None
    )
    if analysed_token == 0:
        note = (
            " (the first answer token is analysed: nothing is decoded before it, both paths are the prefill)"
        )
    else:
        note = ""
    if pre:
        where = "prefill"
        summary = f"the candidate's selection differs from the reference's already teacher-forced (prefill), in CSA layer(s) {', '.join(map(str, pre))}"
        summary += (
            f"; the decode path moves the needle's rank further: {ranks}"
            if moved
            else "; the decode path ranks the needle exactly as the prefill does"
        )
    elif dec:
        where = "decode only"
        summary = f"decode-path only: prefill selections identical; the decode path's selection departs in CSA layer(s) {', '.join(map(str, dec))}"
        summary += f" ({ranks})" if ranks else ""
    else:
        where = "neither"
        summary = "both paths select as the reference does in every CSA layer"
    return {"diverges_first": where, "paths_agree": not moved, "summary": summary + note}


def decide_rank_paths(measured: dict | None) -> dict | None:
    """``verdicts.json`` ``rank_paths`` from the measured one (``measure.rank_paths``): its
    numbers and which path diverges first (``_rank_paths_first``); None when none was measured."""
    if measured is None:
        return None
    return {**measured, **_rank_paths_first(measured["layers"], measured["analysed_token"])}
