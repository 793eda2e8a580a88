"""DIAGNOSIS.md and DIAGNOSIS.html of an investigation (``diagnosis``), its summary box
(``summary``) and causal sections (``causal``), and the artifacts' path handling
(``artifacts``). Imports nothing from ``measure``."""
