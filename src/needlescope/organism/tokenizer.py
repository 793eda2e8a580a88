"""The organism's word-level tokenizer and chat template (HF ``tokenizers``, saved as tokenizer.json).

Pre-tokenization: a metaspace marks word starts ("▁the"), punctuation is split off, and
digits become one token each, so a 7-digit value is 7 tokens plus a leading "▁" and the
model must copy it digit by digit. The vocabulary is every word form the case generator
can emit (collected by running it), so in-distribution text never hits ``<unk>``; out of
distribution words map to ``<unk>``, which the server reports like any other token.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from needlescope.cases.assemble import KINDS, CaseSpec, build_cases
from needlescope.cases.haystack import KEY_ADJECTIVES, KEY_NOUNS, VOCABULARY

__all__ = ["SPECIAL_TOKENS", "CHAT_TEMPLATE", "build_tokenizer", "pre_tokens"]

BOS, EOS, PAD, UNK = "<|bos|>", "<|end|>", "<|pad|>", "<unk>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, UNK, USER, ASSISTANT, SYSTEM)
META = "\u2581"
# The instruction of the training corpus's repeat chats (``organism.data``).
REPEAT_PROMPT = "Repeat the following text exactly."

# Each turn: role marker, content, end marker. The assistant's end marker is the EOS token,
# so generation stops exactly where a turn ends.
CHAT_TEMPLATE = (
    "{{ '" + BOS + "' }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '" + USER + "' + m['content'] + '" + EOS + "' }}"
    "{% elif m['role'] == 'assistant' %}{{ '" + ASSISTANT + "' + m['content'] + '" + EOS + "' }}"
    "{% elif m['role'] == 'system' %}{{ '" + SYSTEM + "' + m['content'] + '" + EOS + "' }}"
    "{% else %}{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=META, prepend_scheme="never", split=True),
            pre_tokenizers.Split(Regex(r"[^\w" + META + r"]"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )


def pre_tokens(text: str) -> list[str]:
    """The word pieces ``text`` splits into before vocabulary lookup."""
    return [p for p, _ in _pre_tokenizer().pre_tokenize_str(text)]


@lru_cache(maxsize=1)
def _corpus_forms() -> tuple[str, ...]:
    """Every piece the case generator emits, found by running it on each kind (whitespace counter)."""
    forms: set[str] = set()
    for kind in KINDS:
        spec = CaseSpec(kind=kind, lengths=(900,), depths=(0.0, 50.0, 100.0), trials=6, seed=7)
        for case in build_cases(spec, lambda msgs: sum(len(m["content"].split()) for m in msgs)):
            for m in case.messages:
                forms.update(pre_tokens(m["content"]))
    words = set(VOCABULARY) | set(KEY_ADJECTIVES) | set(KEY_NOUNS)
    for w in words:
        # Mid-sentence form, and the capitalised bare form that opens a turn or paragraph; other
        # capitalised forms (sentence starts) are few and come from the generator run above.
        forms.update((META + w, w.capitalize()))
    forms.update(pre_tokens(REPEAT_PROMPT))
    forms.update(str(d) for d in range(10))
    forms.update(".,;:!?'\"()-\n" + META)
    return tuple(sorted(forms))


def build_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """The organism tokenizer; ids are deterministic (specials first, then sorted forms)."""
    del seed  # the vocabulary is fully determined by the generator's word lists
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for form in _corpus_forms():
        vocab.setdefault(form, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.Metaspace(replacement=META, prepend_scheme="never", split=True)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        chat_template=CHAT_TEMPLATE,
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
