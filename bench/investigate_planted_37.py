"""Issue 37's planted set on both routes: the characterization against the planted class.

    python bench/investigate_planted_37.py OUT_DIR [--device cpu] [--lengths 512,1024]
        [--depths 0,50,100] [--trials 2] [--bugs NAME,...] [--routes live,inprocess]

Each bug is a patch file of ``tests/planted_bugs/`` (``CLASSES`` there: the planted class).
**In-process**: the example ledger with the candidate ``k=fp8_e4m3 topk=64`` carrying the bug as
an unnamed ``extra_patches`` entry (no page-table fault). **Live**: ``needlescope serve`` with
``--index-k fp8_e4m3 --index-topk 64 --patch BUG --undisclosed-patch`` (``/get_server_info``
names no patch), a ledger written by ``investigate init --live``, then ``investigate run``.
Writes OUT_DIR/summary.json: per (bug, route) the planted class, the classes found, ``where``,
the root cause, the summary's root-cause line, whether the run completed, seconds. Not a test:
the table goes to docs/investigate.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from needlescope.investigate.ledger.example import write_example  # noqa: E402
from needlescope.investigate.ledger.init import live_ledger, write_ledger  # noqa: E402
from needlescope.investigate.run import run_investigation  # noqa: E402
from planted_bugs import CLASSES  # noqa: E402

PLANTED = ROOT / "tests" / "planted_bugs"
CANDIDATE = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64"


def _symptom_text(text: str, args) -> str:
    text = text.replace('device = "cpu"', f'device = "{args.device}"')
    text = text.replace("lengths = [256, 512, 1024]", f"lengths = {json.dumps(args.lengths)}")
    text = text.replace("depths = [0, 50, 100]", f"depths = {json.dumps(args.depths)}")
    return text.replace("trials = 2", f"trials = {args.trials}\nmax_new_tokens = 6")


def inprocess_ledger(d: Path, bug: str, args) -> Path:
    write_example(d, force=True)
    text = _symptom_text((d / "investigation.toml").read_text(), args)
    (d / "extra").mkdir(exist_ok=True)
    shutil.copy(PLANTED / bug, d / "extra" / "p1.py")  # a neutral name: nothing reads it but the run
    text = text.replace(
        'candidate = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64 patch=fault:indexer_page_table"',
        f'candidate = "{CANDIDATE}"',
    )
    text = text.replace("extra_patches = []", 'extra_patches = ["extra/p1.py"]')
    (d / "investigation.toml").write_text(text)
    return d / "investigation.toml"


def live_run(d: Path, bug: str, args):
    from needlescope.serve.config import ServeConfig
    from needlescope.serve.launch import ServerProcess
    from needlescope.setting import Setting

    setting = Setting.parse(f"{CANDIDATE} patch={PLANTED / bug}")
    cfg = ServeConfig(model="organism", port=0, setting=setting, disclose_patch=False, device=args.device)
    with ServerProcess(cfg, timeout=300) as server:
        symptom = {
            "kind": "multiturn",
            "lengths": args.lengths,
            "depths": args.depths,
            "trials": args.trials,
            "seed": 0,
        }
        text = live_ledger(server.url, symptom=symptom, why="issue 37 planted run")
        assert "p1" not in text and bug not in text, "the ledger must not see the patch"
        ledger = write_ledger(d, text, force=True)
        run_investigation(ledger, d / "out")
        return d / "out" / "verdicts.json"


def summarise(verdicts: Path) -> dict:
    from needlescope.investigate.decide.findings import Findings
    from needlescope.investigate.report.diagnosis import write_reports

    write_reports(Findings.read(verdicts.parent))
    v = json.loads(verdicts.read_text())
    ch = v.get("characterization") or {}
    diag = (verdicts.parent / "DIAGNOSIS.md").read_text()
    line = next((ln for ln in diag.splitlines() if "**Root cause:**" in ln), "")
    return {
        "root_cause": v["root_cause"],
        "classes": ch.get("classes"),
        "where": ch.get("where"),
        "next": ch.get("next"),
        "root_line": line,
        "suspects": {s["id"]: s["verdict"] for s in v["suspects"]},
        "recall_reference": v["symptom"]["recall_reference"],
        "recall_candidate": v["symptom"]["recall_candidate"],
        "measured": ch.get("measured"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", default="512,1024")
    ap.add_argument("--depths", default="0,50,100")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--bugs", default=",".join(CLASSES))
    ap.add_argument("--routes", default="inprocess,live")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.depths = [int(x) for x in args.depths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    for bug in args.bugs.split(","):
        bug = bug if bug.endswith(".py") else f"{bug}.py"
        for route in args.routes.split(","):
            key = f"{bug}:{route}"
            if summary.get(key, {}).get("completes"):
                continue
            d = args.out / bug.removesuffix(".py") / route
            d.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            row = {"bug": bug, "route": route, "planted": CLASSES[bug][0], "undo": CLASSES[bug][1]}
            try:
                if route == "inprocess":
                    run_investigation(inprocess_ledger(d, bug, args), d / "out")
                    verdicts = d / "out" / "verdicts.json"
                else:
                    verdicts = live_run(d, bug, args)
                row.update(completes=True, **summarise(verdicts))
            except Exception:  # noqa: BLE001 - a crash is a row of the table
                row.update(completes=False, error=traceback.format_exc()[-1500:])
            row["seconds"] = round(time.time() - t0, 1)
            summary[key] = row
            path.write_text(json.dumps(summary, indent=1))
            print(key, row.get("classes"), row.get("root_cause"), row["seconds"], flush=True)


if __name__ == "__main__":
    main()
