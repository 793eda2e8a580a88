"""``probe --bisect``: find the token length where recall collapses, with few requests.

Steps (the plan is in :mod:`needlescope.analysis.bisect`): a coarse grid over the --lengths range,
binary search of the first bracket to ``resolution`` tokens, fine offsets around the boundary and
around multiples of the kernel boundaries, and residue-class runs for small moduli. Every case
goes through the same durable store as a probe, so a killed bisection resumes: it replays the
same decisions from the stored results and sends only what is missing.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from needlescope.analysis.bisect import (
    RESIDUE_MAX_MOD,
    boundaries_from_server_info,
    bracket,
    cases_for_ci_width,
    coarse_grid,
    fine_lengths,
    full_grid_points,
    midpoint,
    residue_lengths,
    residue_test,
)
from needlescope.analysis.stats import wilson_interval
from needlescope.cases import CaseSpec, build_cases, score_answer
from needlescope.errors import BadInput
from needlescope.report.bisect import write_bisect_outputs
from needlescope.run.config import ProbeConfig
from needlescope.run.probe import STORE_NAME, _token_counter, chat_target, check_out, fit_to_target
from needlescope.run.scheduler import run_cases
from needlescope.run.store import ResultStore
from needlescope.targets import collect_provenance, normalize_base_url, preflight
from needlescope.targets.limits import choose_value_digits, read_limits

__all__ = ["BisectConfig", "run_bisect"]

Event = Callable[[str, dict], None]


@dataclass(frozen=True, kw_only=True)
class BisectConfig:
    """How finely to search; the length range, depths, kind and trials come from the ProbeConfig."""

    resolution: int = 16
    """Binary search stops when the bracket is this many tokens wide or less."""
    ci_width: float | None = None
    """When set, trials per length are raised so recall near the threshold has a 95% interval
    about this wide; otherwise --trials are used."""
    coarse_points: int = 5
    boundaries: tuple[int, ...] | None = None
    """Kernel-relevant lengths (page size, window, ratio, ratio x index_topk); None reads them
    from the server's /get_server_info."""
    residue_runs: int = 3
    """Runs of consecutive lengths per residue modulus."""

    def __post_init__(self) -> None:
        if self.resolution < 1:
            raise BadInput(f"--resolution must be at least 1 token; got {self.resolution}")
        if self.ci_width is not None and not 0 < self.ci_width < 1:
            raise BadInput(f"--ci-width must lie in (0, 1); got {self.ci_width}")
        if self.coarse_points < 2:
            raise BadInput(f"--coarse-points must be at least 2; got {self.coarse_points}")
        if self.boundaries is not None and any(b < 1 for b in self.boundaries):
            raise BadInput(f"--boundaries must be positive token counts; got {list(self.boundaries)}")


class _Bisector:
    def __init__(self, cfg: ProbeConfig, bis: BisectConfig, store: ResultStore, target, counter, on_event):
        self.cfg, self.bis, self.store, self.target = cfg, bis, store, target
        self.counter, self.on_event = counter, on_event
        self.trials = cfg.trials
        if bis.ci_width is not None:
            self.trials = max(
                cfg.trials, math.ceil(cases_for_ci_width(bis.ci_width, cfg.threshold) / len(cfg.depths))
            )
        self.phase: dict[int, str] = {}
        self.haystack = cfg.haystack_file.read_text(encoding="utf-8") if cfg.haystack_file else None

    @property
    def per_point(self) -> int:
        return self.trials * len(self.cfg.depths)

    async def evaluate(self, lengths: list[int], phase: str) -> dict[int, tuple[int, int]]:
        new = [n for n in lengths if n not in self.phase]
        for n in new:
            self.phase[n] = phase
        known = {c["case_id"] for c in self.store.cases()}
        for n in new:
            spec = CaseSpec(
                kind=self.cfg.kind,
                lengths=(n,),
                depths=self.cfg.depths,
                trials=self.trials,
                seed=self.cfg.seed,
                haystack_text=self.haystack,
                max_answer_tokens=self.cfg.max_tokens,
                value_digits=self.cfg.value_digits,
                n_distractors=self.cfg.distractors,
            )
            cases = [c.to_dict() for c in build_cases(spec, self.counter)]
            self.store.add_cases([c for c in cases if c["case_id"] not in known])
        pending = set(self.store.pending_case_ids())
        todo = [c for c in self.store.cases() if c["case_id"] in pending and c["length"] in self.phase]
        self.on_event("bisect_step", {"phase": phase, "lengths": new, "requests": len(todo)})
        await run_cases(
            todo,
            self.target,
            self.store,
            concurrency=self.cfg.concurrency,
            max_tokens=self.cfg.max_tokens,
            extra_body=self.cfg.extra_body,
            score=score_answer,
            on_result=lambda row: self.on_event("result", row),
        )
        return self.tally()

    def tally(self) -> dict[int, tuple[int, int]]:
        length_of = {c["case_id"]: c["length"] for c in self.store.cases()}
        acc: dict[int, list[int]] = {}
        for r in self.store.results():
            if r["status"] != "ok":
                continue
            a = acc.setdefault(length_of[r["case_id"]], [0, 0])
            a[0] += int(bool(r["correct"]))
            a[1] += 1
        return {n: (v[0], v[1]) for n, v in sorted(acc.items())}


