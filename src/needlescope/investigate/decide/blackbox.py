"""What kind of bug, decided from outside: an endpoint without an indexer capture (vLLM).

``characterize_blackbox(evidence, context) -> dict`` is a pure function over what
``measure.blackbox`` measured (answers, and teacher-forced logprobs where the server gives them);
its result is ``verdicts.json`` ``characterization`` (the schema of docs/investigate.md), with
every class's evidence saying the ``experiment`` that decided it and what a capture would add
(``capture_adds``). No reference model runs: a case is lost when the endpoint's answer is wrong
(the null is a model that recalls every needle the symptom plants, which a healthy deployment
of the organism does at the lengths tested; a model that does not is not this route's user).

The rules, in the capture route's order (``decide.characterize``), each from its experiment:

``state_dependent``    every failing case sent again alone answers otherwise (greedy): the
                       failure depends on what ran before it
``outside_selection``  recall lost at a dense length (compressed entries <= top-k: the indexer
                       selects every entry), exact one-sided p < 0.05 (``DENSE``)
``length_residue``     the residue scan: lengths L + d around the shortest failing length L, the
                       class of L mod m against the others, one-sided exact test per modulus m
                       (4, 16, 64, 128, the page size, the chunk size; ``analysis.bisect``),
                       Holm across every class of every modulus, and the other lengths lose at
                       most 10%: the smallest such modulus
``decode_only``        the answer teacher-forced through the server's prompt logprobs ranks first
                       at every answer token for every failing case scored, while the decoded
                       answer was wrong (a bug only the decode path runs)
``positional_bias``    the length x depth grid: a distance from one end of the context separates
                       the kept needles from the lost ones at every length (Fisher exact,
                       one-sided), and it is the top-k's reach, ratio x top-k tokens: a selection
                       piled up at that end holds the top-k entries nearest it and nothing else
``graded``             the grid: such a window wider than the top-k's reach (entries past a window
                       scored wrong: the loss grows with length), or the longest selective length
                       loses and the shortest at most half its rate

``outside_selection`` also fires from a second endpoint that differs only in a larger top-k
(the ledger's ``topk_endpoint``): a loss where that top-k selects every entry
(``blackbox_topk.topk_outside``).

``misaddressed``, ``needle_excluded`` and ``ranking_uninformative`` read the selection, which an
endpoint without a capture does not show: when no rule above fires the class is ``undecided``,
``undecided`` names the capture and ``next`` is the capture command. The top-k pair narrows
them (``topk_narrowing``: ``characterization.topk_pair``, its ``ruled_out`` and
``narrowed_to``): a loss the larger top-k restores where both choose is no ``needle_excluded``,
one it keeps while a dense top-k restores it is no ``misaddressed`` (``decide.blackbox_topk``).
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field

from needlescope.analysis.bisect import correct_residues, residue_test
from needlescope.investigate.decide.blackbox_topk import TopkPair, pair_summary, topk_outside, topk_ruled_out
from needlescope.investigate.decide.characterize import fisher_greater

__all__ = [
    "BLACKBOX_RULES",
    "CAPTURE_ADDS",
    "INSIDE_SELECTION",
    "Arch",
    "BlackboxContext",
    "BlackboxEvidence",
    "GridCell",
    "characterize_blackbox",
    "gold_first",
    "topk_narrowing",
    "residue_offsets",
]

BLACKBOX_RULES = {
    "alpha": 0.05,
    "other_lengths_lose_at_most": 0.1,  # length_residue: the lengths outside the class
    "graded_shortest_share": 0.5,  # the shortest selective length's net loss rate, of the longest's
    "teacher_forced_cases": 2,  # decode_only: at least this many failing cases scored
    "reach_slack": 1.25,  # positional_bias: the kept window within 1.25 x ratio x top-k (the needle's span)
}

MODULI = (4, 16, 64, 128)
"""The residue scan's moduli besides the page size and the chunk size (issue 53)."""

INSIDE_SELECTION = ("misaddressed", "needle_excluded", "ranking_uninformative")
"""Classes only the selection tells apart (a capture, or two endpoints differing in top-k)."""

