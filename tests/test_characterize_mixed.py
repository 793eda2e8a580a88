"""Mixed evidence is decided, not left undecided (issue 53 item 2): when paths or layers disagree
(one departs, another agrees) the class comes from the path and layer that depart and the report
says which agree; two independent bugs give two classes, each with its own ``where``.

The selections are planted the way the routes build evidence (``selection_evidence.
layer_selection`` over the selected sets of a 128-entry context, top-16): a decode path reading
random entries, a scorer whose ranking is random, a ranking just above the near-chance bar."""

from __future__ import annotations

import random

from needlescope.investigate.decide.characterize import RULES, Context, Evidence, LengthCell, characterize
from needlescope.investigate.decide.selection_evidence import Row, layer_selection

CTX = Context(route="live", ratio=4, topk=16, base_url="http://127.0.0.1:8001", lengths=(512, 1024))
REFERENCE = frozenset(range(40, 56))
NEEDLE = frozenset({40, 41})
CELLS = (LengthCell(512, 6, 4, 0, 128), LengthCell(1024, 6, 6, 0, 256))


def _rows(selected: list[frozenset[int]]) -> list[Row]:
    return [Row(s, REFERENCE, 128, NEEDLE) for s in selected]


def _same() -> list[frozenset[int]]:
    return [REFERENCE] * 4


def _random(seed: int) -> list[frozenset[int]]:
    """A random ranking: 16 entries drawn uniformly from the 128 visible (planted: overlap near
    J0, about 0.07)."""
    rng = random.Random(seed)
    return [frozenset(rng.sample(range(128), 16)) for _ in range(4)]


def _partial(keep: int, seed: int) -> list[frozenset[int]]:
    """The reference's selection with all but ``keep`` entries replaced by random ones."""
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        kept = set(sorted(REFERENCE)[-keep:])
        while len(kept) < 16:
            kept.add(rng.randrange(128))
        out.append(frozenset(kept))
    return out


def _ev(*layers) -> Evidence:
    return Evidence(recall_lost=True, cells=CELLS, layers=tuple(layers), answers_differ=True)


def test_a_decode_path_at_chance_beside_an_agreeing_prefill_is_decode_only_and_says_which_agree():
    """Layer 1's prefill agrees and its decode falls below chance; layer 3 agrees on both paths
    but for rounding: the class is the departing path's, and the report names the agreeing ones."""
    ev = _ev(
        layer_selection(1, "prefill", _rows(_same())),
        layer_selection(1, "decode", _rows(_random(1))),
        layer_selection(3, "prefill", _rows(_partial(15, 2))),
        layer_selection(3, "decode", _rows(_partial(15, 3))),
    )
    ch = characterize(ev, CTX)
    assert ch["classes"][0] == "decode_only", ch
    where = ch["where"]
    assert where["decided_by"] == "layer 1 decode"
    assert where["agree"] == ["layer 1 prefill", "layer 3 prefill", "layer 3 decode"]
    assert where["depart"] == ["layer 1 decode"]
    assert "agree: layer 1 prefill" in ch["text"]


