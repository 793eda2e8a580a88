"""The in-process characterization of a session's records, measured then decided as a run
does (``measure.characterize`` measures, ``decide.decision`` decides): the tests that plant a
bug and read its classes share it."""

from __future__ import annotations


def characterized(session, ref: list[dict], cand: list[dict]) -> dict | None:
    """``verdicts.json`` ``characterization`` of ``cand`` against ``ref`` with no suspect
    implicated (the measurements cached in ``session``'s state, the classes decided anew)."""
    from needlescope.investigate.decide.decision import decide_characterization
    from needlescope.investigate.decide.measured import Measured
    from needlescope.investigate.measure.characterize import measure_characterization_inprocess

    char = measure_characterization_inprocess(session, [], ref, cand)
    m = Measured("in-process", {}, "candidate", ref, cand, {}, [], {}, [], characterization=char)
    return decide_characterization(m, [], None)
