"""In-process recall grid of a DeepSeek-V4 checkpoint under several indexer numerics (GPU-friendly).

Same cases and scoring as ``needlescope probe`` (``build_cases`` with the checkpoint's own
token counts, ``score_answer``), but batched greedy decoding in-process, so a 1,000-case
grid runs in a minute on one GPU. Used to pick the organism's deployment-like settings;
the shipped numbers in docs/organism.md come from ``needlescope probe`` against
``needlescope serve``.

    python bench/organism_recall.py --model DIR --settings ref:fp32:fp32:1024 dep:fp8_e4m3:fp32:64 \
        --lengths 256,1024,2048,4096 --depths 0,25,50,75,100 --trials 20 --out recall.json

``--out`` gets the whole result as JSON (rewritten after every setting, so a run cut short keeps
what finished), with the command, machine, versions and times; ``OUT.md`` beside it (``--out``
with its suffix replaced) is the same as a markdown table, ready to paste into docs.

A setting may add ``:rot``/``:norot`` (Hadamard rotation) and ``@PATCH`` (a file or ``fault:NAME``),
e.g. ``pt64:fp8_e4m3:fp32:64@fault:indexer_page_table``. A patch is applied once per setting; when it
returns no undo, the next setting loads a fresh model instead of inheriting the patched one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from needlescope.cases.assemble import CaseSpec, build_cases
from needlescope.cases.scoring import score_answer
from needlescope.dsa.checkpoint import load_bundle, trained_value_digits
from needlescope.dsa.emulate import emulate, patched_for_good
from needlescope.setting import Setting  # noqa: E402


def _count(tokenizer):
    def count(messages):
        return len(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        )

    return count


@torch.no_grad()
def _answers(model, tokenizer, cases, device: str, batch: int, max_new: int) -> list[str]:
    out = []
    eos = tokenizer.eos_token_id
    for i in range(0, len(cases), batch):
        chunk = cases[i : i + batch]
        ids = [
            tokenizer.apply_chat_template(c.messages, tokenize=True, add_generation_prompt=True)["input_ids"]
            for c in chunk
        ]
        # Groups hold cases of one exact token length: V4's compressors would pool left padding
        # into compressed entries, so batches are never padded.
        inp = torch.tensor(ids, device=device)
        T = inp.shape[1]
        gen = model.generate(
            input_ids=inp,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row in gen[:, T:]:
            out.append(
                tokenizer.decode(
                    [t for t in row.tolist() if t != tokenizer.pad_token_id], skip_special_tokens=True
                )
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="organism")
    ap.add_argument(
        "--settings",
        nargs="+",
        help="name:index_k:index_q:index_topk[:rot|:norot][@patch.py] (rot: Hadamard rotation, default for fp4)",
    )
    ap.add_argument("--kind", default="multiturn")
    ap.add_argument("--lengths", default="256,1024,2048,4096")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--value-digits", type=int, help="Default: the checkpoint's training.json.")
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--render", help="print the markdown table of a result JSON and exit")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())), end="")
        return
    if not args.out or not args.settings:
        ap.error("--out and --settings are required")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, path = load_bundle(args.model, device=args.device)
    digits = args.value_digits or trained_value_digits(path)
    spec = CaseSpec(
        kind=args.kind,
        lengths=tuple(int(x) for x in args.lengths.split(",")),
        depths=tuple(float(x) for x in args.depths.split(",")),
        trials=args.trials,
        seed=args.seed,
        value_digits=digits,
    )
    t0 = time.time()
    cases = build_cases(spec, _count(tokenizer))
    by_len: dict[int, list] = {}
    for c in cases:
        by_len.setdefault(c.counted_length, []).append(c)
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": _machine(args.device),
        "started_utc": _utc(),
        "kind": args.kind,
        "lengths": list(spec.lengths),
        "depths": list(spec.depths),
        "trials": args.trials,
        "seed": args.seed,
        "value_digits": digits,
        "build_s": round(time.time() - t0, 1),
        "settings": {},
    }
    for setting in args.settings:
        setting, _, patch = setting.partition("@")
        name, k, q, topk, *rot = setting.split(":")
        hadamard = {"rot": True, "norot": False}[rot[0]] if rot else None
        numerics = Setting(index_k=k, index_q=q, index_topk=int(topk), hadamard=hadamard, patch=patch or None)
        t1 = time.time()
        cells: dict[str, list[int]] = {}
        if patched_for_good(model):
            # The previous setting's patch returned no undo (emulate applied it once and marked
            # the model): it would leak into this setting, so load a fresh model.
            model = load_bundle(args.model, device=args.device)[0]
        with emulate(model, numerics):
            for group in by_len.values():
                for c, ans in zip(
                    group, _answers(model, tokenizer, group, args.device, args.batch, 12), strict=True
                ):
                    cell = cells.setdefault(f"{c.length}:{c.depth:g}", [0, 0])
                    cell[0] += int(score_answer(ans, c.expected))
                    cell[1] += 1
        per_len: dict[str, list[int]] = {}
        for key, (hit, n) in cells.items():
            agg = per_len.setdefault(key.split(":")[0], [0, 0])
            agg[0] += hit
            agg[1] += n
        result["settings"][name] = {
            "numerics": numerics.numerics_json(),
            "patch": patch or None,
            "cells": {k2: v[0] / v[1] for k2, v in cells.items()},
            "by_length": {k2: v[0] / v[1] for k2, v in per_len.items()},
            "min_cell": min(v[0] / v[1] for v in cells.values()),
            "min_cell_at": [
                k2 for k2, v in cells.items() if v[0] / v[1] == min(h / n for h, n in cells.values())
            ],
            "cases": sum(v[1] for v in cells.values()),
            "wall_s": round(time.time() - t1, 1),
        }
        result["finished_utc"] = _utc()
        _write(args.out, result)
        print(
            json.dumps(
                {
                    name: result["settings"][name]["by_length"],
                    "min_cell": result["settings"][name]["min_cell"],
                }
            )
        )


def _utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "cpu"
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "cpu")
    return f"{model}, {sum(ln.startswith('processor') for ln in lines)} cores"


def _machine(device: str) -> dict:
    import transformers

    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else _cpu_name()
    return {
        "device": device,
        "device_name": name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def markdown(result: dict) -> str:
    """The result as a table: recall per length and the weakest cell of every setting."""
    lengths = [str(n) for n in result["lengths"]]
    m = result["machine"]
    head = (
        f"`{result['command']}`: {result['kind']}, {result['trials']} trials x depths "
        f"{', '.join(f'{d:g}' for d in result['depths'])} a length, seed {result['seed']}; "
        f"{m['device_name']} ({m['device']}, {m['threads']} threads, torch {m['torch']}, transformers "
        f"{m['transformers']}), {result['started_utc']} - {result.get('finished_utc', '?')}."
    )
    rows = [
        "| setting | numerics | patch | "
        + " | ".join(lengths)
        + " | weakest cell (length:depth) | cases | s |",
        "|---" * (len(lengths) + 6) + "|",
    ]
    for name, r in result["settings"].items():
        num = r["numerics"]
        keys = f"k={num.get('index_k')} q={num.get('index_q')} topk={num.get('index_topk')}"
        per = " | ".join(f"{r['by_length'][n]:.2f}" for n in lengths)
        at = r["min_cell_at"]
        where = (
            "every cell"
            if len(at) == len(r["cells"])
            else ", ".join(at[:4]) + (f" +{len(at) - 4}" if len(at) > 4 else "")
        )
        weakest = f"{r['min_cell']:.2f} ({where})"
        rows.append(
            f"| {name} | {keys} | {r['patch'] or '-'} | {per} | {weakest} | {r['cases']} | {r['wall_s']} |"
        )
    return head + "\n\n" + "\n".join(rows) + "\n"


def _write(out: str, result: dict) -> None:
    Path(out).write_text(json.dumps(result, indent=1))
    Path(out).with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    main()
