"""Depth is the needle's position in the whole prompt (issue 54 item 12), as in NIAH and RULER:
for every kind, the needle's first token sits at about ``depth`` percent of the rendered prompt's
tokens (the organism's tokenizer and chat template). Multi-turn depth ran over the user turns
only, so depth 100 sat at 46% of a 512-token prompt."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from needlescope.cases.assemble import KINDS, CaseSpec, build_cases  # noqa: E402
from needlescope.dsa.checkpoint import load_tokenizer, shipped_dir  # noqa: E402
from needlescope.dsa.prompt import needle_token_span, render_prompt  # noqa: E402

DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)
# The intro, the question after the haystack and the chat template's role tokens are prompt
# too; at 512 tokens they move the needle's fraction by up to about 0.08.
TOLERANCE = 0.1


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(shipped_dir())


@pytest.mark.parametrize("length", [512])
@pytest.mark.parametrize("kind", KINDS)
def test_the_needle_sits_at_its_depth_in_the_prompt(tokenizer, kind, length):
    def count(messages):
        return len(render_prompt(tokenizer, messages).input_ids)

    spec = CaseSpec(kind=kind, lengths=(length,), depths=DEPTHS, trials=1, seed=3, value_digits=3)
    where = {}
    for case in build_cases(spec, count):
        prompt = render_prompt(tokenizer, case.messages)
        start, _ = needle_token_span(prompt, case.needle)
        where[case.depth] = start / len(prompt.input_ids)
    off = {d: round(f, 3) for d, f in where.items() if abs(f - d / 100.0) > TOLERANCE}
    assert not off, f"needle fraction of the prompt by depth: {off}"
    assert [where[d] for d in DEPTHS] == sorted(where[d] for d in DEPTHS)  # monotone in depth


def test_a_rendering_kept_is_the_same_prompt_and_a_copy(tokenizer):
    """``render_prompt`` keeps its last renderings: the same messages give an equal prompt, whose
    lists a caller may change without changing the next one; other messages are rendered anew."""
    messages = [{"role": "user", "content": "The code is 4711. What is the code?"}]
    first = render_prompt(tokenizer, messages)
    first.input_ids.append(-1)
    again = render_prompt(tokenizer, messages)
    assert again.input_ids == first.input_ids[:-1] and again.text == first.text
    assert again.offsets == first.offsets
    other = render_prompt(tokenizer, [{"role": "user", "content": "The code is 4712. What is the code?"}])
    assert other.text != again.text
