"""Numerics audit: op-level microtests of a candidate op against the fp32 reference, on
activations captured from the model on a real prompt, plus compounding (the candidate
substituted at every layer, final logits compared).

Each check returns ``{"check", "metrics": [{"metric", "value", "threshold"}], "flagged": bool,
"why": str}``. The thresholds and why they are where they are:

* ``hc_mix_bf16``: relative Frobenius error, max abs error, min cosine and the error in units
  of bf16 rounding (2^-8) of the mixing GEMM over every hyper-connection module; compounding:
  next-token top-1 agreement over all prompt positions and mean KL(ref || cand). **Flagged**
  when top-1 agreement < ``TOP1_MIN`` (0.99: a flip on more than 1% of positions shows in
  greedy answers) or mean KL > ``KL_MAX`` (1e-3 nats).
* ``routed_scale``: the routed-expert scale actually applied, measured as the mean per-token
  sum of the router's output weights (they are normalised to 1 before scaling), against
  ``routed_scaling_factor`` from config.json. **Flagged** when they differ by more than 0.1%
  (the scale is a constant: any deviation is a bug); the reason says 0, missing (1.0), double
  (factor^2) or other.
* ``decode_splitk_bf16``: attention outputs merged in bf16 (``substitutes.attn_out_bf16``);
  op error in bf16 units and compounding as for ``hc_mix_bf16``, same thresholds.
* ``indexer_scores_bf16``: indexer scores accumulated in bf16 against fp32 on the captured
  queries and keys: relative error and top-k set overlap at the candidate's ``index_topk``
  (mean over query rows that see more entries than k). **Flagged** when overlap <
  ``OVERLAP_MIN`` (0.99).
* ``index_keys_fp8``: scores with fp8 e4m3 keys against fp32, and for comparison bf16 keys
  and the Hadamard-rotated fp4 keys the model was trained with: top-k overlap each.
  **Flagged** when fp8's overlap is below fp4's by more than 0.01 (fp8 is then worse than
  the precision the model tolerates by training).
* ``index_topk``: the top-k the reference needs: the largest best-needle rank at the first
  answer position over the reference's measured cases. **Flagged** when the candidate's
  ``index_topk`` is smaller.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from needlescope.audit.compounding import KL_MAX, TOP1_MIN, compounding
from needlescope.audit.substitutes import attn_out_bf16, hc_mix_bf16, hc_modules
from needlescope.dsa.emulate import csa_indexers
from needlescope.dsa.passes import prefill
from needlescope.dsa.quant import get_quantizer, hadamard_128
from needlescope.dsa.reference import lightning_scores, visible_entries

__all__ = ["CHECKS", "TOP1_MIN", "KL_MAX", "OVERLAP_MIN", "BF16_UNIT", "run_check"]

OVERLAP_MIN = 0.99
BF16_UNIT = 2.0**-8


def _m(metric: str, value: float, threshold: float | None = None) -> dict:
    return {"metric": metric, "value": float(value), "threshold": threshold}


def _err(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float, float]:
    """(relative Frobenius error, max abs error, cosine) of the candidate against the reference
    over every (reference, candidate) part together (the parts of a chunked run: one per call)."""
    sq_diff = sq_ref = sq_cand = dot = 0.0
    mx = 0.0
    for ref, cand in pairs:
        ref, cand = ref.double().flatten(), cand.double().flatten()
        sq_diff += float(((cand - ref) ** 2).sum())
        sq_ref, sq_cand, dot = (
            sq_ref + float((ref**2).sum()),
            sq_cand + float((cand**2).sum()),
            dot + float(ref @ cand),
        )
        mx = max(mx, float((cand - ref).abs().max()))
    rel = math.sqrt(sq_diff) / max(math.sqrt(sq_ref), 1e-30)
    return rel, mx, dot / max(math.sqrt(sq_ref) * math.sqrt(sq_cand), 1e-30)


def _forward(model, ids: torch.Tensor, ctx: dict) -> None:
    """The prompt through ``model``: one forward, or ``ctx["chunk"]``-token chunks through the cache."""
    prefill(model, ids, chunk=ctx.get("chunk"))


def _flag_compound(metrics: list[dict]) -> bool:
    top1 = next(m["value"] for m in metrics if m["metric"] == "compounded top-1 agreement")
    kl = next(m["value"] for m in metrics if m["metric"].startswith("compounded mean KL"))
    return top1 < TOP1_MIN or kl > KL_MAX


@contextmanager
def _per_call(modules: list[torch.nn.Module], take, *, after: bool = False):
    """module index -> [take(module, args, kwargs, output)] of every call while the block runs (one
    per chunk), computed in the hook (before the call, output None; or ``after`` it): a streamed
    model's layer weights are on the device only while their layer runs (``dsa.streaming``)."""
    got: dict[int, list] = {i: [] for i in range(len(modules))}

    def hook(i: int):
        if after:
            return lambda mod, args, kw, out: got[i].append(take(mod, args, kw, out))
        return lambda mod, args, kw: got[i].append(take(mod, args, kw, None))

    register = "register_forward_hook" if after else "register_forward_pre_hook"
    handles = [getattr(m, register)(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def _hc_mix_pair(mod, args, kw, out) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixing GEMM of one hyper-connection call in fp32 and with bf16 operands."""
    (streams,) = args
    flat = mod.input_norm(streams.reshape(*streams.shape[:2], -1).float())
    return F.linear(flat, mod.fn.float()), F.linear(flat.bfloat16().float(), mod.fn.bfloat16().float())


def check_hc_mix_bf16(model, ids, ctx) -> dict:
    with _per_call([m for _, m in hc_modules(model)], _hc_mix_pair) as got, torch.no_grad():
        _forward(model, ids, ctx)
    rels, maxs, coss = [], [], []
    for pairs in got.values():
        r, mx, c = _err(pairs)
        rels.append(r), maxs.append(mx), coss.append(c)
    metrics = [
        _m("mixing GEMM max relative Frobenius error", max(rels)),
        _m("mixing GEMM max abs error", max(maxs)),
        _m("mixing GEMM min cosine", min(coss)),
        _m("mixing GEMM error in bf16 units", max(rels) / BF16_UNIT),
        *compounding(model, ids, hc_mix_bf16, ctx.get("chunk")),
    ]
    flagged = _flag_compound(metrics)
    return {
        "metrics": metrics,
        "flagged": flagged,
        "why": "compounded top-1 agreement and KL against 0.99 / 1e-3",
    }


def check_decode_splitk_bf16(model, ids, ctx) -> dict:
    mods = [m for _, m in model.named_modules() if type(m).__name__ == "DeepseekV4Attention"]
    with _per_call(mods, lambda mod, a, kw, out: out[0].detach(), after=True) as outs, torch.no_grad():
        _forward(model, ids, ctx)
    rels = [_err([(o, o.bfloat16().float()) for o in calls])[0] for calls in outs.values()]
    metrics = [
        _m("attention output max relative error (bf16 merge)", max(rels)),
        _m("attention output error in bf16 units", max(rels) / BF16_UNIT),
        *compounding(model, ids, attn_out_bf16, ctx.get("chunk")),
    ]
    return {
        "metrics": metrics,
        "flagged": _flag_compound(metrics),
        "why": "compounded top-1 agreement and KL against 0.99 / 1e-3",
    }


def check_routed_scale(model, ids, ctx) -> dict:
    expected = float(model.config.routed_scaling_factor)
    gates = [
        m
        for _, m in model.named_modules()
        if type(m).__name__ in ("DeepseekV4TopKRouter", "DeepseekV4HashRouter")
    ]
    weight_sums = _per_call(gates, lambda mod, a, kw, out: out[1].detach().float().sum(-1), after=True)
    undo = ctx["apply_candidate"](model)
    try:
        with weight_sums as sums, torch.no_grad():
            _forward(model, ids, ctx)
    finally:
        undo()
    # gate by gate, call by call: the same order whether the model runs token- or layer-major
    eff = float(torch.cat([s for calls in sums.values() for s in calls]).mean())
    rel = abs(eff / expected - 1.0)
    kind = "as configured"
    if not rel <= 1e-3:  # NaN included: not "as configured"
        if abs(eff) < 1e-6:
            kind = "zero"
        elif abs(eff - 1.0) < 1e-3 * expected:
            kind = "missing (1.0)"
        elif abs(eff / expected**2 - 1.0) < 1e-3:
            kind = "applied twice (factor^2)"
        else:
            kind = "other"
    metrics = [
        _m("routed_scaling_factor in config", expected),
        _m("effective routed scale (mean sum of routed weights)", eff),
        _m("relative deviation", rel, 1e-3),
    ]
    return {
        "metrics": metrics,
        "flagged": not rel <= 1e-3,
        "why": f"effective scale {eff:.4g} vs {expected:.4g}: {kind}",
    }


def _scorer_inputs(scorer, args, kw, out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(queries, keys, per-head weights ``weights_proj(hidden)``) of one scorer call, fp32."""
    names = ("q", "compressed_kv", "hidden_states")
    q, kv, hs = (list(args) + [kw.get(k) for k in names][len(args) :])[:3]
    return q.float(), kv.float(), scorer.weights_proj(hs).float()


def _indexer_inputs(model, ids, ctx) -> list[tuple[torch.nn.Module, int, list[tuple]]]:
    """Per CSA layer: (scorer, compress ratio, [(start, q, keys, head weights)] per call), ``start``
    the absolute position of the call's first query row (one call, or one per chunk: a call's keys
    are the entries emitted so far, all its rows can see)."""
    idx = [m for _, m in csa_indexers(model)]
    with _per_call([m.scorer for m in idx], _scorer_inputs) as got, torch.no_grad():
        _forward(model, ids, ctx)
    out = []
    for i, m in enumerate(idx):
        calls, start = [], 0
        for q, kv, w in got[i]:
            calls.append((start, q, kv, w))
            start += q.shape[1]
        out.append((m.scorer, int(m.compress_rate), calls))
    return out


def _scores(scorer, q, k, w, acc=torch.float32) -> torch.Tensor:
    """Scores [B, S, L] of queries ``q`` against keys ``k`` with head weights ``w`` [B, S, heads]
    (``scorer``'s scales only: its weights may be gone, on a streamed model)."""
    return lightning_scores(
        q, k, w, scale=scorer.softmax_scale, weight_scale=scorer.weights_scaling, acc_dtype=acc
    ).float()


def _overlaps(ref: torch.Tensor, cand: torch.Tensor, k: int, ratio: int, start: int) -> list[float]:
    """Top-k set overlap of every query row (absolute positions ``start``...) that sees more than
    k entries (causal visibility)."""
    S, L = ref.shape[-2:]
    fracs = []
    for t in range(S):
        v = min(visible_entries(start + t, ratio), L)
        if v <= k:
            continue
        a = set(ref[0, t, :v].topk(k).indices.tolist())
        b = set(cand[0, t, :v].topk(k).indices.tolist())
        fracs.append(len(a & b) / k)
    return fracs


def _visible(scores: torch.Tensor, ratio: int, start: int) -> torch.Tensor:
    """Mask [B, S, L] of the entries query row ``start + t`` can see (causal visibility)."""
    S, L = scores.shape[-2:]
    vis = torch.tensor([visible_entries(start + t, ratio) for t in range(S)], device=scores.device)
    return (torch.arange(L, device=scores.device).view(1, -1) < vis.view(-1, 1)).expand_as(scores)


def _mean(fracs: list[float]) -> float:
    return sum(fracs) / len(fracs) if fracs else 1.0


def check_indexer_scores_bf16(model, ids, ctx) -> dict:
    k = ctx["candidate_topk"]
    rels, overlaps = [], []
    with torch.no_grad():
        for scorer, ratio, calls in _indexer_inputs(model, ids, ctx):
            pairs = [
                (_scores(scorer, q, kv, w), _scores(scorer, q, kv, w, torch.bfloat16))
                for _, q, kv, w in calls
            ]
            # the error over the entries each query row can see (a one-pass call also scores the
            # future entries, which no row uses and a chunked call never computes)
            seen = [_visible(r, ratio, st) for (st, *_), (r, _) in zip(calls, pairs)]
            rels.append(_err([(r[m], c[m]) for m, (r, c) in zip(seen, pairs)])[0])
            overlaps.append(
                _mean([f for (st, *_), (r, c) in zip(calls, pairs) for f in _overlaps(r, c, k, ratio, st)])
            )
    metrics = [
        _m("score max relative error", max(rels)),
        _m("score error in bf16 units", max(rels) / BF16_UNIT),
        _m(f"top-{k} set overlap (min over CSA layers)", min(overlaps), OVERLAP_MIN),
    ]
    return {
        "metrics": metrics,
        "flagged": min(overlaps) < OVERLAP_MIN,
        "why": f"top-{k} overlap against {OVERLAP_MIN}",
    }


def check_index_keys_fp8(model, ids, ctx) -> dict:
    k = ctx["candidate_topk"]
    res: dict[str, list[float]] = {"fp8_e4m3": [], "bf16": [], "fp4_e2m1": []}
    with torch.no_grad():
        for scorer, ratio, calls in _indexer_inputs(model, ids, ctx):
            fracs: dict[str, list[float]] = {name: [] for name in res}
            for start, q, kv, w in calls:
                ref = _scores(scorer, q, kv, w)
                for name in res:
                    if name == "fp4_e2m1":  # trained numerics: rotate, then quantise both sides
                        qq, kk = get_quantizer(name)(hadamard_128(q)), get_quantizer(name)(hadamard_128(kv))
                    else:
                        qq, kk = q, get_quantizer(name)(kv)
                    fracs[name] += _overlaps(ref, _scores(scorer, qq, kk, w), k, ratio, start)
            for name in res:
                res[name].append(_mean(fracs[name]))
    worst = {name: min(v) for name, v in res.items()}
    metrics = [_m(f"top-{k} overlap with fp32, {name} keys", v) for name, v in worst.items()]
    margin = worst["fp4_e2m1"] - worst["fp8_e4m3"]
    metrics.append(_m("fp4 (trained) overlap minus fp8 overlap", margin, 0.01))
    return {
        "metrics": metrics,
        "flagged": margin > 0.01,
        "why": f"fp8 keys keep {worst['fp8_e4m3']:.3f} of the fp32 top-{k}, the trained fp4 keys {worst['fp4_e2m1']:.3f}",
    }


def check_index_topk(model, ids, ctx) -> dict:
    ranks = [
        layer["best_rank"]
        for r in ctx["reference_records"]
        if r["analysed_token"] == 0
        for layer in r["layers"]
    ]
    k = ctx["candidate_topk"]
    if not ranks:
        return {"metrics": [], "flagged": False, "why": "no reference ranks measured"}
    needed = max(ranks)
    metrics = [
        _m("largest best-needle rank under the reference (first answer token)", needed),
        _m("candidate index_topk", k, float(needed)),
    ]
    return {
        "metrics": metrics,
        "flagged": k < needed,
        "why": f"the reference needs top-{needed}; the candidate keeps top-{k}",
    }


CHECKS = {
    "hc_mix_bf16": check_hc_mix_bf16,
    "routed_scale": check_routed_scale,
    "decode_splitk_bf16": check_decode_splitk_bf16,
    "indexer_scores_bf16": check_indexer_scores_bf16,
    "index_keys_fp8": check_index_keys_fp8,
    "index_topk": check_index_topk,
}


def run_check(name: str, model, ids: torch.Tensor, ctx: dict) -> dict:
    """Run built-in check ``name`` on prompt ``ids`` [1, S]; ``ctx`` gives ``candidate_topk``,
    ``reference_records``, ``apply_candidate(model) -> undo`` and optionally ``chunk`` (the prompt
    through the KV cache in chunks of that many tokens: activations captured per call, the
    compounding run chunk by chunk; the metrics are the one-pass ones up to float rounding)."""
    with torch.no_grad():
        out = CHECKS[name](model, ids, ctx)
    bad = [m["metric"] for m in out["metrics"] if not math.isfinite(m["value"])]
    if bad:  # the reason says so: a threshold compared with NaN reads as passed
        out["flagged"] = True
        out["why"] += f"; not finite: {', '.join(bad)} (NaN or inf in the model's activations or logits)"
    return {"check": name, **out}
