"""Deployment-scale measurements on a Flash-shaped DeepSeek-V4 checkpoint (one device call).

Writes a random 4-layer DeepSeek-V4-Flash-shaped checkpoint in the release's block-fp8 layout on
the machine itself (generated on the GPU, never carried), loads it with ``load_bundle(device=
"auto")``, and runs rank dumps with chunked prefill at the given lengths, recording wall time and
peak GPU memory per device for each step. Optionally loads the same checkpoint through
transformers' own FineGrainedFP8 (weights kept fp8) for comparison. Everything goes to
``$OUT/scale.json`` (and the log); docs/scale.md holds the numbers.

Usage (repository root, GPU machine):
    OUT=/some/dir python3 bench/flash_scale.py --lengths 32768,131072 --chunk 1024 --budget-s 420
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch


def peak_per_device() -> dict[str, int]:
    return {f"cuda:{i}": torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())}


def reset_peaks() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(i)


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def rank_dump_at(model, tok, length: int, chunk: int, seed: int) -> dict:
    from needlescope.cases.assemble import CaseSpec, build_cases
    from needlescope.dsa.prompt import render_prompt
    from needlescope.dsa.rankdump import rank_dump

    def count(msgs):
        return len(render_prompt(tok, msgs).input_ids)

    t0 = time.perf_counter()
    case = build_cases(CaseSpec("single", (length,), (50.0,), 1, seed), count)[0]
    build_s = time.perf_counter() - t0
    reset_peaks()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        dump = rank_dump(model, tok, case.messages, needle=case.needle, max_new_tokens=2, chunk=chunk)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    first = [layer["positions"][0] for layer in dump["layers"] if layer["positions"]]
    return {
        "length_target": length,
        "prompt_tokens": dump["prompt_tokens"],
        "chunk": chunk,
        "prompt_build_s": round(build_s, 2),
        "rank_dump_s": round(wall, 2),
        "prefill_tokens_per_s": round(dump["prompt_tokens"] / wall, 1),
        "peak_gib_per_device": {d: gib(n) for d, n in peak_per_device().items()},
        "generated_tokens": dump["generated_tokens"],
        "needle_token_span": dump["needle_token_span"],
        "first_answer_position": [
            {k: p[k] for k in ("query_pos", "visible_entries", "best_rank", "margin", "selected")}
            for p in first
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ckpt", default="/tmp/flash4-fp8")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip optional steps past this wall time")
    ap.add_argument("--hf-fp8", action="store_true", help="also load through transformers' FineGrainedFP8")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "flash-scale-out"))
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    import transformers

    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.loading import placement_of
    from needlescope.testing.flash import write_flash_checkpoint

    res: dict = {
        "machine": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }

    def save() -> None:
        (out / "scale.json").write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res, indent=2), flush=True)

    shutil.rmtree(args.ckpt, ignore_errors=True)
    t0 = time.perf_counter()
    res["write"] = write_flash_checkpoint(args.ckpt, layers=args.layers, fmt="fp8", device="cuda")
    res["write"]["seconds"] = round(time.perf_counter() - t0, 1)
    save()
    torch.cuda.empty_cache()
    reset_peaks()
    t0 = time.perf_counter()
    model, tok, _ = load_bundle(args.ckpt, device="auto")
    torch.cuda.synchronize()
    res["load"] = {
        "seconds": round(time.perf_counter() - t0, 1),
        "placement": placement_of(model).report(),
        "allocated_gib_per_device": {
            f"cuda:{i}": gib(torch.cuda.memory_allocated(i)) for i in range(res["gpus"])
        },
        "peak_gib_per_device": {d: gib(n) for d, n in peak_per_device().items()},
    }
    save()
    res["rank_dumps"] = []
    for n in [int(x) for x in args.lengths.split(",")]:
        if time.perf_counter() - start > args.budget_s:
            res["rank_dumps"].append({"length_target": n, "skipped": "wall-time budget"})
            continue
        try:
            res["rank_dumps"].append(rank_dump_at(model, tok, n, args.chunk, seed=n))
        except torch.OutOfMemoryError as exc:
            res["rank_dumps"].append({"length_target": n, "error": f"OOM: {str(exc)[:300]}"})
            torch.cuda.empty_cache()
        save()
    if args.hf_fp8 and time.perf_counter() - start < args.budget_s:
        del model
        torch.cuda.empty_cache()
        reset_peaks()
        try:
            from transformers import AutoModelForCausalLM

            t0 = time.perf_counter()
            hf = AutoModelForCausalLM.from_pretrained(
                args.ckpt, device_map="auto", attn_implementation="eager"
            )
            torch.cuda.synchronize()
            res["transformers_fp8"] = {
                "seconds": round(time.perf_counter() - t0, 1),
                "allocated_gib_per_device": {
                    f"cuda:{i}": gib(torch.cuda.memory_allocated(i)) for i in range(res["gpus"])
                },
                "linear_weight_dtype": str(hf.model.layers[1].self_attn.q_a_proj.weight.dtype),
            }
        except Exception as exc:  # report what transformers' fp8 path does with this model
            res["transformers_fp8"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        save()
    res["total_s"] = round(time.perf_counter() - start, 1)
    save()


if __name__ == "__main__":
    main()
