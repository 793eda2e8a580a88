"""The investigation's decisions: verdicts (``verdicts``), the in-process causal decisions
(``causal``), the live and dump routes' (``live``, ``dump``), the uninformative-ranking signature
(``signature``), the artifacts' schemas (``schema``) and ``Findings`` (``findings``). Pure and
torch-free; imports nothing from ``measure`` or ``report``."""
