"""lm-eval's RULER ``niah_single_1`` with the organism's 3-digit needle values.

RULER draws its values with ``prepare_niah.generate_random_number()`` (7 digits, no parameter);
the organism learned 3-digit values, so the generator is swapped for one call of the task's own
sample builder. Everything else is lm-eval's: the 'repeat' haystack (its built-in sentences: no
essay download), wonderwords keys, the template, the gen_prefix, the scoring.
"""

from lm_eval.tasks.ruler import common_utils, niah_utils, prepare_niah
from lm_eval.tasks.ruler.common_utils import aggregate_metrics  # noqa: F401 (named by the task yaml)

VALUE_DIGITS = 3
LENGTHS = (256, 512, 1024)
"""The lengths the task yaml has metrics for."""


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """RULER's scoring (the share of expected values in the answer); -1 marks the other lengths."""
    out = {str(n): -1.0 for n in LENGTHS}
    out.update({k: v for k, v in common_utils.process_results(doc, results).items() if k in out})
    return out


def niah_single_1_3digit(**kwargs):
    draw = prepare_niah.generate_random_number
    prepare_niah.generate_random_number = lambda num_digits=VALUE_DIGITS: draw(VALUE_DIGITS)
    try:
        return niah_utils.niah_single_1(**kwargs)
    finally:
        prepare_niah.generate_random_number = draw