async def _search(b: _Bisector, lo: int, hi: int, boundaries: list[int]) -> dict:
    threshold = b.cfg.threshold
    tally = await b.evaluate(coarse_grid(lo, hi, b.bis.coarse_points), "coarse")
    found = bracket(tally, threshold)
    message = ""
    if found is None:
        k, n = tally.get(lo, (0, 0))
        if n and k / n < threshold:
            message = (
                f"cannot bracket a boundary in [{lo}, {hi}]: recall is already {k / n:.2f} < {threshold:g} "
                f"at {lo} tokens; lower the shortest --lengths"
            )
        else:
            message = (
                f"cannot bracket a boundary in [{lo}, {hi}]: recall stays at or above {threshold:g} at every "
                "tested length; raise the longest --lengths"
            )
    else:
        last_pass, first_fail = found
        while (mid := midpoint(last_pass, first_fail, b.bis.resolution)) is not None:
            tally = await b.evaluate([mid], "bisect")
            k, n = tally.get(mid, (0, 0))
            if n == 0:
                raise BadInput(
                    f"every request at {mid} tokens failed; the server cannot be bisected, see results"
                )
            if k / n >= threshold:
                last_pass = mid
            else:
                first_fail = mid
        found = (last_pass, first_fail)
        tally = await b.evaluate(fine_lengths(first_fail, boundaries, lo, hi), "fine")
        message = (
            f"recall falls below {threshold:g} between {last_pass} and {first_fail} tokens "
            f"(resolution {b.bis.resolution})"
        )
    residues = []
    top = found[0] if found else hi
    for m in (m for m in boundaries if 2 <= m <= RESIDUE_MAX_MOD):
        tally = await b.evaluate(residue_lengths(m, lo, top, b.bis.residue_runs), f"residue mod {m}")
        below = {n: v for n, v in tally.items() if found is None or n <= found[0]}
        residues.append(residue_test(below, m))
    return {"bracket": found, "message": message, "residue": residues, "tally": b.tally()}


def _points(tally: dict[int, tuple[int, int]], phase: dict[int, str]) -> list[dict]:
    """bisect.json's points: each length's phase, recall and Wilson 95% interval."""
    points = []
    for n, (k, m) in tally.items():
        lo, hi = wilson_interval(k, m)
        points.append(
            {
                "length": n,
                "phase": phase.get(n, "?"),
                "n": m,
                "correct": k,
                "recall": k / m if m else None,
                "ci_low": lo,
                "ci_high": hi,
            }
        )
    return points


def _check_range(lengths: tuple[int, ...]) -> None:
    if max(lengths) - min(lengths) < 2:
        raise BadInput(f"--bisect needs a range: give --lengths LO,HI with HI > LO + 1; got {list(lengths)}")


def run_bisect(cfg: ProbeConfig, bis: BisectConfig, on_event: Event | None = None) -> dict:
    """Bisect the collapse length of the server in ``cfg`` over [min(lengths), max(lengths)]."""
    on_event = on_event or (lambda _name, _payload: None)
    if cfg.graded or cfg.auto_difficulty:
        raise BadInput("--bisect measures recall only; drop --graded and --auto-difficulty, or drop --bisect")
    _check_range(cfg.lengths)
    roots = [normalize_base_url(u) for u in cfg.base_urls]
    check_out(cfg.out, cfg.resume)
    for root, _v1 in roots:
        preflight(root, cfg.model, api_key=cfg.api_key)
    provenance = collect_provenance(*roots[0], api_key=cfg.api_key)
    limits = read_limits(provenance, cfg.model)
    cfg = fit_to_target(cfg, limits, on_event)
    _check_range(cfg.lengths)
    lo, hi = min(cfg.lengths), max(cfg.lengths)
    info = provenance.get("/get_server_info")
    if bis.boundaries is not None:
        boundaries, source = sorted(set(bis.boundaries)), "--boundaries"
    elif isinstance(info, dict):
        boundaries, source = boundaries_from_server_info(info), "/get_server_info"
    else:
        boundaries, source = [], "none (no --boundaries and no /get_server_info)"
    digits, source_digits = choose_value_digits(cfg.value_digits, limits)
    on_event("value_digits", {"value_digits": digits, "source": source_digits})
    cfg = replace(cfg, value_digits=digits)
    counter = _token_counter(cfg, roots[0][0])
    cfg.out.mkdir(parents=True, exist_ok=True)
    store = ResultStore(cfg.out / STORE_NAME)
    fingerprint = {**cfg.fingerprint(digits), "bisect": asdict(bis)}
    try:
        if store.get_meta("bisect") not in (None, fingerprint):
            raise BadInput(
                f"--resume: the bisection in {cfg.out} was made with other settings; use another --out"
            )
        store.put_meta("bisect", fingerprint)
        store.put_meta("provenance", provenance)

        async def go() -> tuple[dict, _Bisector]:
            async with chat_target(cfg) as target:
                b = _Bisector(cfg, bis, store, target, counter, on_event)
                return await _search(b, lo, hi, boundaries), b

        found, b = asyncio.run(go())
        points = _points(found["tally"], b.phase)
        used = len(store.cases())
        full = full_grid_points(lo, hi, bis.resolution) * b.per_point
        bracket_ = found["bracket"]
        summary = {
            "lo": lo,
            "hi": hi,
            "resolution": bis.resolution,
            "threshold": cfg.threshold,
            "cases_per_point": b.per_point,
            "bracketed": bracket_ is not None,
            "last_pass": bracket_[0] if bracket_ else None,
            "collapse_length": bracket_[1] if bracket_ else None,
            "message": found["message"],
            "boundaries": boundaries,
            "boundaries_source": source,
            "residue": found["residue"],
            "points": points,
            "requests_used": used,
            "full_grid_requests": full,
            "request_ratio": used / full,
            "errors": sum(1 for r in store.results() if r["status"] != "ok"),
            "provenance": provenance,
        }
        return write_bisect_outputs(Path(cfg.out), summary, store.results())
    finally:
        store.close()
