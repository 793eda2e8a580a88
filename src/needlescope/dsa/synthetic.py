"""Synthetic mode: does a precision keep a planted needle in the indexer's top-k? No model needed.

One trial draws, at the real indexer dimensions (default 64 heads x 128):

* queries ``q`` [T, H, D] ~ N(0, 1) and signed head weights ``w`` [T, H] ~ N(0, 1);
* ``L`` distractor keys [L, D] ~ N(0, 1), generated and scored in chunks of ``chunk``
  entries so memory stays O(chunk * T * H) whatever L (256K entries fit on CPU);
* one needle entry at a random index ``n``, key ``alpha * u`` with
  ``u = normalize(sum_{t,h} max(w[t,h], 0) * q[t,h])`` (a direction every query row scores
  positively). The lightning score is positively homogeneous in the key
  (``ReLU(q . alpha k) = alpha ReLU(q . k)``), so ``alpha`` sets the needle's reference fp32
  score exactly: ``alpha = max_t (r_t + m_t) / I_t(u)``, where ``r_t`` is row t's reference
  point (below) and ``m_t`` the requested margin. Every row's margin is then >= ``m_t``,
  with equality in the row that binds (with T = 1, exactly ``m_t``). A negative target
  score uses the direction of the negatively weighted heads instead (``I_t(u) < 0``,
  ``alpha = min_t``); targets of mixed sign across rows are refused (``BadInput``).

The score is ``I(t, s) = sum_h H**-0.5 * w[t,h] * D**-0.5 * ReLU(q[t,h] . k[s])``
(``reference.lightning_scores`` with transformers' constants). Margins are given either in
reference score units (``margin_unit="abs"``) or as a fraction of each row's distractor
score spread (``"spread"``: ``m_t = margin * (max_s - min_s of row t's distractor scores)``),
measured against the best distractor (``margin_ref="best"``, the needle is the top entry
by ``margin``) or against the k-th best (``"kth"``: the needle sits ``margin`` above the
cutoff, so small margins probe the selection boundary). A negative margin plants the needle
below its reference point.

For each precision triple (``index_k``, ``index_q``, ``score_dtype``, names of
``setting.PRECISIONS`` and ``setting.SCORE_DTYPES``) the same trial is re-scored with
fake-quantised keys and queries (Hadamard-rotated first whenever a side is fp4, as
``Setting.rotates`` says) and the needle's rank is counted pessimistically: 1 + the number
of distractors scoring >= the needle. It is kept when rank <= k. Trials are seeded
(from ``seed``, the trial number and L), so a grid is reproducible for one device and chunk size.

``synthetic.json`` schema (``SYNTHETIC_SCHEMA``; keys beyond these may be added)::

    {"config": {"entries": [int], "heads": int, "dim": int, "queries": int, "topk": int,
                "margins": [float], "margin_unit": "abs" | "spread", "margin_ref": "best" | "kth",
                "trials": int, "seed": int, "chunk": int, "device": str,
                "precisions": [{"index_k": str, "index_q": str, "score_dtype": str}]},
     "results": [{"entries": int, "margin": float, "index_k": str, "index_q": str, "score_dtype": str,
                  "rows": int, "kept": int, "kept_rate": float, "kept_ci95": [float, float],
                  "mean_rank": float, "median_rank": float, "worst_rank": int,
                  "mean_margin_abs": float}],
     "elapsed_s": float}
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from needlescope.analysis.stats import wilson_interval
from needlescope.devices import check_device
from needlescope.dsa.emulate import ACC_DTYPES, scoring_function
from needlescope.dsa.quant import get_quantizer, hadamard_128
from needlescope.dsa.reference import lightning_scores
from needlescope.errors import BadInput
from needlescope.schema import check_schema
from needlescope.setting import Setting

__all__ = [
    "validate_synthetic",
    "Precision",
    "SyntheticConfig",
    "SYNTHETIC_SCHEMA",
    "parse_precisions",
    "make_trial",
    "needle_rank",
    "run_synthetic",
    "render_synthetic_md",
]

MAX_ENTRIES = 1 << 18  # 256K compressed entries = 1M tokens at ratio 4

SYNTHETIC_SCHEMA: dict = {
    "type": "object",
    "required": ["config", "results"],
    "properties": {
        "config": {"type": "object"},
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "entries",
                    "margin",
                    "index_k",
                    "index_q",
                    "score_dtype",
                    "rows",
                    "kept",
                    "kept_rate",
                ],
            },
        },
    },
}


# A precision is an indexer ``Setting`` whose ``index_topk`` synthetic mode sets itself.
Precision = Setting


def parse_precisions(text: str) -> tuple[Precision, ...]:
    """``"fp32,bf16,fp8_e4m3:bf16:fp32"`` -> Precisions. A bare name applies to keys and queries
    with fp32 scores; ``K:Q`` or ``K:Q:ACC`` spell each part."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) == 1:
            out.append(Precision(parts[0], parts[0]))
        elif len(parts) in (2, 3):
            out.append(Precision(*parts))
        else:
            raise BadInput(f"precision {item!r} must be NAME, K:Q or K:Q:ACC (e.g. fp8_e4m3:bf16:fp32)")
    if not out:
        raise BadInput("no precisions given; pass e.g. --precisions fp32,bf16,fp8_e4m3,fp4_e2m1")
    return tuple(out)


