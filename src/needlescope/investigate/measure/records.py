"""In-process measurements of one configuration on probe cases: the answer, and the needle's
rank in every CSA layer at the position that produced the first wrong answer token.

The configuration measured is a ``ledger.plan.Config`` (a ``Setting`` plus extra patch files).

``measure_case`` runs greedy decoding under the config with an ``IndexerCapture`` and returns
one record (``CASE_RECORD_KEYS``)::

    {"case_id", "length", "depth", "trial", "prompt_tokens", "expected": [str], "answer": str,
     "correct": bool, "analysed_token": int, "analysed_source": str, "index_topk": int,
     "compress_ratio": int,
     "layers": [{"layer": int, "query_pos": int, "visible": int, "needle_visible": int,
                 "needle_selected": int, "best_rank": int, "selected": bool}],
     "first_token_layers": [the same, at the first answer token],
     "output_ids": [int],
     "nonfinite": {layer: {"neg_inf": int, "nan": int, "pos_inf": int, "first_position": int | None}}}

``nonfinite`` maps a CSA layer (str) to the counts of non-finite indexer scores over the visible
entries of every query row of the case (prefill and decode), ``{"neg_inf", "nan", "pos_inf",
"first_position"}`` (the first query position with a NaN or ``+inf``; None if none), for the
layers that have any. ``-inf`` is a legitimate masked score: it ranks last. NaN ranks last too
and ``+inf`` first in ``best_rank`` (``rank_scores``); both are findings the report shows.

``analysed_token`` is the index of the first wrong answer token (the answer compared token by
token with the expected value, digits and words as the tokenizer splits them); the first
answer token when the answer is right (``analysed_source = "first answer token (answer
correct)"``) or empty (``"first answer token (answer empty)"``). A layer that cannot see any
needle entry at that position is left out. ``first_token_layers`` holds the same at the first
answer token whatever the outcome (the signature's outcome-blind population).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch

from needlescope.cases.scoring import prompt_rivals, score_answer
from needlescope.dsa.budget import measurement_chunk, rows_within
from needlescope.dsa.emulate import IndexerCapture, check_unpatched, csa_indexers, emulate, patches_applied
from needlescope.dsa.nonfinite import rank_scores
from needlescope.dsa.passes import prefill
from needlescope.dsa.prompt import covering_entries, needle_token_span, render_prompt
from needlescope.dsa.rankdump import greedy_new_tokens, needle_rank_stats
from needlescope.dsa.reference import visible_entries
from needlescope.investigate.ledger.plan import Config
from needlescope.setting import check_chunk

__all__ = [
    "measure_case",
    "case_record",
    "measure_cases",
    "measuring",
    "final_logits",
    "first_wrong_token",
    "applied",
    "analyse_answer",
    "rank_scores",
    "nonfinite_counts",
]


def first_wrong_token(tokens: Sequence[str], expected: str) -> int | None:
    """Index of the first decoded answer token that breaks the expected text (spaces ignored),
    None when every token fits (the answer is a prefix of, or equal to, ``expected``)."""
    want = "".join(expected.split())
    got = ""
    for i, tok in enumerate(tokens):
        got += "".join(tok.split())
        if not want.startswith(got) and not got.startswith(want):
            return i
        if got.startswith(want) and len(got) > len(want):
            return i
    return None


@contextmanager
def applied(model, config: Config, capture: IndexerCapture | None = None) -> Iterator[list[int]]:
    """Apply ``config`` to ``model`` for the block; yields the CSA layer indices.

    Every patch goes through ``apply_patch_once``: a patch that returns no undo marks the model,
    which is then refused by any later application (BadInput), so a model changed for good is
    never measured again as if it were clean. Load a fresh model for the next configuration
    (``patched_for_good`` says when). Patch files execute once per process (``load_patch``)."""
    check_unpatched(model)
    with emulate(model, config.setting, capture=capture) as layers, patches_applied(model, config.extra):
        yield layers


def _ids(model, tokenizer, messages: list[dict]) -> tuple[list[int], torch.Tensor]:
    prompt = render_prompt(tokenizer, messages)
    ids = torch.tensor([prompt.input_ids], device=next(model.parameters()).device)
    return prompt, ids


def measure_case(
    model, tokenizer, case, config: Config, *, max_new_tokens: int = 8, chunk: int | None = None
) -> dict:
    """One record for ``case`` (a ``cases.assemble.Case``) under ``config``; see the module docstring."""
    return measure_cases(model, tokenizer, [case], config, max_new_tokens=max_new_tokens, chunk=chunk)[0]


def measure_cases(
    model, tokenizer, cases: Sequence, config: Config, *, max_new_tokens: int = 8, chunk: int | None = None
) -> list[dict]:
    """Records for ``cases`` under ``config`` (one application of it; see ``measuring``)."""
    with measuring(model, tokenizer, config, max_new_tokens=max_new_tokens, chunk=chunk) as measure:
        return measure(cases)


@contextmanager
def measuring(
    model, tokenizer, config: Config, *, max_new_tokens: int = 8, chunk: int | None = None
) -> Iterator[Callable[[Sequence], list[dict]]]:
    """Apply ``config`` once and yield ``measure(cases) -> records`` for any number of batches.

    The cases of a call are decoded in batches: every case's prompt must have the same token
    count (V4's compressors would pool padding into entries, so batches are never padded).
    Greedy decoding is per row, so a batch gives the same answers as one case at a time. Each
    batch's prompts are prefilled through the KV cache in chunks (``chunk``, else
    ``dsa.budget.DEFAULT_CHUNK``) and decoded token by token (``dsa.passes.greedy_batch``); a
    batch holds as many cases as ``dsa.budget.rows_within`` lets fit the memory budget
    (``--max-memory``). The capture keeps selections and scores only from the last prompt
    position on (the rows a record reads) and counts non-finite scores as they pass, so what a
    batch keeps does not grow with the prompt's square."""
    chunk = check_chunk(chunk)
    capture = IndexerCapture(keep_scores=True)
    with applied(model, config, capture) as layers, torch.no_grad():
        k = int(csa_indexers(model)[0][1].index_topk)
        ratio = int(csa_indexers(model)[0][1].compress_rate)

        def measure(cases: Sequence) -> list[dict]:
            prompts = [render_prompt(tokenizer, c.messages) for c in cases]
            P = len(prompts[0].input_ids)
            if any(len(p.input_ids) != P for p in prompts):
                raise ValueError("a batch needs prompts of one token length")
            step_chunk = measurement_chunk(chunk, P)
            step = rows_within(model.config, P, step_chunk)
            capture.score_from = capture.topk_from = P - 1  # the first answer position on
            out = []
            for lo in range(0, len(cases), step):
                batch = prompts[lo : lo + step]
                ids = torch.tensor([p.input_ids for p in batch], device=next(model.parameters()).device)
                capture.clear()
                new = greedy_new_tokens(model, tokenizer, ids, max_new_tokens, chunk=step_chunk)
                out += [
                    case_record(case, prompt, new[b].tolist(), tokenizer, capture, layers, b, k, ratio)
                    for b, (case, prompt) in enumerate(zip(cases[lo : lo + step], batch, strict=True))
                ]
            return out

        yield measure


