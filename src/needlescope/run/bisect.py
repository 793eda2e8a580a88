"""``probe --bisect``: find the token length where recall collapses, with few requests.

Steps (the plan is in :mod:`needlescope.analysis.bisect`): a coarse grid over the --lengths range,
binary search of the first bracket to ``resolution`` tokens, fine offsets around the boundary and
around multiples of the kernel boundaries, and residue-class runs for small moduli.

A bracket is accepted, and a binary step narrows it, only when the recall at its two ends differs
significantly (Fisher exact, ``alpha``); until it does, the ends get more trials (doubled, up to
``max_trials``); a step that still does not differ stops the narrowing and says why. Each step's
evidence (lengths, cases, misses, Wilson intervals, p) is in ``bisect.json``'s ``steps``.

Every case goes through the same durable store as a probe, so a killed bisection resumes: it
replays the same decisions from the stored results and sends only what is missing. Each
decision counts only the cases the search has asked for so far (``_Bisector.asked``): a
resumed run's store already holds later steps' cases, and counting them early gave another
coarse bracket and lost the step history (issue 38, R7).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from needlescope.analysis.bisect import (
    RESIDUE_MAX_MOD,
    boundaries_from_server_info,
    bracket,
    cases_for_ci_width,
    coarse_grid,
    correct_residues,
    crossing_confidence,
    end_evidence,
    ends_differ,
    fine_lengths,
    full_grid_points,
    midpoint,
    pooled,
    residue_runs,
    residue_test,
    tally_slice,
)
from needlescope.analysis.stats import wilson_interval
from needlescope.cases import CaseSpec, build_cases, score_answer
from needlescope.errors import BadInput, ProbeError
from needlescope.progress import Event, no_event
from needlescope.report.bisect import write_bisect_outputs
from needlescope.run.config import ProbeConfig
from needlescope.run.probe import STORE_NAME, _token_counter, chat_target, check_out, fit_to_target
from needlescope.run.scheduler import run_cases
from needlescope.run.store import ResultStore
from needlescope.targets import collect_provenance, normalize_base_url, preflight
from needlescope.targets.limits import choose_value_digits, read_limits

__all__ = ["BisectConfig", "run_bisect"]


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
    alpha: float = 0.05
    """A bracket's ends must differ at this level (Fisher exact) for the bracket to narrow."""
    max_trials: int | None = None
    """Most trials per length when a step's ends do not yet differ; None: 4 x the starting trials."""

    def __post_init__(self) -> None:
        if self.resolution < 1:
            raise BadInput(f"--resolution must be at least 1 token; got {self.resolution}")
        if self.ci_width is not None and not 0 < self.ci_width < 1:
            raise BadInput(f"--ci-width must lie in (0, 1); got {self.ci_width}")
        if self.coarse_points < 2:
            raise BadInput(f"--coarse-points must be at least 2; got {self.coarse_points}")
        if not 0 < self.alpha < 1:
            raise BadInput(f"alpha must lie in (0, 1); got {self.alpha}")
        if self.max_trials is not None and self.max_trials < 1:
            raise BadInput(f"max_trials must be at least 1; got {self.max_trials}")
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
        self.max_trials = max(self.trials, bis.max_trials or 4 * self.trials)
        self.trials_at: dict[int, int] = {}
        self.phase: dict[int, str] = {}
        self.steps: list[dict] = []
        self.haystack = cfg.haystack_file.read_text(encoding="utf-8") if cfg.haystack_file else None

    @property
    def per_point(self) -> int:
        return self.trials * len(self.cfg.depths)

    async def evaluate(
        self, lengths: list[int], phase: str, trials: int | None = None
    ) -> dict[int, tuple[int, int]]:
        """Send the cases of ``lengths`` (``trials`` each, default the starting trials) not sent yet."""
        trials = trials or self.trials
        new = [n for n in lengths if self.trials_at.get(n, 0) < trials]
        for n in new:
            self.phase.setdefault(n, phase)
            self.trials_at[n] = trials
        known = {c["case_id"] for c in self.store.cases()}
        for n in new:
            spec = CaseSpec(
                kind=self.cfg.kind,
                lengths=(n,),
                depths=self.cfg.depths,
                trials=trials,
                seed=self.cfg.seed,
                haystack_text=self.haystack,
                max_answer_tokens=self.cfg.max_tokens,
                value_digits=self.cfg.value_digits,
                n_distractors=self.cfg.distractors,
            )
            cases = [c.to_dict() for c in build_cases(spec, self.counter)]
            self.store.add_cases([c for c in cases if c["case_id"] not in known])
        pending = set(self.store.pending_case_ids())
        todo = [c for c in self.store.cases() if c["case_id"] in pending and self.asked(c)]
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

    def require_scored(self, tally: dict, lengths: list[int]) -> None:
        """ProbeError (a target failure: exit 1, the finished cases kept for ``--resume``), as for
        a midpoint with no scored case (``confirm``), when every request at one of ``lengths``
        failed: the search must not conclude from errors."""
        blind = sorted({n for n in lengths if tally.get(n, (0, 0))[1] == 0})
        if blind:
            raise ProbeError(
                f"every request at {', '.join(map(str, blind))} tokens failed, so no recall was measured "
                "there and the bisection cannot conclude"
            )

    def asked(self, case: dict) -> bool:
        """Whether the search has asked for ``case`` yet: its length, up to its trials there."""
        return int(case["trial"]) < self.trials_at.get(case["length"], 0)

    def tally(self) -> dict[int, tuple[int, int]]:
        """(correct, scored) per length over the cases asked for so far (``asked``)."""
        asked = {c["case_id"]: c["length"] for c in self.store.cases() if self.asked(c)}
        return pooled(
            (asked[r["case_id"]], r["correct"])
            for r in self.store.results()
            if r["status"] == "ok" and r["case_id"] in asked
        )

    async def confirm(
        self, tally: dict, mid: int | None, ends: tuple[int, int], phase: str
    ) -> tuple[dict, tuple | None]:
        """Add trials until a valid bracket around ``mid`` (or ``ends`` itself when ``mid`` is None)
        has ends that differ significantly; returns (tally, the bracket or None) and records the step."""
        thr = self.cfg.threshold
        while True:
            if mid is None:
                cand = ends
            else:
                k, n = tally.get(mid, (0, 0))
                if n == 0:
                    raise ProbeError(f"every request at {mid} tokens failed; the server cannot be bisected")
                cand = (mid, ends[1]) if k / n >= thr else (ends[0], mid)
            a, f = cand
            valid = _passes(tally, a, thr) and not _passes(tally, f, thr)
            ok, p = ends_differ(tally, a, f, self.bis.alpha) if valid else (False, 1.0)
            more = [x for x in cand if self.trials_at.get(x, 0) < self.max_trials]
            if ok or not valid or not more:
                self.steps.append(
                    {
                        "phase": phase,
                        "tested": mid,
                        "last_pass": end_evidence(tally, a),
                        "first_fail": end_evidence(tally, f),
                        "p_value": p,
                        "narrowed": ok,
                    }
                )
                self.on_event("bisect_evidence", self.steps[-1])
                return tally, cand if ok else None
            grown = min(self.max_trials, 2 * max(self.trials_at.get(x, self.trials) for x in more))
            tally = await self.evaluate(more, phase, grown)