def test_two_independent_bugs_give_two_classes_each_with_its_own_where():
    """Issue 53's first undecided case, planted: layer 1's prefill agrees while its decode is at
    chance, and the next CSA layer shows the opposite (its prefill at chance, its decode agreeing).
    Before, decode_only needed every prefill to agree, so one class came out
    (``ranking_uninformative``, at layer 1, where the prefill agrees). Now: a decode-path bug at
    layer 1 and a ranking at chance at layer 3, each with its own ``where``."""
    ev = _ev(
        layer_selection(1, "prefill", _rows(_same())),
        layer_selection(1, "decode", _rows(_random(4))),
        layer_selection(3, "prefill", _rows(_random(5))),
        layer_selection(3, "decode", _rows(_same())),
    )
    ch = characterize(ev, CTX)
    assert ch["classes"][:2] == ["decode_only", "ranking_uninformative"], ch
    sites = {s["class"]: s["where"] for s in ch["sites"]}
    assert (sites["decode_only"]["layer"], sites["decode_only"]["path"]) == (1, "decode")
    assert (sites["ranking_uninformative"]["layer"], sites["ranking_uninformative"]["path"]) == (3, "prefill")
    assert "layer 3 decode" in sites["ranking_uninformative"]["agree"]
    assert "independently, ranking_uninformative at layer 3 prefill" in ch["text"]
    # one bug on both paths of every layer is one site, never two classes of "independent" bugs
    one = characterize(
        _ev(*(layer_selection(n, p, _rows(_random(n))) for n in (1, 3) for p in ("prefill", "decode"))), CTX
    )
    assert "sites" not in one and one["classes"][0] == "ranking_uninformative"


def test_a_ranking_just_above_the_bar_on_one_path_and_below_on_the_other_is_at_chance():
    """Issue 53's second undecided case, planted: the overlap just above the near-chance bar on the
    prefill path and below it on the decode path, recall lost at the longest length only. The
    path below the bar decides, and the report names the one above (before, the prefill path
    alone was read: ``graded``)."""
    above = layer_selection(1, "prefill", _rows(_partial(4, 6)))
    below = layer_selection(1, "decode", _rows(_random(7)))
    norm = lambda s: (s.overlap - s.chance) / (1 - s.chance)  # noqa: E731
    assert norm(below) <= RULES["near_chance"] < norm(above) < RULES["agree"], (norm(above), norm(below))
    longest_only = (LengthCell(512, 6, 0, 0, 128), LengthCell(1024, 6, 3, 0, 256))
    ev = Evidence(recall_lost=True, cells=longest_only, layers=(above, below), answers_differ=True)
    ch = characterize(ev, CTX)
    assert ch["classes"][0] == "ranking_uninformative", ch
    e = ch["evidence"]["ranking_uninformative"]
    assert (e["layer"], e["path"]) == (1, "decode")
    assert ch["where"]["decided_by"] == "layer 1 decode"
    assert ch["where"]["depart"] == ["layer 1 prefill", "layer 1 decode"]


def test_a_later_layers_decode_departing_downstream_of_a_decode_bug_still_gives_two_sites():
    """Measured through a real server (``two_bugs_layers.py``, ``tests/test_two_bugs_live.py``):
    layer 1's decode at chance beside its agreeing prefill changes every later layer's decode
    queries, so layer 3's decode departs partly (0.78) beside its own prefill at chance. Layer 3's
    prefill departure is still its own bug (every earlier prefill agrees, and the prefill path
    never runs the decode bug): two sites. Layer 3 before layer 1's decode bug is not read so."""
    ev = _ev(
        layer_selection(1, "prefill", _rows(_same())),
        layer_selection(1, "decode", _rows(_random(4))),
        layer_selection(3, "prefill", _rows(_random(5))),
        layer_selection(3, "decode", _rows(_partial(12, 8))),
    )
    ch = characterize(ev, CTX)
    assert ch["classes"][:2] == ["decode_only", "ranking_uninformative"], ch
    sites = {s["class"]: s["where"] for s in ch["sites"]}
    assert (sites["ranking_uninformative"]["layer"], sites["ranking_uninformative"]["path"]) == (3, "prefill")
    # a prefill departing between them (layer 2, only its prefill compared): layer 3's prefill
    # may be downstream of it, and its decode departs: no second site read at layer 3
    upstream = _ev(
        layer_selection(1, "prefill", _rows(_same())),
        layer_selection(1, "decode", _rows(_random(4))),
        layer_selection(2, "prefill", _rows(_random(9))),
        layer_selection(3, "prefill", _rows(_random(5))),
        layer_selection(3, "decode", _rows(_partial(12, 8))),
    )
    assert "sites" not in characterize(upstream, CTX)