CAPTURE_ADDS = {
    "state_dependent": "the selection of the failing case run alone and after another, row by row",
    "outside_selection": "the first CSA layer and path where the answers depart while the selections agree",
    "length_residue": "the CSA layer and path whose selection departs at the failing residue",
    "decode_only": "the first CSA layer whose decode selection departs while its prefill agrees",
    "positional_bias": "the layer whose selection crowds one quarter of the context",
    "graded": "the partial loss of overlap per CSA layer and its growth with length",
    "misaddressed": "a shifted or page-permuted selection that agrees with the reference's",
    "needle_excluded": "the needle entries dropped while the rest of the selection agrees",
    "ranking_uninformative": "the selection's overlap with the reference near chance",
}


@dataclass(frozen=True)
class Arch:
    """The architecture numbers the experiments are placed by, and where they came from."""

    ratio: int | None
    topk: int | None
    page_size: int | None = None
    chunk_size: int | None = None
    source: str = ""

    @property
    def dense_length(self) -> int | None:
        """A prompt length whose compressed entries fit the top-k (every entry selected)."""
        return self.ratio * self.topk - 1 if self.ratio and self.topk else None


@dataclass(frozen=True)
class GridCell:
    """Cases at one (length, depth): ``lost`` of ``n`` answered wrong."""

    length: int
    depth: float
    n: int
    lost: int


@dataclass(frozen=True)
class BlackboxEvidence:
    """Everything ``characterize_blackbox`` reads (``measure.blackbox`` fills it).

    ``grid``: the symptom's length x depth cells; ``dense``: the cells at the dense length;
    ``scan``: length -> [correct, n] of the residue scan around ``failing_length`` (its own
    cells included); ``rerun`` / ``not_reproduced``: failing cases sent again alone and how many
    answered otherwise; ``teacher``: per failing case scored teacher-forced, whether the gold
    answer ranked first at every token (``method``: the logprob interface, None: none offered);
    ``topk_pair``: the same cases on a second endpoint that differs only in a larger top-k
    (``decide.blackbox_topk``), None when the ledger names none."""

    arch: Arch
    grid: tuple[GridCell, ...] = ()
    dense: tuple[GridCell, ...] = ()
    failing_length: int | None = None
    scan: dict = field(default_factory=dict)
    rerun: int = 0
    not_reproduced: int = 0
    teacher: tuple[dict, ...] = ()
    method: str | None = None
    method_note: str = ""
    topk_pair: TopkPair | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> BlackboxEvidence:
        pair = obj.get("topk_pair")
        return cls(
            **{
                k: v
                for k, v in obj.items()
                if k not in ("arch", "grid", "dense", "scan", "teacher", "topk_pair")
            },
            topk_pair=None if pair is None else TopkPair.from_json(pair),
            arch=Arch(**obj["arch"]),
            grid=tuple(GridCell(**c) for c in obj.get("grid", [])),
            dense=tuple(GridCell(**c) for c in obj.get("dense", [])),
            scan={int(k): list(v) for k, v in obj.get("scan", {}).items()},
            teacher=tuple(obj.get("teacher", [])),
        )


@dataclass(frozen=True)
class BlackboxContext:
    """How the user reaches the endpoint (for ``next``): its URL, served model, the tokenizer
    and a failing case's messages file and needle the run wrote."""

    base_url: str
    served_model: str
    tokenizer: str = "organism"
    prompt: str | None = None
    needle: str | None = None
    lengths: tuple[int, ...] = ()

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> BlackboxContext:
        return cls(**{**obj, "lengths": tuple(obj.get("lengths", ()))})


def moduli(arch: Arch) -> list[int]:
    """The residue scan's moduli: ``MODULI``, the page size and the chunk size (each >= 2)."""
    extra = [m for m in (arch.page_size, arch.chunk_size) if m and m >= 2]
    return sorted(set(MODULI) | set(extra))


