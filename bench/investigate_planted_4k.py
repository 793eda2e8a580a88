"""Planted suspects where they can bite: the investigation at 4,096 tokens, 100 cases a run.

    python bench/investigate_planted_4k.py OUT_DIR [--device cuda]

The CPU tests (tests/test_investigate_organism.py) plant ``index_topk`` halved and fp4 keys
without the Hadamard rotation at 256 and 512 tokens, where the organism loses nothing. The
organism's only measured top-k cost is top-1 at 4K (docs/organism.md), so this plants there:
``index_topk`` 2 -> 1, and fp4 keys without the rotation at top-1 and top-2; every other
suspect of the planted tests is absent from the candidate. Multiturn, 4,096 tokens, 5 depths x
20 trials. Hours on 2 CPU cores; about 23-36 s a run on one H200. Writes OUT_DIR/summary.json
(verdict and reason per suspect, the symptom, seconds). Not a test: the numbers go to
docs/investigate.md (docs/investigate_runs/planted_4k_h200.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from needlescope.dsa.checkpoint import load_bundle
from needlescope.investigate.ledger.example import write_example
from needlescope.investigate.run import run_investigation

SUSPECTS = {
    "routed_scaling": 'patch = "patches/routed_scale_twice.py"',
    "hc_mix_bf16": 'patch = "patches/hc_mix_bf16.py"',
    "index_keys_fp4_norot": 'setting = "k=fp4_e2m1 hadamard=off"',
    "index_topk": 'setting = "topk=1"',
    "page_table": 'patch = "fault:indexer_page_table"',
    "key_slot": 'patch = "fault:indexer_key_slot"',
}
RUNS = (  # (name, planted suspect, reference, candidate = reference + the planted suspect)
    ("topk_2_to_1", "index_topk", "k=fp32 topk=2", "k=fp32 topk=1"),
    ("fp4norot_top1", "index_keys_fp4_norot", "k=fp32 topk=1", "k=fp4_e2m1 hadamard=off topk=1"),
    ("fp4norot_top2", "index_keys_fp4_norot", "k=fp32 topk=2", "k=fp4_e2m1 hadamard=off topk=2"),
)


def ledger(d: Path, planted: str, ref: str, cand: str, device: str) -> Path:
    write_example(d, force=True)  # the patch files the suspects map to
    lines = ["[target]", 'model = "organism"', f'device = "{device}"', "threads = 4"]
    lines += [f'reference = "{ref}"', f'candidate = "{cand}"', "", "[symptom]", 'kind = "multiturn"']
    lines += ["lengths = [4096]", "depths = [0, 25, 50, 75, 100]", "trials = 20", "max_new_tokens = 6", ""]
    for i, (sid, mapping) in enumerate(SUSPECTS.items()):
        if sid == "index_topk" and planted != "index_topk":
            continue  # its topk=1 would read as absent or as the reference's own value
        checks = json.dumps(["ablation"] if sid == planted else [])
        lines += ["[[suspects]]", f'id = "{sid}"', f"tier = {1 + i // 2}", f'hypothesis = "{sid}"', mapping]
        lines += [f"checks = {checks}", ""]
    (d / "investigation.toml").write_text("\n".join(lines))
    return d / "investigation.toml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    loaded = load_bundle("organism", device=args.device)[:2]
    summary = {}
    for name, planted, ref, cand in RUNS:
        d = args.out / name
        t = time.time()
        run_investigation(ledger(d, planted, ref, cand, args.device), d / "out", loaded=loaded)
        v = json.loads((d / "out" / "verdicts.json").read_text())
        summary[name] = {
            "seconds": round(time.time() - t, 1),
            "symptom": v["symptom"],
            "root": v["root_cause"],
            "suspects": {s["id"]: [s["verdict"], s["reason"]] for s in v["suspects"]},
        }
        print(name, json.dumps(summary[name]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
