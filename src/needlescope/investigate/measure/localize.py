"""Where the unexplained divergence starts: the localizer step of an in-process investigation.

When the residual still loses (or no suspect is implicated), ``localize_residual`` takes the
first failing case of the residual candidate (when a root cause is an automatic suspect, one the
ledger did not name, and nothing is left unexplained: of the candidate itself, to show where in
the model the unnamed difference acts) (wrong there, right under the reference; shortest
length, then depth and trial), at its **first wrong answer token**, and runs the white-box
comparisons on the token ids that produced it (the prompt plus the residual candidate's answer
tokens before that one):

* **prefill** (teacher-forced, one forward over those ids): the differential localizer
  ``dsa.diff.localize`` between the reference (its numerics at the residual candidate's
  ``index_topk``) and a second copy of the checkpoint carrying the residual candidate's setting
  and extra patches: the first module whose own error exceeds its budget, its class and layer,
  and per CSA layer the selections compared (overlap, needle entries kept);
* **decode** (``investigate.measure.decode_path``): the same ids the way a server runs them, the prompt
  prefilled into the cache and the answer tokens decoded one at a time.

The measured localization (the paths' numbers and the command that reproduces the prefill
step; cached in ``state.json`` as ``measured:localization``) becomes ``verdicts.json``
``localization`` in ``decide.localization.decide_localization``, which applies the one
departure rule of every route and names the path that diverges first.
"""

from __future__ import annotations

import re
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from needlescope.investigate.measure.session import Session

__all__ = ["localize_residual", "failing_case", "prefill_path", "STEP"]

STEP = "measured:localization"
"""The ``state.json`` step that caches the measured localization (numbers, never a decision)."""


def failing_case(res_recs: list[dict], ref_records: list[dict]) -> dict | None:
    """The first case wrong under the residual candidate and right under the reference."""
    ok = {r["case_id"] for r in ref_records if r.get("correct")}
    failing = [r for r in res_recs if not r.get("error") and not r["correct"] and r["case_id"] in ok]
    return min(failing, key=lambda r: (r["length"], r["depth"], r["trial"])) if failing else None


def _answer_ids(session: Session, cfg, case, rec: dict) -> list[int]:
    """The residual candidate's generated tokens for ``case`` (measured again when the record
    predates ``output_ids``)."""
    if "output_ids" in rec:
        return rec["output_ids"]
    from needlescope.investigate.measure.records import measure_cases

    return measure_cases(
        session.model,
        session.tokenizer,
        [case],
        cfg,
        max_new_tokens=session.ledger.symptom.max_new_tokens,
        chunk=session.chunk,
    )[0]["output_ids"]


def _layer_of(module: str | None) -> int | None:
    m = re.search(r"layers\.(\d+)\.", module or "")
    return int(m.group(1)) if m else None


def prefill_path(diff: dict) -> dict:
    """The ``localization.paths`` entry of a ``dsa.diff.localize`` result."""
    first = diff["first_divergent_module"]
    row = next((m for m in diff["modules"] if m["module"] == first), None)
    layers = [
        {
            "layer": ly["layer"],
            "topk_overlap": ly["topk_overlap"],
            "needle_visible": len(ly["needle_entries"]),
            "needle_kept_reference": ly["needle_selected_reference"],
            "needle_kept_candidate": ly["needle_selected_candidate"],
        }
        for ly in diff["layers"]
    ]
    return {
        "path": "prefill",
        "diverges": first is not None,
        "first_divergent_module": first,
        "module_type": None if row is None else row["type"],
        "layer": _layer_of(first),
        "own_err": None if row is None else _num(row["own_err"]),
        "own_budget": None if row is None else _num(row["own_budget"]),
        "layers": layers,
        "summary": diff["summary"],
        "finding": diff["rope"][0]["finding"] if diff.get("rope") else None,
    }


def _num(x):
    return x if x is None or (isinstance(x, float) and x == x and abs(x) != float("inf")) else str(x)


def _command(session: Session, cfg, prompt_file: str) -> str:
    """The ``needlescope indexer diff`` command that repeats the prefill step."""
    s = cfg.setting
    parts = [
        "needlescope",
        "indexer",
        "diff",
        "--model",
        session.ledger.target.model,
        "--input-ids",
        prompt_file,
    ]
    parts += ["--index-k", s.index_k, "--index-q", s.index_q, "--score-dtype", s.score_dtype]
    if s.index_topk is not None:
        parts += ["--index-topk", str(s.index_topk)]
    if s.patch:
        parts += ["--patch", s.patch.spec]
    for p in cfg.extra:
        parts += ["--extra-patch", p.spec]
    return " ".join(shlex.quote(p) for p in parts)


def localize_residual(
    session: Session,
    cfg,
    res_recs: list[dict],
    ref_records: list[dict],
    target: str = "the residual candidate",
) -> dict | None:
    """The measured localization (module docstring), or None when no case fails. ``target``
    says what ``cfg`` is (the residual candidate, or the candidate itself)."""
    import torch

    from needlescope.dsa.budget import measurement_chunk
    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.diff import localize
    from needlescope.dsa.prompt import needle_token_span, render_prompt
    from needlescope.paths import atomic_write_json

    rec = failing_case(res_recs, ref_records)
    if rec is None:
        return None
    done = session.state.step_value(STEP)
    if done is not None:
        return done
    case = next(c for c in session.cases if c.case_id == rec["case_id"])
    prompt = render_prompt(session.tokenizer, case.messages)
    answer = _answer_ids(session, cfg, case, rec)
    ids = prompt.input_ids + answer[: rec["analysed_token"]]
    device = next(session.model.parameters()).device
    tensor = torch.tensor([ids], device=device)
    twin = load_bundle(session.model_dir, device=session.ledger.target.device)[0]
    ref_setting = session.reference.setting.with_(index_topk=rec["index_topk"])
    session.progress("localize", 0, 2, rec["case_id"])
    diff = localize(
        session.model,
        twin,
        tensor,
        setting=cfg.setting,
        reference_setting=ref_setting,
        needle_span=needle_token_span(prompt, case.needle),
        extra_patches=cfg.extra,
        # in steps of the measurement chunk: one step's module records at a time, never every
        # module's output over the whole prompt (issue 55)
        chunk=measurement_chunk(session.chunk, len(ids)),
    )
    from needlescope.investigate.measure.decode_path import decode_path

    session.progress("localize", 1, 2, "decode path")
    paths = [prefill_path(diff), decode_path(session, twin, cfg, ref_setting, prompt.input_ids, answer, rec)]
    (session.out / "localize").mkdir(exist_ok=True)
    span = needle_token_span(prompt, case.needle)
    atomic_write_json(
        session.out / "localize" / "input_ids.json", {"input_ids": ids, "needle_token_span": list(span)}
    )
    out = {
        "route": "in-process",
        "case_id": rec["case_id"],
        "target": target,
        "config": cfg.label(),
        "analysed_token": rec["analysed_token"],
        "query_pos": len(ids) - 1,
        "paths": paths,
        "command": _command(session, cfg, "localize/input_ids.json"),
    }
    session.state.mark_done(STEP, out)
    session.progress("localize", 2, 2, rec["case_id"])
    return out