def residue_offsets(arch: Arch) -> list[int]:
    """The offsets d of the scan's lengths L + d: 1, 2, 3 (other residues of every modulus) and
    each modulus and its half (L's class of the larger moduli, another class of the smaller)."""
    out = {1, 2, 3}
    for m in moduli(arch):
        out |= {m, m // 2}
    return sorted(d for d in out if d > 0)


def _lost_p(lost: int, n: int) -> float:
    """One-sided exact p of ``lost`` losses of ``n`` under a model that recalls them all but for
    chance pairing: the McNemar p with no case gained (0.5 ** lost)."""
    return 0.5**lost if lost else 1.0


def _rule_state(ev: BlackboxEvidence) -> dict | None:
    if not ev.rerun or ev.not_reproduced < ev.rerun:
        return None
    return {
        "rule": "every failing case sent again alone answers otherwise: the failure depends on what ran before it",
        "experiment": "the failing case alone vs after another",
        "failing_cases_rerun": ev.rerun,
        "not_reproduced": ev.not_reproduced,
        "null": "a failure that reproduces when its case is sent alone",
    }


def _rule_outside(ev: BlackboxEvidence) -> dict | None:
    """The top-k pair's loss where its larger top-k selects every entry
    (``blackbox_topk.topk_outside``: a longer length, the pair's cases), else the dense length's.
    Neither when the pair's larger top-k restores what the smaller lost (``topk_ruled_out``):
    that paired test puts the loss in the selection (measured: ``topk_drops_best.py`` at top-16
    loses 5 of 10 cases at the 63-token dense length, as the same server without the bug does,
    and top-48 restores 14 of 15 at 191 tokens)."""
    if "outside_selection" in topk_ruled_out(ev.topk_pair):
        return None
    return topk_outside(ev.topk_pair) or _dense_loss(ev)


def _dense_loss(ev: BlackboxEvidence) -> dict | None:
    for length, lost, n in _rates_by_length(list(ev.dense)):
        p = _lost_p(lost, n)
        if p < BLACKBOX_RULES["alpha"]:
            return {
                "rule": f"recall lost where every entry is selected (entries {length // ev.arch.ratio} <= "
                f"top-k {ev.arch.topk})",
                "experiment": f"recall at the dense length {length}",
                "length": length,
                "lost": lost,
                "n": n,
                "p": p,
                "null": "no loss where the selection is dense (exact, one-sided)",
            }
    return None


def residue_scan(ev: BlackboxEvidence) -> list[dict]:
    """Per modulus: ``analysis.bisect.residue_test`` over the scan (one stratum), Holm across
    every class of every modulus (``correct_residues``)."""
    if ev.failing_length is None or len(ev.scan) < 2:
        return []
    tally = {int(k): (int(v[0]), int(v[1])) for k, v in ev.scan.items()}
    tests = []
    for m in moduli(ev.arch):
        t = residue_test([tally], m)
        # a class no scanned length falls in is no test (Holm counts the tests made)
        tests.append(
            {
                **t,
                "classes": [c for c in t["classes"] if c["n"] and c["n"] < sum(v[1] for v in tally.values())],
            }
        )
    return correct_residues(tests, BLACKBOX_RULES["alpha"])


def _rule_residue(ev: BlackboxEvidence) -> dict | None:
    """The modulus whose failing class is Holm-significant with the other lengths clean; of
    several, the one whose class loses the largest share (0 mod 16 is also 0 mod 4, but mod 4's
    class then holds lengths that do not lose), then the smallest."""
    tests = residue_scan(ev)
    found = []
    for t in tests:
        m, r = t["modulus"], ev.failing_length % t["modulus"]
        if r not in t["flagged"]:
            continue
        cls = next(c for c in t["classes"] if c["residue"] == r)
        rest = [v for k, v in ev.scan.items() if int(k) % m != r]
        rest_n, rest_lost = sum(v[1] for v in rest), sum(v[1] - v[0] for v in rest)
        if rest_lost <= BLACKBOX_RULES["other_lengths_lose_at_most"] * rest_n:
            found.append((-(cls["n"] - cls["correct"]) / cls["n"], m, r, cls, rest_lost, rest_n))
    if not found:
        return None
    _, m, r, cls, rest_lost, rest_n = min(found, key=lambda f: (f[0], f[1]))
    return {
        "rule": f"losses concentrate on length = {r} mod {m}",
        "experiment": "the residue scan of the prompt length mod "
        + ", ".join(str(x) for x in moduli(ev.arch)),
        "modulus": m,
        "residue": r,
        "lost_in_class": [cls["n"] - cls["correct"], cls["n"]],
        "lost_elsewhere": [rest_lost, rest_n],
        "p_holm": cls["p_holm"],
        "tests": sum(len(x["classes"]) for x in tests),
        "null": "every residue class loses alike (exact per modulus, Holm across them)",
    }


def gold_first(scored: dict) -> bool:
    """The gold answer teacher-forced ranks first at every token: rank 1 where the server gives
    ranks, else a positive margin over every rival it returned."""
    ranks, margins = scored.get("ranks") or [], scored.get("margins") or []
    if ranks and all(r is not None for r in ranks):
        return all(r == 1 for r in ranks)
    return bool(margins) and all(m is not None and m > 0 for m in margins)


def _rule_decode_only(ev: BlackboxEvidence) -> dict | None:
    right = [gold_first(t) for t in ev.teacher]
    if len(right) < BLACKBOX_RULES["teacher_forced_cases"] or not all(right):
        return None
    return {
        "rule": "the answer teacher-forced ranks first at every token while the decoded answer is wrong",
        "experiment": f"the answer teacher-forced ({ev.method}) against the answer decoded",
        "teacher_forced_right": sum(right),
        "scored": len(ev.teacher),
        "null": "a prefill that loses the answer as the decode does",
    }


def _selective(ev: BlackboxEvidence) -> list[GridCell]:
    dense = ev.arch.dense_length
    return [c for c in ev.grid if c.n and (dense is None or c.length > dense)]


def _rates_by_length(cells: list[GridCell]) -> list[tuple[int, int, int]]:
    """(length, lost, n) per length, shortest first."""
    acc: dict[int, list[int]] = {}
    for c in cells:
        a = acc.setdefault(c.length, [0, 0])
        a[0] += c.lost
        a[1] += c.n
    return [(k, v[0], v[1]) for k, v in sorted(acc.items())]


def _grows_with_length(cells: list[GridCell]) -> tuple[bool, tuple, tuple] | None:
    """(the longest loses and the shortest at most half its rate, shortest, longest), or None
    with fewer than two lengths."""
    rates = _rates_by_length(cells)
    if len(rates) < 2:
        return None
    short, long = rates[0], rates[-1]
    grows = long[1] > 0 and short[1] * long[2] <= BLACKBOX_RULES["graded_shortest_share"] * long[1] * short[2]
    return grows, short, long


def _distance(c: GridCell, end: str) -> float:
    """Tokens between the cell's needle and one end of its context (the needle sits ``depth``%
    into it)."""
    return (1 - c.depth / 100) * c.length if end == "last" else c.depth / 100 * c.length


def window(cells: list[GridCell]) -> dict | None:
    """The distance from one end of the context that separates the kept needles from the lost
    ones at every length, or None: each cell's needle sits ``depth``% into the context, so
    ``(1 - depth / 100) x length`` tokens from its end (``depth / 100 x length`` from its start);
    a window is (the farthest cell with no loss, the nearest cell with one), the first below the
    second, over every length. {"end", "kept_within", "lost_from", kept/lost cases}."""
    for end in ("last", "first"):
        kept = [c for c in cells if not c.lost]
        lost = [c for c in cells if c.lost]
        if not kept or not lost:
            return None
        lo, hi = max(_distance(c, end) for c in kept), min(_distance(c, end) for c in lost)
        if lo < hi:
            return {
                "end": end,
                "kept_within": round(lo),
                "lost_from": round(hi),
                "kept": [sum(c.lost for c in kept), sum(c.n for c in kept)],
                "lost": [sum(c.lost for c in lost), sum(c.n for c in lost)],
            }
    return None


def _reach(arch: Arch) -> int | None:
    """Tokens the top-k entries nearest one end cover: ``ratio x top-k``."""
    return arch.ratio * arch.topk if arch.ratio and arch.topk else None


def _window_rule(ev: BlackboxEvidence) -> tuple[dict, float] | None:
    """(the window, its Fisher p) when one separates kept from lost needles over at least two
    selective lengths and the separation is significant."""
    cells = _selective(ev)
    if len({c.length for c in cells}) < 2:
        return None
    w = window(cells)
    if w is None:
        return None
    p = fisher_greater(w["lost"][0], w["lost"][1], w["kept"][0], w["kept"][1])
    return (w, p) if p < BLACKBOX_RULES["alpha"] else None


def _rule_positional(ev: BlackboxEvidence) -> dict | None:
    found, reach = _window_rule(ev), _reach(ev.arch)
    if found is None or reach is None:
        return None
    w, p = found
    # the selection piled up at one end holds exactly the top-k entries there: needles kept
    # within ratio x top-k tokens of that end (slack for the needle's own span), lost beyond
    if not (w["kept_within"] <= BLACKBOX_RULES["reach_slack"] * reach and reach < w["lost_from"]):
        return None
    return {
        "rule": f"needles are kept only within the top-k's reach of the {w['end']} end of the context "
        f"(ratio x top-k = {reach} tokens), at every length",
        "experiment": "the length x depth grid",
        **w,
        "reach": reach,
        "p": p,
        "null": "a loss that does not follow the distance from one end (Fisher exact, one-sided)",
    }


def _rule_graded(ev: BlackboxEvidence) -> dict | None:
    found, reach = _window_rule(ev), _reach(ev.arch)
    if (
        found is not None
        and reach is not None
        and found[0]["kept_within"] > BLACKBOX_RULES["reach_slack"] * reach
    ):
        w, p = found
        return {
            "rule": f"needles farther than a window from the {w['end']} end are lost at every length, a window "
            f"wider than the top-k's reach ({reach} tokens): the loss grows with length",
            "experiment": "the length x depth grid",
            **w,
            "reach": reach,
            "p": p,
            "null": "a loss that does not follow the distance from one end (Fisher exact, one-sided)",
        }
    trend = _grows_with_length(_selective(ev))
    if trend is None or not trend[0]:
        return None
    _, short, long = trend
    return {
        "rule": "the recall lost grows with length: the shortest selective length loses at most half the longest's rate",
        "experiment": "the length x depth grid",
        "shortest": list(short),
        "longest": list(long),
        "shortest_rate": short[1] / short[2],
        "longest_rate": long[1] / long[2],
        "null": f"the shortest loses more than {BLACKBOX_RULES['graded_shortest_share']:.0%} of the longest's rate",
    }


_ORDERED = (
    ("state_dependent", _rule_state),
    ("outside_selection", _rule_outside),
    ("length_residue", _rule_residue),
    ("decode_only", _rule_decode_only),
    ("positional_bias", _rule_positional),
    ("graded", _rule_graded),
)


def _missing(ev: BlackboxEvidence, ctx: BlackboxContext) -> list[tuple[str, str]]:
    """(experiment, what it would decide) for each class this run could not decide, cheapest
    first; the capture comes last and is always listed (the selection classes need it)."""
    out = []
    if ev.arch.dense_length is None:
        out.append(
            (
                "config",
                "the compression ratio and top-k (--config config.json) place the dense length: outside_selection",
            )
        )
    if ev.method is None:
        out.append(
            ("logprobs", f"prompt logprobs would test decode_only ({ev.method_note or 'none offered'})")
        )
    narrowing = topk_narrowing(ev)
    left = INSIDE_SELECTION if narrowing is None else tuple(narrowing["narrowed_to"])
    out.append(
        (
            "capture",
            f"an indexer capture of a failing case decides {_listed(left)} (the selection itself)"
            + ("" if narrowing is None else f"; the top-k pair ruled out {_listed(narrowing['ruled_out'])}"),
        )
    )
    if narrowing is None:
        out.append(
            (
                "topk",
                "two endpoints that differ only in top-k ([target] topk_endpoint) narrow them: a loss the "
                "larger top-k restores where both choose is no needle_excluded; one it keeps where it "
                "selects every entry is outside_selection",
            )
        )
    return out


def _listed(names) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names) or "nothing"


