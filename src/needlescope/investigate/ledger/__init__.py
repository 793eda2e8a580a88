"""The ledger and everything read from it before anything runs: its parsing and checks
(``ledger``, ``checks``), the example and live ledgers (``example``, ``init``), the differences
between reference and candidate (``differences``) and the configurations to measure (``plan``).
Torch-free; imports nothing from ``measure``, ``decide`` or ``report``."""
