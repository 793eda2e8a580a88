"""docs/investigate.md's "Planted faults" table: the ledgers of ``tests/test_investigate_organism.py``.

    python bench/investigate_planted_faults.py OUT [--faults routed_scaling,hc_mix_bf16,...] [--threads 1]
    python bench/investigate_planted_faults.py --render OUT/rows.jsonl

One in-process investigation per planted fault (the test's ``plant_ledger``: reference fp32 keys at
top-16, the candidate the reference plus one fault, multiturn 5 depths x 2 trials at 256/512
tokens, the key-slot fault at 512/1,024), run one after the other in this process with one
loaded organism; the reference records are shared as the test shares them. Each finished run
appends its row (the planted suspect's verdict, paired recall, b / c, p, the final-logit
divergence, the root cause, the signature, every other suspect's verdict) to OUT/rows.jsonl.
Not a test: the table goes to docs/investigate.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _row(planted: str, v: dict, seconds: float) -> dict:
    by = {s["id"]: s for s in v["suspects"]}
    ev = {e["metric"].split(" (")[0]: e["value"] for e in by[planted]["evidence"]}
    div = next((val for key, val in ev.items() if key.startswith("final-logit relative error")), None)
    sig = v["signature"]
    return {
        "planted": planted,
        "verdict": by[planted]["verdict"],
        "root_cause": v["root_cause"],
        "recall_with": ev.get(f"recall with {planted}"),
        "recall_without": ev.get(f"recall without {planted}"),
        "b": ev.get("discordant b"),
        "c": ev.get("discordant c"),
        "p": ev.get("exact McNemar p"),
        "divergence": div,
        "signature": {k: sig.get(k) for k in ("ranking", "uninformative_ranking")},
        "others": {sid: s["verdict"] for sid, s in by.items() if sid != planted},
        "recall_by_length": {
            "reference": v["symptom"].get("recall_reference"),
            "candidate": v["symptom"].get("recall_candidate"),
        },
        "seconds": round(seconds, 1),
    }


def run(out: Path, faults: list[str], threads: int) -> None:
    import torch

    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.investigate.run import run_investigation
    from test_investigate_organism import _seed_reference, plant_ledger

    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    model, tok, _ = load_bundle("organism")
    cache = out / "reference.jsonl"
    for planted in faults:
        d = out / planted
        d.mkdir(exist_ok=True)
        t0 = time.time()
        ledger = plant_ledger(d, planted)
        text = ledger.read_text().replace("threads = 1", f"threads = {threads}")
        ledger.write_text(text)
        run_out = d / "out"
        _seed_reference(run_out, cache)
        run_investigation(ledger, run_out, loaded=(model, tok))
        measured = run_out / "measure" / "reference.jsonl"
        aside = measured.with_name(measured.name + ".superseded")
        cache.write_text(measured.read_text() + (aside.read_text() if aside.exists() else ""))
        row = _row(planted, json.loads((run_out / "verdicts.json").read_text()), time.time() - t0)
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def _fmt(x) -> str:
    return "-" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))


def render(rows: Path) -> str:
    lines = [
        "| planted | verdict | root cause | paired recall (with vs without) | b / c, exact McNemar p "
        "| final-logit rel. error added alone | ranking | others | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ln in rows.read_text().splitlines():
        r = json.loads(ln)
        others = sorted(set(r["others"].values()))
        lines.append(
            f"| {r['planted']} | `{r['verdict']}` | {_fmt(r['root_cause'])} | {_fmt(r['recall_with'])} vs "
            f"{_fmt(r['recall_without'])} | {_fmt(r['b'])} / {_fmt(r['c'])}, p = {_fmt(r['p'])} | "
            f"{_fmt(r['divergence'])} | {_fmt(r['signature']['ranking'])} | {', '.join(others)} | {r['seconds']} |"
        )
    return "\n".join(lines)


def main() -> None:
    from test_investigate_organism import SUSPECTS

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--faults", default=",".join(SUSPECTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--render", type=Path)
    args = ap.parse_args()
    if args.render:
        print(render(args.render))
        return
    faults = args.faults.split(",")
    unknown = [f for f in faults if f not in SUSPECTS]
    if unknown or args.out is None:
        sys.exit(f"--faults: {unknown} not among {list(SUSPECTS)}" if unknown else "OUT is required")
    run(args.out, faults, args.threads)


if __name__ == "__main__":
    main()