def _passes(tally: dict, length: int, threshold: float) -> bool:
    k, n = tally.get(length, (0, 0))
    return n > 0 and k / n >= threshold


def _no_bracket(tally: dict, lo: int, hi: int, threshold: float) -> str:
    k, n = tally.get(lo, (0, 0))
    if n and k / n < threshold:
        return (
            f"cannot bracket a boundary in [{lo}, {hi}]: recall is already {k / n:.2f} < {threshold:g} "
            f"at {lo} tokens; lower the shortest --lengths"
        )
    return (
        f"cannot bracket a boundary in [{lo}, {hi}]: recall stays at or above {threshold:g} at every "
        "tested length; raise the longest --lengths"
    )


def _crossing(tally: dict, found: tuple[int, int], threshold: float) -> dict:
    a, f = found
    conf = crossing_confidence(tally, a, f, threshold)
    ea, ef = end_evidence(tally, a), end_evidence(tally, f)
    meaning = (
        f"where this sample crossed {threshold:g}: recall {ea['correct']}/{ea['n']} "
        f"[{ea['ci_low']:.2f}, {ea['ci_high']:.2f}] at {a} tokens, {ef['correct']}/{ef['n']} "
        f"[{ef['ci_low']:.2f}, {ef['ci_high']:.2f}] at {f}; confidence {conf:.2f} that recall is at or above "
        f"{threshold:g} at {a} and below it at {f} (so, if recall falls with length, that the crossing lies between)"
    )
    return {"last_pass": ea, "first_fail": ef, "confidence": conf, "meaning": meaning}


