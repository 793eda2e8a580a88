"""Rank dump: where the needle's compressed entries rank in every CSA layer's indexer scores.

For each CSA layer and each query position of interest (by default the positions that
produce the answer: the last prompt position and every generated token fed back during
greedy decoding), the dump records the visible entries' scores and derives:

* ``visible_entries`` v = (t+1)//4: entries the query at position t may select;
* ``needle_entries``: the entries covering the needle's tokens (``prompt.covering_entries``,
  overlapping ratio-4 windows), restricted to visible ones;
* ``best_rank``: 1-based rank of the best needle entry among the visible entries by score.
  Ties are counted pessimistically: rank = 1 + the number of *non-needle* visible entries
  whose score is >= the best needle score, so ``best_rank <= k`` guarantees selection
  whatever the top-k tie-break; ``ties`` counts the non-needle entries scoring exactly the
  needle's score (a random or ReLU-saturated indexer gives many exact 0 scores), so the
  optimistic rank is ``best_rank - ties``;
* ``needle_score``: the best needle entry's score;
* ``cutoff_score``: the k-th largest visible score with k = min(index_topk, v); when v <= k
  it is the smallest visible score and every entry is selected;
* ``margin`` = needle_score - cutoff_score (>= 0 means the best needle entry is at or above
  the cutoff) and ``margin_frac`` = margin / (max - min visible score), 0 when all scores tie;
* ``selected``: whether any needle entry is in the top-k set the model actually used (read
  from ``IndexerCapture``, not recomputed).

Query positions where no needle entry is visible yet (the needle sits in the last, unfinished
4-token block, which only the sliding window covers) have no rank; they are listed in the
layer's ``needle_not_visible`` instead of ``positions``, so every position record's numbers
are meaningful.

``rankdump.json`` schema (``RANKDUMP_SCHEMA``; keys beyond these may be added)::

    {"index_topk": int, "numerics": {"index_k": str, "index_q": str, "score_dtype": str,
                                     "hadamard": bool},
     "prompt_tokens": int, "needle_token_span": [int, int], "compress_ratio": int,
     "query_positions_source": "answer" | "explicit",
     "generated_tokens": [int], "generated_text": str, "answer_correct": bool | null,
     "patch": str | null, "label": str,
     "layers": [{"layer": int, "needle_not_visible": [int],
                 "positions": [{"query_pos": int, "visible_entries": int, "needle_entries": [int],
                                "best_rank": int, "ties": int, "needle_score": float, "cutoff_score": float,
                                "margin": float, "margin_frac": float, "selected": bool,
                                "nonfinite": {"neg_inf": int, "nan": int, "pos_inf": int}}]}],
                                # nonfinite: only where a visible score was -inf, NaN or +inf
     "prompts": [<dump>, ...]}   # only in a multi-prompt dump (see ``combine_dumps``)

A multi-prompt dump is the first prompt's dump with ``prompts`` listing every prompt's dump
(the first included), so a reader expecting one dump still finds the schema at the top.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from needlescope.cases.scoring import score_answer
from needlescope.dsa.emulate import IndexerCapture, csa_indexers, emulate
from needlescope.dsa.nonfinite import nonfinite_in, rank_scores
from needlescope.dsa.passes import greedy, greedy_batch, prefill
from needlescope.dsa.prompt import covering_entries, render_prompt, resolve_needle_span
from needlescope.dsa.rankdump_schema import RANKDUMP_SCHEMA
from needlescope.dsa.reference import visible_entries
from needlescope.dsa.streaming import is_streamed
from needlescope.errors import BadInput
from needlescope.schema import check_schema
from needlescope.setting import REFERENCE, Setting, check_chunk

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "RANKDUMP_SCHEMA",
    "RankStats",
    "needle_rank_stats",
    "selected_in",
    "answer_positions",
    "greedy_new_tokens",
    "rank_dump",
    "combine_dumps",
    "dumps_of",
    "validate_rankdump",
    "render_rankdump_md",
    "plot_rank_vs_layer",
    "plot_margin_vs_length",
]

DEFAULT_MAX_NEW_TOKENS = 12


@dataclass(frozen=True)
class RankStats:
    """Rank and margin of the best needle entry among one query's visible entries."""

    visible_entries: int
    k: int  # effective k = min(index_topk, visible_entries)
    best_entry: int
    best_rank: int  # 1-based, ties pessimistic
    ties: int  # non-needle visible entries scoring exactly needle_score (optimistic rank = best_rank - ties)
    needle_score: float
    cutoff_score: float
    max_score: float
    min_score: float

    @property
    def margin(self) -> float:
        return self.needle_score - self.cutoff_score

    @property
    def margin_frac(self) -> float:
        spread = self.max_score - self.min_score
        return self.margin / spread if spread > 0 else 0.0

    @property
    def within_k(self) -> bool:
        """best_rank <= k: the needle is selected whatever the tie-break."""
        return self.best_rank <= self.k


