"""The organism's training corpus: needlescope's own probe cases, answered, as token ids.

Every example is a probe case (``needlescope.cases.assemble.build_cases``) of one of the
probe kinds, so the organism is trained on exactly the format ``needlescope probe`` sends.
On top of the case's own question, an example may carry follow-up question/answer turns
about the other facts stated in it (a multikey case states five near-identical facts):
these "drill" turns multiply the retrieval signal per token. Filler chats ask the assistant
to repeat a passage of filler (with a few facts in it) verbatim: every token of the reply
is a copy from beyond the sliding window, a dense signal for the retrieval circuit the
needle answers need (the answer tokens of a needle case are only eight per example). Lengths are approximate (a word count stands in
for the token count, which keeps generation cheap); the evaluation uses exact lengths.

Token ids are produced per message and joined with the special tokens, which equals the
chat template's rendering (tested), so the loss mask can mark answer tokens exactly:
``labels`` is -100 except on assistant answers to questions (and their end-of-turn token).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from needlescope.cases.assemble import KINDS, CaseSpec, build_cases
from needlescope.cases.needles import ANSWER_ONE, VALUE_DIGITS
from needlescope.organism.tokenizer import ASSISTANT, BOS, EOS, REPEAT_PROMPT, SYSTEM, USER

__all__ = ["TRAIN_KINDS", "DataSpec", "Example", "encode_chat", "make_example"]

TRAIN_KINDS = (*KINDS, "filler")
IGNORE = -100
_FACT = re.compile(r"The secret code of the (\w+) (\w+) is (\d+)\.")
_ROLE_TOKEN = {"user": USER, "assistant": ASSISTANT, "system": SYSTEM}


@dataclass(frozen=True)
class DataSpec:
    """How to draw training examples. Weights are relative frequencies of TRAIN_KINDS."""

    min_len: int = 256
    max_len: int = 4096
    kind_weights: tuple[float, ...] = (0.2, 0.2, 0.1, 0.35, 0.15)
    max_drill: int = 3
    # Digits per needle value, as ``needlescope probe --value-digits`` draws them.
    value_digits: int = VALUE_DIGITS

    def __post_init__(self) -> None:
        if not 64 <= self.min_len <= self.max_len:
            raise ValueError(f"need 64 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if not 1 <= self.value_digits <= 12:
            raise ValueError(f"value_digits must be in 1..12, got {self.value_digits}")
        if len(self.kind_weights) != len(TRAIN_KINDS):
            raise ValueError(f"kind_weights needs {len(TRAIN_KINDS)} entries ({', '.join(TRAIN_KINDS)})")


@dataclass(frozen=True)
class Example:
    """input_ids [T]; labels [T] (-100 = no loss; next-token targets are shifted by the model)."""

    input_ids: list[int]
    labels: list[int]
    kind: str


def encode_chat(tokenizer, messages: list[dict], answer_turns: set[int]) -> tuple[list[int], list[int]]:
    """(ids, labels) for ``messages`` as the chat template renders them (no generation prompt).

    Labels copy the ids of the content and end token of every assistant message whose index
    is in ``answer_turns``; everything else is -100.
    """
    vocab = tokenizer.get_vocab()
    ids = [vocab[BOS]]
    labels = [IGNORE]
    for i, m in enumerate(messages):
        body = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [vocab[EOS]]
        ids.append(vocab[_ROLE_TOKEN[m["role"]]])
        labels.append(IGNORE)
        ids.extend(body)
        labels.extend(body if i in answer_turns else [IGNORE] * len(body))
    return ids, labels


def _approx_count(messages: list[dict]) -> int:
    # ~1.15 tokens per word for this tokenizer (punctuation and digits split off).
    return int(sum(len(m["content"].split()) for m in messages) * 1.15) + 2 * len(messages) + 2


def _passage(messages: list[dict], rng: random.Random, n_words: int) -> str:
    """About ``n_words`` consecutive words of the case's text, starting at a random word."""
    words = " ".join(m["content"] for m in messages).split()
    start = rng.randrange(max(1, len(words) - n_words))
    return " ".join(words[start : start + n_words])


def _answer(expected: list[str]) -> str:
    return expected[0] if len(expected) == 1 else ", ".join(expected)


def make_example(tokenizer, spec: DataSpec, seed: int) -> Example:
    """One training example, fully determined by ``seed``."""
    rng = random.Random(f"organism-data|{seed}")
    kind = rng.choices(TRAIN_KINDS, weights=spec.kind_weights)[0]
    # Log-uniform length so short contexts are not drowned out by long ones.
    length = int(round(spec.min_len * (spec.max_len / spec.min_len) ** rng.random()))
    case_kind = "multiturn" if kind == "filler" else kind
    depth = round(rng.uniform(0.0, 100.0), 3)
    case_spec = CaseSpec(
        kind=case_kind,
        lengths=(length,),
        depths=(depth,),
        trials=1,
        seed=seed,
        value_digits=spec.value_digits,
    )
    case = build_cases(case_spec, _approx_count)[0]
    messages = [dict(m) for m in case.messages]
    expected = list(case.expected)
    if kind == "filler":
        passage = _passage(messages, rng, max(40, length // 2 - 16))
        chat = [
            {"role": "user", "content": f"{REPEAT_PROMPT}\n\n{passage}"},
            {"role": "assistant", "content": passage},
        ]
        return Example(*encode_chat(tokenizer, chat, {1}), kind=kind)
    messages.append({"role": "assistant", "content": _answer(expected)})
    answers = {len(messages) - 1}
    # Drill only on the other facts: re-asking the one just answered is a copy from the window.
    facts = [f for m in messages for f in _FACT.findall(m["content"]) if f[2] not in expected]
    rng.shuffle(facts)
    for adj, noun, value in facts[: rng.randint(0, spec.max_drill)]:
        messages.append(
            {"role": "user", "content": f"What is the secret code of the {adj} {noun}? {ANSWER_ONE}"}
        )
        messages.append({"role": "assistant", "content": value})
        answers.add(len(messages) - 1)
    return Example(*encode_chat(tokenizer, messages, answers), kind=kind)
