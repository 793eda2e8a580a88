"""Offline, deterministic filler text for haystacks.

The vocabulary is derived in code from compact embedded stems so the file stays small while the
generated text draws on roughly two thousand plain lowercase English words. Needle vocabulary (key
adjectives and nouns, digits, the words "secret"/"code") is kept out of the filler so a needle can never
be confused with, or accidentally reproduced by, the filler.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from functools import lru_cache

__all__ = ["VOCABULARY", "FillerStream", "sentence_boundaries", "render_words"]

_NOUNS = """
apple bank basket beach bell bench bicycle blanket boat book bottle bowl box branch bread bridge
brother bucket building bus button cabin cake camera candle canal car card carpet castle cat chair
chalk cheese chimney church circle city cliff clock cloud coat coin collar corner cottage country
cousin crowd cup curtain cushion desk dinner doctor dog door drawer dream dress driver drum earth
engine evening face factory farm farmer father feather fence field finger fire flag floor flower
forest fork friend garden gate glass glove goat grass guitar hall hammer harbor hat hill hobby hole
horse hospital hotel house island jacket jar journey kettle kitchen ladder lake lamp lawn leaf letter
library market meadow meal mirror morning mother mountain museum needlework neighbor nest newspaper
night notebook ocean office orchard oven painter palace paper park path pencil piano picture pillow
planet plate pocket pond porch potato river road roof room rope sailor sand scarf school sea season
shadow shelf ship shirt shoe shop shore singer sister sky soup spoon square stair station stone
storm story street student sugar summer table teacher tent theater thread ticket tower town toy train
tree tunnel umbrella uncle valley village violin wagon wall wheel window winter wood workshop writer
yard answer argument artist audience author baker barn battery beard blossom border breakfast brush
cabinet canvas captain carriage cellar century chapter cloth coast comb concert cook crown custom
dancer diary ditch engineer envelope festival film fountain gallery gardener habit helmet highway
honey insect journal judge kitten lantern lesson lunch machine magnet manager melody mill minute
moment motor nurse orange parcel passenger pattern pebble pilot poem poet powder puzzle quilt rabbit
radio recipe ribbon saddle salad scholar sculptor shell signal silver skirt sleeve smile soldier
song stove stream supper sweater tailor teapot temple thunder tile tool towel traveler tray trumpet
village visitor voice wallet weather whistle wire yarn
"""

_VERBS = """
accept admire allow answer arrange arrive ask bake borrow brush call carry change check clean climb
collect comfort cook count cover cross dance deliver discover dress drop enjoy explain fill finish
fix fold follow gather greet guard hand help hope hunt join jump kick knock laugh learn lift listen
load look mark mend move open order paint pass pick plant play point pour pray press print pull push
reach repair rest return roll rush sail scrub search share shout show sign smell sort start stay
step stop study talk taste thank touch travel turn visit walk want wander wash watch wave whisper
wish wonder work wrap yawn polish plan hurry carve tidy hammer hum knit mix nod obey offer park peel
pack pause place prefer promise pretend rain record relax remember rescue sketch skip slip spell
spill sprinkle squeeze stamp stitch store stretch suggest supply tap test tie trace train trust
tumble unpack wait warm weigh whistle wipe
"""

_ADJECTIVES = """
able bright busy calm careful cheerful clean clever cold cool curious dark deep dry early easy
empty fair famous fancy fine flat fresh friendly full gentle glad grand great happy hard heavy
high honest huge humble kind large late light little lively long loud lovely low lucky mild modern
narrow neat new nice noisy old open patient plain pleasant polite poor proud quick quiet rare rich
rough round sharp short shy simple slow small smooth soft solid steady strange strong sudden sweet
tall thick thin tidy tiny tired warm weak wet whole wide wild wise young wooden woolen dusty sandy
sunny rainy windy snowy cloudy foggy frosty misty rusty shiny stony grassy
"""

_FUNCTION = """
the a an this that every each some many few several near beside under over behind along across
through around after before during while because although and but so then later soon often always
never sometimes again together outside inside nearby slowly quietly gently quickly happily carefully
"""

# Key vocabulary used by needles; filler must never contain these words.
KEY_ADJECTIVES = (
    "blue red green amber crimson violet golden scarlet ivory indigo silver black white orange purple "
    "copper bronze emerald teal magenta"
).split()
KEY_NOUNS = (
    "falcon otter badger heron lynx walrus panther raven beetle dolphin wolf tiger eagle salmon "
    "gazelle hornet parrot viper bison jackal"
).split()
_RESERVED = set(KEY_ADJECTIVES) | set(KEY_NOUNS) | {"secret", "code", "codes", "number", "numbers"}


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _verb_forms(verb: str) -> tuple[str, str, str, str]:
    """Return (base, third person, past, gerund) by regular English rules; irregulars are avoided."""
    if verb.endswith("e"):
        past, ing = verb + "d", verb[:-1] + "ing"
    elif verb.endswith("y") and verb[-2] not in "aeiou":
        past, ing = verb[:-1] + "ied", verb + "ing"
    elif len(verb) <= 4 and verb[-1] not in "aeiouwxy" and verb[-2] in "aeiou" and verb[-3] not in "aeiou":
        past, ing = verb + verb[-1] + "ed", verb + verb[-1] + "ing"
    else:
        past, ing = verb + "ed", verb + "ing"
    return verb, _plural(verb), past, ing


def _clean(words: str) -> list[str]:
    # Dedup while keeping order: ordering must be stable for determinism across runs.
    return [w for w in dict.fromkeys(words.split()) if w not in _RESERVED]


@lru_cache(maxsize=1)
def _parts() -> dict[str, tuple[str, ...]]:
    nouns = _clean(_NOUNS)
    verbs = _clean(_VERBS)
    forms = [_verb_forms(v) for v in verbs]
    adjs = _clean(_ADJECTIVES)
    return {
        "noun": tuple(nouns),
        "nouns": tuple(_plural(n) for n in nouns),
        "verb": tuple(f[0] for f in forms),
        "verbs": tuple(f[1] for f in forms),
        "past": tuple(f[2] for f in forms),
        "ing": tuple(f[3] for f in forms),
        "adj": tuple(adjs),
        "det": ("the", "a", "this", "that", "every", "each", "one", "her", "his", "our", "their"),
        "dets": ("the", "some", "many", "few", "several", "these", "those", "our", "their"),
        "prep": ("near", "beside", "under", "over", "behind", "along", "across", "through", "around", "by"),
        "adv": ("slowly", "quietly", "gently", "quickly", "happily", "carefully", "often", "again", "later"),
        "conj": ("after", "before", "while", "because", "although", "when", "since", "until"),
        "name": ("anna", "ben", "clara", "david", "ella", "frank", "grace", "henry", "iris", "jack"),
    }


def _vocabulary() -> tuple[str, ...]:
    p = _parts()
    words: dict[str, None] = {}
    for key in (
        "noun",
        "nouns",
        "verb",
        "verbs",
        "past",
        "ing",
        "adj",
        "det",
        "dets",
        "prep",
        "adv",
        "conj",
        "name",
    ):
        words.update(dict.fromkeys(p[key]))
    words.update(dict.fromkeys(_clean(_FUNCTION)))
    words.update(dict.fromkeys(a + "er" for a in p["adj"] if not a.endswith(("e", "y"))))
    return tuple(words)


VOCABULARY: tuple[str, ...] = _vocabulary()

# Sentence templates: slots are part-of-speech names. A handful of shapes give readable, varied prose
# without a grammar engine.
_TEMPLATES = (
    "det adj noun past det noun prep det noun",
    "name past det adj noun adv",
    "dets nouns verb prep det adj noun",
    "det noun past adv conj det adj noun past",
    "name and name past dets adj nouns prep det noun",
    "det noun was ing prep det adj noun",
    "dets adj nouns verb det noun conj det noun verbs",
    "name verbs det noun every morning",
    "prep det adj noun det noun past det noun",
    "det adj noun and det adj noun past together",
)


def _sentence(rng: random.Random) -> list[str]:
    p = _parts()
    template = rng.choice(_TEMPLATES).split()
    words = [rng.choice(p[slot]) if slot in p else slot for slot in template]
    words[-1] += "."
    return words


_ENDS = (".", "!", "?")


class FillerStream:
    """An endless, deterministic stream of filler words, sentence-punctuated.

    ``words(n)`` always returns a prefix of the same stream, so filler for the same seed grows only at
    the end as more words are requested; this keeps prefixes identical across fitting attempts and
    across depths, which is what lets a server's prefix cache help.
    """

    def __init__(self, rng: random.Random | None = None, text: str | None = None) -> None:
        if (rng is None) == (text is None):
            raise ValueError("give exactly one of rng or text")
        self._rng = rng
        self._text = text.split() if text is not None else None
        if self._text is not None and not self._text:
            raise ValueError("haystack text is empty")
        self._buf: list[str] = []
        self._source: Iterator[list[str]] = self._chunks()

    def _chunks(self) -> Iterator[list[str]]:
        if self._text is not None:
            # User filler is cycled; the end of one pass is forced to be a sentence boundary.
            chunk = list(self._text)
            if not chunk[-1].endswith(_ENDS):
                chunk[-1] += "."
            while True:
                yield chunk
        assert self._rng is not None
        while True:
            yield _sentence(self._rng)

    def words(self, n: int, join: bool = False) -> list[str]:
        """The first ``n`` words; a truncated final sentence gets a period.

        That forced period makes the token count jump by two (word + period) where the tail starts a
        new sentence, so some lengths are unreachable by word count alone. ``join=True`` is the
        exact-length fitter's second knob: it folds a truncated tail into the sentence before it
        (drops that sentence's period), one token fewer without changing any earlier word.
        """
        while len(self._buf) < n:
            self._buf.extend(next(self._source))
        out = self._buf[:n]
        if out and not out[-1].endswith(_ENDS):
            # A truncated final sentence still ends with a period so it is a sentence boundary.
            out[-1] = out[-1] + "."
            if join:
                for i in range(len(out) - 2, -1, -1):
                    if len(out[i]) > 1 and out[i].endswith(_ENDS):
                        out[i] = out[i][:-1]
                        break
        return out


MAX_GAP = 16
"""About the most words between two insertion points (at most 1.5 times it). A ``--haystack-file``
without sentence ends (code, logs, a CSV, text ending its sentences in "。") once had only its
start and end to insert at, so every depth landed at 0% or 100%. The generated filler's sentences
are shorter (10 words, 19 where the fitter's join knob folds a truncated tail into the sentence
before: under 1.5 times this), so its cases are unchanged."""


def sentence_boundaries(words: list[str]) -> list[int]:
    """Indices i such that a sentence may be inserted before words[i]; includes 0 and len(words).

    Sentence ends, and inside a longer run of words without one, every ``MAX_GAP``-th word, so a
    needle lands near its depth in any text.
    """
    ends = [i + 1 for i, w in enumerate(words) if w.endswith(_ENDS) and i + 1 < len(words)]
    if words:
        ends.append(len(words))
    bounds = [0]
    for end in ends:
        bounds += range(bounds[-1] + MAX_GAP, end - MAX_GAP // 2, MAX_GAP)
        bounds.append(end)
    return bounds


def render_words(words: list[str]) -> str:
    """Join words into prose, capitalising sentence starts."""
    out: list[str] = []
    start = True
    for w in words:
        out.append(w[:1].upper() + w[1:] if start else w)
        start = w.endswith(_ENDS)
    return " ".join(out)
