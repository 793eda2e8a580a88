"""The investigation's decisions: verdicts (``verdicts``), the causal decisions (``causal``),
the uninformative-ranking signature (``signature``) and the schema of ``verdicts.json``
(``schema``). Pure and torch-free; imports nothing from ``measure`` or ``report``."""
