"""Mutation testing of the statistics and verdict code (``make mutation``; not part of ``make test``).

    .venv/bin/python bench/mutation.py [--only NAME ...] [--out mutation-out]

For each target (a module and the test files that cover it) this copies ``src/`` and those test
files into a scratch directory, writes a ``setup.cfg`` for mutmut (pinned in the dev extras)
that mutates that module only and runs only those tests, runs ``mutmut run`` there, and reads
``mutmut results --all true``. Printed per target, and written to ``OUT/mutation.json``: killed,
survived, timed out, no tests, and the score

    score = (killed + timeout) / (mutants - equivalent)

where ``equivalent`` are the surviving mutants listed in ``EQUIVALENT`` below with the reason
they cannot change behaviour (docs/mutation.md). Survivors not listed are printed with their
diff (``mutmut show``): kill them with a test, or list them with the reason.

Mutants run in forked processes on the machine's cores; restricting each target to the tests
that cover it keeps a run to a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TARGETS: dict[str, tuple[str, list[str]]] = {
    "analysis.stats": ("analysis/stats.py", ["test_stats_exact.py", "test_regress_analysis.py"]),
    "analysis.significance": (
        "analysis/significance.py",
        ["test_stats_exact.py", "test_regress_analysis.py"],
    ),
    "analysis.paired": (
        "analysis/paired.py",
        ["test_regress_analysis.py", "test_compare_fpr.py", "test_paired_exact.py"],
    ),
    "analysis.bisect": ("analysis/bisect.py", ["test_bisect_analysis.py", "test_regress_analysis.py"]),
    "analysis.margins": ("analysis/margins.py", ["test_margins.py", "test_margins_exact.py"]),
    "analysis.curve": ("analysis/curve.py", ["test_analysis.py", "test_curve.py"]),
    "analysis.depth": ("analysis/depth.py", ["test_depth.py"]),
    "investigate.decide.signature": ("investigate/decide/signature.py", ["test_signature.py"]),
    "run.bisect": ("run/bisect.py", ["test_bisect_logic.py", "test_bisect.py", "test_bisect_events.py"]),
    "investigate.decide.verdicts": (
        "investigate/decide/verdicts.py",
        ["test_investigate_rules.py", "test_investigate_causal.py", "test_verdict_boundaries.py"],
    ),
    "analysis.taxonomy": ("analysis/taxonomy.py", ["test_regress_analysis.py", "test_taxonomy_rules.py"]),
    "analysis.endpoints": ("analysis/endpoints.py", ["test_regress_analysis.py", "test_endpoints_rules.py"]),
    "analysis.engine_state": (
        "analysis/engine_state.py",
        ["test_analysis_oracle.py", "test_engine_state_rules.py"],
    ),
    "analysis.oracle": ("analysis/oracle.py", ["test_analysis_oracle.py", "test_oracle_rules.py"]),
}

_V = "needlescope.investigate.decide.verdicts."
_M = "needlescope.analysis.margins."
_P = "needlescope.analysis.paired."
_S = "needlescope.analysis.significance."
_B = "needlescope.analysis.bisect."
_G = "needlescope.investigate.decide.signature."
_R = "needlescope.run.bisect."
_EXACT_POWER = (
    "a power exactly POWER (0.8): none at k_min 2-8, n <= 150, costs 0.01-1.00 (scanned 2026-12-05)"
)
_EXACT_ALPHA = "p == ALPHA: an exact McNemar p (Holm-adjusted or not) is never exactly 0.05"
_CASE_INF = "float() reads 'inf', 'nan' in any case"

EQUIVALENT: dict[str, str] = {
    **dict.fromkeys(
        [_V + f"x_cases_needed__mutmut_{i}" for i in (18, 19, 20, 22, 24, 25, 26)],
        "cases_needed's bisection starts at or below the first doubling past the last failing n: power "
        "grows with n, so it finds the same first n",
    ),
    _V + "x_cases_needed__mutmut_1": "limit 100001: no power of two lies between 100000 and 100001",
    _V
    + "x_cases_needed__mutmut_3": "starting at 2 pairs: one pair never has power at a level <= 1 (2 x 0.5 = 1)",
    _V + "x_cases_needed__mutmut_12": _EXACT_POWER,
    _V + "x_cases_needed__mutmut_43": _EXACT_POWER,
    _V + "x_detectable_cost__mutmut_15": _EXACT_POWER,
    _V + "x_detectable_cost__mutmut_3": "a cost of 0 points has power 0: pct = 0 never returns",
    _V
    + "x_detectable_cost__mutmut_6": "a cost of 101% is capped at 100%: reached only after 100% failed, it fails too",
    _V + "x_evidence__mutmut_10": _CASE_INF,
    _V + "x_evidence__mutmut_13": _CASE_INF,
    _V + "x_live_verdict__mutmut_22": _CASE_INF,
    _V + "x_paired__mutmut_37": _CASE_INF,
    _V + "x_paired__mutmut_46": _CASE_INF,
    _V + "x_restores__mutmut_7": _EXACT_ALPHA,
    _V + "x_suspect_verdict__mutmut_74": _EXACT_ALPHA,
    _V + "x_restores__mutmut_10": "b >= c: p < 0.05 with b == c is impossible (p = 1)",
    _V + "x_suspect_verdict__mutmut_77": "c >= b: p < 0.05 with b == c is impossible (p = 1)",
    **dict.fromkeys(
        [_M + f"x_compare_margins__mutmut_{i}" for i in (71, 74, 78)]
        + [_M + f"x_paired_differences__mutmut_{i}" for i in (7, 10, 11)]
        + [_M + f"x_wilcoxon_signed_rank__mutmut_{i}" for i in (18, 21, 22)]
        + ["needlescope.analysis.curve.x_cliff__mutmut_6", "needlescope.analysis.curve.x_cliff__mutmut_9"],
        "zip without strict=True: the sequences always have one length (checked before, or built together)",
    ),
    **dict.fromkeys(
        [_M + f"x_wilcoxon_signed_rank__mutmut_{i}" for i in (86, 87, 88)],
        "var <= 0 / <= 1: the tie-corrected variance is at least n(n+1)(3n+3)/48 > 1 (all ties)",
    ),
    **dict.fromkeys(
        [_M + "x__sign__mutmut_7", _M + "x__sign__mutmut_11"],
        "_sign giving 2 or -2: margin_direction only compares signs with each other and with 0",
    ),
    _M + "x__sign__mutmut_8": "x >= 0: x == 0 returned 0 on the line before",
    _M + "x__midranks__mutmut_10": "ranks start at 1.0: every entry is overwritten",
    _M + "x_margin_direction__mutmut_27": "test >= 0: test is never 0 there ('none' returned before)",
    _M + "x_wilcoxon_signed_rank__mutmut_23": "x >= 0: zeros were dropped (|x| > zero_tol, a tolerance >= 0)",
    _M + "x_wilcoxon_signed_rank__mutmut_105": "min(2.0, erfc(z / sqrt 2)): erfc of z >= 0 is <= 1",
    _M + "x_hodges_lehmann__mutmut_36": "ranks 0..n: a rank 0 leaves the signed-rank null unchanged",
    "needlescope.analysis.depth.x__middle_hole__mutmut_61": "middle <= ends: equal recalls give p = 1, never < alpha",
    **dict.fromkeys(
        [_P + "x__verdict__mutmut_8", _P + "x__verdict__mutmut_17", _P + "x_compare_pairs__mutmut_76"],
        "delta <= 0 / >= 0: a delta of 0 has a_only == b_only, McNemar p = 1, never < alpha",
    ),
    _P
    + "x_bucket_of__mutmut_10": "i = -1 reads the largest edge, which a length below the first is below too",
    **dict.fromkeys(
        [f"needlescope.analysis.oracle.x__kl_common__mutmut_{i}" for i in (24, 27, 28)]
        + [f"needlescope.analysis.oracle.x_compare_steps__mutmut_{i}" for i in (29, 32, 33)]
        + [f"needlescope.analysis.oracle.x_first_difference__mutmut_{i}" for i in (4, 7)],
        "zip(strict=...) over lists of equal length (or strict=None, the same as False)",
    ),
    "needlescope.analysis.oracle.x_summarize__mutmut_4": "ids_differ counting 2 a prompt: only its truth is used",
    **dict.fromkeys(
        [f"needlescope.analysis.engine_state.x_factor_effect__mutmut_{i}" for i in (14, 16)],
        "Pair without case_id or depth: paired_group reads only a, b and length",
    ),
    "needlescope.analysis.taxonomy.x__cross_case_summary__mutmut_36": "'XXXX' for a missing answer has no digits either",
    "needlescope.analysis.taxonomy.x_prompt_values__mutmut_13": "total 2 for no text: with no messages there are no values",
    "needlescope.analysis.endpoints.x_endpoint_breakdown__mutmut_57": "recall <= rest_recall: equal recalls give "
    "Fisher p = 1 (Holm-adjusted too), never < alpha",
    "needlescope.analysis.taxonomy.x__cross_case_summary__mutmut_84": "p <= CROSS_CASE_ALPHA: no binomial tail equals "
    "0.01 exactly (none for 2 <= k <= n < 60, chance (v - 1) / 10^d, v < 200, d 1-4: scanned 2026-12-06)",
    "needlescope.analysis.stats.x_binomial_tail__mutmut_1": "k < 0 for k <= 0: at k = 0 the sum over every outcome "
    "is 1 up to an ulp of rounding; callers pass k >= 1, or k = n = 0 (exactly 1)",
    "needlescope.analysis.stats.x_binomial_tail__mutmut_10": "min(2.0, ...): a binomial tail is at most 1 (up to an ulp)",
    "needlescope.analysis.stats.x_mcnemar_exact__mutmut_4": "n == 1 returns 1.0: n == 0 gives 2 x 1 capped at 1, n == 1 "
    "gives 2 x 0.5 = 1 either way",
    "needlescope.analysis.stats.x_wilson_interval__mutmut_55": "min(2.0, centre + half): below k == n the Wilson upper "
    "bound is below 1",
    _S + "x_holm__mutmut_11": "out starts as [1.0] * m: every entry is overwritten",
    _S + "x_fisher_exact__mutmut_8": "n == 1 returns 1.0: a table of one case has p = 1 anyway",
    **dict.fromkeys(
        [_S + "x_fisher_exact__mutmut_17", _S + "x_fisher_exact__mutmut_35"],
        "summing from 0 (max(0, row1 - col1 - n) is 0): the hypergeometric pmf is 0 below the support",
    ),
    _S
    + "x_fisher_exact__mutmut_47": "q < observed * (1 + 1e-7): the tolerance still admits the observed table and its ties",
    _S + "x_mcnemar_power__mutmut_2": "n < 0: n == 0 is below k_min >= 1 and returns 0 on the next test",
    _S
    + "x_mcnemar_power__mutmut_3": "n <= 1: one pair is below k_min >= 2 (alpha < 1) and returns 0 on the next test",
    _S + "x_mcnemar_power__mutmut_4": "drop < 0: a drop of 0 gives binomial_tail(k_min >= 1, n, 0) = 0",
    _S + "x_mcnemar_power__mutmut_12": "max(2, ...): floor(log2(2 / alpha)) + 1 >= 2 for any alpha < 1",
    _S + "x_groups_vs_rest__mutmut_71": "k / n if (n) or True: a group present in the outcomes has n >= 1",
    **dict.fromkeys(
        [_B + f"x_coarse_grid__mutmut_{i}" for i in (2, 3, 4)],
        "points <= 2 / < 3 / hi < lo: the formula gives the same {lo, hi} (or {lo}) at the edge",
    ),
    _B + "x__passes__mutmut_3": "n >= 0: only lengths with cases (n > 0) reach it (bracket filters them)",
    **dict.fromkeys(
        [_B + f"x_correct_residues__mutmut_{i}" for i in (7, 10, 14)],
        "zip without strict=True: holm returns a list as long as its input",
    ),
    _B + "x_ends_differ__mutmut_17": "ka * nb >= kb * na: equal proportions have Fisher p = 1, never < alpha",
    _B
    + "x_residue_test__mutmut_52": "stratified_class_test of no strata is 1.0 (the empty product's whole tail)",
    _B
    + "x_stratified_class_test__mutmut_36": "min(2.0, ...): a head of a distribution sums to at most 1 (fsum, exactly rounded)",
    **dict.fromkeys(
        [_G + f"x__layer_class__mutmut_{i}" for i in (4, 16, 21)] + [_G + "x_topk_fix__mutmut_56"],
        "p <= ALPHA: the p-values are continuous (t, Irwin-Hall) or 2 x 0.5^k, never exactly 0.05",
    ),
    _G
    + "x__layer_class__mutmut_9": "> 0.5 + NEAR_CHANCE: a t bound on a mean of mid-p values never equals it exactly",
    **dict.fromkeys(
        [_G + "x__state__mutmut_7", _G + "x__state__mutmut_11"],
        "lo >= HOLD / hi <= HOLD: a Wilson bound never equals the threshold exactly",
    ),
    _G + "x_topk_fix__mutmut_57": "b >= c: p < 0.05 with b == c is impossible (p = 1)",
    **dict.fromkeys(
        [_G + f"x_layer_ranking__mutmut_{i}" for i in (18, 21, 23)],
        "zip without strict=True: holm returns a list as long as its input",
    ),
    _G + "x_case_draw__mutmut_5": "int.from_bytes without 'big': Python 3.11's default byte order is big",
    **dict.fromkeys(
        [_G + "x_case_draw__mutmut_11", _G + "x_case_draw__mutmut_12"],
        "(h - 0.5) or (h + 1.5) / 2^64: moves the draw by 2^-64, below float resolution near any decision",
    ),
    **dict.fromkeys(
        [_G + "x_sum_uniform_cdf__mutmut_4", _G + "x_sum_uniform_cdf__mutmut_7"],
        "s < 0 / s > n: the Irwin-Hall formula gives the same 0 and 1 at the ends",
    ),
    _G
    + "x_sum_uniform_cdf__mutmut_21": "s > n * 2: the direct sum equals the symmetric one (exact in rationals)",
    _G + "x_collapse_runs__mutmut_45": "n >= cap: a length at the capacity is already judged as inside it",
    _G + "x_collapse_runs__mutmut_108": "m < n: n itself is holding, so excluding it changes nothing",
    _G + "x__moves__mutmut_26": "<= at the small capacity: a collapse there makes the run inconsistent first",
    _R + "xǁ_Bisectorǁ__init____mutmut_32": "encoding='UTF-8': codec names ignore case",
    _R + "x_run_bisect__mutmut_3": "the default on_event returning 0: its value is never used",
    _R
    + "xǁ_Bisectorǁevaluate__mutmut_34": "CaseSpec without max_answer_tokens: it is only validated (>= 1), no case depends on it",
    _R + "xǁ_Bisectorǁconfirm__mutmut_10": "(1, 0) for a missing midpoint: n = 0 raises before k is read",
    **dict.fromkeys(
        [_R + f"xǁ_Bisectorǁconfirm__mutmut_{i}" for i in (53, 55, 56, 102, 104)],
        "trials_at.get's default: both ends of a candidate bracket were evaluated, so it is never used",
    ),
    _R + "x__passes__mutmut_6": "(1, 0) for a missing length: n = 0 fails before k is read",
    _R + "x__passes__mutmut_7": "(0, 1) for a missing length: recall 0 is below every threshold in (0, 1]",
    _R + "x__no_bracket__mutmut_6": "(1, 0) for a missing length: n = 0 skips the branch that reads k",
}
"""mutant name -> why it cannot change behaviour (kept in step with docs/mutation.md)."""


def _mutmut(cwd: Path, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    exe = Path(sys.executable).with_name("mutmut")
    return subprocess.run(
        [str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_target(name: str, module: str, tests: list[str], out: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"mutation-{name}-"))
    try:
        shutil.copytree(ROOT / "src", work / "src")
        (work / "tests").mkdir()
        for t in ["conftest.py", *tests]:
            shutil.copy(ROOT / "tests" / t, work / "tests" / t)
        shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
        (work / "setup.cfg").write_text(
            "[mutmut]\nsource_paths = src\n"
            f"only_mutate = src/needlescope/{module}\n"
            "pytest_add_cli_args_test_selection =\n"
            + "".join(f"    tests/{t}\n" for t in tests)
            + "pytest_add_cli_args = -p no:cacheprovider -n 0 -q\n"
        )
        t0 = time.time()
        run = _mutmut(work, "run")
        if run.returncode != 0:
            raise SystemExit(f"mutmut run failed for {name}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
        results = _mutmut(work, "results", "--all", "true").stdout
        status: dict[str, str] = {}
        for line in results.splitlines():
            if ": " in line:
                mutant, state = line.strip().rsplit(": ", 1)
                status[mutant] = state
        survivors = sorted(
            m for m, s in status.items() if s in ("survived", "no tests") and m not in EQUIVALENT
        )
        diffs = {m: _mutmut(work, "show", m).stdout for m in survivors}
        (out / f"{name}.survivors.txt").write_text("\n".join(diffs[m] for m in survivors))
        counts = {s: sum(1 for v in status.values() if v == s) for s in sorted(set(status.values()))}
        equivalent = sum(1 for m in status if m in EQUIVALENT)
        detected = counts.get("killed", 0) + counts.get("timeout", 0)
        return {
            "target": name,
            "module": module,
            "tests": tests,
            "mutants": len(status),
            "counts": counts,
            "equivalent": equivalent,
            "score": detected / max(1, len(status) - equivalent),
            "survivors": survivors,
            "seconds": round(time.time() - t0),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*", default=None, help=f"targets: {', '.join(TARGETS)}")
    p.add_argument("--out", type=Path, default=ROOT / "mutation-out")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown target(s) {unknown}; choose from {list(TARGETS)}")
    print(
        f"# {platform.node()} {platform.machine()} python {platform.python_version()} {time.strftime('%Y-%m-%d')}"
    )
    print("| target | mutants | killed | timeout | survived | no tests | equivalent | score | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for n in names:
        module, tests = TARGETS[n]
        r = run_target(n, module, tests, args.out)
        rows.append(r)
        c = r["counts"]
        print(
            f"| {n} | {r['mutants']} | {c.get('killed', 0)} | {c.get('timeout', 0)} | {c.get('survived', 0)} | "
            f"{c.get('no tests', 0)} | {r['equivalent']} | {r['score']:.3f} | {r['seconds']} |",
            flush=True,
        )
    (args.out / "mutation.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"survivors' diffs: {args.out}/<target>.survivors.txt")


if __name__ == "__main__":
    main()
