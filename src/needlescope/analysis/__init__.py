"""Statistics over probe results: intervals, paired tests, effective length, cliffs. Pure."""

from needlescope.analysis.curve import Cell, cells_from_results, cliff, effective_length, recall_by_length
from needlescope.analysis.stats import mcnemar_exact, wilson_interval

__all__ = [
    "Cell",
    "cells_from_results",
    "cliff",
    "effective_length",
    "mcnemar_exact",
    "recall_by_length",
    "wilson_interval",
]
