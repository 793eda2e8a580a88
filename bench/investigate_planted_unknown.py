"""Bugs the ledger does not name: the investigation on six planted bugs, unnamed and named.

    python bench/investigate_planted_unknown.py OUT_DIR [--device cuda] [--lengths 1024,2048,4096]
        [--depths 0,33,67,100] [--trials 3] [--bugs NAME,...] [--skip-demo]

Each bug is a model patch in ``bench/planted/`` carried by the candidate as an ``extra_patches``
entry, on top of the example ledger's deployment numerics (fp8 index keys, ``index_topk`` 64,
no page-table fault). **Unnamed**: the example ledger's eight suspects, none of which names the
bug (the investigation must find it as an automatic suspect). **Named**: the same plus a suspect
``planted_bug`` mapped to the patch with an ablation. Then the example ledger itself (the
page-table deployment) with ``device`` set, every audit included (``--skip-demo`` leaves it out).

The configurations every run shares (``SHARED``) are measured once and copied into the later runs. Writes OUT_DIR/summary.json: per run the symptom, the root cause(s), the verdict and
role of the bug's suspect, of ``index_topk`` and of ``index_keys_fp8``, the residual, the
localization summary, non-finite counts, and seconds per step. Not a test: the table goes to
docs/investigate.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import needlescope.investigate.measure.inprocess as inprocess
from needlescope.dsa.checkpoint import load_bundle
from needlescope.investigate.ledger.example import write_example
from needlescope.investigate.run import run_investigation

PLANTED = Path(__file__).resolve().parent / "planted"
BUGS = (
    "indexer_one_head",
    "indexer_drop_past_buffer",
    "indexer_decode_key_slot",
    "moe_route_shift",
    "moe_route_shift_all",
    "indexer_weights_bf16",
    "indexer_nan_slot",
)
CANDIDATE = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64"


def ledger(d: Path, bug: str | None, named: bool, args) -> Path:
    """The example ledger in ``d``: its own deployment when ``bug`` is None, else the planted one."""
    write_example(d, force=True)
    text = (d / "investigation.toml").read_text()
    text = text.replace('device = "cpu"', f'device = "{args.device}"')
    text = text.replace("lengths = [256, 512, 1024]", f"lengths = {json.dumps(args.lengths)}")
    text = text.replace("depths = [0, 50, 100]", f"depths = {json.dumps(args.depths)}")
    text = text.replace("trials = 2", f"trials = {args.trials}\nmax_new_tokens = 6")
    if bug is not None:
        (d / "planted").mkdir(exist_ok=True)
        shutil.copy(PLANTED / f"{bug}.py", d / "planted" / f"{bug}.py")
        text = text.replace(
            'candidate = "k=fp8_e4m3 q=fp32 acc=fp32 topk=64 patch=fault:indexer_page_table"',
            f'candidate = "{CANDIDATE}"',
        )
        text = text.replace("extra_patches = []", f'extra_patches = ["planted/{bug}.py"]')
        if named:
            text += (
                '\n[[suspects]]\nid = "planted_bug"\ntier = 3\n'
                f'hypothesis = "the patch {bug} breaks recall"\npatch = "planted/{bug}.py"\nchecks = ["ablation"]\n'
            )
    (d / "investigation.toml").write_text(text)
    return d / "investigation.toml"


class Timer:
    """Seconds per step from the runner's progress callback."""

    def __init__(self):
        self.steps: dict[str, float] = {}
        self.last, self.phase = time.time(), None

    def __call__(self, phase: str, done: int, total: int, what: str) -> None:
        now = time.time()
        if self.phase is not None:
            self.steps[self.phase] = round(self.steps.get(self.phase, 0.0) + now - self.last, 2)
        self.last, self.phase = now, phase.split(" ")[0] if phase.startswith("measure") else phase


def summarise(v: dict, bug_id: str | None, seconds: float, steps: dict) -> dict:
    by = {s["id"]: s for s in v["suspects"]}
    pick = lambda i: None if i not in by else [by[i]["verdict"], by[i].get("role")]  # noqa: E731
    loc = v["localization"]
    return {
        "seconds": round(seconds, 1),
        "steps": steps,
        "recall_reference": v["symptom"]["recall_reference"],
        "recall_candidate": v["symptom"]["recall_candidate"],
        "root_cause": v["root_cause"],
        "root_causes": v["root_causes"],
        "bug": pick(bug_id) if bug_id else None,
        "index_topk": pick("index_topk"),
        "index_keys_fp8": pick("index_keys_fp8"),
        "triton_paged_indexer": pick("triton_paged_indexer"),
        "unaccounted": [d["name"] for d in v["unaccounted_differences"]],
        "residual": None if v["residual"] is None else v["residual"]["text"],
        "localization": None
        if loc is None
        else {
            "summary": loc["summary"],
            "diverges_first": loc["diverges_first"],
            "paths": [
                [p["path"], p["module_type"], p["first_divergent_module"], p["layer"]] for p in loc["paths"]
            ],
        },
        "nonfinite": v["nonfinite_scores"]["counts"].get("candidate"),
        "signature": v["signature"]["uninformative_ranking"],
        "suspects": {s["id"]: [s["verdict"], s.get("role"), s["reason"]] for s in v["suspects"]},
    }


SHARED = ("reference", "reference-at-k", "alone-index_keys_fp8", "alone-index_topk")
"""Configurations identical in every run (the reference, and it at top-64 with and without fp8
keys): measured once, copied into the later runs."""


def run_one(name: str, path: Path, loaded, seed: Path, bug_id: str | None) -> dict:
    out = path.parent / "out"
    (out / "measure").mkdir(parents=True, exist_ok=True)
    for n in SHARED:
        if (seed / f"{n}.jsonl").exists():
            shutil.copy(seed / f"{n}.jsonl", out / "measure" / f"{n}.jsonl")
    timer, t = Timer(), time.time()
    findings = run_investigation(path, out, timer, loaded=loaded)
    timer("end", 0, 0, "")
    from needlescope.investigate.report.diagnosis import write_reports

    write_reports(findings)
    v = json.loads((out / "verdicts.json").read_text())
    for n in SHARED:
        if not (seed / f"{n}.jsonl").exists() and (out / "measure" / f"{n}.jsonl").exists():
            shutil.copy(out / "measure" / f"{n}.jsonl", seed / f"{n}.jsonl")
    res = summarise(v, bug_id, time.time() - t, timer.steps)
    print(name, json.dumps({k: res[k] for k in res if k != "suspects"}), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--depths", default="0,33,67,100")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--bugs", default=",".join(BUGS))
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--skip-demo", action="store_true")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.depths = [int(x) for x in args.depths.split(",")]
    inprocess.BATCH = args.batch  # cases of one length decoded together (same answers as one at a time)
    t0 = time.time()
    loaded = load_bundle("organism", device=args.device)[:2]
    summary: dict = {
        "load_seconds": round(time.time() - t0, 1),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    seed = args.out / "shared"
    seed.mkdir(parents=True, exist_ok=True)
    for bug in args.bugs.split(","):
        for named in (False, True):
            name = f"{bug}-{'named' if named else 'unnamed'}"
            path = ledger(args.out / name, bug, named, args)
            bug_id = "planted_bug" if named else f"auto:planted/{bug}.py"
            summary[name] = run_one(name, path, loaded, seed, bug_id)
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if not args.skip_demo:
        path = ledger(args.out / "demo", None, False, args)
        summary["demo"] = run_one("demo", path, loaded, seed, "triton_paged_indexer")
    summary["total_seconds"] = round(time.time() - t0, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
