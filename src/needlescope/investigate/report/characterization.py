"""DIAGNOSIS's "What kind of bug" section: ``verdicts.json`` ``characterization`` as blocks,
quoting its catalogue entry (``CATALOGUE``, the table of docs/signatures.md)."""

from __future__ import annotations

__all__ = ["CATALOGUE", "characterization_blocks"]


CATALOGUE = {
    "state_dependent": (
        "state kept across requests or batch-dependent numerics: a cache slot or buffer reused"
        " without reset, prefix-cache reuse of stale entries, batch-variant kernels",
        "the failing case alone and after the case that ran before it: alone it answers right",
    ),
    "outside_selection": (
        "MoE routing, attention, norms or the compressed path itself (vllm-ascend-deepseekv4#76)",
        "top-k >= the sequence length (the 1bit-MONSTER fix); the localizer names the module family",
    ),
    "decode_only": (
        "decode-only and speculative-decoding paths (vllm PR #50455, vllm PR #47238)",
        "the failing ids prefilled, then decoded token by token, against the reference",
    ),
    "length_residue": (
        "chunk, prefix and compressor-boundary arithmetic (mlx-lm PR #1189, vllm-ascend-deepseekv4#76, vllm#55927)",
        "the lengths L+1 .. L+ratio-1 beside L, with more trials",
    ),
    "misaddressed": (
        "index-key cache layout or scale disagreements (ROCm/ATOM PR #1466, vllm#52109, vllm PR #40991, vllm#50576)",
        "the rank dump of a failing case against the reference: the needle's score at the shifted entry",
    ),
    "needle_excluded": (
        "top-k kernels silently dropping candidates (sglang#36807, sglang#35257, vllm PR #52149)",
        "the captured scores replayed through an exact top-k (vllm PR #52149)",
    ),
    "positional_bias": (
        "position-dependent scoring: RoPE or mask offsets that grow with distance",
        "rank dumps at several depths: the needle's rank falls with its distance from the favoured end",
    ),
    "ranking_uninformative": (
        "indexer RoPE convention mismatches (ik_llama.cpp PR #2099, mlx-lm PR #1431), key scales, head weights",
        "the localizer: the first divergent module is the scorer or its inputs",
    ),
    "graded": (
        "reduced-precision or partial scoring bugs whose cost grows with the competing entries;"
        " window bugs (entries past a window scored with stale or scrambled keys)",
        "a longer length and a larger top-k: the loss grows with length and shrinks with top-k",
    ),
}
"""class -> (the public bug classes it points at, the experiment that confirms it); docs/signatures.md."""


def _numbers(e: dict) -> str:
    return ", ".join(
        f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in e.items()
        if k not in ("rule", "null")
    )


def characterization_blocks(v: dict) -> list[tuple]:
    ch = v.get("characterization")
    if not ch:
        return []
    blocks: list[tuple] = [("h", 2, "What kind of bug"), ("p", ch["text"] + ".")]
    first = ch["classes"][0]
    if first in CATALOGUE:
        points, confirm = CATALOGUE[first]
        blocks.append(
            ("p", f"Catalogue (docs/signatures.md), `{first}`: points at {points}; confirmed by {confirm}.")
        )
    if ch["evidence"]:
        rows = [[f"`{c}`", e["rule"], _numbers(e), e["null"]] for c, e in ch["evidence"].items()]
        blocks.append(("table", ["class", "rule", "numbers", "null"], rows))
    if ch.get("undecided"):
        blocks.append(("p", "What would decide it: " + "; ".join(ch["undecided"]) + "."))
    if ch.get("next"):
        blocks.append(
            ("p", f"Next (run it from the ledger's directory; its files are the run's): `{ch['next']}`")
        )
    return blocks
