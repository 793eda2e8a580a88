"""The decode path of the localizer step: the token ids run the way a server runs them.

A server prefills the prompt into its cache and then decodes one token per forward (in SGLang
and vLLM a different kernel, paged MQA logits, from prefill's). A teacher-forced forward over the
same ids never takes that path, so a bug that lives only there is invisible to it.

``decode_path`` runs the analysed ids (prompt + the residual candidate's answer tokens before
the first wrong one) both ways, for the residual candidate and for the reference, with
``dsa.passes`` (chunked prefill into a cache, then ``decode`` token by token) and one
teacher-forced forward, recording every module's output at each decoded position:

* per decode step (``steps``), every module's difference between its decode output and its own
  teacher-forced output at that position, in the order calls return (``err``), beside the
  reference's difference for the same module (``reference_err``, null where it has none); an
  indexer's selection is compared as sets, a scorer over the visible entries;
* per CSA layer at the analysed query: the candidate's decode selection against the reference's
  decode selection (Jaccard overlap) and whether each keeps a needle entry.

Which module departs, and so where the decode path diverges, is decided from ``steps`` in
``decide.localization`` (``decode_departure``), never here: a rule change re-decides a resumed
run. With the first wrong token being the first answer token, nothing is decoded before it:
``steps`` is null and the decode path equals the prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from needlescope.dsa.emulate import IndexerCapture, emulate, patches_applied
from needlescope.dsa.module_replay import rel_err, selection_error
from needlescope.dsa.reference import visible_entries

if TYPE_CHECKING:
    from needlescope.investigate.measure.session import Session

__all__ = ["decode_path", "differences"]

_INDEXER = "DeepseekV4Indexer"
_SCORER = "DeepseekV4IndexerScorer"


@contextmanager
def _outputs(model, keep) -> Iterator[list]:
    """Record ``keep(output)`` of every module call while the block runs: [(name, type, value)]."""
    rows: list = []
    handles = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def hook(m, args, out, name=name):
            t = out[0] if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) else out
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                v = keep(t)
                if v is not None:
                    rows.append((name, type(m).__name__, v))

        handles.append(mod.register_forward_hook(hook))
    try:
        yield rows
    finally:
        for h in handles:
            h.remove()


def _keyed(rows: list) -> dict:
    seen: dict[str, int] = {}
    out = {}
    for name, typ, v in rows:
        seen[name] = seen.get(name, 0) + 1
        out[f"{name}#{seen[name]}"] = (name, typ, v)
    return out


def _difference(typ: str, a: torch.Tensor, b: torch.Tensor, pos: int, ratio: int) -> float | None:
    """Decode output ``a`` [B, 1, ...] vs teacher-forced ``b`` [B, 1, ...] at position ``pos``."""
    if typ == _INDEXER:
        return selection_error(a.reshape(1, -1).cpu(), b.reshape(1, -1).cpu())[0]
    if typ == _SCORER:
        v = int(visible_entries(pos, ratio))
        return rel_err(a[..., :v].float().cpu(), b[..., :v].float().cpu())
    if a.shape != b.shape or not a.is_floating_point():
        return None
    return rel_err(a.float().cpu(), b.float().cpu())


def differences(cand: dict, ref: dict, pos: int, ratio: int) -> list[dict]:
    """Each module's decode-vs-teacher-forced difference at position ``pos``, the candidate's
    (``err``) beside the reference's (``reference_err``), in call order (module docstring);
    modules without a comparable output or without a reference counterpart are left out.

    ``cand`` / ``ref``: key -> ((name, type, decode value), (name, type, prefill value))."""
    out = []
    for key, ((name, typ, dec), (_, _, tf)) in cand.items():
        d = _difference(typ, dec, tf, pos, ratio)
        if d is None or key not in ref:
            continue
        (_, _, rdec), (_, _, rtf) = ref[key]
        r = _difference(typ, rdec, rtf, pos, ratio)
        out.append({"module": name, "type": typ, "err": d, "reference_err": r})
    return out


def _run_both(model, ids: list[int], n_prompt: int, cap: IndexerCapture, chunk: int | None) -> list[dict]:
    """Per decoded position: {key: ((name, type, decode output), (name, type, prefill output))};
    ``cap`` (attached by the caller's ``emulate``) ends holding the decode path's selections. The
    decode path's prompt goes into the cache in ``chunk``-token forwards; the teacher-forced
    side records every module's output over all ids in one forward."""
    from needlescope.dsa import passes

    dev = next(model.parameters()).device
    T = len(ids)
    positions = list(range(n_prompt, T))
    with _outputs(model, lambda t: t[:, n_prompt:T].detach() if t.shape[1] == T else None) as tf_rows:
        passes.prefill(model, torch.tensor([ids], device=dev))
    tf = _keyed(tf_rows)
    cap.clear()
    steps = []
    run = passes.prefill(model, torch.tensor([ids[:n_prompt]], device=dev), chunk=chunk, keep_cache=True)
    for i, p in enumerate(positions):
        with _outputs(model, lambda t: t[:, :1].detach() if t.shape[1] == 1 else None) as rows:
            run = passes.decode(model, torch.tensor([[ids[p]]], device=dev), run.cache)
        dec = _keyed(rows)
        steps.append(
            {
                k: (v, (tf[k][0], tf[k][1], tf[k][2][:, i : i + 1]))
                for k, v in dec.items()
                if k in tf and tf[k][2].shape[1] == len(positions)
            }
        )
    return steps


def decode_path(
    session: Session, twin, cfg, ref_setting, prompt_ids: list[int], answer: list[int], rec: dict
) -> dict:
    """The measured decode path of ``localization.paths`` (module docstring): ``steps`` and
    ``layers``, no decided field (``decide.localization.decode_departure`` adds them)."""
    from needlescope.dsa.emulate import csa_indexers
    from needlescope.dsa.prompt import covering_entries, needle_token_span, render_prompt

    a = rec["analysed_token"]
    ids = prompt_ids + answer[:a]
    P, q = len(prompt_ids), len(ids) - 1
    ratio = int(csa_indexers(session.model)[0][1].compress_rate)
    if a == 0:
        return {"path": "decode", "steps": None, "layers": []}
    ref_cap, cand_cap = IndexerCapture(), IndexerCapture()
    with torch.no_grad(), emulate(session.model, ref_setting, capture=ref_cap):
        ref_steps = _run_both(session.model, ids, P, ref_cap, session.chunk)
    with torch.no_grad(), emulate(twin, cfg.setting, capture=cand_cap), patches_applied(twin, cfg.extra):
        cand_steps = _run_both(twin, ids, P, cand_cap, session.chunk)
    steps = [
        {"position": P + i, "modules": differences(cs, rs, P + i, ratio)}
        for i, (cs, rs) in enumerate(zip(cand_steps, ref_steps))
    ]
    case = next(c for c in session.cases if c.case_id == rec["case_id"])
    entries = covering_entries(
        needle_token_span(render_prompt(session.tokenizer, case.messages), case.needle), ratio
    )
    layers = []
    for layer in ref_cap.layers():
        width = int(ref_setting.index_topk or 2048)
        rp, rr = ref_cap.rows(layer, width)
        cp, cr = cand_cap.rows(layer, width)
        ri, ci = int((rp == q).nonzero()[0]), int((cp == q).nonzero()[0])
        err = selection_error(cr[ci : ci + 1], rr[ri : ri + 1])[0]
        ne = {e for e in entries if e < int(visible_entries(q, ratio))}
        layers.append(
            {
                "layer": layer,
                "topk_overlap": 1.0 - err,
                "needle_visible": len(ne),
                "needle_kept_reference": bool(ne & set(rr[ri].tolist())) if ne else None,
                "needle_kept_candidate": bool(ne & set(cr[ci].tolist())) if ne else None,
            }
        )
    return {"path": "decode", "steps": steps, "layers": layers}
