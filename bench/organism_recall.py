"""In-process recall grid of a DeepSeek-V4 checkpoint under several indexer numerics (GPU-friendly).

Same cases and scoring as ``needlescope probe`` (``build_cases`` with the checkpoint's own
token counts, ``score_answer``), but batched greedy decoding in-process, so a 1,000-case
grid runs in a minute on one GPU. Used to pick the organism's deployment-like settings;
the shipped numbers in docs/organism.md come from ``needlescope probe`` against
``needlescope serve``.

    python bench/organism_recall.py --model DIR --settings ref:fp32:fp32:1024 dep:fp8_e4m3:fp32:64 \
        --lengths 256,1024,2048,4096 --depths 0,25,50,75,100 --trials 20 --out recall.json

A setting may add ``:rot``/``:norot`` (Hadamard rotation) and ``@PATCH`` (a file or ``fault:NAME``),
e.g. ``pt64:fp8_e4m3:fp32:64@fault:indexer_page_table``. A patch is applied once per setting; when it
returns no undo, the next setting loads a fresh model instead of inheriting the patched one.
"""

from __future__ import annotations

import argparse
import json
import time

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
        required=True,
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
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
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
        "kind": args.kind,
        "trials": args.trials,
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
            "wall_s": round(time.time() - t1, 1),
        }
        print(
            json.dumps(
                {
                    name: result["settings"][name]["by_length"],
                    "min_cell": result["settings"][name]["min_cell"],
                }
            )
        )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
