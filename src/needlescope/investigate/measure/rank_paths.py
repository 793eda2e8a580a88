"""The rank statistics of the failing case on both paths: teacher-forced prefill and a server's decode.

A server prefills the prompt into its cache and then decodes one token per forward; a
teacher-forced forward runs the same token ids in one pass (or in the ledger's prefill chunks).
A bug that lives only in the decode path (a decode kernel reading the key cache wrongly, say)
moves the needle's rank on one path and not on the other, so the rank statistics of the failing
case are measured on both.

``rank_paths`` takes the failing case's record under the candidate (``measure`` record: its
answer tokens and the analysed token, the first wrong one) and runs the token ids that produced
that token (the prompt plus the answer tokens before it) both ways, under the candidate and
under the reference at the candidate's ``index_topk``:

* **prefill**: teacher-forced, the answer tokens run as one more prefill chunk after the
  prompt (``dsa.passes.prefill``; a single answer token: all the ids from scratch);
* **decode**: the prompt prefilled into the cache, then the answer tokens fed one per forward
  (``dsa.passes.decode``), as the server does.

The prompt itself runs once (in the ledger's ``prefill_chunk`` chunks) and both paths continue
from a copy of its cache.

Per CSA layer at the analysed query position: the needle's best rank, its rank percentile
(``signature.rank_percentile``, mid-p: 0 = first, 0.5 = chance), the needle entries selected,
on each path, and the Jaccard overlap of the candidate's selected sets on the two paths.

Per CSA layer, too, whether the candidate's selection on each path is the reference's (same
set). Which path diverges first is decided from these in ``decide.localization``
(``decide_rank_paths``), never here, so a rule change re-decides a resumed run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from needlescope.analysis.stats import jaccard
from needlescope.investigate.decide.signature import rank_percentile
from needlescope.investigate.decide.verdicts import PATHS

if TYPE_CHECKING:
    from needlescope.investigate.measure.session import Session

__all__ = ["failing_rank_paths", "path_selections", "rank_paths"]


def path_selections(
    model,
    config,
    prompt_ids: list[int],
    answer: list[int],
    query: int,
    *,
    chunk: int | None = None,
    tokens: dict[str, int] | None = None,
) -> dict[str, dict[int, tuple]]:
    """path -> CSA layer -> (selected entries, visible scores [v] tensor) of query position
    ``query`` under ``config`` (``measure.Config``), the ids ``prompt_ids + answer`` run
    teacher-forced (``prefill``) and the server's way (``decode``: the prompt into the cache, the
    answer tokens one per forward).

    The prompt is run once into the cache and both paths continue from a copy of it: the decode
    path token by token, the prefill path with the answer tokens as one more prefill chunk
    (equal to one pass: docs/scale.md). One answer token alone would be a one-token call, which
    is what a decode step is, so then the prefill path runs all the ids from scratch.

    ``tokens``, when given, receives path -> the greedy token each path predicts at ``query``:
    whether this rerun reproduces the recorded answer (a failure that depends on what ran before
    the case does not, and its selections here are not a failing run's)."""
    import copy

    import torch

    from needlescope.dsa import passes
    from needlescope.dsa.emulate import IndexerCapture, csa_indexers
    from needlescope.dsa.reference import visible_entries
    from needlescope.investigate.measure.records import applied

    dev = next(model.parameters()).device
    capture = IndexerCapture(keep_scores=True, score_from=query)
    with applied(model, config, capture) as layers, torch.no_grad():
        ratio = int(csa_indexers(model)[0][1].compress_rate)
        k = int(csa_indexers(model)[0][1].index_topk)
        v = int(visible_entries(query, ratio))

        def at_query() -> dict[int, tuple]:
            per = {}
            for layer in layers:
                pos, rows = capture.rows(layer, width=k)
                spos, scores = capture.score_rows(layer)
                i, j = int((pos == query).nonzero()[0]), int((spos == query).nonzero()[0])
                per[layer] = ([int(e) for e in rows[i].tolist() if e >= 0], scores[j][:v])
            return per

        want = (query,) if tokens is not None else ()

        def token(run) -> int | None:
            return None if not want else int(run.logits[0, -1].argmax())

        first = want if not answer else ()  # the query lies in the prompt only without answer tokens
        run = passes.prefill(
            model, torch.tensor([prompt_ids], device=dev), chunk=chunk, keep_cache=True, logits_at=first
        )
        if not answer:  # the analysed query is the prompt's last: both paths are this prefill
            same = at_query()
            if tokens is not None:
                tokens["prefill"] = tokens["decode"] = token(run)
            return {"prefill": same, "decode": same}
        prompt_calls, fork = list(capture.calls), copy.deepcopy(run.cache)
        dec = passes.decode(model, torch.tensor([answer], device=dev), run.cache, logits_at=want)
        out = {"decode": at_query()}
        capture.clear()
        if len(answer) > 1:
            capture.calls.extend(prompt_calls)
            pre = passes.prefill(
                model, torch.tensor([answer], device=dev), chunk=chunk, cache=fork, logits_at=want
            )
        else:
            pre = passes.prefill(
                model, torch.tensor([prompt_ids + answer], device=dev), chunk=chunk, logits_at=want
            )
        out["prefill"] = at_query()
        if tokens is not None:
            tokens.update(decode=token(dec), prefill=token(pre))
    return out


def _stats(selected: list[int], scores, needle: list[int], k: int) -> dict:
    from needlescope.dsa.nonfinite import rank_scores
    from needlescope.dsa.rankdump import needle_rank_stats

    st = needle_rank_stats(rank_scores(scores), len(scores), needle, k)
    return {
        "best_rank": st.best_rank,
        "percentile": rank_percentile(st.best_rank, len(scores), len(needle)),
        "needle_selected": sum(1 for e in needle if e in set(selected)),
    }


def rank_paths(session: Session, config, rec: dict) -> dict:
    """The measured ``rank_paths`` (module docstring; ``decide_rank_paths`` adds the decision) for the measure record
    ``rec`` of the candidate ``config`` (``measure.Config``) on one of ``session.cases``."""
    from needlescope.dsa.prompt import covering_entries, needle_token_span, render_prompt
    from needlescope.dsa.reference import visible_entries
    from needlescope.investigate.ledger.plan import Config

    case = next(c for c in session.cases if c.case_id == rec["case_id"])
    prompt = render_prompt(session.tokenizer, case.messages)
    P, a = len(prompt.input_ids), rec["analysed_token"]
    answer = rec["output_ids"][:a]
    query = P - 1 + a
    k = rec["index_topk"]
    ratio = rec["compress_ratio"]
    ref = Config(session.reference.setting.with_(index_topk=k))
    cand_sel = path_selections(session.model, config, prompt.input_ids, answer, query, chunk=session.chunk)
    ref_sel = path_selections(session.model, ref, prompt.input_ids, answer, query, chunk=session.chunk)
    entries = covering_entries(needle_token_span(prompt, case.needle), ratio=ratio, overlap=True)
    visible = int(visible_entries(query, ratio))
    needle = [e for e in entries if e < visible]
    layers = []
    for layer in cand_sel["prefill"]:
        row = {"layer": layer, "visible": visible, "needle_visible": len(needle)}
        for path in PATHS:
            if needle:
                row[path] = _stats(*cand_sel[path][layer], needle, k)
                row[f"reference_{path}"] = _stats(*ref_sel[path][layer], needle, k)
            else:
                row[path] = row[f"reference_{path}"] = None
            row[f"{path}_same_as_reference"] = set(cand_sel[path][layer][0]) == set(ref_sel[path][layer][0])
        row["paths_overlap"] = jaccard(cand_sel["prefill"][layer][0], cand_sel["decode"][layer][0])
        layers.append(row)
    return {
        "case_id": rec["case_id"],
        "config": config.label(),
        "reference": ref.label(),
        "analysed_token": a,
        "query_pos": query,
        "layers": layers,
    }


def failing_rank_paths(
    session: Session, explained: dict | None, candidate_only: str, cand_records: list[dict]
) -> dict | None:
    """``verdicts.json`` ``rank_paths`` of an in-process run: ``rank_paths`` of the explained case
    under the candidate; None unless that case fails under the candidate only (``explained["why"]
    == candidate_only``: no extra pass otherwise). Resumed from ``state.json``."""
    if session.model is None or not explained or explained["why"] != candidate_only:
        return None
    done = session.state.step_value("rank_paths")
    if done is None:
        rec = next(r for r in cand_records if r["case_id"] == explained["case_id"])
        session.progress("rank paths", 0, 1, rec["case_id"])
        done = rank_paths(session, session.candidate, rec)
        session.state.mark_done("rank_paths", done)
        session.progress("rank paths", 1, 1, rec["case_id"])
    return done