def needle_rank_stats(scores: torch.Tensor, visible: int, needle_entries: Sequence[int], k: int) -> RankStats:
    """Rank statistics of the needle entries in one score row.

    scores: [L] scores of one query over L >= ``visible`` entries (entries >= visible are
    ignored whatever their value, e.g. -inf); needle_entries: entry ids, all < visible,
    at least one; k: index_topk (>= 1). Raises ValueError on inconsistent input.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [L], got shape {tuple(scores.shape)}")
    if not 1 <= visible <= scores.shape[0]:
        raise ValueError(f"visible must be in 1..{scores.shape[0]} (the row length), got {visible}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    ne = sorted(set(int(e) for e in needle_entries))
    if not ne:
        raise ValueError("needle_entries is empty; the needle has no visible entry at this query")
    if ne[0] < 0 or ne[-1] >= visible:
        raise ValueError(f"needle entries {ne} must lie in 0..{visible - 1} (the visible entries)")
    vis = scores[:visible].float()  # [v]
    if not bool(torch.isfinite(vis).all()):
        raise ValueError("a visible entry has a non-finite score; the indexer produced inf/nan")
    is_needle = torch.zeros(visible, dtype=torch.bool)
    is_needle[ne] = True
    needle_scores = vis[ne]  # [n]
    best_i = int(needle_scores.argmax())
    best = needle_scores[best_i]
    best_rank = 1 + int(((vis >= best) & ~is_needle).sum())
    ties = int(((vis == best) & ~is_needle).sum())
    kk = min(k, visible)
    ordered = vis.sort(descending=True).values  # [v]
    return RankStats(
        visible_entries=visible,
        k=kk,
        best_entry=ne[best_i],
        best_rank=best_rank,
        ties=ties,
        needle_score=float(best),
        cutoff_score=float(ordered[kk - 1]),
        max_score=float(ordered[0]),
        min_score=float(ordered[-1]),
    )


def selected_in(topk_row: torch.Tensor, needle_entries: Sequence[int]) -> bool:
    """Whether any of ``needle_entries`` is in ``topk_row`` ([k'] entry ids, -1 padded)."""
    chosen = set(int(x) for x in topk_row.tolist() if x >= 0)
    return any(int(e) in chosen for e in needle_entries)


def answer_positions(prompt_tokens: int, generated: int) -> list[int]:
    """Query positions that produce the answer: the last prompt position and each fed generated token.

    With ``generated`` new tokens the model ran the prompt (its last position produces token 1)
    and then fed tokens 1..generated-1 back; the last generated token is never fed.
    """
    return [prompt_tokens - 1 + i for i in range(max(1, generated))]


def greedy_new_tokens(
    model, tokenizer, ids: torch.Tensor, max_new_tokens: int, *, chunk: int | None = None
) -> torch.Tensor:
    """Greedy decoding of the unpadded batch ``ids`` [B, P]: the new tokens [B, <= max_new_tokens].

    The prompts are prefilled through the KV cache in chunks of ``chunk`` tokens (None: one
    forward) and the answers decoded one token per forward, logits at the last position only
    (``dsa.passes.greedy_batch``); a streamed model (``dsa.streaming``) runs one prompt at a
    time (``dsa.passes.greedy``).
    """
    eos = tokenizer.eos_token_id
    if is_streamed(model):
        return torch.tensor(
            [greedy(model, ids, max_new_tokens, eos_token_id=eos, chunk=chunk)], dtype=torch.long
        )
    return greedy_batch(model, ids, max_new_tokens, eos_token_id=eos, chunk=chunk)


def _run_prompt(
    model, tokenizer, ids: torch.Tensor, query_positions, max_new_tokens: int, chunk: int | None
) -> tuple[list[int], list[int]]:
    """Run the prompt ``ids`` [1, P]: (generated tokens, query positions to dump): greedy
    generation when ``query_positions`` is None (answer positions), else one prefill."""
    if query_positions is None:
        generated = greedy_new_tokens(model, tokenizer, ids, max_new_tokens, chunk=chunk)[0].tolist()
        return generated, answer_positions(ids.shape[1], len(generated))
    prefill(model, ids, chunk=chunk)
    return [], list(query_positions)


def _prompt_positions(query_positions: Sequence[int], prompt_tokens: int) -> list[int]:
    """Sorted distinct query positions, each inside the prompt (BadInput otherwise, or if none)."""
    positions = sorted(set(int(t) for t in query_positions))
    bad = [t for t in positions if not 0 <= t < prompt_tokens]
    if bad or not positions:
        raise BadInput(
            f"query positions must lie in 0..{prompt_tokens - 1} (the prompt), got {bad or 'none'}"
        )
    return positions


def rank_dump(
    model,
    tokenizer,
    messages: list[dict],
    *,
    needle: str | None = None,
    needle_span: tuple[int, int] | None = None,
    setting: Setting = REFERENCE,
    query_positions: Sequence[int] | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    expected: Sequence[str] | None = None,
    label: str = "",
    capture: IndexerCapture | None = None,
    chunk: int | None = None,
) -> dict:
    """Run ``model`` on ``messages`` under ``setting`` (numerics and patch) and dump the needle's ranks.

    ``chunk``: None runs the prompt in one forward (and greedy decoding through
    ``model.generate``); a token count runs it in chunks of that many tokens through the KV
    cache (``dsa.passes``), so that peak memory is bounded by the chunk; the dump is the same.

    ``capture``: the caller already runs ``model`` inside ``emulate(model, numerics,
    capture=capture)`` with the setting's patch applied once (a sweep runs many prompts on one
    patched model); the capture is cleared and reused, and ``setting`` is only recorded.

    The needle is given as text (its first and only occurrence in the rendered prompt) or as an
    explicit [start, end) token span. ``query_positions=None`` runs greedy generation for up to
    ``max_new_tokens`` (stops at EOS) and uses ``answer_positions``; explicit positions (all
    inside the prompt) run one prefill instead. ``expected`` values, when given, score the
    generated answer (``answer_correct``). Returns a dict following ``RANKDUMP_SCHEMA``.
    """
    prompt = render_prompt(tokenizer, messages)
    P = len(prompt.input_ids)
    start, end = resolve_needle_span(prompt, needle, needle_span)
    if max_new_tokens < 1:
        raise BadInput(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    chunk = check_chunk(chunk)
    if query_positions is not None:
        query_positions = _prompt_positions(query_positions, P)

    ids = torch.tensor([prompt.input_ids], device=next(model.parameters()).device)
    if capture is None:
        first = P - 1 if query_positions is None else min(query_positions)
        capture = IndexerCapture(keep_scores=True, score_from=first)
        context = emulate(model, setting, capture=capture)
    else:
        capture.clear()
        context = nullcontext([layer for layer, _ in csa_indexers(model)])
    with torch.no_grad(), context as layers:
        indexer = csa_indexers(model)[0][1]
        index_topk = int(indexer.index_topk)
        ratio = int(indexer.compress_rate)
        generated, positions = _run_prompt(model, tokenizer, ids, query_positions, max_new_tokens, chunk)

    entries = covering_entries((start, end), ratio=ratio, overlap=True)
    out_layers = [_layer_record(capture, layer, positions, entries, index_topk, ratio) for layer in layers]

    answer_ids = [t for t in generated if t != tokenizer.eos_token_id]
    text = tokenizer.decode(answer_ids, skip_special_tokens=True) if generated else ""
    return {
        "index_topk": index_topk,
        "numerics": {
            "index_k": setting.index_k,
            "index_q": setting.index_q,
            "score_dtype": setting.score_dtype,
            "hadamard": setting.rotates,
        },
        "prompt_tokens": P,
        "needle_token_span": [start, end],
        "compress_ratio": ratio,
        "query_positions_source": "explicit" if query_positions is not None else "answer",
        "generated_tokens": generated,
        "generated_text": text,
        "answer_correct": (
            score_answer(text, list(expected)) if expected is not None and generated else None
        ),
        "patch": None if setting.patch is None else setting.patch.spec,
        "label": label,
        "layers": out_layers,
    }


def _layer_record(
    capture: IndexerCapture,
    layer: int,
    positions: Sequence[int],
    entries: Sequence[int],
    index_topk: int,
    ratio: int,
) -> dict:
    """One ``layers[]`` record of the schema: the needle's rank at each query position of ``layer``."""
    score_pos, score_rows = capture.score_rows(layer)
    topk_pos, topk_rows = capture.rows(layer, width=index_topk)
    row_of = {int(p): i for i, p in enumerate(score_pos.tolist())}
    topk_of = {int(p): i for i, p in enumerate(topk_pos.tolist())}
    if len(row_of) != len(score_rows) or len(topk_of) != len(topk_pos) or not row_of.keys() <= topk_of.keys():
        raise RuntimeError(f"layer {layer}: captured positions repeat or disagree between scores and top-k")
    recs, unseen = [], []
    for t in positions:
        if t not in row_of:
            raise RuntimeError(f"layer {layer}: no indexer row was captured for query position {t}")
        i = row_of[t]
        visible = visible_entries(t, ratio)
        ne = [e for e in entries if e < visible]
        if not ne:
            unseen.append(t)
            continue
        row = score_rows[i][:visible].float()
        st = needle_rank_stats(rank_scores(row), visible, ne, index_topk)
        bad = nonfinite_in(row)
        recs.append(
            {
                **({"nonfinite": bad} if bad else {}),
                "query_pos": t,
                "visible_entries": visible,
                "needle_entries": ne,
                "best_rank": st.best_rank,
                "ties": st.ties,
                "needle_score": st.needle_score,
                "cutoff_score": st.cutoff_score,
                "margin": st.margin,
                "margin_frac": st.margin_frac,
                "selected": selected_in(topk_rows[topk_of[t]], ne),
            }
        )
    return {"layer": layer, "needle_not_visible": unseen, "positions": recs}


def combine_dumps(dumps: Sequence[dict]) -> dict:
    """One rankdump.json for several prompts: the first dump plus ``prompts`` listing all of them."""
    if not dumps:
        raise ValueError("no dumps to combine")
    if len(dumps) == 1:
        return dict(dumps[0])
    return {**dumps[0], "prompts": list(dumps)}


def dumps_of(obj: dict) -> list[dict]:
    """The per-prompt dumps of a (single or multi-prompt) rankdump.json object."""
    return list(obj["prompts"]) if "prompts" in obj else [obj]


def validate_rankdump(obj: dict) -> None:
    """Raise ValueError unless ``obj`` follows RANKDUMP_SCHEMA and its internal invariants."""
    check_schema(obj, RANKDUMP_SCHEMA, "rankdump")
    for d in dumps_of(obj):
        span = d["needle_token_span"]
        if len(span) != 2 or not 0 <= span[0] < span[1] <= d["prompt_tokens"]:
            raise ValueError(f"rankdump: needle_token_span {span} is not a range inside the prompt")
        for layer in d["layers"]:
            for p in layer["positions"]:
                if not 1 <= p["best_rank"] <= p["visible_entries"]:
                    raise ValueError(
                        f"rankdump: layer {layer['layer']} pos {p['query_pos']}: best_rank {p['best_rank']} "
                        f"outside 1..{p['visible_entries']}"
                    )
                if not p["needle_entries"] or max(p["needle_entries"]) >= p["visible_entries"]:
                    raise ValueError(
                        f"rankdump: layer {layer['layer']} pos {p['query_pos']}: needle entries "
                        f"{p['needle_entries']} empty or not visible"
                    )


def _k_eff(d: dict, p: dict) -> int:
    return min(d["index_topk"], p["visible_entries"])


def render_rankdump_md(obj: dict, *, stability: dict | None = None) -> str:
    """Markdown summary of a (single or multi-prompt) rank dump."""
    dumps = dumps_of(obj)
    n = obj["numerics"]
    lines = [
        "# needlescope indexer rank-dump",
        "",
        f"Numerics: keys **{n['index_k']}**, queries **{n['index_q']}**, scores accumulated in "
        f"**{n['score_dtype']}**, index_topk **{obj['index_topk']}**"
        + (f", patch `{obj['patch']}`" if obj.get("patch") else "")
        + ".",
        "",
        "best_rank counts from 1 among the visible entries (ties pessimistic); cutoff is the k-th "
        "visible score (k = min(index_topk, visible)); margin = needle score - cutoff; "
        "margin_frac = margin / (max - min visible score); selected = a needle entry is in the "
        "captured top-k.",
    ]
    for d in dumps:
        title = d.get("label") or "prompt"
        lines += [
            "",
            f"## {title}: {d['prompt_tokens']} tokens, needle tokens "
            f"{d['needle_token_span'][0]}:{d['needle_token_span'][1]}",
            "",
        ]
        if d.get("query_positions_source") == "answer":
            ok = d.get("answer_correct")
            verdict = "" if ok is None else (" (correct)" if ok else " (wrong)")
            lines.append(
                f"Greedy answer ({len(d.get('generated_tokens', []))} tokens): `{d.get('generated_text', '')}`"
                f"{verdict}"
            )
            lines.append("")
        lines += [
            "| layer | first query pos | visible | best rank | k | needle score | cutoff | margin | "
            "margin frac | selected | positions selected |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for layer in d["layers"]:
            ps = layer["positions"]
            if not ps:
                lines.append(
                    f"| {layer['layer']} | - | - | - | - | - | - | - | - | needle not visible | "
                    f"0/{len(layer.get('needle_not_visible', []))} |"
                )
                continue
            p = ps[0]
            sel = sum(q["selected"] for q in ps)
            lines.append(
                f"| {layer['layer']} | {p['query_pos']} | {p['visible_entries']} | {p['best_rank']} | "
                f"{_k_eff(d, p)} | {p['needle_score']:.4g} | {p['cutoff_score']:.4g} | {p['margin']:+.4g} | "
                f"{p.get('margin_frac', float('nan')):+.3f} | {'yes' if p['selected'] else '**no**'} | "
                f"{sel}/{len(ps)} |"
            )
        unseen = sorted({t for layer in d["layers"] for t in layer.get("needle_not_visible", [])})
        if unseen:
            lines += ["", f"Needle not yet in a visible entry (sliding window only) at positions {unseen}."]
    if stability is not None:
        lines += ["", "## Selection stability against the reference numerics"]
        stabs = stability.get("prompts", [stability])
        for d, stab in zip(dumps, stabs, strict=True):
            title = d.get("label") or "prompt"
            lines += ["", f"### {title}: {stab['prompt_tokens']} tokens, every prompt position", ""]
            lines += stability_md_rows(stab)
    return "\n".join(lines) + "\n"


def stability_md_rows(stab: dict) -> list[str]:
    """Table rows for a stability.json object (see ``needlescope.dsa.stability``)."""
    rows = [
        "| layer | mean recall of reference set | positions changed | needle flips |",
        "|---|---|---|---|",
    ]
    for layer in stab["layers"]:
        rows.append(
            f"| {layer['layer']} | {layer['mean_recall']:.4f} | {layer['changed_positions']}/{layer['rows']} "
            f"({layer['changed_fraction']:.1%}) | {len(layer['needle_flips'])} |"
        )
    return rows


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rank_vs_layer(obj: dict, path: str | Path) -> None:
    """Needle best rank (first answer position; band over all positions) vs CSA layer, with k line."""
    plt = _plt()
    dumps = dumps_of(obj)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for d in dumps:
        xs, first, lo, hi = [], [], [], []
        for layer in d["layers"]:
            ps = layer["positions"]
            if not ps:
                continue
            ranks = [p["best_rank"] for p in ps]
            xs.append(layer["layer"])
            first.append(ps[0]["best_rank"])
            lo.append(min(ranks))
            hi.append(max(ranks))
        label = d.get("label") or f"{d['prompt_tokens']} tokens"
        (line,) = ax.plot(xs, first, marker="o", label=label)
        if any(len(layer["positions"]) > 1 for layer in d["layers"]):
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    ax.axhline(obj["index_topk"], color="red", linestyle="--", label=f"index_topk = {obj['index_topk']}")
    ax.set_yscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("CSA layer")
    ax.set_ylabel("needle best rank (1 = top)")
    layers = sorted({layer["layer"] for d in dumps for layer in d["layers"]})
    ax.set_xticks(layers)
    ax.set_title("Needle rank at the first answer position (band: all answer positions)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_margin_vs_length(obj: dict, path: str | Path) -> None:
    """margin_frac at the first answer position vs prompt length, one line per CSA layer."""
    plt = _plt()
    dumps = sorted(dumps_of(obj), key=lambda d: d["prompt_tokens"])
    layers = sorted({layer["layer"] for d in dumps for layer in d["layers"]})
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for lid in layers:
        xs, ys = [], []
        for d in dumps:
            for layer in d["layers"]:
                if layer["layer"] == lid and layer["positions"]:
                    xs.append(d["prompt_tokens"])
                    ys.append(layer["positions"][0].get("margin_frac", 0.0))
        ax.plot(xs, ys, marker="o", label=f"layer {lid}")
    ax.axhline(0.0, color="red", linestyle="--", label="cutoff (margin 0)")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("margin / score spread")
    ax.set_title("Needle margin over the top-k cutoff at the first answer position", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
