"""The organism's behaviour table (docs/organism.md): ``needlescope probe`` against ``needlescope serve``.

Each setting ``name:index_k:index_topk[@patch]`` (index_q stays fp32; topk ``-`` keeps the
checkpoint's; the patch is a file or a built-in ``fault:NAME``)
gets its own real server and a full multiturn probe grid; ``behaviour.json`` collects recall per
length and the weakest cell of each, rewritten after every setting so a run cut short keeps what
finished. ``--explain NAME`` then rank-dumps the failing case of setting NAME against the first
(reference) setting, tries the fixes and writes ``OUT/explain/DIAGNOSIS.md``.

    python bench/organism_behaviour.py --device cuda --out OUT \\
        --settings ref:fp32:- dep:fp8_e4m3:64@fault:indexer_key_slot dep32:fp8_e4m3:64 --explain dep
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import httpx
import torch

from needlescope.dsa.checkpoint import resolve_model_dir, trained_value_digits
from needlescope.report.diagnosis import recall_by_length
from needlescope.run.config import ProbeConfig, parse_float_list, parse_int_list
from needlescope.run.probe import run_probe
from needlescope.serve.config import ServeConfig
from needlescope.serve.launch import ServerProcess
from needlescope.setting import Setting
from needlescope.workflows import explain


def _setting(spec: str) -> tuple[str, Setting]:
    spec, _, patch = spec.partition("@")
    name, k, topk = spec.split(":")
    return name, Setting(index_k=k, index_topk=None if topk == "-" else int(topk), patch=patch or None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="organism")
    ap.add_argument(
        "--settings",
        nargs="+",
        required=True,
        help="name:index_k:index_topk[@patch]; the first is the reference",
    )
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--explain", help="Setting whose failing case to rank-dump against the reference.")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    path = resolve_model_dir(args.model)
    digits = trained_value_digits(path)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "model": str(args.model),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "trials": args.trials,
        "value_digits": digits,
        "settings": {},
    }
    setting_of = {}
    for spec in args.settings:
        name, setting = _setting(spec)
        setting_of[name] = setting
        t0 = time.monotonic()
        cfg = ServeConfig(
            model=str(path),
            served_model_name="organism",
            setting=setting,
            port=0,
            threads=4,
            device=args.device,
            max_running_requests=args.concurrency,
            max_queued_requests=4096,
            max_prefill_tokens=65536,
        )
        with ServerProcess(cfg, timeout=300) as srv:
            info = httpx.get(f"{srv.url}/get_server_info", timeout=30).json()
            summary = run_probe(
                ProbeConfig(
                    base_urls=(f"{srv.url}/v1",),
                    model="organism",
                    kind="multiturn",
                    lengths=parse_int_list(args.lengths, "--lengths"),
                    depths=parse_float_list(args.depths, "--depths"),
                    trials=args.trials,
                    out=args.out / name,
                    concurrency=args.concurrency,
                    timeout_s=600.0,
                    value_digits=digits,
                )
            )
        cells = summary["cells"]
        record["settings"][name] = {
            "spec": spec,
            "server_info": info,
            "by_length": {str(n): r for n, r in recall_by_length(summary).items()},
            "min_cell": min(c["correct"] / c["n"] for c in cells if c["n"]),
            "errors": summary["errors_total"],
            "effective_length": summary["effective_length"],
            "wall_s": round(time.monotonic() - t0, 1),
        }
        print(json.dumps({name: record["settings"][name]["by_length"]}), flush=True)
        (args.out / "behaviour.json").write_text(json.dumps(record, indent=1))
    if args.explain:
        reference = args.settings[0].split(":")[0]
        deployment = setting_of[args.explain]
        (args.out / "explain").mkdir(exist_ok=True)
        ecfg = explain.ExplainConfig(
            model=path,
            reference_dir=args.out / reference,
            deployment_dir=args.out / args.explain,
            deployment=deployment,
            fixes=explain.default_fixes(deployment),
            device=args.device,
        )
        result = explain.run(ecfg, lambda name, info: print("phase", name, info, flush=True))
        explain.write(result, args.out / "explain")


if __name__ == "__main__":
    main()
