"""The investigation: from a ledger of suspects to causal verdicts and DIAGNOSIS.md.

Its rooms, in import order (``tests/test_import_direction.py`` enforces it)::

    run.py  ->  measure/, report/  ->  decide/  ->  ledger/

- ``run``: ``run_investigation(ledger, out, progress)``: picks the route (``ROUTES``), hands its
  ``Measured`` to ``decide``, writes ``verdicts.json`` and ``investigation.json`` once each.
- ``ledger``: the ledger, its checks, ``init``, the example, the differences and the plan
  (``Config``). Torch-free.
- ``measure``: what runs a model or an endpoint: the routes (``measure(session) -> Measured``:
  in-process, live, dump), the case records, the cheap questions, the causal measurements,
  localization, the decode and rank paths, the resumable state (measurements only).
- ``decide``: ``decide(measured, ledger) -> Findings``: every verdict, role and rule. Pure and
  torch-free.
- ``report``: DIAGNOSIS.md/html from ``Findings``, its summary and causal sections.

The other multi-step workflows (serve-probe-explain, explain, rank dump, capture) live in
``needlescope.workflows``.
"""
