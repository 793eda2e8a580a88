"""Regenerate the logprob oracle's shipped prompt set (src/needlescope/run/data/oracle_prompts.json).

    PYTHONPATH=src python bench/make_oracle_prompts.py

Deterministic. General prompts (arithmetic, code, translation) are for real models; the long
prefill and the needle prompts are English built by the case generator, so every word is in the
organism's vocabulary too (its needle prompts are rendered with the organism's chat template and
sized in its tokens). Changing this file changes the set's sha256, which an export records.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from needlescope.cases.assemble import CaseSpec, build_cases
from needlescope.cases.haystack import FillerStream, render_words
from needlescope.targets.tokenize import LocalTokenCounter

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "src/needlescope/organism/weights"
OUT = ROOT / "src/needlescope/run/data/oracle_prompts.json"

GENERAL = [
    ("arith-add", "arithmetic", "Q: What is 17 + 25?\nA:", 8),
    ("arith-mul", "arithmetic", "Compute the product. 123 * 4 =", 8),
    (
        "arith-word",
        "arithmetic",
        "A train travels 60 miles per hour for 3 hours. How many miles does it travel?\nAnswer:",
        16,
    ),
    ("code-fib", "code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', 32),
    ("code-reverse", "code", "# Reverse a string in Python\ndef reverse(s: str) -> str:\n", 24),
    (
        "translate-fr",
        "translation",
        "Translate English to French.\nEnglish: The cat sits on the mat.\nFrench:",
        16,
    ),
    (
        "translate-de",
        "translation",
        "Translate English to German.\nEnglish: Where is the train station?\nGerman:",
        16,
    ),
]


def main() -> None:
    counter = LocalTokenCounter(WEIGHTS / "tokenizer.json", WEIGHTS / "chat_template.jinja")
    prompts = [
        {"id": i, "category": c, "prompt": p, "max_tokens": n, "organism_vocabulary": False}
        for i, c, p, n in GENERAL
    ]
    words = FillerStream(rng=random.Random(11)).words(1500)
    prompts.append(
        {
            "id": "long-prefill",
            "category": "long_prefill",
            "prompt": render_words(words) + "\n\nIn one sentence, the text above is about",
            "max_tokens": 16,
            "organism_vocabulary": True,
        }
    )
    for kind, length, depth in (
        ("single", 256, 0.0),
        ("single", 256, 50.0),
        ("single", 1024, 50.0),
        ("multikey", 1024, 90.0),
        ("single", 2048, 25.0),
    ):
        spec = CaseSpec(kind=kind, lengths=(length,), depths=(depth,), trials=1, seed=18, value_digits=3)
        (case,) = build_cases(spec, counter)
        prompts.append(
            {
                "id": f"needle-{kind}-{length}-d{int(depth)}",
                "category": "needle",
                "prompt": counter.render(case.messages),
                "max_tokens": 8,
                "organism_vocabulary": True,
                "expected": case.expected,
            }
        )
    OUT.write_text(json.dumps({"name": "needlescope-oracle-v1", "prompts": prompts}, indent=1) + "\n")
    print(f"wrote {len(prompts)} prompts to {OUT}")


if __name__ == "__main__":
    main()
