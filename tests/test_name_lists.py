"""Names kept in two places because one side must load without torch (or without the code that
answers them): each pair names the same set (after ``kernels.names`` and its test)."""

from __future__ import annotations


def test_precisions_are_the_quantizers():
    from needlescope.dsa.quant import QUANTIZERS
    from needlescope.setting import PRECISIONS

    assert set(PRECISIONS) == set(QUANTIZERS)


def test_ledger_audit_checks_are_the_audit_checks():
    from needlescope.audit.checks import CHECKS
    from needlescope.investigate.ledger.ledger import AUDIT_CHECKS

    assert set(AUDIT_CHECKS) == set(CHECKS)


def test_ledger_question_types_are_the_answered_ones():
    from needlescope.investigate.ledger.ledger import QUESTION_TYPES
    from needlescope.investigate.measure.questions import ASKERS

    assert set(QUESTION_TYPES) == set(ASKERS)