def analyse_answer(
    tokens: Sequence[int], tokenizer, expected: Sequence[str], rivals: Sequence[str] = ()
) -> dict:
    """The answer of generated ``tokens`` (cut at EOS) and the answer token to analyse.
    ``rivals``: values an answer must not name beside the right one (``cases.scoring``).

    Returns {"generated": [int], "answer": str, "correct": bool, "analysed_token": int,
    "analysed_source": str} (module docstring: the first wrong answer token, else the first)."""
    eos = tokenizer.eos_token_id
    generated = []
    for t in tokens:
        if t == eos:
            break
        generated.append(int(t))
    answer = tokenizer.decode(generated, skip_special_tokens=True)
    correct = bool(generated) and score_answer(answer, list(expected), rivals)
    if not generated:
        tok_i, source = 0, "first answer token (answer empty)"
    elif correct:
        tok_i, source = 0, "first answer token (answer correct)"
    else:
        pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in generated]
        wrong = first_wrong_token(pieces, " ".join(expected))
        tok_i, source = (
            (wrong, "first wrong answer token")
            if wrong is not None
            else (0, "first answer token (answer incomplete)")
        )
    return {
        "generated": generated,
        "answer": answer,
        "correct": bool(correct),
        "analysed_token": tok_i,
        "analysed_source": source,
    }


