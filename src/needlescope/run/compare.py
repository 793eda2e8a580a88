"""Paired A/B over two finished probe runs that share a case set (the live workflow that makes
them is ``run.compare_live``). Runs whose case sets do not hash equal are refused, naming the
first differing case.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from needlescope.analysis.margins import compare_margins
from needlescope.analysis.paired import Pair, compare_pairs, headline
from needlescope.errors import BadInput, ProbeError
from needlescope.report.compare import errors_line, write_compare_outputs
from needlescope.run.probe import STORE_NAME
from needlescope.run.store import ResultStore

__all__ = ["case_hash", "load_run", "compare_runs", "side_errors"]


def case_hash(case: dict) -> str:
    """Hash of what is sent and how it is judged: the messages and the expected values."""
    body = json.dumps(
        {"messages": case["messages"], "expected": case["expected"]},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def load_run(run_dir: Path, flag: str) -> tuple[list[dict], dict[str, dict], dict]:
    """(cases, results by case_id, provenance) of a finished probe directory; a result carries
    its case's graded score under ``graded`` when the run scored one, and the provenance the
    run's auto-difficulty record under ``difficulty`` when it had one."""
    path = Path(run_dir) / STORE_NAME
    if not Path(run_dir).is_dir():
        raise BadInput(f"{flag} {run_dir} is not a folder; pass the --out directory of a probe run")
    if not path.is_file():
        raise BadInput(f"{flag} {run_dir} holds no {STORE_NAME}; pass the --out directory of a probe run")
    with ResultStore(path) as store:
        cases = store.cases()
        results = {r["case_id"]: r for r in store.results()}
        for case_id, g in store.graded().items():
            if case_id in results and g["status"] == "ok":
                results[case_id]["graded"] = g
        provenance = store.get_meta("provenance") or {}
        difficulty = store.get_meta("difficulty")
    if not cases:
        raise BadInput(f"{flag} {run_dir} holds no cases; the probe run never started")
    return cases, results, {**provenance, **({"difficulty": difficulty} if difficulty else {})}


def _check_same_cases(cases_a: list[dict], cases_b: list[dict]) -> None:
    by_a = {c["case_id"]: c for c in cases_a}
    by_b = {c["case_id"]: c for c in cases_b}
    for cid in sorted(by_a.keys() | by_b.keys()):
        if cid not in by_b:
            raise BadInput(f"the runs do not share a case set: case {cid} is in A only; {_SAME_GRID}")
        if cid not in by_a:
            raise BadInput(f"the runs do not share a case set: case {cid} is in B only; {_SAME_GRID}")
        if case_hash(by_a[cid]) != case_hash(by_b[cid]):
            raise BadInput(
                f"the runs do not share a case set: case {cid} differs (prompt or expected answer); {_SAME_GRID}"
            )


_SAME_GRID = "compare runs made from one case set (same --kind, --lengths, --depths, --trials, --seed, --value-digits and tokenizer)"


def _pairs(
    cases: list[dict], res_a: dict[str, dict], res_b: dict[str, dict]
) -> tuple[list[Pair], list[dict], int]:
    pairs, rows, unpaired = [], [], 0
    for c in cases:
        ra, rb = res_a.get(c["case_id"]), res_b.get(c["case_id"])
        ok_a = ra is not None and ra["status"] == "ok"
        ok_b = rb is not None and rb["status"] == "ok"
        if not (ok_a and ok_b):
            # An error on either side says nothing about recall; the pair is left out, and counted.
            unpaired += 1
            continue
        pair = Pair(
            c["case_id"], int(c["length"]), float(c["depth"]), bool(ra["correct"]), bool(rb["correct"])
        )
        pairs.append(pair)
        rows.append(
            {
                "case_id": c["case_id"],
                "length": pair.length,
                "depth": pair.depth,
                "a_correct": pair.a,
                "b_correct": pair.b,
                "a_answer": ra.get("answer"),
                "b_answer": rb.get("answer"),
                "expected": list(c["expected"]),
                **_graded_pair(ra.get("graded"), rb.get("graded")),
            }
        )
    return pairs, rows, unpaired


