"""Token-exact case lengths against the real organism tokenizer and chat template (no server).

The probe's promise is that every case's whole rendered request, template included, counts exactly
its target length. These tests count the way ``needlescope serve`` and ``transformers serve`` do
for the shipped organism (its tokenizer.json + chat_template.jinja).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import needlescope  # noqa: E402
from needlescope.cases import KINDS, CaseSpec, build_cases  # noqa: E402
from needlescope.targets import LocalTokenCounter  # noqa: E402

WEIGHTS = Path(needlescope.__file__).parent / "organism" / "weights"
COUNT = LocalTokenCounter(WEIGHTS)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    length=st.integers(min_value=160, max_value=1400),
    seed=st.integers(min_value=0, max_value=2**31),
    trials=st.integers(min_value=1, max_value=2),
    digits=st.sampled_from([3, 7]),
)
def test_every_case_hits_its_length_with_the_organism_tokenizer(kind, length, seed, trials, digits):
    spec = CaseSpec(kind, (length,), (0.0, 37.0, 100.0), trials, seed, value_digits=digits)
    for case in build_cases(spec, COUNT):
        assert case.counted_length == length, case.case_id
        assert COUNT(case.messages) == length, case.case_id  # recounted from the final messages


@pytest.mark.parametrize(
    ("kind", "length", "trial"),
    [("single", 512, 0), ("multikey", 256, 1), ("multiturn", 2048, 0), ("multiturn", 2048, 1)],
)
def test_a_length_just_past_a_sentence_end_is_reached(kind, length, trial):
    # Seen against needlescope serve: 512 -> 513, 256 -> 257, 2048 -> 2049/2047. A sentence-final
    # period made the count jump by two there, and multiturn turn ends moved with every word.
    spec = CaseSpec(kind, (length,), (0.0, 50.0, 100.0), trial + 1, 0, value_digits=3)
    cases = [c for c in build_cases(spec, COUNT) if c.trial == trial]
    assert [c.counted_length for c in cases] == [length] * 3


def test_local_count_uses_the_checkpoints_template_from_a_dir_or_its_tokenizer_json():
    msgs = [{"role": "user", "content": "The blue falcon."}]
    from_dir = LocalTokenCounter(WEIGHTS)
    from_file = LocalTokenCounter(WEIGHTS / "tokenizer.json")
    # <|bos|> <|user|> The ▁blue ▁falcon . <|end|> <|assistant|>: the template's 4 special tokens.
    assert from_dir(msgs) == from_file(msgs) == 8
    assert from_dir.render(msgs).startswith("<|bos|><|user|>")
