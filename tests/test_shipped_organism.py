"""The shipped organism loads offline from package data and recalls needles on fixed prompts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from needlescope.cases.assemble import CaseSpec, build_cases  # noqa: E402
from needlescope.cases.scoring import score_answer  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits  # noqa: E402


@pytest.fixture(scope="module")
def organism():
    return load_bundle("organism")


def test_shipped_checkpoint_has_the_issue_architecture(organism):
    model, tokenizer, path = organism
    cfg = model.config
    assert cfg.model_type == "deepseek_v4" and cfg.hc_mult == 4
    assert cfg.sliding_window <= 64
    assert (path / "model.safetensors").stat().st_size <= 25 * 2**20
    assert trained_value_digits(path) == 3 and tokenizer.chat_template


@pytest.mark.parametrize("kind", ["multiturn", "single"])
def test_shipped_organism_answers_fixed_prompts(organism, kind):
    model, tokenizer, path = organism

    def count(messages):
        return len(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        )

    spec = CaseSpec(kind=kind, lengths=(256,), depths=(0.0, 100.0), trials=2, seed=11, value_digits=3)
    cases = build_cases(spec, count)
    answers = []
    with torch.no_grad():
        for case in cases:
            ids = tokenizer.apply_chat_template(case.messages, tokenize=True, add_generation_prompt=True)[
                "input_ids"
            ]
            out = model.generate(
                input_ids=torch.tensor([ids]),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            answers.append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    assert [score_answer(a, c.expected) for a, c in zip(answers, cases, strict=True)] == [True] * len(cases)
