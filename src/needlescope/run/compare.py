"""Paired A/B: the same cases, byte for byte, against two targets (or two finished runs).

Live mode runs the probe on A, copies A's case set into B's store and resumes it there, so B is
sent exactly the prompts A was sent (B's tokenizer is never consulted). Run mode reads two
finished probe directories and refuses them unless their case sets hash equal.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from needlescope.analysis.paired import Pair, compare_pairs
from needlescope.errors import BadInput
from needlescope.report.compare import write_compare_outputs
from needlescope.run.config import ProbeConfig
from needlescope.run.probe import STORE_NAME, Event, run_probe
from needlescope.run.store import ResultStore
from needlescope.targets import collect_provenance, normalize_base_url, preflight

__all__ = ["case_hash", "load_run", "compare_runs", "compare_live"]


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
    """(cases, results by case_id, provenance) of a finished probe directory."""
    path = Path(run_dir) / STORE_NAME
    if not path.is_file():
        raise BadInput(f"{flag} {run_dir} holds no {STORE_NAME}; pass the --out directory of a probe run")
    with ResultStore(path) as store:
        cases = store.cases()
        results = {r["case_id"]: r for r in store.results()}
        provenance = store.get_meta("provenance") or {}
    if not cases:
        raise BadInput(f"{flag} {run_dir} holds no cases; the probe run never started")
    return cases, results, provenance


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
            }
        )
    return pairs, rows, unpaired


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
    if not pairs:
        raise BadInput(
            f"no case was scored on both sides ({unpaired} had an error on A or B); nothing to compare"
        )
    result = compare_pairs(pairs, alpha=alpha, power_drop=power_drop, bucket_edges=bucket_edges)
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


def compare_live(
    cfg_a: ProbeConfig,
    cfg_b: ProbeConfig,
    out: Path,
    *,
    alpha: float = 0.05,
    power_drop: float = 0.10,
    bucket_edges: tuple[int, ...] | None = None,
    on_event: Event | None = None,
) -> dict:
    """Probe A (``out/a``), send B (``out/b``) A's exact case set, then compare the two runs."""
    on_event = on_event or (lambda _name, _payload: None)
    out = Path(out)
    # Both sides are checked before either is probed, so a typo in --b costs no run of A.
    for cfg in (cfg_a, cfg_b):
        for url in cfg.base_urls:
            preflight(normalize_base_url(url)[0], cfg.model, api_key=cfg.api_key)
    cfg_a = replace(cfg_a, out=out / "a")
    cfg_b = replace(cfg_b, out=out / "b")
    on_event("side", {"side": "A", "base_urls": list(cfg_a.base_urls)})
    run_probe(cfg_a, on_event)
    b_store = cfg_b.out / STORE_NAME
    if not b_store.exists():
        cfg_b.out.mkdir(parents=True, exist_ok=True)
        with ResultStore(cfg_a.out / STORE_NAME) as store_a:
            cases_a = store_a.cases()
            digits = store_a.get_meta("fingerprint")["value_digits"]
        root, v1 = normalize_base_url(cfg_b.base_urls[0])
        with ResultStore(b_store) as store:
            store.put_meta("fingerprint", cfg_b.fingerprint(digits))
            store.put_meta("provenance", collect_provenance(root, v1, api_key=cfg_b.api_key))
            store.put_meta("run_notes", {"value_digits_source": "side A's case set (compare)", "assumed": []})
            store.add_cases(cases_a)
    on_event("side", {"side": "B", "base_urls": list(cfg_b.base_urls)})
    run_probe(replace(cfg_b, resume=True), on_event)
    return compare_runs(
        cfg_a.out, cfg_b.out, out, alpha=alpha, power_drop=power_drop, bucket_edges=bucket_edges
    )
