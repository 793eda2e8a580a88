"""Statistics and recall-curve analysis over probe results."""

from .curve import Cell, cells_from_results, cliff, effective_length, pooled_recall
from .stats import mcnemar_exact, wilson_interval

__all__ = [
    "Cell",
    "cells_from_results",
    "cliff",
    "effective_length",
    "pooled_recall",
    "mcnemar_exact",
    "wilson_interval",
]
