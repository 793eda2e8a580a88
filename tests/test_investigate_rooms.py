"""Every decision of the investigation lives in ``decide/`` (issue 51): ``measure/`` defines no
decision constant and no rule, which this test checks on the source (AST, no import):

- no module-level numeric constant in ``measure/`` but the measurement sizes named below (how
  much to measure, never what a measurement means);
- no import of an UPPER_CASE name of ``decide/`` (a threshold) into ``measure/``, but ``PATHS``
  (the two paths' names); a route follows a rule by calling ``decide``'s function for it;
- no comparison with a fractional literal (``x < 0.99``) in ``measure/``: a threshold in disguise.
"""

from __future__ import annotations

import ast
from pathlib import Path

MEASURE = Path(__file__).parents[1] / "src" / "needlescope" / "investigate" / "measure"

SIZES = {
    "BATCH": "cases decoded together",
    "FAILING_CASES": "failing cases whose selections the characterization reads",
    "DENSE_CASES": "cases at the dense length",
    "SCAN_DEPTHS": "depths of the black box's residue scan",
    "PAIR_CASES": "cases at each of the black box's top-k pair lengths",
    "CONTINUATION": "greedy tokens each serving-factor request continues for (output identity)",
    "DRAFT": "the draft depth the serving-factor experiment adds when a server takes one per request",
    "TOP_LOGPROBS": "alternatives the teacher-forced scoring asks for",
    "SOURCE_TIMEOUT_S": "a cheap question's deadline for a source",
}
"""Module-level numbers measure/ may define: how much to measure, never what it means."""

ALLOWED_UPPER = {"PATHS"}


def _modules():
    for path in sorted(MEASURE.glob("*.py")):
        yield path.name, ast.parse(path.read_text(encoding="utf-8"))


def _numeric(node) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    )


def test_measure_defines_no_decision_constant():
    found = []
    for name, tree in _modules():
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            value = getattr(node, "value", None)
            for t in targets:
                if isinstance(t, ast.Name) and value is not None and _numeric(value) and t.id not in SIZES:
                    found.append(f"{name}: {t.id} = {value.value}")
    assert found == [], "decision constants belong in investigate/decide/: " + "; ".join(found)


def test_measure_imports_no_threshold_from_decide():
    found = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "needlescope.investigate.decide"
            ):
                found += [
                    f"{name}: {a.name}"
                    for a in node.names
                    if a.name.isupper() and a.name not in ALLOWED_UPPER
                ]
    assert found == [], (
        "measure/ follows decide's rules through its functions, never its constants: " + "; ".join(found)
    )


def test_measure_compares_with_no_fractional_literal():
    found = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    if isinstance(side, ast.Constant) and isinstance(side.value, float):
                        found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "a threshold in measure/: " + "; ".join(found)


def _localization_imports(tree) -> list[str]:
    return [
        a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "needlescope.investigate.decide.localization"
        for a in node.names
    ]


def test_measure_applies_no_localization_rule():
    """Which layer, module or path departs is decided in ``decide.localization`` alone, from the
    measured numbers (the decode path's first departing module was picked at measurement time
    and cached in state.json, so a resumed run kept an old rule's choice)."""
    found = [f"{name}: {n}" for name, tree in _modules() for n in _localization_imports(tree)]
    assert found == [], "measure/ applies a localization rule: " + "; ".join(found)
    assert _localization_imports(
        ast.parse("from needlescope.investigate.decide.localization import module_limit\n")
    ) == ["module_limit"]


def test_the_checks_can_fail():
    """Each check finds what it forbids (so none of them passes vacuously)."""
    tree = ast.parse(
        "DEPARTS = 0.99\nfrom needlescope.investigate.decide.verdicts import ALPHA\nx = y < 0.5\n"
    )
    assert _numeric(tree.body[0].value)
    assert tree.body[1].names[0].name.isupper() and tree.body[1].names[0].name not in ALLOWED_UPPER
    assert isinstance(tree.body[2].value.comparators[0].value, float)


def test_records_are_read_once_a_run_and_appended_through(tmp_path, monkeypatch):
    """Issue 51: measure/NAME.jsonl was read up to four times per Session.measure."""
    from needlescope.investigate.measure import state as state_mod

    st = state_mod.RunState(tmp_path, "ledger", ["a"])
    st.append_record("candidate", {"case_id": "c0", "correct": True})
    reads: list[str] = []
    real = state_mod.RunState._read
    monkeypatch.setattr(
        state_mod.RunState, "_read", lambda self, name: reads.append(name) or real(self, name)
    )
    fresh = state_mod.RunState(tmp_path, "ledger", ["a"])  # a resumed run
    assert fresh.records("candidate") == [{"case_id": "c0", "correct": True}]
    fresh.append_record("candidate", {"case_id": "c1", "correct": False})
    assert [r["case_id"] for r in fresh.records("candidate")] == ["c0", "c1"]
    fresh.supersede("candidate", fresh.records("candidate")[1:], fresh.records("candidate")[:1])
    assert [r["case_id"] for r in fresh.records("candidate")] == ["c1"]
    assert reads == ["candidate"]  # once, however often it is asked
    assert [r["case_id"] for r in real(fresh, "candidate")] == ["c1"]  # the file says the same
