"""What an investigation measures: the shared ``session.Session``; the routes, each a module with
``measure(session) -> decide.measured.Measured`` (in-process ``inprocess``, live ``live``,
tensor dump ``dump``; the protocol is ``decide.measured``'s docstring); the case records
(``records``), the cheap questions, the causal measurements (``causal``: sufficiency, residual),
``localize``, ``decode_path``, ``rank_paths``, the characterization's experiments
(``characterize``) and the resumable run state (``state``: measurements only). No verdict,
threshold or rule is defined here (tests/test_investigate_rooms.py). The only room of the
investigation that loads torch."""