@dataclass(frozen=True)
class SyntheticConfig:
    """A synthetic grid: entries x margins x precisions, ``trials`` seeded trials each."""

    entries: tuple[int, ...] = (4096, 65536)
    heads: int = 64
    dim: int = 128
    queries: int = 1
    topk: int = 512
    margins: tuple[float, ...] = (0.0, 0.01, 0.05)
    margin_unit: str = "spread"
    margin_ref: str = "best"
    trials: int = 20
    precisions: tuple[Precision, ...] = field(
        default_factory=lambda: parse_precisions("fp32,bf16,fp8_e4m3,fp4_e2m1")
    )
    seed: int = 0
    chunk: int = 16384
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.entries:
            raise BadInput("no entry counts given; pass e.g. --entries 4096,65536")
        for n in self.entries:
            if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_ENTRIES:
                raise BadInput(f"entries must be integers in 2..{MAX_ENTRIES}, got {n!r}")
        for name in ("heads", "dim", "queries", "trials", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BadInput(f"{name} must be a positive integer, got {v!r}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise BadInput(f"topk must be a positive integer, got {self.topk!r}")
        if min(self.entries) <= self.topk:
            raise BadInput(
                f"every entry count must exceed topk={self.topk} (otherwise every entry is selected); "
                f"got entries {list(self.entries)}"
            )
        if not self.margins or any(not math.isfinite(float(m)) for m in self.margins):
            raise BadInput(f"margins must be finite numbers, got {list(self.margins)}")
        if self.margin_unit not in ("abs", "spread"):
            raise BadInput(f"margin_unit must be 'abs' or 'spread', got {self.margin_unit!r}")
        if self.margin_ref not in ("best", "kth"):
            raise BadInput(f"margin_ref must be 'best' or 'kth', got {self.margin_ref!r}")
        if not self.precisions:
            raise BadInput("no precisions given")
        if any(p.rotates for p in self.precisions) and self.dim != 128:
            raise BadInput(
                f"fp4_e2m1 rotates with a 128-point Hadamard transform; dim must be 128, got {self.dim}"
            )
        check_device(self.device)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["entries"], d["margins"] = list(self.entries), list(self.margins)
        d["precisions"] = [
            {"index_k": p.index_k, "index_q": p.index_q, "score_dtype": p.score_dtype}
            for p in self.precisions
        ]
        return d


@dataclass
class Trial:
    """One planted-needle instance; keys are regenerated chunk by chunk from ``seed``."""

    q: torch.Tensor  # [T, H, D] fp32
    w: torch.Tensor  # [T, H] fp32
    needle_key: torch.Tensor  # [D] fp32
    needle_index: int
    entries: int
    seed: int
    chunk: int
    margin_abs: torch.Tensor  # [T] fp32, the planted margin of each row vs its reference point

    def key_chunks(self):
        """Yield (start, keys [c, D] fp32) over the L entries, needle included at its index."""
        for start, k in _distractor_chunks(
            self.seed, self.entries, self.chunk, self.q.shape[-1], self.q.device
        ):
            if start <= self.needle_index < start + k.shape[0]:
                k[self.needle_index - start] = self.needle_key
            yield start, k


def _distractor_chunks(seed: int, entries: int, chunk: int, dim: int, device: torch.device):
    """Yield (start, keys [c, D] ~ N(0, 1) fp32) for entries 0..L-1, ``chunk`` at a time, from ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 1)
    for start in range(0, entries, chunk):
        n = min(chunk, entries - start)
        yield start, torch.randn(n, dim, generator=gen, device=device)  # [c, D]


def _scale(H: int, D: int) -> tuple[float, float]:
    return D**-0.5, H**-0.5


def _scores(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, acc: torch.dtype, fn=lightning_scores
) -> torch.Tensor:
    """q [T, H, D], k [c, D], w [T, H] -> fp32 scores [T, c] (``fn``: lightning_scores or a kernel backend)."""
    H, D = q.shape[-2], q.shape[-1]
    scale, wscale = _scale(H, D)
    return fn(q, k, w, scale=scale, weight_scale=wscale, acc_dtype=acc).float()


def _row_stats(trial_q, trial_w, chunks, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row over distractor chunks: (best [T], k-th best [T], min [T]) reference scores."""
    T = trial_q.shape[0]
    top = torch.full((T, 0), float("-inf"), device=trial_q.device)
    lo = torch.full((T,), float("inf"), device=trial_q.device)
    for _, kc in chunks:
        s = _scores(trial_q, kc, trial_w, torch.float32)  # [T, c]
        top = torch.cat([top, s], dim=1).topk(min(k, top.shape[1] + s.shape[1]), dim=1).values
        lo = torch.minimum(lo, s.min(dim=1).values)
    return top[:, 0], top[:, -1], lo


def make_trial(cfg: SyntheticConfig, entries: int, margin: float, trial: int) -> Trial:
    """Draw trial ``trial`` of ``entries`` keys and plant the needle at ``margin`` (see module docstring)."""
    dev = torch.device(cfg.device)
    seed = cfg.seed * 7919 + trial * 104_729 + entries
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(cfg.queries, cfg.heads, cfg.dim, generator=gen, device=dev)  # [T, H, D]
    w = torch.randn(cfg.queries, cfg.heads, generator=gen, device=dev)  # [T, H]
    needle_index = int(torch.randint(0, entries, (1,), generator=gen, device=dev))
    u = (w.clamp_min(0).unsqueeze(-1) * q).sum(dim=(0, 1))  # [D]
    u = u / u.norm().clamp_min(1e-12)
    # Distractor statistics: every key but the needle's slot.
    distractors = (
        (s, torch.cat([kc[: needle_index - s], kc[needle_index - s + 1 :]]))
        if s <= needle_index < s + kc.shape[0]
        else (s, kc)
        for s, kc in _distractor_chunks(seed, entries, cfg.chunk, cfg.dim, dev)
    )
    best, kth, lo = _row_stats(q, w, distractors, cfg.topk)
    ref_point = best if cfg.margin_ref == "best" else kth
    m = margin * (best - lo) if cfg.margin_unit == "spread" else torch.full_like(best, margin)  # [T]
    target = ref_point + m  # [T] the needle's reference score, per row
    if bool((target >= 0).all()):
        unit = _scores(q, u.view(1, -1), w, torch.float32)[:, 0]  # [T] > 0 expected
        if bool((unit <= 0).any()):
            raise BadInput("a query row scores the needle direction <= 0; use fewer --queries per trial")
        alpha = float((target / unit).max())
    elif bool((target < 0).all()):
        # Below zero: plant along the negatively weighted heads' direction (scores < 0).
        u = (w.clamp_max(0).neg().unsqueeze(-1) * q).sum(dim=(0, 1))
        u = u / u.norm().clamp_min(1e-12)
        unit = _scores(q, u.view(1, -1), w, torch.float32)[:, 0]  # [T] < 0 expected
        if bool((unit >= 0).any()):
            raise BadInput("no key direction gives every query row a negative score; use fewer --queries")
        alpha = float((target / unit).min())
    else:
        raise BadInput(
            f"margin {margin} asks for a positive needle score in some query rows and a negative one in "
            "others; use --queries 1 or a margin that keeps the sign"
        )
    unit = _scores(q, u.view(1, -1), w, torch.float32)[:, 0]
    needle = alpha * u
    return Trial(q, w, needle, needle_index, entries, seed, cfg.chunk, alpha * unit - ref_point)


def needle_rank(trial: Trial, precision: Precision) -> torch.Tensor:
    """Pessimistic 1-based rank [T] of the needle under ``precision``: 1 + distractors scoring >= it."""
    qz, kz = get_quantizer(precision.index_q), get_quantizer(precision.index_k)
    acc = ACC_DTYPES[precision.score_dtype]
    q = trial.q
    if precision.rotates:
        q = hadamard_128(q)
    q = qz(q)  # [T, H, D]

    def keys(k: torch.Tensor) -> torch.Tensor:
        return kz(hadamard_128(k) if precision.rotates else k)

    fn = scoring_function(precision.index_k, precision.index_q)  # the kernels under scores_backend
    needle_score = _scores(q, keys(trial.needle_key.view(1, -1)), trial.w, acc, fn)[:, 0]  # [T]
    above = torch.zeros_like(needle_score, dtype=torch.long)
    for start, kc in trial.key_chunks():
        s = _scores(q, keys(kc), trial.w, acc, fn)  # [T, c]
        ge = s >= needle_score.view(-1, 1)
        if start <= trial.needle_index < start + kc.shape[0]:
            ge[:, trial.needle_index - start] = False
        above += ge.sum(dim=1)
    return above + 1


def run_synthetic(cfg: SyntheticConfig) -> dict:
    """The ``synthetic.json`` object for ``cfg`` (module docstring)."""
    t0 = time.perf_counter()
    acc: dict[tuple, list[torch.Tensor]] = {}
    margins_seen: dict[tuple, list[torch.Tensor]] = {}
    with torch.no_grad():
        for entries in cfg.entries:
            for margin in cfg.margins:
                for trial in range(cfg.trials):
                    tr = make_trial(cfg, entries, float(margin), trial)
                    margins_seen.setdefault((entries, margin), []).append(tr.margin_abs.cpu())
                    for p in cfg.precisions:
                        acc.setdefault((entries, margin, p), []).append(needle_rank(tr, p).cpu())
    results = []
    for (entries, margin, p), ranks in acc.items():
        r = torch.cat(ranks).double()
        kept = int((r <= cfg.topk).sum())
        lo, hi = wilson_interval(kept, r.numel())
        results.append(
            {
                "entries": entries,
                "margin": float(margin),
                "index_k": p.index_k,
                "index_q": p.index_q,
                "score_dtype": p.score_dtype,
                "rows": int(r.numel()),
                "kept": kept,
                "kept_rate": kept / r.numel(),
                "kept_ci95": [lo, hi],
                "mean_rank": float(r.mean()),
                "median_rank": float(r.median()),
                "worst_rank": int(r.max()),
                "mean_margin_abs": float(torch.cat(margins_seen[(entries, margin)]).double().mean()),
            }
        )
    return {"config": cfg.to_dict(), "results": results, "elapsed_s": time.perf_counter() - t0}


def render_synthetic_md(obj: dict) -> str:
    """Markdown: one table per entry count, rows = margins, columns = precisions (kept rate)."""
    cfg = obj["config"]
    labels: list[str] = []
    for p in cfg["precisions"]:
        lab = f"k={p['index_k']} q={p['index_q']} acc={p['score_dtype']}"
        if lab not in labels:
            labels.append(lab)
    lines = [
        "# Synthetic indexer top-k survival",
        "",
        f"{cfg['heads']} heads x {cfg['dim']} dims, {cfg['queries']} query row(s) per trial, top-{cfg['topk']}, "
        f"{cfg['trials']} trials per cell, seed {cfg['seed']}, device `{cfg['device']}`. Margin unit "
        f"`{cfg['margin_unit']}` over the {'best' if cfg['margin_ref'] == 'best' else 'k-th best'} distractor. "
        "Cells: fraction of query rows whose needle stays in the top-k (mean rank).",
        "",
    ]
    by = {
        (r["entries"], r["margin"], f"k={r['index_k']} q={r['index_q']} acc={r['score_dtype']}"): r
        for r in obj["results"]
    }
    for entries in cfg["entries"]:
        lines += [f"## {entries} entries", "", "| margin | " + " | ".join(labels) + " |"]
        lines.append("|---" * (len(labels) + 1) + "|")
        for m in cfg["margins"]:
            cells = []
            for lab in labels:
                r = by.get((entries, float(m), lab))
                cells.append("-" if r is None else f"{r['kept_rate']:.2f} ({r['mean_rank']:.0f})")
            lines.append(f"| {m:g} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"Elapsed {obj.get('elapsed_s', 0):.2f} s.")
    return "\n".join(lines) + "\n"


def validate_synthetic(obj: dict) -> None:
    """Raise ValueError unless ``obj`` follows SYNTHETIC_SCHEMA."""
    check_schema(obj, SYNTHETIC_SCHEMA, "synthetic")
