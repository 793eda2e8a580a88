"""Test-case generation: haystacks, needles, exact-length fitting and answer scoring."""

from .assemble import KINDS, Case, CaseSpec, build_cases, order_for_prefix_cache
from .scoring import score_answer

__all__ = ["KINDS", "Case", "CaseSpec", "build_cases", "order_for_prefix_cache", "score_answer"]
