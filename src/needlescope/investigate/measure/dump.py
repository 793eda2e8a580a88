"""``candidate = "dump"``: an investigation whose candidate is an engine's tensor dump (issue 39, item 4).

For deployments that can dump their tensors (SGLang's dumper, docs/dsa_dump.md) but cannot serve
``return_indexer_topk``. Nothing runs the candidate, so nothing can be ablated or emulated
against it:

1. **questions**, as on every route; a suspect whose questions show it absent is exonerated,
   every other one is inconclusive (a dump answers *where*, not *which suspect*;
   ``decide.dump.decide_dump`` decides it from the measured record);
2. **symptom**: the reference on the ledger's probe cases (recall per length); the dump holds
   one request, so there is no candidate recall;
3. **localization**: ``dsa.compare_dump.compare_dump`` of the dump against the reference
   (``localize/compare_dump.json`` and ``.md``), turned into ``verdicts.json``'s
   ``localization``: one path, ``"dump"``, whose first divergent module is the reference module
   of the first tensor beyond its precision budget, its ``own_err`` / ``own_budget`` that
   tensor's ``rel_err`` / ``budget``, and per CSA layer the dump's top-k against the reference's.

``investigation.json`` has ``route = "dump"``; DIAGNOSIS.md's "Where the divergence starts"
section is this localization.
"""

from __future__ import annotations

import shlex

from needlescope.investigate.decide.measured import Measured
from needlescope.investigate.ledger.ledger import Suspect
from needlescope.investigate.measure.localize import STEP
from needlescope.investigate.measure.session import Session, measure_suspects, suspect_identity
from needlescope.paths import relativize

__all__ = ["measure", "DumpRoute", "dump_localization"]


def dump_localization(result: dict, module_type: str | None, command: str) -> dict:
    """The measured localization of a ``compare_dump`` result (module docstring); its first
    departing CSA layer is ``decide.localization``'s."""
    first = result["first_beyond"]
    row = None if first is None else next(t for t in result["tensors"] if t["engine_name"] == first["engine_name"]
                                          and t["layer"] == first["layer"])  # fmt: skip
    layers = [
        {
            "layer": r["layer"],
            "topk_overlap": r["topk_overlap"],
            "needle_visible": len(r["needle_entries"]),
            "needle_kept_reference": r["needle_kept_reference"],
            "needle_kept_candidate": r["needle_kept_engine"],
        }
        for r in result["indexer"]
        if r["layer"] is not None
    ]
    where = (
        f"first tensor beyond its budget: `{first['engine_name']}` = {first['reference']} ({module_type}, "
        f"layer {first['layer']}), rel_err {row['rel_err']:.3g} vs budget {row['budget']:.3g}"
        if first is not None
        else result["summary"]
    )
    path = {
        "path": "dump",
        "diverges": first is not None,
        "first_divergent_module": None if first is None else first["reference"],
        "module_type": module_type,
        "layer": None if first is None else first["layer"],
        "own_err": None if row is None else row["rel_err"],
        "own_budget": None if row is None else row["budget"],
        "layers": layers,
        "summary": where,
    }
    return {
        "route": "dump",
        "case_id": "dump",
        "target": "the engine's tensor dump",
        "config": f"dump of {result['prompt_tokens']} tokens, passes {result['passes']}, ranks {result['ranks']}",
        "analysed_token": 0,
        "query_pos": result["prompt_tokens"] - 1,
        "path": path,
        "summary": where
        + f" ({len(result['tensors'])} dumped tensors compared, mapping {result['mapping']})",
        "command": command,
    }


class DumpRoute:
    """The dump route's measurements on a ``Session`` (module docstring); no verdicts."""

    def __init__(self, session: Session):
        self.session = session

    def measure_suspect(self, s: Suspect) -> dict:
        """What a dump route knows of ``s``: its cheap questions (``decide.dump.decide_dump``)."""
        ss = self.session
        return {
            **suspect_identity(s),
            "absent_by_question": ss.absent_by_question(s.id),
            "questions": ss.question_summary(s.id),
        }

    def localize(self) -> dict | None:
        """The dump compared with the reference (resumed from ``state.json``); None when blocked."""
        from needlescope.dsa.compare_dump import compare_dump
        from needlescope.dsa.compare_dump_md import (
            compare_dump_to_json,
            render_compare_dump_md,
            validate_compare_dump,
        )
        from needlescope.dsa.dump_mapping import load_mapping

        ss = self.session
        done = ss.state.step_value(STEP)
        if done is not None or not ss.loaded:
            return done
        t = ss.ledger.target
        ss.progress("localize", 0, 1, "dump")
        result = compare_dump(ss.model, t.dump, load_mapping(t.dump_mapping))
        validate_compare_dump(result)
        result = relativize(result, ss.path_map())
        (ss.out / "localize").mkdir(exist_ok=True)
        (ss.out / "localize" / "compare_dump.json").write_text(compare_dump_to_json(result), encoding="utf-8")
        (ss.out / "localize" / "compare_dump.md").write_text(render_compare_dump_md(result), encoding="utf-8")
        first = result["first_beyond"]
        module_type = None if first is None else type(ss.model.get_submodule(first["reference"])).__name__
        parts = [
            "needlescope",
            "indexer",
            "compare-dump",
            str(t.dump),
            "--model",
            t.model,
            "--out",
            "compare-dump",
        ]
        if t.dump_mapping is not None:
            parts += ["--mapping", str(t.dump_mapping)]
        command = relativize(" ".join(shlex.quote(p) for p in parts), ss.path_map())
        loc = dump_localization(result, module_type, command)
        ss.state.mark_done(STEP, loc)
        ss.progress("localize", 1, 1, "dump")
        return loc


def measure(session: Session) -> Measured:
    """Every dump-route measurement: the reference's recall, the cheap questions, the dump's
    localization (module docstring), resumable."""
    route = DumpRoute(session)
    ref_records = session.measure("reference", session.reference) if session.loaded else []
    measured = measure_suspects(session, route.measure_suspect)
    t = session.ledger.target
    return session.measured(
        measured,
        route="dump",
        target={"model": t.model, "device": t.device, "dump": str(t.dump)},
        candidate_label="engine tensor dump",
        reference_records=ref_records,
        candidate_records=[],
        symptom_extra={"cases": len(ref_records)},
        localization=route.localize(),
    )
