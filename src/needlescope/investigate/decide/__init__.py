"""The investigation's decisions: ``decision.decide(measured, ledger) -> findings.Findings``, from
a route's ``measured.Measured``; verdicts and roles (``verdicts``), the in-process causal
decisions (``causal``), the live and dump routes' (``live``, ``dump``), the one localization rule
(``localization``), the characterization (``characterize``), the uninformative-ranking signature
(``signature``) and the artifacts' schemas (``schema``). Pure and torch-free; imports nothing
from ``measure`` or ``report``."""