def topk_narrowing(ev: BlackboxEvidence) -> dict | None:
    """What the top-k pair rules out and the selection classes it leaves
    (``blackbox_topk``), with its per-length evidence; None without a pair."""
    if ev.topk_pair is None:
        return None
    ruled = topk_ruled_out(ev.topk_pair)
    return {
        **pair_summary(ev.topk_pair),
        "ruled_out": ruled,
        "narrowed_to": [c for c in INSIDE_SELECTION if c not in ruled],
    }


def _next(ctx: BlackboxContext, experiment: str) -> str:
    if experiment == "capture" and ctx.prompt:
        return shlex.join(
            ["needlescope", "indexer", "capture", "--sglang", ctx.base_url, "--prompt", ctx.prompt]
            + ["--needle", ctx.needle or "", "--tokenizer", ctx.tokenizer, "--out", "next-capture"]
        )
    lengths = ",".join(str(n) for n in ctx.lengths) or "1024,2048"
    return shlex.join(
        ["needlescope", "probe", "--base-url", ctx.base_url, "--model", ctx.served_model]
        + ["--kind", "multiturn", "--lengths", lengths, "--depths", "0,25,50,75,100", "--trials", "4"]
        + (["--graded"] if experiment == "logprobs" else [])
        + ["--out", f"next-{experiment}"]
    )


