"""Issue 53's done-when: the planted set of docs/investigate.md against our server with the
indexer capture off, characterized from outside (the black-box route).

    python bench/investigate_planted_blackbox.py OUT [--lengths 1024,2048] [--depths 0,25,50,75,100]
        [--trials 2] [--threads 1] [--device cpu] [--bugs NAME,...] [--topk 64] [--topk-b N]
    python bench/investigate_planted_blackbox.py --render OUT/rows.jsonl   # the docs/investigate.md table
    python bench/investigate_planted_blackbox.py --redecide OUT [OUT ...] > rows.jsonl  # today's rules, same measurements

Per bug of ``tests/planted_bugs/`` (``CLASSES``: the planted class): ``needlescope serve`` with
``--index-k fp8_e4m3 --index-topk 64 --patch BUG --undisclosed-patch --no-indexer-capture``,
a ledger written by ``investigate init --live URL --config config.json`` (the organism's: the
server does not say its compression ratio), then ``investigate run``. With ``--topk-b N`` a
second server of the same bug with ``--index-topk N`` is the ledger's ``topk_endpoint`` (the top-k
pair, ``decide.blackbox_topk``). Each finished run appends
its row to OUT/rows.jsonl at once; a second invocation skips the bugs already there. The
``expected`` column: the planted class when it is decidable from outside, else ``undecided``
with the capture as ``next`` (``decide.blackbox.INSIDE_SELECTION``). Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from planted_bugs import CLASSES  # noqa: E402

PLANTED = ROOT / "tests" / "planted_bugs"
CANDIDATE = "k=fp8_e4m3 q=fp32 acc=fp32"


def expected(planted: str) -> str:
    from needlescope.investigate.decide.blackbox import INSIDE_SELECTION

    return "undecided" if planted in INSIDE_SELECTION else planted


def run_bug(out: Path, bug: str, args) -> dict:
    from needlescope.dsa.checkpoint import resolve_model_dir
    from needlescope.investigate.ledger.init import live_ledger, write_ledger
    from needlescope.investigate.run import run_investigation
    from needlescope.serve.config import ServeConfig
    from needlescope.serve.launch import ServerProcess
    from needlescope.setting import Setting

    d = out / bug.removesuffix(".py")
    d.mkdir(parents=True, exist_ok=True)

    def config(topk: int) -> ServeConfig:
        return ServeConfig(
            model="organism",
            port=0,
            setting=Setting.parse(f"{CANDIDATE} topk={topk} patch={PLANTED / bug}"),
            disclose_patch=False,
            indexer_capture=False,
            device=args.device,
            threads=args.threads,
        )

    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerProcess(config(args.topk), timeout=300))
        pair = (
            None
            if args.topk_b is None
            else stack.enter_context(ServerProcess(config(args.topk_b), timeout=300))
        )
        symptom = {
            "kind": "multiturn",
            "lengths": args.lengths,
            "depths": args.depths,
            "trials": args.trials,
            "seed": 0,
        }
        text = live_ledger(
            server.url,
            symptom=symptom,
            why="issue 53 planted run",
            config="config.json",
            topk_endpoint=None if pair is None else pair.url,
        )
        assert bug not in text, "the ledger must not see the patch"
        (d / "config.json").write_bytes((resolve_model_dir("organism") / "config.json").read_bytes())
        ledger = write_ledger(d, text, force=True)
        run_investigation(ledger, d / "out")
    v = json.loads((d / "out" / "verdicts.json").read_text())
    ch = v.get("characterization") or {}
    return {
        "bug": bug,
        "planted": CLASSES[bug][0],
        "expected": expected(CLASSES[bug][0]),
        "classes": ch.get("classes"),
        "where": ch.get("where"),
        "undecided": ch.get("undecided"),
        "next": ch.get("next"),
        "root_cause": v["root_cause"],
        "recall": v["symptom"]["recall_candidate"],
        "measured": (ch.get("measured") or {}).get("evidence"),
        "topk_pair": ch.get("topk_pair"),
        "s": round(time.monotonic() - start, 1),
    }


def redecide(outs: list[Path]) -> None:
    """Print each finished run's row again, its classes decided by today's ``decide.blackbox``
    from the measurements its run kept (``state.json``'s black-box step; the teacher-forced
    ranks from ``measure/bb-teacher.jsonl``): a rule change is judged on the same answers."""
    from needlescope.investigate.decide.blackbox import (
        BlackboxContext,
        BlackboxEvidence,
        characterize_blackbox,
    )

    for out in outs:
        for line in (out / "rows.jsonl").read_text().splitlines():
            row = json.loads(line)
            run = out / row["bug"].removesuffix(".py") / "out"
            step = json.loads((run / "state.json").read_text())["done"].get("measured:blackbox")
            if isinstance(step, dict):
                teacher = [
                    json.loads(x) for x in (run / "measure" / "bb-teacher.jsonl").read_text().splitlines()
                ]
                ev = {**step["evidence"], "teacher": [t for t in teacher if not t.get("error")]}
                ch = characterize_blackbox(
                    BlackboxEvidence.from_json(ev), BlackboxContext.from_json(step["context"])
                )
                row.update(
                    classes=ch["classes"],
                    where=ch["where"],
                    undecided=ch["undecided"],
                    next=ch["next"],
                    topk_pair=ch.get("topk_pair"),
                )
            print(json.dumps(row))


def render(rows_path: Path) -> str:
    rows = [json.loads(x) for x in rows_path.read_text().splitlines() if x.strip()]
    out = [
        "| planted bug | planted class | expected from outside | recall per length | classes | `where` | next (start) | root cause | as expected | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    good = 0
    for r in rows:
        cls = r.get("classes") or ["(failed)"]
        ok = cls[0] == r["expected"] and r.get("root_cause") is None
        good += ok
        where = r.get("where") or {}
        site = ", ".join(f"{k} {v}" for k, v in where.items() if k not in ("route", "experiment")) or "-"
        recall = ", ".join(f"{x:.2f}" for x in (r.get("recall") or {}).values())
        nxt = (r.get("next") or "-")[:48]
        out.append(
            f"| `{r['bug']}` | {r['planted']} | {r['expected']} | {recall} | **{cls[0]}**{' + ' + ', '.join(cls[1:]) if cls[1:] else ''} "
            f"| {site} | `{nxt}` | {r.get('root_cause') or '-'} | {'yes' if ok else 'NO'} | {r.get('s', '-')} |"
        )
    out.append(f"\n{good} of {len(rows)} runs as expected (first class; no root cause).")
    if any(r.get("topk_pair") for r in rows):
        out += ["", *render_pairs(rows)]
    return "\n".join(out)


def render_pairs(rows: list[dict]) -> list[str]:
    """The top-k pair's table: per bug and length, both regimes and the paired counts, then what
    it ruled out and the classes it left."""
    out = [
        "| planted bug | length (entries) | A / B | lost at A | lost at B | gained | dropped | McNemar p | ruled out | narrowed to |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tp = r.get("topk_pair")
        if not tp:
            continue
        ruled = ", ".join(tp["ruled_out"]) or "-"
        left = ", ".join(tp["narrowed_to"])
        for i, x in enumerate(tp["lengths"]):
            tail = f"{ruled} | {left}" if i == 0 else " | "
            out.append(
                f"| `{r['bug']}` | {x['length']} ({x['entries']}) | {x['a']} / {x['b']} | {x['a_lost']} of {x['n']} "
                f"| {x['b_lost']} | {x['gained']} | {x['dropped']} | {x['p']:.2g} | {tail} |"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--render", type=Path)
    ap.add_argument("--redecide", type=Path, nargs="+")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bugs", default=",".join(CLASSES))
    ap.add_argument("--topk", type=int, default=64, help="the endpoint's --index-topk")
    ap.add_argument("--topk-b", type=int, help="a second endpoint's larger --index-topk (the top-k pair)")
    args = ap.parse_args()
    if args.render:
        print(render(args.render))
        return
    if args.redecide:
        redecide(args.redecide)
        return
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.depths = [int(x) for x in args.depths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = args.out / "rows.jsonl"
    done = {json.loads(x)["bug"] for x in rows.read_text().splitlines()} if rows.exists() else set()
    for bug in args.bugs.split(","):
        if bug in done:
            continue
        try:
            row = run_bug(args.out, bug, args)
        except Exception as exc:  # a failed run is a row saying so, never a silent gap
            row = {
                "bug": bug,
                "planted": CLASSES[bug][0],
                "expected": expected(CLASSES[bug][0]),
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()[-2000:],
            }
        with rows.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row.get(k) for k in ("bug", "expected", "classes", "error", "s")}), flush=True)


if __name__ == "__main__":
    main()
