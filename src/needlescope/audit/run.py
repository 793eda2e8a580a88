"""``audit_checkpoint``: run built-in checks on one probe prompt of a checkpoint."""

from __future__ import annotations

import torch

from needlescope.audit.checks import run_check
from needlescope.setting import Setting

__all__ = ["TOPK_CHECKS", "audit_checkpoint", "audit_model"]

TOPK_CHECKS = ("indexer_scores_bf16", "index_keys_fp8")
"""The checks that compare top-k selections over the query rows that see more than k entries."""


def audit_checkpoint(
    model_name: str,
    checks: list[str],
    candidate: Setting,
    length: int,
    *,
    chunk: int | None = None,
    device: str = "cpu",
    max_memory: str | None = None,
    stream_layers: bool = False,
) -> list[dict]:
    """Results of ``checks`` on a multiturn case of ``length`` tokens (``run_check`` records);
    ``chunk``: the prompt runs through the KV cache in chunks of that many tokens.

    ``device``, ``max_memory``, ``stream_layers``: as ``dsa.checkpoint.load_bundle`` takes them;
    every audit forward runs through ``dsa.passes`` or layer-major, so ``device="auto"`` streams
    the layers when the weights do not fit the budget (``stream_if_needed``)."""
    from needlescope.dsa.checkpoint import load_bundle, resolve_model_dir
    from needlescope.setting import check_chunk

    check_chunk(chunk)
    path = resolve_model_dir(model_name)
    model, tokenizer, _ = load_bundle(
        path, device=device, max_memory=max_memory, stream_layers=stream_layers, stream_if_needed=True
    )
    return audit_model(model, tokenizer, path, checks, candidate, length, chunk=chunk)


def audit_model(
    model, tokenizer, path, checks: list[str], candidate: Setting, length: int, *, chunk: int | None = None
) -> list[dict]:
    """``audit_checkpoint`` on a loaded ``model`` (in memory or streamed) of the checkpoint ``path``."""
    from needlescope.cases.assemble import CaseSpec, build_cases
    from needlescope.dsa.checkpoint import trained_value_digits
    from needlescope.dsa.emulate import emulate
    from needlescope.dsa.prompt import render_prompt

    spec = CaseSpec(
        kind="multiturn",
        lengths=(length,),
        depths=(50.0,),
        trials=1,
        seed=0,
        value_digits=trained_value_digits(path),
    )
    case = build_cases(spec, lambda m: len(render_prompt(tokenizer, m).input_ids))[0]
    ids = torch.tensor([render_prompt(tokenizer, case.messages).input_ids])
    topk = candidate.index_topk or int(model.config.index_topk)
    _check_selects(model, [c for c in checks if c in TOPK_CHECKS], ids.shape[1], topk)

    def apply_candidate(m):
        cm = emulate(m, candidate)
        cm.__enter__()
        return lambda: cm.__exit__(None, None, None)

    ctx = {
        "candidate_topk": topk,
        "reference_records": [],
        "apply_candidate": apply_candidate,
        "chunk": chunk,
    }
    return [run_check(name, model, ids, ctx) for name in checks]


def _check_selects(model, checks: list[str], tokens: int, topk: int) -> None:
    """BadInput when no query row of a ``tokens``-token prompt sees more than ``topk`` entries of
    a CSA layer: the top-k checks would compare no row and report an overlap of 1.0 ("not
    flagged") for nothing measured (``--length 256`` at the default ``topk=64``)."""
    if not checks:
        return
    from needlescope.dsa.emulate import csa_indexers
    from needlescope.dsa.reference import visible_entries
    from needlescope.errors import BadInput

    ratio = int(csa_indexers(model)[0][1].compress_rate)
    seen = visible_entries(tokens - 1, ratio)
    if seen <= topk:
        raise BadInput(
            f"the top-k check(s) {', '.join(checks)} compare the top-{topk} over query rows that see more than {topk} "
            f"compressed entries, and the last row of this {tokens}-token prompt sees {seen} (one "
            f"entry per {ratio} tokens): nothing would be compared; pass --length of at least "
            f"{ratio * (topk + 1)} or a smaller topk in --candidate"
        )