def side_errors(cases: list[dict], results: dict[str, dict]) -> dict:
    """``{"failed": n, "kinds": {error kind: n}}``: the cases of one side with no ``ok`` result
    (a request that failed, or one never sent), by the kind of their last error."""
    kinds: dict[str, int] = {}
    for c in cases:
        r = results.get(c["case_id"])
        if r is None or r["status"] != "ok":
            kind = "not sent" if r is None else (r.get("error_kind") or "error")
            kinds[kind] = kinds.get(kind, 0) + 1
    return {"failed": sum(kinds.values()), "kinds": dict(sorted(kinds.items()))}


def _graded_pair(ga: dict | None, gb: dict | None) -> dict:
    """The pair's graded values for pairs.jsonl (empty when either side has no graded score)."""
    if ga is None or gb is None:
        return {}
    return {
        f"{side}_{key}": g[key]
        for side, g in (("a", ga), ("b", gb))
        for key in ("min_margin", "gold_logprob", "first_logprob", "first_rank")
    }


def _graded_comparison(
    cases: list[dict], res_a: dict[str, dict], res_b: dict[str, dict], edges: list[int], alpha: float
) -> dict | None:
    """Paired margin and gold-logprob differences, or None when no pair was graded on both sides."""
    pairs = []
    methods = set()
    for c in cases:
        # The gold answer is scored apart from the chat, so a pair needs only both graded scores.
        ga = (res_a.get(c["case_id"]) or {}).get("graded")
        gb = (res_b.get(c["case_id"]) or {}).get("graded")
        if ga is None or gb is None:
            continue
        pairs.append((int(c["length"]), ga, gb))
        methods.add((ga["method"], gb["method"]))
    if not pairs:
        return None
    result = compare_margins(pairs, edges, alpha)
    return {"methods": sorted({m for pair in methods for m in pair}), "pairs": len(pairs), **result}


def compare_runs(
    a_dir: Path,
    b_dir: Path,
    out: Path,
    *,
    alpha: float = 0.05,
    power_drop: float = 0.10,
    bucket_edges: tuple[int, ...] | None = None,
) -> dict:
    """Compare two finished probe runs over their shared case set; write compare outputs to ``out``."""
    cases_a, res_a, prov_a = load_run(a_dir, "--a-run")
    cases_b, res_b, prov_b = load_run(b_dir, "--b-run")
    _check_same_cases(cases_a, cases_b)
    pairs, rows, unpaired = _pairs(cases_a, res_a, res_b)
    errors = {"cases": len(cases_a), "a": side_errors(cases_a, res_a), "b": side_errors(cases_a, res_b)}
    if not pairs:
        # The targets failed, not the user: the CLI exits with the target-failure code.
        raise ProbeError(f"no case was scored on both sides ({errors_line(errors)}); nothing to compare")
    result = compare_pairs(pairs, alpha=alpha, power_drop=power_drop, bucket_edges=bucket_edges)
    result["errors"] = errors
    trials = max(int(c["trial"]) for c in cases_a) + 1
    result["headline"] = headline(result, alpha=alpha, trials=trials, failed=errors_line(errors))
    edges = sorted(set(bucket_edges)) if bucket_edges else sorted({p.length for p in pairs})
    result["graded"] = _graded_comparison(cases_a, res_a, res_b, edges, alpha)
    result["difficulty"] = prov_a.pop("difficulty", None)
    prov_b.pop("difficulty", None)
    return write_compare_outputs(
        Path(out),
        result,
        pairs=rows,
        unpaired=unpaired,
        sides={
            "A": {"run": str(a_dir), "provenance": prov_a},
            "B": {"run": str(b_dir), "provenance": prov_b},
        },
        alpha=alpha,
    )