async def _search(b: _Bisector, lo: int, hi: int, boundaries: list[int]) -> dict:
    threshold = b.cfg.threshold
    coarse = coarse_grid(lo, hi, b.bis.coarse_points)
    tally = await b.evaluate(coarse, "coarse")
    found = bracket(tally, threshold)
    # A length where every request failed has no recall: a bracket read past it, or "recall stays
    # above the threshold at every tested length", would be concluded from errors.
    b.require_scored(tally, [n for n in coarse if found is None or n < found[1]])
    crossing, confirmed = None, False
    if found is None:
        message = _no_bracket(tally, lo, hi, threshold)
    else:
        tally, first = await b.confirm(tally, None, found, "coarse")
        confirmed = first is not None
        if not confirmed:
            step = b.steps[-1]
            message = (
                f"recall crosses {threshold:g} between {found[0]} and {found[1]} tokens in this sample, but the two "
                f"do not differ significantly (Fisher p={step['p_value']:.2g} with {step['first_fail']['n']} cases "
                f"at {found[1]}): not narrowed; raise --trials"
            )
        else:
            while (mid := midpoint(*found, b.bis.resolution)) is not None:
                tally = await b.evaluate([mid], "bisect")
                tally, narrowed = await b.confirm(tally, mid, found, "bisect")
                if narrowed is None:
                    break
                found = narrowed
            tally = await b.evaluate(fine_lengths(found[1], boundaries, lo, hi), "fine")
            stopped = found[1] - found[0] > b.bis.resolution
            message = f"recall falls below {threshold:g} between {found[0]} and {found[1]} tokens " + (
                f"(stopped before the resolution of {b.bis.resolution}: a step's ends did not differ "
                f"significantly with up to {b.max_trials * len(b.cfg.depths)} cases a length)"
                if stopped
                else f"(resolution {b.bis.resolution})"
            )
        crossing = _crossing(b.tally(), found, threshold)
        message += f"; {crossing['meaning']}"
    residues = []
    top = found[0] if found else hi
    for m in (m for m in boundaries if 2 <= m <= RESIDUE_MAX_MOD):
        runs = residue_runs(m, lo, top, b.bis.residue_runs)
        tally = await b.evaluate(sorted({x for r in runs for x in r}), f"residue mod {m}")
        b.require_scored(tally, [x for r in runs for x in r])
        residues.append(residue_test([tally_slice(tally, r) for r in runs], m))
    return {
        "bracket": found,
        "crossing": crossing,
        "confirmed": confirmed,
        "message": message,
        "residue": correct_residues(residues, b.bis.alpha),
        "steps": b.steps,
        "tally": b.tally(),
    }


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


def run_bisect(cfg: ProbeConfig, bis: BisectConfig, on_event: Event = no_event) -> dict:
    """Bisect the collapse length of the server in ``cfg`` over [min(lengths), max(lengths)]."""
    if cfg.graded or cfg.auto_difficulty:
        raise BadInput("--bisect measures recall only; drop --graded and --auto-difficulty, or drop --bisect")
    _check_range(cfg.lengths)
    roots = [normalize_base_url(u) for u in cfg.base_urls]
    check_out(cfg.out, cfg.resume)
    for root, _v1 in roots:
        preflight(root, cfg.model, api_key=cfg.api_key)
    provenance = collect_provenance(*roots[0], api_key=cfg.api_key, timeout=min(cfg.timeout_s, 5.0))
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
    # As the store gives it back (JSON: --boundaries' tuple becomes a list), so a resume with the
    # same settings compares equal.
    fingerprint = json.loads(json.dumps({**cfg.fingerprint(digits), "bisect": asdict(bis)}))
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
        errors = sum(1 for r in store.results() if r["status"] != "ok")
        if errors:
            # The printed result says so too (bisect.md's Requests line did, the terminal did not).
            found["message"] += f"; {errors} request(s) failed and are not counted as misses"
        summary = {
            "lo": lo,
            "hi": hi,
            "resolution": bis.resolution,
            "threshold": cfg.threshold,
            "cases_per_point": b.per_point,
            "bracketed": bracket_ is not None,
            "confirmed": found["confirmed"],
            "crossing": found["crossing"],
            "steps": found["steps"],
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
            "errors": errors,
            "provenance": provenance,
        }
        return write_bisect_outputs(Path(cfg.out), summary, store.results())
    finally:
        store.close()