def nonfinite_counts(capture: IndexerCapture, layer: int, b: int) -> dict | None:
    """Non-finite scores of ``layer`` over the visible entries of every query row of batch item
    ``b`` (module docstring, ``nonfinite``; counted by the capture as the scores passed); None
    when every visible score is finite."""
    c = capture.nonfinite.get((layer, b))
    if c is None:
        return None
    return {"neg_inf": c[0], "nan": c[1], "pos_inf": c[2], "first_position": c[3]}


def _layer_ranks(capture, layers, b: int, t: int, entries, k: int, ratio: int) -> list[dict]:
    """The needle's rank in every CSA layer at query position ``t`` (layers seeing no needle entry left out)."""
    recs = []
    for layer in layers:
        score_pos, score_rows = capture.score_rows(layer, b)
        topk_pos, topk_rows = capture.rows(layer, width=k, batch_index=b)
        row = {int(p): i for i, p in enumerate(score_pos.tolist())}[t]
        top = {int(p): i for i, p in enumerate(topk_pos.tolist())}[t]
        visible = visible_entries(t, ratio)
        ne = [e for e in entries if e < visible]
        if not ne:
            continue
        st = needle_rank_stats(rank_scores(score_rows[row][:visible]), visible, ne, k)
        chosen = {int(x) for x in topk_rows[top].tolist() if x >= 0}
        n_sel = sum(1 for e in ne if e in chosen)
        recs.append(
            {
                "layer": layer,
                "query_pos": t,
                "visible": visible,
                "needle_visible": len(ne),
                "needle_selected": n_sel,
                "best_rank": st.best_rank,
                "selected": n_sel > 0,
            }
        )
    return recs


def case_record(
    case, prompt, tokens: list[int], tokenizer, capture, layers, b: int, k: int, ratio: int
) -> dict:
    """The record of ``case`` (module docstring) from its rendered ``prompt``, its generated
    ``tokens`` and ``capture``'s calls (batch row ``b``; CSA ``layers``, ``index_topk`` ``k``)."""
    P = len(prompt.input_ids)
    a = analyse_answer(tokens, tokenizer, case.expected, prompt_rivals(case.messages, case.expected))
    tok_i = a["analysed_token"]
    entries = covering_entries(needle_token_span(prompt, case.needle), ratio=ratio, overlap=True)
    recs = _layer_ranks(capture, layers, b, P - 1 + tok_i, entries, k, ratio)
    first = recs if tok_i == 0 else _layer_ranks(capture, layers, b, P - 1, entries, k, ratio)
    return {
        "case_id": case.case_id,
        "length": case.length,
        "depth": float(case.depth),
        "trial": case.trial,
        "prompt_tokens": P,
        "expected": list(case.expected),
        "answer": a["answer"],
        "correct": a["correct"],
        "analysed_token": tok_i,
        "analysed_source": a["analysed_source"],
        "index_topk": k,
        "compress_ratio": ratio,
        "layers": recs,
        "first_token_layers": first,
        "output_ids": a["generated"],
        "nonfinite": {
            str(layer): c for layer in layers if (c := nonfinite_counts(capture, layer, b)) is not None
        },
    }


@torch.no_grad()
def final_logits(
    model, tokenizer, messages: list[dict], config: Config | None, *, chunk: int | None = None
) -> torch.Tensor:
    """Logits [V] (fp32) at the last prompt position under ``config`` (None: the model as loaded);
    the prompt runs through the KV cache in chunks of ``chunk`` tokens (``dsa.passes``; None:
    ``dsa.budget.DEFAULT_CHUNK``, as the case measurements)."""
    _, ids = _ids(model, tokenizer, messages)
    chunk = measurement_chunk(chunk, ids.shape[1])
    with nullcontext() if config is None else applied(model, config):
        return prefill(model, ids, chunk=chunk, logits_at=[ids.shape[1] - 1]).logits[0, 0].cpu()