def characterize_blackbox(ev: BlackboxEvidence, ctx: BlackboxContext) -> dict:
    """The black-box characterization (module docstring): classes, where, evidence, next."""
    lost = sum(c.lost for c in ev.grid)
    if not lost:
        n = sum(c.n for c in ev.grid)
        return {
            "classes": ["none"],
            "where": None,
            "evidence": {
                "none": {
                    "rule": "no recall lost: the endpoint answers every case of the symptom",
                    "experiment": "the length x depth grid",
                    "cases": n,
                    "null": "a case answered wrong",
                }
            },
            "undecided": [],
            "next": None,
            "text": "nothing to explain: no recall lost",
        }
    fired = {}
    for name, rule in _ORDERED:
        found = rule(ev)
        if found is not None:
            fired[name] = {**found, "capture_adds": CAPTURE_ADDS[name]}
    missing = _missing(ev, ctx)
    classes = list(fired) or ["undecided"]
    where = {"route": "blackbox", "experiment": fired[classes[0]]["experiment"] if fired else None}
    if fired:
        where.update(_site(classes[0], fired[classes[0]]))
    result = {
        "classes": classes,
        "where": where,
        "evidence": fired,
        "undecided": [] if fired else [why for _, why in missing],
        "next": _next(ctx, "capture" if fired else missing[0][0]),
    }
    narrowing = topk_narrowing(ev)
    if narrowing is not None:
        result["topk_pair"] = narrowing
    result["text"] = _summary(result)
    return result


def _site(cls: str, e: dict) -> dict:
    """Where a class's evidence sits, from outside: the lengths, residue or depths it names."""
    keys = {
        "outside_selection": ("length",),
        "length_residue": ("modulus", "residue"),
        "positional_bias": ("end", "kept_within", "lost_from"),
        "graded": ("end", "kept_within", "lost_from", "shortest", "longest"),
    }.get(cls, ())
    site = {k: e[k] for k in keys if k in e}
    if cls == "decode_only":
        site["path"] = "decode"
    return site


def _summary(ch: dict) -> str:
    first = ch["classes"][0]
    if first == "undecided":
        return "from outside, the kind of bug is undecided: " + "; ".join(ch["undecided"])
    e = ch["evidence"][first]
    numbers = ", ".join(
        f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in e.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    return f"from outside: {e['rule']} ({numbers}); decided by {e['experiment']}; a capture would add {e['capture_adds']}"
