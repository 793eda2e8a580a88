"""The 43-layer plan from a streamed run's per-layer records (``bench/flash_stream.py``'s stream.json).

For each pass of each rank dump (pass 0: the prompt's chunked prefill; pass 1: the decode step
feeding the first answer token) the per-layer wall time is ``wait_s + place_s + compute_s`` (the
reader thread's disk read overlaps the previous layer's compute; what it does not hide shows as
wait). The mean per layer kind (sliding window, CSA, HCA) times DeepSeek-V4-Flash's 43-layer
schedule (2 sliding, then CSA and HCA alternating: 21 CSA and 20 HCA) plus what the pass spent
outside the layers (embedding, masks, head) gives the 43-layer pass. Bytes read per pass: the
mean bytes of a layer of each kind, times the schedule. Everything printed says where it comes
from; nothing here is measured, it is arithmetic on what was.

Usage: python3 bench/stream_plan.py docs/scale_runs/flash8_fp4_stream.json
"""

from __future__ import annotations

import json
import sys
from statistics import mean

SCHEDULE = {"swa": 2, "csa": 21, "hca": 20}  # DeepSeek-V4-Flash, 43 layers


def kinds(layers: int) -> list[str]:
    """The writer's schedule (testing.flash.flash_config) as kinds, layer by layer."""
    ratios = ([0, 0] + [4, 128] * layers)[:layers]
    return [{0: "swa", 4: "csa", 128: "hca"}[r] for r in ratios]


def per_kind(records: list[dict], layer_kinds: list[str], field) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for r in records:
        out.setdefault(layer_kinds[r["layer"]], []).append(field(r))
    return {k: mean(v) for k, v in out.items()}


def plan(run: dict) -> list[dict]:
    layer_kinds = kinds(run["args"]["layers"])
    rows = []
    for dump in run.get("rank_dumps", []):
        if "passes" not in dump:
            continue
        for index, records in enumerate(dump["passes"]):
            step = per_kind(records, layer_kinds, lambda r: r["wait_s"] + r["place_s"] + r["compute_s"])
            compute = per_kind(records, layer_kinds, lambda r: r["compute_s"])
            nbytes = per_kind(records, layer_kinds, lambda r: r["bytes"])
            rows.append(
                {
                    "prompt_tokens": dump["prompt_tokens"],
                    "pass": "prefill" if index == 0 else f"decode {index}",
                    "measured_layers": len(records),
                    "step_s_per_kind": {k: round(v, 3) for k, v in step.items()},
                    "compute_s_per_kind": {k: round(v, 3) for k, v in compute.items()},
                    "pass_43_layers_s": round(sum(SCHEDULE[k] * step[k] for k in SCHEDULE), 1),
                    "compute_43_layers_s": round(sum(SCHEDULE[k] * compute[k] for k in SCHEDULE), 1),
                    "read_43_layers_gb": round(sum(SCHEDULE[k] * nbytes[k] for k in SCHEDULE) / 1e9, 1),
                }
            )
    return rows


def main() -> None:
    run = json.loads(open(sys.argv[1]).read())
    for row in plan(run):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
