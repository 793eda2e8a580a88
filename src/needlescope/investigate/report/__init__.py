"""DIAGNOSIS.md and DIAGNOSIS.html of an investigation (``diagnosis``), its summary box
(``summary``) and causal sections (``causal``). Imports nothing from ``measure``."""
